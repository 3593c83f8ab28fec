"""Fleet scenarios (`replicas = N`): N SGLang replicas behind a round-robin sglang-router,
replayed in virtual time, with the fleet's oracles and its false-switch rule.

Owns:
- `VirtualFleet`, the fleet's server model: N one-server `VirtualServer`s (each its own engine
  seeds, counters and restarts). A phase's `concurrency` is the fleet's closed-loop clients, split
  over the replicas in the router as round robin does: C // k each, the remainder one more each
  to the lowest-indexed ones. A replica out of the router (restarting) serves nothing and its
  clients go to the others. Drain is not modelled: a replica leaves the router and restarts at
  once, and the requests it had in flight continue on the others.
- `fleet_replay`, FleetController's tick in virtual time: every replica scraped at the same
  instant (controller.fleet.observe.replica_window), the deployment's one policy state fed the
  mean replica (controller.fleet.controller.deployment_window), the move chosen by
  controller.fleet.controller.plan_move, a canary judged by controller.fleet.canary.CanaryTrial,
  and rolling switches with at most FleetSettings.max_unavailable() replicas out at once, in
  replica order, as FleetActuator.rolling_switch does. A switch blocks the loop until the last
  replica is back, and the reported downtime is the replicas' restart seconds / N (the fleet's
  lost capacity, what FleetActuator reports to the policy).
- the fleet's `oracle_dp`: a dynamic programme over the poll grid in which a switch is a rolling
  restart, one batch of replicas out after another, the others serving (their measured per-
  replica rates at the concurrency the router gives them), so a switch costs what the replicas
  out would have served, not the whole fleet's tokens.
- `fleet_false_switches` and `run_fleet_scenario` (runner.run_scenario's counterpart: same rows,
  same JSON keys).
Must not: decide anything (policies.decide, the peers and policies.canary do) or do I/O.

Switch accounting in a fleet: a switch is a rolling switch of the deployment (a canary that was
promoted and the rollout after it are one switch, from the canary's start to the last replica
back) or a canary that was rolled back (the policy asked for a restart; it was undone). A rolled-
back canary is always a false switch (undone before it could repay anything); a rolling switch is
false by the one-server rules with the fleet's cost: (a) the new profile is not better in the
fleet's measured rates of the phase in which the rollout completes, or (b) the next deployment
switch goes back before the gain repays what the fleet lost during the switch (the tokens the
fleet would have served on the old profile minus those it served).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from controller.bench import peers
from controller.bench.harness import Replay, Segment, SwitchEvent, Tick, VirtualServer
from controller.bench.metrics import _gain_between, _rate, comes_up_worse
from controller.bench.oracles import (
    Measurements,
    OracleResult,
    cumulative_on_grid,
    oracle_free,
    phase_rates,
)
from controller.bench.scenario import BenchProfile, Phase, Scenario
from controller.fleet.canary import CanaryTrial, could_judge
from controller.fleet.controller import deployment_window, note_rollback, plan_move
from controller.fleet.observe import ReplicaObservation, replica_window
from controller.fleet.settings import CanarySettings, FleetSettings
from policies.canary import Verdict
from policies.types import Action, Decision, Mode, Reason, Snapshot
from simulator.engine import WindowEngine
from simulator.model import SimProfile

if TYPE_CHECKING:  # runner dispatches fleet scenarios here: imported lazily both ways
    from controller.bench.runner import ScenarioResult

# SwitchEvent.reason of a canary that was rolled back (its candidate never reached the fleet).
CANARY_ROLLED_BACK = "canary_rolled_back"
# ... and of a canary that was promoted: the event runs to the end of the rollout after it.
CANARY_PROMOTED = "canary_promoted"
# Mixed into replica seeds so they differ from every other seed derived from the scenario's.
_REPLICA_SEED_TAG = 0xF1EE7
_RATE_SEED_TAG = 0xF1EE8


def replica_seed(seed: int, index: int) -> int:
    """The seed replica `index` of a fleet replays the scenario with (independent draws per
    replica, the same for every policy: common random numbers, as for one server)."""
    return int(np.random.SeedSequence([seed, _REPLICA_SEED_TAG, index]).generate_state(1)[0])


def split_concurrency(concurrency: int, replicas: int) -> list[int]:
    """Round robin with closed-loop clients: `concurrency` clients over `replicas` replicas in
    the router, C // k each and the remainder one each to the first ones (by replica index)."""
    if replicas < 1:
        raise ValueError(f"replicas in the router must be >= 1 (got {replicas})")
    if concurrency < 0:
        raise ValueError(f"concurrency must be >= 0 (got {concurrency})")
    q, r = divmod(concurrency, replicas)
    return [q + (1 if j < r else 0) for j in range(replicas)]


