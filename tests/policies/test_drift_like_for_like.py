"""Drift compares like with like: a batch-size change is not drift (the demo's 1 -> 48 streams
reported "cycle:baseline moved from 0.0112 to 0.02487 s" and "baseline_tok_s 1406 -> 633"), and
baseline tok/s in a finding is one stream's, as FIELD.md reports it."""

from __future__ import annotations

import numpy as np
import pytest

from policies.cycle_time import CycleTimeSurface, comparable_step_s
from policies.forgetting import batch_bucket
from policies.types import DecodeMoments, Overrides
from tests.policies.driver import Driver
from tests.policies.synth import BASE, Cost

HI = {"chat": 0.85}
MIX = {"chat": 1.0}


def _concave_step_s(b: float) -> float:
    """A MoE-like step time: saturating expert streaming plus a linear compute part."""
    return 0.010 + 0.03 * (1.0 - np.exp(-b / 20.0)) + 0.0002 * b


def _moments(b: float, steps: float = 500.0) -> DecodeMoments:
    t = _concave_step_s(b)
    return DecodeMoments(steps, steps * b, steps * t, steps * b * b, steps * b * t, steps * b)


def test_batch_change_across_boots_is_not_drift() -> None:
    dr = Driver("baseline", seed=21)
    dr.syn.batch_jitter = 0  # exactly one stream, as the demo: no slope seen at B = 1
    dr.run(40, 1, HI, MIX, Overrides(pin_profile="baseline"))
    dr.run(40, 1, HI, MIX, Overrides(pin_profile="eagle5"))
    # The baseline boots again into traffic at 48 streams: nothing comparable was served before.
    dr.run(40, 48, HI, MIX, Overrides(pin_profile="baseline"))
    drift = [f for f in dr.state.findings if f.kind == "drift"]
    assert drift == [], drift


def test_drift_across_boots_at_the_same_batch_size_reports_one_stream() -> None:
    dr = Driver("baseline", seed=22)
    dr.run(40, 1, HI, MIX, Overrides(pin_profile="baseline"))
    dr.run(40, 8, HI, MIX, Overrides(pin_profile="eagle5"))
    # Next boot ~8% slower at one stream (the field's 89 -> 82 tok/s).
    dr.syn.cost = Cost(fixed_s=0.0109)
    dr.run(40, 1, HI, MIX, Overrides(pin_profile="baseline"))
    tok = [f for f in dr.state.findings if f.subject == "baseline_tok_s"]
    assert len(tok) == 1
    # One stream at B = 1 does ~1 / (fixed + per_tok + per_seq) tok/s, not B / step.
    old = 1.0 / float(Cost().step_s(1, 1))
    new = 1.0 / float(Cost(fixed_s=0.0109).step_s(1, 1))
    assert tok[0].before == pytest.approx(old, rel=0.03)
    assert tok[0].after == pytest.approx(new, rel=0.03)
    cyc = [f for f in dr.state.findings if f.subject == "cycle:baseline"]
    assert len(cyc) == 1 and cyc[0].after > cyc[0].before


def test_cycle_change_stream_skips_new_batch_sizes() -> None:
    """The prequential ratio (the cycle change stream) is only given at batch sizes whose bucket
    already has data: the first windows at a new batch size teach, they do not alarm."""
    c = CycleTimeSurface([BASE], min_windows=3, min_steps=20)
    ratios = [c.update("baseline", _moments(1.0), 10.0 * i, 10.0) for i in range(1, 6)]
    assert ratios[:3] == [None, None, None] and ratios[3] == pytest.approx(1.0)
    jump = [c.update("baseline", _moments(48.0), 60.0 + 10.0 * i, 10.0) for i in range(4)]
    assert jump[:3] == [None, None, None] and jump[3] == pytest.approx(1.0)


def test_estimates_at_every_batch_size_seen_follow_a_concave_curve() -> None:
    c = CycleTimeSurface([BASE], min_windows=3, min_steps=20)
    t = 0.0
    for b in (1.0, 4.0, 16.0, 48.0):
        for _ in range(6):
            t += 10.0
            c.update("baseline", _moments(b), t, 10.0)
    for b in (1.0, 4.0, 16.0, 48.0):
        e = c.estimate("baseline", b)
        assert e is not None and e.mean == pytest.approx(_concave_step_s(b), rel=1e-6)
    # Between buckets: interpolated, and the interval spans the curve.
    for b in (8.0, 28.0):
        e = c.estimate("baseline", b)
        assert e is not None and e.low <= _concave_step_s(b) <= e.high, (b, e)


def test_comparable_step_s_only_inside_a_served_bucket() -> None:
    c = CycleTimeSurface([BASE], min_windows=3, min_steps=20)
    for i in range(5):
        c.update("baseline", _moments(16.0), 10.0 * i + 10.0, 10.0)
    snap = c.profile_snapshot("baseline")
    assert comparable_step_s(snap, 16.0) == pytest.approx(_concave_step_s(16.0))
    assert comparable_step_s(snap, 17.0) is not None  # same half-octave bucket
    assert batch_bucket(17.0) == batch_bucket(16.0)
    assert comparable_step_s(snap, 1.0) is None
    assert comparable_step_s(snap, 48.0) is None
