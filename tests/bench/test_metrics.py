"""False switches and detection delay on hand-made replays with known measured rates."""

from __future__ import annotations

import numpy as np

from controller.bench.harness import Replay, Segment, SwitchEvent
from controller.bench.metrics import JSON_KEYS, detection_delays, false_switches, make_row
from controller.bench.scenario import Scenario
from tests.bench.conftest import make_scenario

# Two 1800 s phases: 5-step best in phase 0 (one stream), 2-step best in phase 1.
RATES = {
    "baseline": np.array([80.0, 800.0]),
    "eagle3-2step": np.array([120.0, 900.0]),
    "eagle3-5step": np.array([160.0, 850.0]),
}


def _replay(switches: list[SwitchEvent]) -> Replay:
    r = Replay("t", "x", "baseline", 3600.0, switches=list(switches))
    prof, t = "baseline", 0.0
    for s in switches:
        r.segments.append(Segment(t, s.t_s, 0 if s.t_s < 1800 else 1, prof, 0.0))
        r.segments.append(Segment(s.t_s, s.up_s, 0 if s.t_s < 1800 else 1, None, 0.0))
        prof, t = s.to_profile, s.up_s
    r.segments.append(Segment(t, 3600.0, 1, prof, 0.0))
    return r


def sw(t: float, a: str, b: str, down: float = 230.0) -> SwitchEvent:
    return SwitchEvent(t, t + down, a, b, "x")


def test_good_switches_are_not_false() -> None:
    sc = make_scenario()
    rep = _replay([sw(10, "baseline", "eagle3-5step"), sw(1850, "eagle3-5step", "eagle3-2step")])
    assert false_switches(sc, RATES, rep) == 0


def test_switch_to_a_worse_profile_is_false() -> None:
    sc = make_scenario()
    rep = _replay([sw(10, "baseline", "eagle3-2step"), sw(300, "eagle3-2step", "baseline")])
    # 2-step is better than baseline in phase 0 but is undone long before 40 tok/s x (300 - 240)
    # repays 80 tok/s x 230 s; going back to baseline is a switch to a worse profile.
    assert false_switches(sc, RATES, rep) == 2


def test_undone_after_repaying_is_not_false() -> None:
    sc = make_scenario()
    # 2-step gains 40 tok/s over baseline from 240 s to 1790 s = 62,000 > 80 x 230 = 18,400.
    rep = _replay([sw(10, "baseline", "eagle3-2step"), sw(1790, "eagle3-2step", "baseline")])
    assert false_switches(sc, RATES, rep) == 1  # only the return (baseline worse in phase 0)


def test_phase_is_where_the_new_profile_comes_up() -> None:
    sc = make_scenario()
    # Decided in phase 0 (where 2-step < 5-step) but up in phase 1 (where it is better).
    rep = _replay([sw(10, "baseline", "eagle3-5step"), sw(1700, "eagle3-5step", "eagle3-2step")])
    assert false_switches(sc, RATES, rep) == 0


def test_detection_delay_and_missed() -> None:
    sc = make_scenario()
    rep = _replay([sw(10, "baseline", "eagle3-5step"), sw(1850, "eagle3-5step", "eagle3-2step")])
    assert detection_delays(sc, RATES, rep) == ([5.0], 0)
    late = _replay([sw(10, "baseline", "eagle3-5step")])
    assert detection_delays(sc, RATES, late) == ([], 1)
    # Already on the new phase's best at the change: nothing to detect.
    ahead = _replay([sw(10, "baseline", "eagle3-2step")])
    assert detection_delays(sc, RATES, ahead) == ([], 0)


def test_row_json_has_exactly_the_issue_keys() -> None:
    sc = make_scenario()
    rep = _replay([sw(10, "baseline", "eagle3-5step")])
    rep.tokens = 500.0
    row = make_row(
        sc, RATES, rep, policy="x", oracle_dp_tokens=1000.0, best_static_tokens=400.0, wall_s=0.1
    )
    assert tuple(row.to_json()) == JSON_KEYS
    assert row.ratio_oracle_dp == 0.5 and row.ratio_best_static == 1.25 and row.switches == 1


# 5-step best at one stream, an idle half hour, then 2-step best at 64 streams.
IDLE_RATES = {
    "baseline": np.array([80.0, 0.0, 800.0]),
    "eagle3-2step": np.array([120.0, 0.0, 900.0]),
    "eagle3-5step": np.array([160.0, 0.0, 850.0]),
}


def _with_idle(concurrencies: tuple[int, ...] = (1, 0, 64)) -> Scenario:
    mix = {"chat": 1.0}
    return make_scenario(
        phases=[{"duration_s": 1800, "concurrency": c, "workloads": mix} for c in concurrencies]
    )


def _one_switch(t: float, a: str, b: str, end: float = 5400.0) -> Replay:
    """A replay on `a` that switches to `b` at `t` (its segments' phase numbers unused here)."""
    s = sw(t, a, b)
    segments = [Segment(0.0, t, 0, a, 0.0), Segment(t, s.up_s, 0, None, 0.0)]
    return Replay(
        "t", "x", a, end, switches=[s], segments=[*segments, Segment(s.up_s, end, 0, b, 0.0)]
    )


def test_a_switch_that_comes_up_in_an_idle_phase_is_judged_where_traffic_returns() -> None:
    # A switch to 2-step made in the idle phase (as oracle_dp makes it, ahead of the 64
    # streams) serves nothing there on either profile, and is judged in phase 2.
    sc = _with_idle()
    assert false_switches(sc, IDLE_RATES, _one_switch(2000, "eagle3-5step", "eagle3-2step")) == 0
    assert false_switches(sc, IDLE_RATES, _one_switch(2000, "eagle3-2step", "eagle3-5step")) == 1
    # With no traffic after it, a switch is not false: nothing was served worse.
    two = {k: v[:2] for k, v in IDLE_RATES.items()}
    idle = _one_switch(2000, "eagle3-2step", "eagle3-5step", end=3600.0)
    assert false_switches(_with_idle((1, 0)), two, idle) == 0


def test_an_idle_phase_has_nothing_to_detect() -> None:
    # One change to detect, from phase 0 to phase 2; the idle phase's all-zero rates name no
    # best profile (they named the first).
    sc = _with_idle()
    rep = _one_switch(3650, "eagle3-5step", "eagle3-2step")
    assert detection_delays(sc, IDLE_RATES, rep) == ([5.0], 0)
    stays = Replay(
        "t", "x", "eagle3-5step", 5400.0, segments=[Segment(0, 5400, 0, "eagle3-5step", 0)]
    )
    assert detection_delays(sc, IDLE_RATES, stays) == ([], 1)
