"""A baseline never run is bounded by the speculative profile serving, not guessed: its tok/s
interval is the physics' band, exploration weighs it as a uniform prior over that band, and no
predicted-gain switch is ever made on it."""

from __future__ import annotations

from policies.decide import predictions
from policies.explore_value import prior_dist
from policies.types import Reason
from tests.policies.driver import SPECS, Driver

HI = {"chat": 0.85}
LO = {"chat": 0.3}
MIX = {"chat": 1.0}


def _bound(dr: Driver):  # type: ignore[no-untyped-def]
    preds = {p.profile: p for p in predictions(dr.state)}
    base = preds["baseline"]
    assert base.bound and base.tok_s is not None
    return base, preds


def test_a_never_run_baseline_is_a_bound_that_holds_the_truth() -> None:
    dr = Driver("eagle2", seed=5)
    dr.run(6, 8, HI, MIX)
    base, preds = _bound(dr)
    assert base.cycle_s is not None
    truth = float(dr.syn.cost.step_s(8, 1))
    assert base.cycle_s.low <= truth <= base.cycle_s.high
    # Its decode costs at most the running cycle, at least a third of it (3 tokens verified).
    cyc = preds["eagle2"].cycle_s
    assert cyc is not None
    assert base.cycle_s.high <= cyc.high and base.cycle_s.low >= cyc.low / 3 * 0.95 * 0.99
    assert SPECS["baseline"].name not in dr.state.tried
    kind, lo, hi = prior_dist(base, 100.0, dr.settings, SPECS["baseline"], SPECS["eagle2"])
    assert (kind, lo, hi) == ("unif", base.tok_s.low, base.tok_s.high)  # type: ignore[union-attr]


def test_weak_drafter_explores_the_bounded_baseline_and_no_switch_rides_on_the_bound() -> None:
    # With a weak drafter the bound puts most of its mass above the running rate: a run pays.
    dr = Driver("eagle2", seed=6)
    dr.run(240, 8, LO, MIX)
    sw = dr.switches()
    assert sw and sw[0].profile == "baseline" and sw[0].reason is Reason.EXPLORE
    for d in dr.decisions:
        if d.reason is Reason.SWITCH_PREDICTED_GAIN:
            assert d.profile != "baseline" or "baseline" in dr.state.tried
