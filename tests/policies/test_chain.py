import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.chain import (
    alpha_from_accept_length,
    expected_accept_length,
    extrapolated_accept_length,
    fit_tail,
    hist_from_alpha,
    mixture_accept_length,
    predict_from_mean,
    survival,
    truncate_histogram,
    truncated_accept_length,
)


@pytest.mark.parametrize(
    ("alpha", "g", "expected"),
    [(0.6, 2, 1.96), (0.6, 5, 2.38), (0.8, 2, 2.44), (0.8, 5, 3.69), (1.0, 3, 4.0), (0.0, 4, 1.0)],
)
def test_field_chain_numbers(alpha: float, g: int, expected: float) -> None:
    assert float(expected_accept_length(alpha, g)) == pytest.approx(expected, abs=0.005)


@given(st.floats(0.0, 0.999), st.integers(1, 8))
@settings(max_examples=50, deadline=None)
def test_alpha_inverts_expected_length(alpha: float, g: int) -> None:
    L = float(expected_accept_length(alpha, g))
    assert float(expected_accept_length(alpha_from_accept_length(L, g), g)) == pytest.approx(
        L, abs=1e-9
    )


@given(
    st.lists(st.integers(0, 500), min_size=6, max_size=6).filter(lambda h: sum(h) > 0),
    st.integers(0, 5),
)
@settings(max_examples=60, deadline=None)
def test_truncation_is_exact(hist: list[int], g_prime: int) -> None:
    # Per verify step A_g' = min(A_g, g'): E[L_g'] computed from the per-step values must equal
    # 1 + sum_{i<=g'} P(A >= i) from the histogram.
    steps = np.repeat(np.arange(6), hist)
    direct = 1.0 + np.minimum(steps, g_prime).mean()
    assert truncated_accept_length(hist, g_prime) == pytest.approx(direct, rel=1e-12)
    th = truncate_histogram(hist, g_prime)
    assert th.sum() == sum(hist)
    assert truncated_accept_length(th, g_prime) == pytest.approx(direct, rel=1e-12)


def test_truncation_of_a_chain_equals_the_shorter_chain() -> None:
    # A constant-alpha 5-step histogram truncated to 2 steps is the 2-step chain's accept length.
    h5 = hist_from_alpha(0.7, 5, 1e6)
    assert truncated_accept_length(h5, 2) == pytest.approx(float(expected_accept_length(0.7, 2)))
    assert truncated_accept_length(h5, 5) == pytest.approx(float(expected_accept_length(0.7, 5)))


def test_truncation_refuses_longer_chains() -> None:
    with pytest.raises(ValueError):
        truncated_accept_length([1, 1, 1], 3)
    with pytest.raises(ValueError):
        survival([0, 0])
    with pytest.raises(ValueError):
        survival([1, -1])


def test_tail_model_brackets_truth_and_is_wider_than_truncation() -> None:
    rng = np.random.default_rng(3)
    for alpha in (0.5, 0.7, 0.85):
        p2 = hist_from_alpha(alpha, 2, 1.0)
        h2 = rng.multinomial(5000, p2 / p2.sum())
        fit = fit_tail(h2)
        m, lo, hi = extrapolated_accept_length(fit, 5)
        truth = float(expected_accept_length(alpha, 5))
        assert lo <= truth <= hi
        assert m == pytest.approx(truth, rel=0.05)
        # Censored extrapolation: wider than the exact (truncation) side.
        _m2, lo2, hi2 = extrapolated_accept_length(fit, 2)
        assert hi - lo > 2 * (hi2 - lo2)


def test_means_only_prediction_is_wider_upward() -> None:
    _m, lo, hi = predict_from_mean(float(expected_accept_length(0.7, 2)), 2, 5, se=0.01)
    assert lo < float(expected_accept_length(0.7, 5)) < hi
    _m_dn, lo_dn, hi_dn = predict_from_mean(float(expected_accept_length(0.7, 5)), 5, 2, se=0.01)
    assert lo_dn < float(expected_accept_length(0.7, 2)) < hi_dn
    assert (hi - lo) > (hi_dn - lo_dn)


def test_mixture_is_token_weighted_harmonic_mean() -> None:
    # Half the tokens from L=2 and half from L=4: slots spend 1/4 + 1/8 cycles per token.
    assert mixture_accept_length([2.0, 4.0], [0.5, 0.5]) == pytest.approx(1 / (0.25 + 0.125))
