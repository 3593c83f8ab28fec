"""The two oracles of DESIGN.md, computed from measurements taken in the same bench run.

Owns: the measurement replays (every candidate profile run for the whole scenario from t = 0
with no restart: the clairvoyant's knowledge), the per-phase measured rates every metric uses,
`oracle_free` (best profile per phase, switches free and instant: bounds everything) and
`oracle_dp` (clairvoyant, but each switch takes the server down for the target's restart time:
the real limit of a restart-based controller).
Must not: run the policies compared (runner.py does) or feed anything back to them.

oracle_dp is a dynamic programme over the poll grid t_k = k x poll_interval_s (the instants a
controller can act). At each t_k the running profile p either stays (earning C_p(t_{k+1}) -
C_p(t_k), C_p = p's measured cumulative tokens) or switches to q: nothing is served until
t_k + R_q, then q earns C_q(t_j) - C_q(t_k + R_q) up to the next grid point t_j and continues
from there. The value of switching into q at t_k does not depend on p, so each step is O(P).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from controller.bench.harness import Replay, Segment, SwitchEvent, replay
from controller.bench.peers import Static
from controller.bench.scenario import Scenario


@dataclass
class Measurements:
    """Per-profile replays without restarts and the rates derived from them."""

    scenario: Scenario
    replays: dict[str, Replay]
    # profile -> per-phase mean tok/s (measured, including profiles seen only in other replays)
    rates: dict[str, np.ndarray] = field(default_factory=dict)

    def cumulative(self, profile: str) -> tuple[np.ndarray, np.ndarray]:
        return self.replays[profile].cumulative()


def phase_rates(scenario: Scenario, replays: Sequence[Replay]) -> dict[str, np.ndarray]:
    """profile -> tok/s per phase, pooled over every segment in which the profile was up.
    A profile never up in a phase gets NaN there."""
    n = len(scenario.phases)
    tok: dict[str, np.ndarray] = {}
    dur: dict[str, np.ndarray] = {}
    for r in replays:
        for s in r.segments:
            if s.profile is None:
                continue
            tok.setdefault(s.profile, np.zeros(n))[s.phase] += s.tokens
            dur.setdefault(s.profile, np.zeros(n))[s.phase] += s.t1 - s.t0
    out = {}
    for p in tok:
        with np.errstate(invalid="ignore", divide="ignore"):
            out[p] = np.where(dur[p] > 0, tok[p] / np.maximum(dur[p], 1e-12), np.nan)
    return out


def measure(scenario: Scenario) -> Measurements:
    """Replay every candidate profile for the whole scenario, already running at t = 0."""
    reps = {
        p: replay(scenario, Static(p, name=f"measure:{p}"), initial_profile=p)
        for p in scenario.profiles
    }
    m = Measurements(scenario, reps)
    m.rates = phase_rates(scenario, list(reps.values()))
    return m


@dataclass
class OracleResult:
    name: str
    tokens: float
    replay: Replay  # synthesised from the measurements, for metrics and plots


def _grid(scenario: Scenario) -> np.ndarray:
    end = scenario.duration_s
    dt = scenario.poll_interval_s
    g = np.arange(0.0, end, dt)
    return np.append(g, end) if g[-1] < end else g


def oracle_free(m: Measurements) -> OracleResult:
    """Best measured profile in every phase, switched to for free at the phase start."""
    sc = m.scenario
    rep = Replay(sc.name, "oracle_free", sc.initial_profile, sc.duration_s)
    curves = {p: m.cumulative(p) for p in sc.profiles}
    prev = sc.initial_profile
    for ph in sc.phases:
        gains = {
            p: float(np.interp(ph.end_s, *curves[p]) - np.interp(ph.start_s, *curves[p]))
            for p in sc.profiles
        }
        best = max(sc.profiles, key=lambda p: gains[p])
        if best != prev:
            rep.switches.append(SwitchEvent(ph.start_s, ph.start_s, prev, best, "oracle"))
        rep.segments.append(Segment(ph.start_s, ph.end_s, ph.index, best, gains[best]))
        rep.tokens += gains[best]
        prev = best
    return OracleResult("oracle_free", rep.tokens, rep)


def cumulative_on_grid(m: Measurements) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(profile names, the poll grid t_0..t_K, C[P, K + 1]: each profile's measured cumulative
    tokens at the grid points): what both clairvoyant DPs plan over."""
    names = list(m.scenario.profiles)
    grid = _grid(m.scenario)
    return names, grid, np.stack([np.interp(grid, *m.cumulative(p)) for p in names])


def oracle_dp(m: Measurements, restart_s: Mapping[str, float]) -> OracleResult:
    """The clairvoyant restart-paying optimum over the poll grid (see the module docstring)."""
    sc = m.scenario
    names, grid, C = cumulative_on_grid(m)  # C: [P, K + 1]
    P = len(names)
    K = len(grid) - 1
    end = sc.duration_s
    # For a switch into q at t_k: the grid index where it resumes and the tokens until then.
    jump = np.zeros((P, K + 1), dtype=np.int64)
    lead = np.zeros((P, K + 1))
    for qi, q in enumerate(names):
        up = grid + restart_s[q]
        j = np.minimum(np.searchsorted(grid, up - 1e-9, side="left"), K)
        jump[qi] = j
        cq = np.interp(np.minimum(up, end), *m.cumulative(q))
        lead[qi] = np.where(up < end, C[qi, j] - cq, 0.0)
    V = np.zeros((K + 1, P))
    choice = np.full((K + 1, P), -1, dtype=np.int64)
    idx = np.arange(P)
    for k in range(K - 1, -1, -1):
        stay = C[:, k + 1] - C[:, k] + V[k + 1]
        sw = np.array(
            [lead[q, k] + (V[jump[q, k], q] if jump[q, k] > k else 0.0) for q in range(P)]
        )
        # Best switch target other than p: the best overall unless it is p, then the runner-up.
        order = np.argsort(-sw)
        best_q = np.where(order[0] != idx, order[0], order[1] if P > 1 else order[0])
        best_sw = sw[best_q] if P > 1 else np.full(P, -np.inf)
        take = best_sw > stay
        V[k] = np.where(take, best_sw, stay)
        choice[k] = np.where(take, best_q, -1)
    # Forward pass: the schedule.
    rep = Replay(sc.name, "oracle_dp", sc.initial_profile, end)
    p = names.index(sc.initial_profile)
    k = 0
    while k < K:
        c = int(choice[k, p])
        if c < 0:
            t0, t1 = float(grid[k]), float(grid[k + 1])
            rep.segments.append(
                Segment(t0, t1, sc.phase_at(t0).index, names[p], float(C[p, k + 1] - C[p, k]))
            )
            k += 1
            continue
        t = float(grid[k])
        up = min(t + restart_s[names[c]], end)
        rep.switches.append(SwitchEvent(t, up, names[p], names[c], "oracle"))
        rep.segments.append(Segment(t, up, sc.phase_at(t).index, None, 0.0))
        j = int(jump[c, k])
        if up < end and j > k:
            rep.segments.append(
                Segment(up, float(grid[j]), sc.phase_at(up).index, names[c], float(lead[c, k]))
            )
        p, k = c, max(j, k + 1)
    rep.tokens = float(V[0, names.index(sc.initial_profile)])
    return OracleResult("oracle_dp", rep.tokens, rep)
