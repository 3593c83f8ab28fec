import numpy as np
import pytest

from policies.breakeven import (
    accept_length_for,
    accept_length_for_batch,
    breakeven_accept_length,
    breakeven_accept_length_batch,
    tok_s_for,
)


def test_field_breakeven_numbers() -> None:
    # FIELD.md: 82 tok/s at 30 ms -> 2.46; 100 tok/s needs 3.0; 120 tok/s needs 3.6.
    assert breakeven_accept_length(82.0, 0.030) == pytest.approx(2.46)
    assert accept_length_for(100.0, 0.030) == pytest.approx(3.0)
    assert accept_length_for(120.0, 0.030) == pytest.approx(3.6)


def test_tok_s_inverts_accept_length_for() -> None:
    assert tok_s_for(accept_length_for(120.0, 0.030), 0.030) == pytest.approx(120.0)
    assert tok_s_for(2.0, 0.020, batch=8) == pytest.approx(800.0)


def test_batch_variants() -> None:
    # At B, speculation pays iff B L / T_cyc(B) > B / T_base(B) <=> L > T_cyc / T_base.
    base = np.array([0.0122, 0.0130, 0.0160])
    cyc = np.array([0.0300, 0.0320, 0.0400])
    be = breakeven_accept_length_batch(base, cyc)
    np.testing.assert_allclose(be, cyc / base)
    # B = 1 reduces to the single-stream rule: baseline tok/s x cycle.
    assert breakeven_accept_length_batch(1 / 82.0, 0.030) == pytest.approx(2.46)
    np.testing.assert_allclose(accept_length_for_batch(800.0, 8, 0.030), 3.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_inputs_raise(bad: float) -> None:
    with pytest.raises(ValueError):
        breakeven_accept_length(bad, 0.03)
    with pytest.raises(ValueError):
        accept_length_for(100.0, bad)
    with pytest.raises(ValueError):
        breakeven_accept_length_batch([0.01, bad], [0.03, 0.03])
