"""Numbers for people: the one formatter of the CLI tables, the demos and the status page.

Owns `num`: three significant digits below 1000, whole numbers with thousands separators from
there (1,234 tok/s, never 1.23e+03: a batch of 48 on one GPU serves thousands).
Must not: know what the number measures.
"""

from __future__ import annotations

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
