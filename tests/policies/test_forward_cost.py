"""policies.forward_cost: the roofline fitted over several profiles' served points finds a
compute-bound turn, keeps a saturating MoE saturating when told its routing, and refuses what
cannot identify it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.cycle_time import CycleTimeSurface
from policies.decide import decide, initial_state
from policies.forward_cost import (
    ForwardCurve,
    ForwardPoint,
    expert_coverage,
    fit_forward_curve,
    line_pair,
)
from policies.settings import PolicySettings
from policies.types import DecodeMoments, Overrides, ProfileSpec

BATCHES = (1, 4, 16, 48)


def served(truth: ForwardCurve, draft_tokens: int = 3) -> list[ForwardPoint]:
    """Baseline and one chain profile at the bench's batch sizes, priced by `truth`."""
    return [
        ForwardPoint(b, n, n > 1, truth.at(b, n, n > 1)) for n in (1, draft_tokens) for b in BATCHES
    ]


def curve(coef: tuple[float, ...], share: float = 0.0) -> ForwardCurve:
    a, c, m0, m1, k, kv = coef
    return ForwardCurve((a, c, m0, m1, k, kv), share, 0.0, 0, math.inf)


def test_coverage_is_the_share_of_experts_reached() -> None:
    assert expert_coverage(1, 8 / 384) == pytest.approx(8 / 384)
    assert float(expert_coverage(10_000, 8 / 384)) == pytest.approx(1.0)
    assert float(expert_coverage(48, 0.0)) == 0.0


def test_a_turn_to_compute_bound_seen_at_one_point_is_continued() -> None:
    """Dense: weights streamed (flat) until the tokens' compute line crosses them; only the
    2-step at 48 streams (144 tokens) is past the kink. A line through the last two served
    sizes would miss 288 tokens by a quarter; the roofline through the origin does not. One
    compute-bound size cannot split the size-independent time from the weights': the fit
    counts it all as memory, so its compute line is the steepest the data allow (above the
    truth, by the 4 ms of launch costs over 288 tokens' worth)."""
    truth = curve((0.004, 0.003, 0.040, 0.0, 0.0004, 0.00002))
    fit = fit_forward_curve(served(truth))
    assert fit is not None and fit.rel_rms < 1e-6
    assert 48 <= fit.kink_tokens < 144
    for b in BATCHES:
        assert fit.at(b, 6, True) == pytest.approx(truth.at(b, 6, True), rel=0.05)
    assert fit.at(48, 6, True) >= truth.at(48, 6, True)
    # With two compute-bound sizes (144 and 192 tokens) the split is data, and so the slope.
    more = [*served(truth), ForwardPoint(64, 3, True, truth.at(64, 3, True))]
    fit = fit_forward_curve(more)
    assert fit is not None
    assert fit.at(48, 6, True) == pytest.approx(truth.at(48, 6, True), rel=0.005)


def test_a_saturating_moe_stays_saturated_when_its_routing_is_known() -> None:
    share = 8 / 384
    truth = curve((0.010, 0.005, 0.002, 0.600, 0.0, 0.0), share)
    fit = fit_forward_curve(served(truth), share)
    assert fit is not None and fit.rel_rms < 1e-6 and math.isinf(fit.kink_tokens)
    assert fit.at(48, 6, True) == pytest.approx(truth.at(48, 6, True), rel=0.01)
    # Without the routing the family holds no saturating curve: the fit says so.
    blind = fit_forward_curve(served(truth), 0.0)
    assert blind is not None and blind.rel_rms > 0.05


def test_unidentified_inputs_give_none() -> None:
    truth = curve((0.004, 0.003, 0.040, 0.0, 0.0004, 0.00002))
    pts = served(truth)
    assert fit_forward_curve([p for p in pts if not p.speculative]) is None
    assert fit_forward_curve([p for p in pts if p.speculative]) is None
    assert fit_forward_curve(pts[:3] + pts[4:7]) is None  # 6 points, 5 parameters
    assert fit_forward_curve([*pts[:-1], pts[-1]._replace(cycle_s=0.0)]) is None
    assert fit_forward_curve([*pts[:-1], pts[-1]._replace(cycle_s=math.nan)]) is None


@settings(max_examples=60, deadline=None)
@given(
    coef=st.tuples(
        st.floats(0.0, 0.02),
        st.floats(0.0, 0.02),
        st.floats(0.0, 0.05),
        st.floats(0.0, 0.5),
        st.floats(0.0, 0.002),
        st.floats(0.0, 0.0005),
    ),
    moe=st.booleans(),
)
def test_the_fit_never_does_worse_than_its_family_allows(
    coef: tuple[float, float, float, float, float, float], moe: bool
) -> None:
    """Points priced by a member of the family are fitted with a small residual and every
    coefficient non-negative (the best split is at least as good as the true one)."""
    share = 8 / 384 if moe else 0.0
    truth = curve(coef if moe else (*coef[:3], 0.0, *coef[4:]), share)
    pts = served(truth)
    if min(p.cycle_s for p in pts) <= 1e-6:
        return
    fit = fit_forward_curve(pts, share)
    assert fit is not None
    assert all(c >= 0.0 for c in fit.coef)
    assert fit.rel_rms < 0.02
    assert np.isfinite(fit.at(48, 6, True))


