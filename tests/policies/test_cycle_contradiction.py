"""A change of system state that comes with a change of concurrency: the step-time stream compares
like batch sizes only and cannot see it, but the physics can (a step time never falls as the batch
grows, its time per sequence never rises). A bucket's level outside the band older data at
another batch size allow says the system moved: the older data are forgotten and the move
recorded (CycleTimeSurface.contradiction, intake._contradicted_cycle)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from policies.cycle_time import CycleTimeSurface
from policies.decide import predictions
from policies.forgetting import batch_bucket
from policies.types import DecodeMoments, Overrides, ProfileSpec
from tests.policies.driver import Driver
from tests.policies.synth import E5, PROFILES

HI = {"chat": 0.85}
MIX = {"chat": 1.0}


def _moments(b: float, step_s: float, steps: float = 500.0) -> DecodeMoments:
    return DecodeMoments(
        steps, steps * b, steps * step_s, steps * b * b, steps * b * step_s, steps * b
    )


def _surface(
    b1: float, y1: float, profiles: tuple[ProfileSpec, ...] = PROFILES, name: str = "eagle5"
) -> CycleTimeSurface:
    """`name` served 16 streams at 80 ms for 6 windows, then `b1` streams at `y1` for 4."""
    surf = CycleTimeSurface(list(profiles))
    t = 0.0
    for _ in range(6):
        t += 10.0
        surf.update(name, _moments(16.0, 0.080), t, 10.0)
    for _ in range(4):
        t += 10.0
        surf.update(name, _moments(b1, y1), t, 10.0)
    return surf


def test_a_level_outside_the_band_older_data_allow_is_a_contradiction() -> None:
    # Twice the sequences cost at most twice the time: 250 ms is 1.56x that.
    c = _surface(32.0, 0.250).contradiction("eagle5", 32.0)
    assert c is not None
    assert c.buckets == (batch_bucket(16.0),)
    assert c.ratio == pytest.approx(0.250 / 0.160)
    assert c.since_s == 70.0
    # A step time that falls as the batch grows: the system sped up.
    c = _surface(32.0, 0.060).contradiction("eagle5", 32.0)
    assert c is not None and c.ratio == pytest.approx(0.060 / 0.080)
    # Going down: 8 streams take at least half of what 16 took.
    c = _surface(8.0, 0.030).contradiction("eagle5", 8.0)
    assert c is not None and c.ratio == pytest.approx(0.030 / 0.040)
    # Inside the band, or within the tolerance of its edge: the same system.
    for b1, y1 in ((32.0, 0.150), (32.0, 0.165), (8.0, 0.060), (16.0, 0.085)):
        assert _surface(b1, y1).contradiction("eagle5", b1) is None, (b1, y1)


def test_data_served_alongside_is_no_contradiction() -> None:
    """Buckets served in turn (the batch moving to and fro) are one system's: only data that all
    predate the bucket's first window may be another's. Nor is an adaptive profile judged: its
    tokens per sequence move with the batch. Too few windows at the new size say nothing yet."""
    surf = _surface(32.0, 0.250)
    surf.update("eagle5", _moments(16.0, 0.080), 110.0, 10.0)
    assert surf.contradiction("eagle5", 32.0) is None
    adaptive = dataclasses.replace(E5, name="adaptive", adaptive=True)
    surf = _surface(32.0, 0.250, (*PROFILES, adaptive), "adaptive")
    assert surf.contradiction("adaptive", 32.0) is None
    surf = CycleTimeSurface(list(PROFILES))
    for i in range(6):
        surf.update("eagle5", _moments(16.0, 0.080), 10.0 * (i + 1), 10.0)
    for i in range(2):
        surf.update("eagle5", _moments(32.0, 0.250), 70.0 + 10.0 * i, 10.0)
    assert surf.contradiction("eagle5", 32.0) is None
    assert surf.contradiction("eagle5", 64.0) is None  # no data there


def test_dropping_buckets_forgets_them_in_the_line_too() -> None:
    surf = _surface(32.0, 0.250)
    k16, k32 = batch_bucket(16.0), batch_bucket(32.0)
    kept = surf.buckets["eagle5"][k32]
    surf.drop_buckets("eagle5", [k16])
    assert set(surf.buckets["eagle5"]) == {k32}
    line = surf.stats["eagle5"]
    assert line.s0 == pytest.approx(kept.s0)
    assert line.bbar == pytest.approx(32.0) and line.level == pytest.approx(0.250)
    e = surf.estimate("eagle5", 32.0)
    assert e is not None and e.mean == pytest.approx(0.250, rel=1e-6)
    # The state still round-trips (first_t_s included).
    again = CycleTimeSurface.from_dict(surf.to_dict())
    assert again.buckets["eagle5"][k32].first_t_s == kept.first_t_s == 70.0
    surf.drop_buckets("eagle5", [k32])
    assert not surf.has_data("eagle5") and surf.stats["eagle5"].s0 == 0.0


def test_a_rise_of_the_verify_with_the_concurrency_is_detected_and_moves_the_estimates() -> None:
    """5-step serves 16 streams, then 32, and at the same moment the verify forward's fixed
    cost grows seven-fold (a change of system state with a change of traffic: a random day's
    7-step went from 16 streams to 32 as its verify got 1.41x dearer). 32 streams then cost
    more than twice what 16 did: the old data are forgotten, a rise of the verify recorded,
    and 2-step, never run and read off 5-step's forwards at fewer tokens, is priced with its
    true step time inside its band (read off the 16-stream data, it was priced at 1.4x the
    rate it served and switched to)."""
    pin = Overrides(pin_profile="eagle5")
    dr = Driver("eagle5", seed=11)
    dr.run(300, 16, HI, MIX, pin)
    assert dr.state.cycle_moves == []
    dr.syn.cost = dataclasses.replace(dr.syn.cost, verify_fixed_s=0.05)
    dr.run(120, 32, HI, MIX, pin)
    cycle = dr.state.model.cycle
    assert set(cycle.buckets["eagle5"]) == {batch_bucket(32.0)}
    rises = [m for m in dr.state.cycle_moves if m[2] and m[1] > 1.2]
    assert len(rises) == 1
    assert dr.state.last_cycle_change_s is not None
    assert any(f.kind == "drift" and f.subject == "cycle:eagle5" for f in dr.state.findings)
    truth = float(dr.syn.cost.step_s(32, 3))
    e2 = {p.profile: p for p in predictions(dr.state)}["eagle2"]
    assert e2.cycle_s is not None
    assert e2.cycle_s.low <= truth <= e2.cycle_s.high
    assert math.isfinite(e2.cycle_s.high)


def test_a_state_saved_before_first_t_s_judges_nothing_it_cannot_date() -> None:
    """A bucket saved without `first_t_s` (states from before it) cannot say when its data
    began: it is never taken for newer than the others, so nothing is dropped on its account."""
    surf = _surface(32.0, 0.250)
    d = surf.to_dict()
    for b in d["buckets"]["eagle5"].values():
        del b["first_t_s"]
    del d["stats"]["eagle5"]["first_t_s"]
    old = CycleTimeSurface.from_dict(d)
    assert all(b.first_t_s is None for b in old.buckets["eagle5"].values())
    assert old.contradiction("eagle5", 32.0) is None