def fleet_settings(scenario: Scenario, *, canary: bool | None = None) -> FleetSettings:
    """The [fleet] settings a fleet scenario runs under: [fleet]'s defaults, the scenario's
    `max_unavailable_fraction` and `canary`, or `canary` forced (the peers roll straight)."""
    enabled = scenario.canary if canary is None else canary
    cs = CanarySettings() if enabled is None else CanarySettings(enabled=enabled)
    kw: dict[str, float] = {}
    if scenario.max_unavailable_fraction is not None:
        kw["max_unavailable_fraction"] = scenario.max_unavailable_fraction
    return FleetSettings(replicas=scenario.replicas, canary=cs, **kw)  # type: ignore[arg-type]


def replica_name(index: int) -> str:
    """As FleetActuator names its replicas."""
    return f"replica{index}"


# --------------------------------------------------------------------------------------------
# The fleet in virtual time
# --------------------------------------------------------------------------------------------


class ReplicaServer(VirtualServer):
    """One replica: a VirtualServer that serves the clients the router gives it (not the
    phase's whole concurrency)."""

    def serve(self, t0: float, t1: float, phase: Phase, concurrency: int) -> float:
        r = self.engine.run_window(t1 - t0, concurrency, phase.mix, phase.scale)
        self._accumulate(r)
        return r.output_tokens

    def pieces(self, t0: float, t1: float) -> list[tuple[float, float, int]]:
        return self._pieces(t0, t1)


@dataclass(frozen=True)
class CanaryOutcome:
    """One canary of a fleet replay, for the record."""

    candidate: str
    current: str
    started_s: float
    ended_s: float
    outcome: str  # promoted | rolled_back | unfinished
    verdict: str


@dataclass
class FleetReplay(Replay):
    """A Replay of a fleet: segments carry the fleet's tokens, labelled with the profile every
    replica runs (None while a replica is out or a canary runs: the band's grey)."""

    replicas: int = 1
    canaries: list[CanaryOutcome] = field(default_factory=list)


