"""The break-even horizon decide reports for an exploration: the remaining regime at which the
value of what the run reveals equals its cost (the same formula the decision weighs)."""

from __future__ import annotations

import math

import pytest

from policies.explore_value import breakeven_s, expected_excess, explore_gain
from policies.settings import PolicySettings
from policies.types import ProfileSpec

S = PolicySettings()
CHAIN = ProfileSpec("eagle2", num_steps=2, draft_tokens=3, algorithm="EAGLE3")
ADAPTIVE = ProfileSpec(
    "hybrid", num_steps=2, draft_tokens=3, algorithm="EAGLE3", adaptive=True, candidate_steps=(2,)
)


@pytest.mark.parametrize(
    ("dists", "cur"),
    [
        ([("norm", 92.1, 0.7)], 90.8),
        ([("norm", 88.0, 2.0)], 90.8),
        ([("unif", 54.0, 126.0)], 90.0),
        ([("norm", 95.0, 1.0), ("unif", 60.0, 120.0)], 90.0),
    ],
)
@pytest.mark.parametrize("spec", [CHAIN, ADAPTIVE], ids=["chain", "adaptive"])
def test_value_equals_cost_at_the_breakeven_horizon(
    dists: list[tuple[str, float, float]], cur: float, spec: ProfileSpec
) -> None:
    restart = 200.0
    cost = cur * restart + 300.0
    gain = explore_gain(dists, cur, S, spec)
    h = breakeven_s(gain, cost, restart, S)
    # A chain's gain is the expected excess less the switch margin; an adaptive profile's is not
    # charged the margin.
    margin = 0.0 if spec.adaptive else S.margin_frac * cur
    assert gain == pytest.approx(expected_excess(dists, cur) - margin)
    if gain <= 0:  # no upside past the margin: no horizon repays it
        assert h == math.inf
        return

    def net(horizon: float) -> float:
        return gain * max(horizon - restart - S.min_dwell_s, 0.0) - cost

    assert math.isfinite(h) and h > restart + S.min_dwell_s
    assert net(h) == pytest.approx(0.0, abs=1e-6 * cost)
    assert net(0.99 * h) < 0 < net(1.01 * h)


def test_no_upside_never_breaks_even() -> None:
    for spec in (CHAIN, ADAPTIVE):
        assert (
            breakeven_s(explore_gain([("norm", 50.0, 1e-9)], 90.0, S, spec), 1000.0, 180.0, S)
            == math.inf
        )
    # Within the margin is no upside for a chain: 1.2% expected over 90 tok/s, a 2% margin.
    assert (
        breakeven_s(explore_gain([("norm", 91.1, 1e-9)], 90.0, S, CHAIN), 1000.0, 180.0, S)
        == math.inf
    )
    assert math.isfinite(
        breakeven_s(explore_gain([("norm", 91.1, 1e-9)], 90.0, S, ADAPTIVE), 1000.0, 180.0, S)
    )
