"""controller.numfmt: numbers as the CLI tables, demos and status page print them."""

from __future__ import annotations

import pytest

from controller.numfmt import num, span_end


@pytest.mark.parametrize(
    ("v", "text"),
    [
        (None, "–"),
        (0, "0"),
        (1.2345, "1.23"),
        (48, "48"),
        (999.4, "999"),
        (999.6, "1,000"),  # 3 significant digits would be 1e+03
        (1234.4, "1,234"),  # a batch of 48 serves thousands of tok/s: never 1.23e+03
        (98765.4, "98,765"),
        (0.00012, "0.00012"),
        (float("inf"), "inf"),
        (float("nan"), "nan"),
    ],
)
def test_num(v: float | None, text: str) -> None:
    assert num(v) == text


def test_num_digits_and_none() -> None:
    assert num(None, none="-") == "-"
    assert num(12.345, 4) == "12.35"
    assert num(12345.0, 4) == "12,345"


def test_a_span_end_is_dated_only_on_another_day() -> None:
    midnight = 1_800_057_600.0  # 2027-01-16 00:00:00 UTC
    assert span_end(midnight - 600, midnight - 5, "%H:%M:%S") == "23:59:55"
    assert span_end(midnight - 600, midnight + 5, "%H:%M:%S") == "2027-01-16 00:00:05"
    assert span_end(midnight - 86400 + 18000, midnight + 18000, "%H:%M") == "2027-01-16 05:00"