def _surface_fed(share: float) -> tuple[CycleTimeSurface, ForwardCurve]:
    """A CycleTimeSurface fed baseline and 2-step windows priced by a saturating MoE roofline
    (the served forwards reach 144 tokens; 5-step at 48 streams is 288)."""
    truth = curve((0.010, 0.005, 0.002, 0.600, 0.0, 0.0), 8 / 384)
    profiles = [
        ProfileSpec("baseline"),
        ProfileSpec("e2", num_steps=2, draft_tokens=3, algorithm="EAGLE3"),
        ProfileSpec("e5", num_steps=5, draft_tokens=6, algorithm="EAGLE3"),
    ]
    surf = CycleTimeSurface(profiles, expert_share=share)
    t = 0.0
    for spec, n in ((profiles[0], 1), (profiles[1], 3)):
        for b in BATCHES:
            y = truth.at(b, n, n > 1)
            for _ in range(6):
                t += 10.0
                steps = 10.0 / y
                surf.update(
                    spec.name,
                    DecodeMoments(steps, steps * b, 10.0, steps * b * b, 10.0 * b, steps * b),
                    t,
                    10.0,
                )
    return surf, truth


def test_the_surface_centres_an_unseen_profile_on_the_roofline() -> None:
    told, truth = _surface_fed(8 / 384)
    blind, _ = _surface_fed(0.0)
    want = truth.at(48, 6, True)
    e_told = told.estimate("e5", 48.0)
    e_blind = blind.estimate("e5", 48.0)
    assert e_told is not None and e_blind is not None
    assert e_told.mean == pytest.approx(want, rel=0.05)
    assert e_blind.mean > 1.2 * want  # the donor's straight continuation
    assert e_told.low <= want <= e_told.high and e_blind.low <= want <= e_blind.high
    # The share is saved with the estimator, and the settings in force replace it.
    back = CycleTimeSurface.from_dict(told.to_dict())
    assert back.expert_share == pytest.approx(8 / 384)
    back.set_expert_share(0.0)
    e_back = back.estimate("e5", 48.0)
    assert e_back is not None and e_back.mean == pytest.approx(e_blind.mean)
    with pytest.raises(ValueError):
        back.set_expert_share(1.5)


def test_a_run_profile_beyond_its_served_sizes_follows_the_roofline() -> None:
    """2-step served up to 48 streams (144 tokens), asked at 96: its own end secant runs on
    as if the experts were not all read already; the roofline, anchored at its last point,
    knows they are."""
    told, truth = _surface_fed(8 / 384)
    blind, _ = _surface_fed(0.0)
    want = truth.at(96, 3, True)
    assert told.support("e2", 96.0) == "extrapolated"
    e_told, e_blind = told.estimate("e2", 96.0), blind.estimate("e2", 96.0)
    assert e_told is not None and e_blind is not None
    assert e_told.mean == pytest.approx(want, rel=0.03)
    assert e_blind.mean > 1.1 * want
    assert e_told.low <= want <= e_told.high


def test_decide_applies_the_settings_share_to_a_restored_state() -> None:
    profiles = [ProfileSpec("baseline")]
    state = initial_state(profiles, "baseline", 0.0, PolicySettings())
    assert state.model.cycle.expert_share == 0.0
    state, _ = decide(state, None, 10.0, PolicySettings(moe_experts=256, moe_topk=8), Overrides())
    assert state.model.cycle.expert_share == pytest.approx(8 / 256)
    with pytest.raises(ValueError, match="moe_topk"):
        PolicySettings(moe_experts=8, moe_topk=0)


def test_a_newly_served_batch_size_refits_however_few_its_steps() -> None:
    """A bucket that gains enough data is new shape: the roofline is refitted with it even when
    its steps are far under REFIT_FRACTION of all the steps seen."""
    surf, truth = _surface_fed(8 / 384)
    before = surf.forward_curve()
    assert before is not None and before.n_points == 8
    y = truth.at(96, 3, True)
    for i in range(3):
        steps = 10.0 / y
        m = DecodeMoments(steps, steps * 96, 10.0, steps * 96 * 96, 10.0 * 96, steps * 96)
        surf.update("e2", m, 1e4 + 10.0 * i, 10.0)
    after = surf.forward_curve()
    assert after is not None and after.n_points == 9


def test_a_cost_is_read_across_the_nearest_chains_on_each_side_else_one_side() -> None:
    assert line_pair([2, 5], 3) == (2, 5)  # between: interpolated
    assert line_pair([3, 5, 7], 2) == (3, 5)  # below all: the two nearest, continued
    assert line_pair([1, 3, 5], 7) == (3, 5)  # above all
    assert line_pair([3, 5], 5) is None  # x itself is not a second length
    assert line_pair([4], 2) is None
