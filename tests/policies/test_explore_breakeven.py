"""The break-even horizon decide reports for an exploration: the remaining regime at which the
value of what the run reveals equals its cost (the same formula the decision weighs)."""

from __future__ import annotations

import math

import pytest

from policies.decide import PolicySettings, _breakeven_s, _expected_excess

S = PolicySettings()


@pytest.mark.parametrize(
    ("dists", "cur"),
    [
        ([("norm", 92.1, 0.7)], 90.8),
        ([("norm", 88.0, 2.0)], 90.8),
        ([("unif", 54.0, 126.0)], 90.0),
        ([("norm", 95.0, 1.0), ("unif", 60.0, 120.0)], 90.0),
    ],
)
def test_value_equals_cost_at_the_breakeven_horizon(
    dists: list[tuple[str, float, float]], cur: float
) -> None:
    restart = 200.0
    cost = cur * restart + 300.0
    h = _breakeven_s(dists, cur, cost, restart, S)
    excess = _expected_excess(dists, cur)

    def net(horizon: float) -> float:
        return excess * max(horizon - restart - S.min_dwell_s, 0.0) - cost

    assert math.isfinite(h) and h > restart + S.min_dwell_s
    assert net(h) == pytest.approx(0.0, abs=1e-6 * cost)
    assert net(0.99 * h) < 0 < net(1.01 * h)


def test_no_upside_never_breaks_even() -> None:
    assert _breakeven_s([("norm", 50.0, 1e-9)], 90.0, 1000.0, 180.0, S) == math.inf