class VirtualFleet:
    """N replicas behind a round-robin router, in virtual time."""

    def __init__(
        self,
        scenario: Scenario,
        catalog: Mapping[str, BenchProfile],
        sim: SimProfile,
        profile: str,
        replay: FleetReplay,
        fleet: FleetSettings,
        table_for: Callable[[str], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.scenario = scenario
        self.replay = replay
        self.fleet = fleet
        self.n = scenario.replicas
        self.replicas = [
            ReplicaServer(
                replace(scenario, seed=replica_seed(scenario.seed, i)),
                catalog,
                sim,
                profile,
                # Each replica's own record (its restarts); the fleet's is `replay`.
                Replay(scenario.name, f"{replay.policy}/{replica_name(i)}", profile, 0.0),
                table_for,
            )
            for i in range(self.n)
        ]
        self.prev: list[Snapshot | None] = [None] * self.n

    def label(self, out: frozenset[int]) -> str | None:
        profiles = {r.profile for r in self.replicas}
        return next(iter(profiles)) if not out and len(profiles) == 1 else None

    def serve(self, t0: float, t1: float, out: frozenset[int] = frozenset()) -> float:
        """Every replica in the router serves [t0, t1) (one window per phase piece)."""
        total = 0.0
        inside = [i for i in range(self.n) if i not in out]
        label = self.label(out)
        for a, b, ph in self.replicas[0].pieces(t0, t1):
            phase = self.scenario.phases[ph]
            tokens = 0.0
            if inside:
                conc = split_concurrency(phase.concurrency, len(inside))
                for i, c in zip(inside, conc, strict=True):
                    tokens += self.replicas[i].serve(a, b, phase, c)
            self.replay.segments.append(Segment(a, b, ph, label, tokens))
            total += tokens
        self.replay.tokens += total
        return total

    def roll(self, t_s: float, targets: Sequence[int], profile: str) -> tuple[float, float]:
        """Restart `targets` into `profile`, max_unavailable() at a time in the given order, the
        others serving meanwhile. Returns (when the last one is back, capped at the scenario's
        end; the sum of the replicas' restart seconds)."""
        end = self.scenario.duration_s
        per = self.fleet.max_unavailable()
        t = t_s
        down = 0.0
        for k in range(0, len(targets), per):
            if t >= end - 1e-9:
                break
            batch = list(targets[k : k + per])
            restart = max(self.replicas[i].restart(profile, t) for i in batch)
            down += restart * len(batch)
            self.serve(t, min(t + restart, end), frozenset(batch))
            t += restart
        return min(t, end), down

    def forget(self, indices: Sequence[int]) -> None:
        """As FleetObserver.forget: the next scrape of these replicas starts a new window."""
        for i in indices:
            self.prev[i] = None

    def observe(self, t_s: float) -> dict[str, ReplicaObservation]:
        """Every replica scraped at t_s, as FleetObserver.observe."""
        out: dict[str, ReplicaObservation] = {}
        for i, r in enumerate(self.replicas):
            snap = r.snapshot(t_s)
            obs = replica_window(self.prev[i], snap)
            self.prev[i] = snap
            out[replica_name(i)] = ReplicaObservation(replica_name(i), r.profile, obs)
        return out


def fleet_replay(
    scenario: Scenario,
    policy: peers.BenchPolicy,
    *,
    initial_profile: str | None = None,
    canary: bool | None = None,
) -> FleetReplay:
    """Run the whole fleet scenario under `policy` (every replica already running
    `initial_profile`, default the scenario's). `canary`: whether its switches go through a
    canary first (default: the scenario's `canary`, else [fleet.canary]'s default)."""
    wall0 = time.perf_counter()
    if scenario.replicas < 2:
        raise ValueError(f"{scenario.name}: a fleet replay needs replicas >= 2")
    catalog = scenario.catalog()
    initial = initial_profile or scenario.initial_profile
    if initial not in catalog:
        raise ValueError(f"initial profile {initial!r} is not in the catalog")
    fs = fleet_settings(scenario, canary=canary)
    n = scenario.replicas
    end = scenario.duration_s
    out = FleetReplay(scenario.name, policy.name, initial, end, replicas=n)
    fleet = VirtualFleet(
        scenario,
        catalog,
        scenario.sim_profile(),
        initial,
        out,
        fs,
        getattr(policy, "adaptive_table", None),
    )
    if (on_fleet := getattr(policy, "on_fleet", None)) is not None:
        on_fleet(fs)  # a policy that prices its switches by the fleet's (as FleetController)
    launch = policy.start([catalog[p].spec for p in scenario.profiles], initial, 0.0)
    first = peers.first_decision(launch, initial)
    canary_index = list(range(n))[fs.canary_replica]
    everyone = list(range(n))
    running = initial
    trial: CanaryTrial | None = None
    rejected: dict[str, float] = {}  # candidate -> when its canary was rolled back
    unjudged: dict[str, float] = {}  # ... rolled back unjudged (out of time, no traffic)
    dt = scenario.poll_interval_s
    t = 0.0
    last_tok_s: float | None = None
    # Optional hooks of a policy that learns from a canary's windows (as FleetController).
    canary_started = getattr(policy, "canary_started", None)
    canary_window = getattr(policy, "canary_window", None)
    canary_rejected = getattr(policy, "canary_rejected", None)

    def record(action: Action, target: str, reason: Reason) -> None:
        out.ticks.append(Tick(t, running, last_tok_s, action, target, reason))

    while t < end - 1e-9:
        windows = fleet.observe(t)
        if trial is not None:
            if canary_window is not None and (cw := trial.candidate_window(windows)) is not None:
                canary_window(cw)
            v = trial.add(windows)
            if v is not None and v.verdict is not Verdict.CONTINUE:
                cand, cur, started = trial.candidate, trial.current, trial.started_s
                trial = None
                if v.verdict is Verdict.ROLLBACK:
                    record(Action.SWITCH, cur, Reason.ROLLBACK_TRIAL_FAILED)
                    up, _ = fleet.roll(t, [canary_index], cur)
                    fleet.forget([canary_index])
                    judged = note_rollback(rejected, unjudged, cand, v, t)
                    # As FleetController: the policy backs a judged candidate off like a failed
                    # start (a policy without the hook is told of one).
                    if canary_rejected is not None:
                        canary_rejected(cand, up, judged=judged)
                    else:
                        policy.switch_done(cand, False, 0.0, up)
                    out.switches.append(SwitchEvent(started, up, cur, cand, CANARY_ROLLED_BACK))
                    out.canaries.append(
                        CanaryOutcome(cand, cur, started, up, "rolled_back", v.summary())
                    )
                else:
                    record(Action.SWITCH, cand, Reason.SWITCH_PREDICTED_GAIN)
                    todo = [i for i in everyone if fleet.replicas[i].profile != cand]
                    up, down = fleet.roll(t, todo, cand)
                    fleet.forget(everyone)
                    policy.switch_done(cand, True, down / n, up)
                    running = cand
                    out.switches.append(SwitchEvent(started, up, cur, cand, CANARY_PROMOTED))
                    out.canaries.append(
                        CanaryOutcome(cand, cur, started, up, "promoted", v.summary())
                    )
                last_tok_s = None
                t = up
                continue
            record(Action.HOLD, running, Reason.HOLD_TRIAL)
        else:
            obs = deployment_window(windows, running)
            if t == 0.0:
                d = first  # the first scrape: no window yet; a static profile's launch
            elif obs is None:
                # The fleet's first scrape after a start: no window yet, the policy is not asked.
                d = Decision(t, Action.HOLD, running, Reason.HOLD_INSUFFICIENT_DATA, {})
            else:
                d = policy.tick(obs, t)
            move, target, _why = plan_move(
                d,
                running,
                None,
                rejected,
                t,
                fs,
                n,
                Mode.ACTIVE,
                partial(could_judge, windows, replica_name(canary_index), running, fs.canary),
                unjudged,
            )
            record(d.action, d.profile, d.reason)
            if target is not None and target not in catalog:
                raise ValueError(f"policy {policy.name} asked for unknown profile {target!r}")
            if move == "canary" and target is not None:
                up, _ = fleet.roll(t, [canary_index], target)
                fleet.forget([canary_index])
                trial = CanaryTrial(target, running, replica_name(canary_index), t, fs.canary)
                if canary_started is not None:
                    canary_started(target)
                last_tok_s = None
                t = up
                continue
            if move in ("rollout", "rewrite") and target is not None:
                # A rewrite restarts every replica on the same profile (its new table).
                todo = [
                    i for i in everyone if move == "rewrite" or fleet.replicas[i].profile != target
                ]
                up, down = fleet.roll(t, todo, target)
                fleet.forget(everyone)
                policy.switch_done(target, True, down / n, up)
                out.switches.append(SwitchEvent(t, up, running, target, d.reason.value))
                running = target
                last_tok_s = None
                t = up
                continue
        t1 = min(t + dt, end)
        last_tok_s = fleet.serve(t, t1) / (t1 - t)
        t = t1
    if trial is not None:
        out.canaries.append(
            CanaryOutcome(trial.candidate, trial.current, trial.started_s, end, "unfinished", "")
        )
    out.wall_s = time.perf_counter() - wall0
    return out


# --------------------------------------------------------------------------------------------
# Oracles
# --------------------------------------------------------------------------------------------


def fleet_measure(scenario: Scenario) -> Measurements:
    """Every candidate profile on every replica for the whole scenario, already running at 0."""
    reps: dict[str, Replay] = {
        p: fleet_replay(scenario, peers.Static(p, name=f"measure:{p}"), initial_profile=p)
        for p in scenario.profiles
    }
    m = Measurements(scenario, reps)
    m.rates = phase_rates(scenario, list(reps.values()))
    return m


def _rollout_batches(replicas: int, per: int) -> list[list[int]]:
    idx = list(range(replicas))
    return [idx[k : k + per] for k in range(0, replicas, per)]


def replica_rates(scenario: Scenario, fleet: FleetSettings) -> dict[tuple[str, int, int], float]:
    """(profile, phase index, clients) -> one replica's measured tok/s, for every client count a
    replica has while a batch of replicas is out of the router (the oracle's rollout states).
    Each is one engine window over the whole phase (the engine is a steady-state model, so a
    long window measures the rate with little noise)."""
    catalog = scenario.catalog()
    sim = scenario.sim_profile()
    sizes = {len(b) for b in _rollout_batches(scenario.replicas, fleet.max_unavailable())}
    out: dict[tuple[str, int, int], float] = {}
    for pi, p in enumerate(scenario.profiles):
        for ph in scenario.phases:
            levels = {
                c
                for k in sizes
                if scenario.replicas - k >= 1
                for c in split_concurrency(ph.concurrency, scenario.replicas - k)
            }
            for c in sorted(levels):
                seed = np.random.SeedSequence([scenario.seed, _RATE_SEED_TAG, pi, ph.index, c])
                eng = WindowEngine(
                    sim,
                    catalog[p].sim,
                    scenario.workloads,
                    seed=int(seed.generate_state(1)[0]),
                    max_running_requests=scenario.max_running_requests,
                )
                r = eng.run_window(ph.duration_s, c, ph.mix, ph.scale)
                out[(p, ph.index, c)] = r.output_tokens / ph.duration_s
    return out


def rollout_rates(
    scenario: Scenario,
    fleet: FleetSettings,
    rates: Mapping[tuple[str, int, int], float],
    old: str,
    new: str,
) -> list[np.ndarray]:
    """Per rollout batch (replica order, max_unavailable() at a time), the fleet's tok/s in each
    phase while that batch is out: the earlier batches already on `new`, the later on `old`,
    the clients split over the replicas in the router."""
    out = []
    for batch in _rollout_batches(scenario.replicas, fleet.max_unavailable()):
        first = batch[0]
        inside = [i for i in range(scenario.replicas) if i not in batch]
        r = np.zeros(len(scenario.phases))
        for ph in scenario.phases:
            if not inside:
                continue
            conc = split_concurrency(ph.concurrency, len(inside))
            r[ph.index] = sum(
                rates[(new if i < first else old, ph.index, c)]
                for i, c in zip(inside, conc, strict=True)
            )
        out.append(r)
    return out


def _integral(scenario: Scenario, rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knots of t -> the integral from 0 to t of a per-phase constant rate."""
    t = np.array([0.0, *(p.end_s for p in scenario.phases)])
    d = np.array([p.duration_s for p in scenario.phases])
    return t, np.concatenate([[0.0], np.cumsum(rate * d)])


def fleet_oracle_dp(
    m: Measurements,
    restart_s: Mapping[str, float],
    fleet: FleetSettings,
    rates: Mapping[tuple[str, int, int], float],
) -> OracleResult:
    """Clairvoyant with rolling restarts, over the poll grid t_k. At each t_k the fleet (every
    replica on p) either stays (earning C_p(t_{k+1}) - C_p(t_k), C_p = the fleet's measured
    cumulative tokens on p) or rolls to q: batch b of replicas is out during
    [t_k + b R_q, t_k + (b + 1) R_q) while the others serve (rollout_rates), then the fleet is on
    q from t_k + B R_q and continues from the next grid point."""
    sc = m.scenario
    names, grid, C = cumulative_on_grid(m)  # C: [P, K + 1]
    P = len(names)
    K = len(grid) - 1
    end = sc.duration_s
    ks = np.arange(K + 1)
    n_batches = len(_rollout_batches(sc.replicas, fleet.max_unavailable()))
    batch_knots: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    lead = np.zeros((P, P, K + 1))  # tokens from t_k until the fleet is on q (or the end)
    for pi, p in enumerate(names):
        for qi, q in enumerate(names):
            if pi == qi:
                continue
            knots = [_integral(sc, r) for r in rollout_rates(sc, fleet, rates, p, q)]
            batch_knots[(pi, qi)] = knots
            R = restart_s[q]
            for b, (kt, kv) in enumerate(knots):
                a = np.minimum(grid + b * R, end)
                z = np.minimum(grid + (b + 1) * R, end)
                lead[pi, qi] += np.interp(z, kt, kv) - np.interp(a, kt, kv)
    jump = np.zeros((P, K + 1), dtype=np.int64)
    after = np.zeros((P, K + 1))  # tokens on q from the rollout's end to the next grid point
    for qi, q in enumerate(names):
        up = grid + n_batches * restart_s[q]
        j = np.minimum(np.searchsorted(grid, up - 1e-9, side="left"), K)
        jump[qi] = np.minimum(np.maximum(j, ks + 1), K)
        cq = np.interp(np.minimum(up, end), *m.cumulative(q))
        after[qi] = np.where(up < end, C[qi, jump[qi]] - cq, 0.0)
    V = np.zeros((K + 1, P))
    choice = np.full((K + 1, P), -1, dtype=np.int64)
    for k in range(K - 1, -1, -1):
        for pi in range(P):
            best = C[pi, k + 1] - C[pi, k] + V[k + 1, pi]
            pick = -1
            for qi in range(P):
                if qi == pi:
                    continue
                v = lead[pi, qi, k] + after[qi, k] + V[jump[qi, k], qi]
                if v > best:
                    best, pick = v, qi
            V[k, pi] = best
            choice[k, pi] = pick
    # Forward pass: the schedule, for the metrics and the plot.
    rep = FleetReplay(sc.name, "oracle_dp", sc.initial_profile, end, replicas=sc.replicas)
    p = names.index(sc.initial_profile)
    k = 0
    while k < K:
        c = int(choice[k, p])
        t = float(grid[k])
        if c < 0:
            rep.segments.append(
                Segment(
                    t, float(grid[k + 1]), sc.phase_at(t).index, names[p], C[p, k + 1] - C[p, k]
                )
            )
            k += 1
            continue
        R = restart_s[names[c]]
        for b, (kt, kv) in enumerate(batch_knots[(p, c)]):
            a, z = min(t + b * R, end), min(t + (b + 1) * R, end)
            if z > a:
                tok = float(np.interp(z, kt, kv) - np.interp(a, kt, kv))
                rep.segments.append(Segment(a, z, sc.phase_at(a).index, None, tok))
        up = min(t + n_batches * R, end)
        rep.switches.append(SwitchEvent(t, up, names[p], names[c], "oracle"))
        j = int(jump[c, k])
        if up < end and float(grid[j]) > up:
            rep.segments.append(
                Segment(up, float(grid[j]), sc.phase_at(up).index, names[c], float(after[c, k]))
            )
        p, k = c, j
    rep.tokens = float(V[0, names.index(sc.initial_profile)])
    return OracleResult("oracle_dp", rep.tokens, rep)


# --------------------------------------------------------------------------------------------
# Switch accounting
# --------------------------------------------------------------------------------------------


def _served_and_lost(
    rates: Mapping[str, np.ndarray], rep: Replay, old: str, t0: float, t1: float
) -> float:
    """Tokens the fleet would have served on `old` over [t0, t1) (measured rates) minus the
    tokens it served."""
    lost = 0.0
    for s in rep.segments:
        if s.t0 >= t0 - 1e-9 and s.t1 <= t1 + 1e-9:
            r = _rate(rates, old, s.phase)
            lost += (r if math.isfinite(r) else 0.0) * (s.t1 - s.t0) - s.tokens
    return lost


def fleet_false_switches(scenario: Scenario, rates: Mapping[str, np.ndarray], rep: Replay) -> int:
    """See the module docstring: rolled-back canaries, then rolling switches by rules (a), (b)."""
    count = sum(1 for s in rep.switches if s.reason == CANARY_ROLLED_BACK)
    deploy = [s for s in rep.switches if s.reason != CANARY_ROLLED_BACK]
    for i, sw in enumerate(deploy):
        if comes_up_worse(scenario, rates, sw):
            count += 1
            continue
        nxt = deploy[i + 1] if i + 1 < len(deploy) else None
        if nxt is not None and nxt.to_profile == sw.from_profile:
            gain = _gain_between(scenario, rates, sw.to_profile, sw.from_profile, sw.up_s, nxt.t_s)
            if gain < _served_and_lost(rates, rep, sw.from_profile, sw.t_s, sw.up_s):
                count += 1
    return count


# --------------------------------------------------------------------------------------------
# One fleet scenario, every row
# --------------------------------------------------------------------------------------------


def run_fleet_scenario(
    scenario: Scenario,
    policies: Sequence[str] | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> ScenarioResult:
    """runner.run_scenario for a fleet: the same rows (names and JSON keys), from fleet replays
    and the fleet's oracles."""
    from controller.bench import runner

    t0 = time.perf_counter()
    known, wanted = runner.check_policies(scenario, policies)
    say = progress or (lambda _m: None)
    fs = fleet_settings(scenario)

    say(f"{scenario.name}: measuring {len(scenario.profiles)} profiles on {scenario.replicas}")
    m = fleet_measure(scenario)
    timings = {f"measure:{p}": r.wall_s for p, r in m.replays.items()}
    restart = scenario.restart_times()
    reps: dict[str, Replay] = {}
    w0 = time.perf_counter()
    dp = fleet_oracle_dp(m, restart, fs, replica_rates(scenario, fs))
    timings["oracle_dp"] = time.perf_counter() - w0
    free = oracle_free(m)
    reps["oracle_free"], reps["oracle_dp"] = free.replay, dp.replay

    runner.add_statics(
        scenario,
        m,
        reps,
        timings,
        say,
        lambda p: fleet_replay(scenario, peers.Static(p), canary=False),
    )

    for name in runner.ADAPTIVE:
        if name in wanted:
            say(f"{scenario.name}: {name}")
            # specpilot (with or without a hybrid profile) switches as FleetController does (a
            # canary first when enabled, a table rewrite rolling); the other policies know no
            # canary: their switches roll straight through.
            canary = None if name in ("specpilot", runner.HYBRID) else False
            policy = runner.make_policy(name, scenario)
            reps[name] = fleet_replay(scenario, policy, canary=canary)
            timings[name] = reps[name].wall_s

    rates = runner.merge_rates(scenario, m, reps, runner.ADAPTIVE)
    rows = runner.make_rows(
        scenario,
        known,
        wanted,
        reps,
        rates,
        dp.tokens,
        lambda row, rep: replace(row, false_switches=fleet_false_switches(scenario, rates, rep)),
    )
    return runner.ScenarioResult(
        scenario=scenario,
        rows=rows,
        replays=reps,
        measurements=m,
        wall_s=time.perf_counter() - t0,
        timings=timings,
    )


def fleet_notes(res: ScenarioResult) -> list[str]:
    """Lines the report prints under a fleet scenario's table: the fleet's settings and
    specpilot's canaries (the table's switch counts merge them, see the module docstring)."""
    sc = res.scenario
    if sc.replicas < 2:
        return []
    fs = fleet_settings(sc)
    lines = [
        f"fleet: {sc.replicas} replicas, at most {fs.max_unavailable()} out of the router at "
        f"once, specpilot's canary {'on' if fs.canary.enabled else 'off'}"
    ]
    rep = res.replays.get("specpilot")
    canaries = rep.canaries if isinstance(rep, FleetReplay) else []
    if canaries:
        outcomes = [c.outcome for c in canaries]
        lines.append(
            f"specpilot canaries: {len(canaries)} ({outcomes.count('promoted')} promoted, "
            f"{outcomes.count('rolled_back')} rolled back"
            + (f", {outcomes.count('unfinished')} unfinished" if "unfinished" in outcomes else "")
            + ")"
        )
    return lines
