"""Numbers and times for people: the one formatter of the CLI tables, the demos, the status
page and the report.

Owns `num`: three significant digits below 1000, whole numbers with thousands separators from
there (1,234 tok/s, never 1.23e+03: a batch of 48 on one GPU serves thousands); and
`span_end`: the end of a period of time, dated only where it falls on another day.
Must not: know what the number measures.
"""

from __future__ import annotations

import datetime as dt
import math


def num(v: float | None, digits: int = 3, none: str = "–") -> str:
    """`v` to `digits` significant digits, or whole with separators where that would need an
    exponent (at and above 10**digits); `none` for None; inf and nan as Python spells them."""
    if v is None:
        return none
    x = float(v)
    if not math.isfinite(x):
        return str(x)
    s = f"{x:.{digits}g}"
    return f"{x:,.0f}" if "e+" in s else s


def span_end(start_s: float, end_s: float, clock: str) -> str:
    """`end_s` (epoch seconds) in UTC as `clock` ("%H:%M:%S"), after its date only where that is
    not `start_s`'s: a run "x5 until 03:18:09", a day "05:00 to 2026-12-06 05:00"."""
    start, end = (dt.datetime.fromtimestamp(t, tz=dt.UTC) for t in (start_s, end_s))
    return end.strftime(clock if end.date() == start.date() else f"%Y-%m-%d {clock}")
