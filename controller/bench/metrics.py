"""Switch accounting of one replay: switches, false switches, detection delay; the result row.

Owns the definitions (also in scenarios/README.md), all judged against the phase's measured
rates (oracles.phase_rates: the same run's measurements, not the policy's beliefs):

- A switch is every restart the policy asked for (a static profile's one restart at the start
  included; SGLang adaptive's in-process tier moves are not restarts and do not count).
- A false switch is a switch from A to B such that either
  (a) B is not better than A in the measured rates of the phase in which B comes up (the one
      it was decided in, unless the restart ran past a phase change; where that phase has no
      traffic, the first phase after it that has), or
  (b) it is undone before it repays its restart: the next switch goes back to A, and the tokens
      B gained over A between B coming up and that next switch (measured rates, phase by phase)
      are fewer than the tokens A would have served during the restart.
- Detection delay: for each phase change after which the measured best candidate profile is not
  the one that was best before, and not the one the policy is running at the change, the poll
  windows from the change to the policy's first switch decision inside the new phase. A change
  with no switch inside the new phase is a missed detection (left out of the mean, counted).
  Phases without traffic have no best profile: they are skipped, and the phase after one is
  compared with the last phase before it that had traffic.

Must not: run replays or know policies' internals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from controller.bench.harness import Replay, SwitchEvent
from controller.bench.scenario import Scenario

# The exact keys of one --json row (the contract; tests check them).
JSON_KEYS = (
    "scenario",
    "policy",
    "tokens",
    "ratio_oracle_dp",
    "ratio_best_static",
    "switches",
    "false_switches",
)


def _rate(rates: Mapping[str, np.ndarray], profile: str, phase: int) -> float:
    r = rates.get(profile)
    if r is None or not math.isfinite(float(r[phase])):
        return math.nan
    return float(r[phase])


def _gain_between(
    scenario: Scenario,
    rates: Mapping[str, np.ndarray],
    new: str,
    old: str,
    t0: float,
    t1: float,
) -> float:
    """Tokens `new` serves beyond `old` over [t0, t1), phase by phase, at measured rates."""
    gain = 0.0
    for ph in scenario.phases:
        a, b = max(t0, ph.start_s), min(t1, ph.end_s)
        if b <= a:
            continue
        d = _rate(rates, new, ph.index) - _rate(rates, old, ph.index)
        if math.isfinite(d):
            gain += d * (b - a)
    return gain


def _up_phase(scenario: Scenario, sw: SwitchEvent) -> int:
    """The phase the new profile starts serving in (the one it was decided in unless the restart
    ran past a phase change; a restart past the end: the decision's)."""
    return scenario.phase_at(sw.up_s if sw.up_s < scenario.duration_s else sw.t_s).index


def comes_up_worse(scenario: Scenario, rates: Mapping[str, np.ndarray], sw: SwitchEvent) -> bool:
    """Rule (a): the new profile is not better than the old in the measured rates of the phase
    it comes up in (a clairvoyant switches ahead of a change), or, where that phase has no
    traffic, of the first phase after it that has: an idle phase serves nothing on either, so a
    switch made in one (the oracle's ahead of the load's return) is judged where it serves.
    Never false when no traffic follows."""
    start = _up_phase(scenario, sw)
    phase = next((ph.index for ph in scenario.phases[start:] if ph.concurrency > 0), None)
    if phase is None:
        return False
    r_new, r_old = _rate(rates, sw.to_profile, phase), _rate(rates, sw.from_profile, phase)
    return math.isfinite(r_new) and math.isfinite(r_old) and r_new <= r_old


def is_false_switch(
    scenario: Scenario,
    rates: Mapping[str, np.ndarray],
    sw: SwitchEvent,
    following: SwitchEvent | None,
) -> bool:
    """See the module docstring: (a) not better in its phase, or (b) undone before repaid."""
    if comes_up_worse(scenario, rates, sw):
        return True
    r_old = _rate(rates, sw.from_profile, _up_phase(scenario, sw))
    if following is not None and following.to_profile == sw.from_profile:
        gain = _gain_between(
            scenario, rates, sw.to_profile, sw.from_profile, sw.up_s, following.t_s
        )
        lost = r_old * (sw.up_s - sw.t_s) if math.isfinite(r_old) else 0.0
        if gain < lost:
            return True
    return False


def false_switches(scenario: Scenario, rates: Mapping[str, np.ndarray], rep: Replay) -> int:
    sws = rep.switches
    return sum(
        is_false_switch(scenario, rates, s, sws[i + 1] if i + 1 < len(sws) else None)
        for i, s in enumerate(sws)
    )


def detection_delays(
    scenario: Scenario, rates: Mapping[str, np.ndarray], rep: Replay
) -> tuple[list[float], int]:
    """(delays in poll windows, missed detections); see the module docstring."""
    cands = [p for p in scenario.profiles if p in rates]
    delays: list[float] = []
    missed = 0
    if not cands:
        return delays, missed

    def best(phase: int) -> str:
        return max(cands, key=lambda p: np.nan_to_num(rates[p][phase], nan=-1.0))

    busy = [ph for ph in scenario.phases if ph.concurrency > 0]
    for prev, ph in pairwise(busy):
        before, after = best(prev.index), best(ph.index)
        if before == after or rep.profile_at(ph.start_s) == after:
            continue
        first = next((s for s in rep.switches if ph.start_s <= s.t_s < ph.end_s), None)
        if first is None:
            missed += 1
        else:
            delays.append((first.t_s - ph.start_s) / scenario.poll_interval_s)
    return delays, missed


@dataclass(frozen=True)
class Row:
    """One (scenario, policy) result."""

    scenario: str
    policy: str
    tokens: float
    ratio_oracle_dp: float
    ratio_best_static: float
    switches: int
    false_switches: int
    detection_delay_windows: float | None  # mean over detected changes; None if none counted
    missed_detections: int
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        """The --json object: exactly JSON_KEYS. A ratio over no tokens (a scenario without
        traffic) is null: JSON has no NaN."""
        return {
            "scenario": self.scenario,
            "policy": self.policy,
            "tokens": self.tokens,
            "ratio_oracle_dp": _finite_or_none(self.ratio_oracle_dp),
            "ratio_best_static": _finite_or_none(self.ratio_best_static),
            "switches": self.switches,
            "false_switches": self.false_switches,
        }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def make_row(
    scenario: Scenario,
    rates: Mapping[str, np.ndarray],
    rep: Replay,
    *,
    policy: str,
    oracle_dp_tokens: float,
    best_static_tokens: float,
    wall_s: float,
) -> Row:
    delays, missed = detection_delays(scenario, rates, rep)
    return Row(
        scenario=scenario.name,
        policy=policy,
        tokens=rep.tokens,
        ratio_oracle_dp=rep.tokens / oracle_dp_tokens if oracle_dp_tokens > 0 else math.nan,
        ratio_best_static=rep.tokens / best_static_tokens if best_static_tokens > 0 else math.nan,
        switches=len(rep.switches),
        false_switches=false_switches(scenario, rates, rep),
        detection_delay_windows=float(np.mean(delays)) if delays else None,
        missed_detections=missed,
        wall_s=wall_s,
    )
