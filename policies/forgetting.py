"""The primitives every estimator shares: exponential forgetting of old windows, half-octave
batch-size buckets, an interval clipped to its physical range, a bounded memo of derived
answers, and the constants the cycle-time and accept-length statistics both read (the
all-workloads key, the refit threshold).

Must not: estimate anything itself, read clocks, or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from policies.types import Estimate

# Key of the all-workloads aggregate accept length of a profile (never a real workload label:
# SGLang's custom label values come from clients; "*" is not a workload name anyone sends).
AGGREGATE = "*"

# The shared surface is refitted once the steps added since the last fit exceed this fraction
# of all (forgotten) steps, or when a profile gains/loses enough data to be in it: a few percent
# of new evidence cannot move a least-squares fit by more than its own noise, and refitting
# every window would cost more than all the other work of a tick.
REFIT_FRACTION = 0.05
# Memoised answers kept at most (cleared when full): batch sizes are floats (the concurrency
# estimate moves every window), so a profile that is not running would otherwise add entries
# until the next refit, which grows rarer as the data grows.
MEMO_MAX = 4096


class Memo(dict[tuple[Any, ...], Any]):
    """Answers keyed by (profile, ...) and memoised between changes of the statistics they
    read: at most MEMO_MAX of them (emptied when full). Derived, never persisted."""

    def answer(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        if key not in self:
            if len(self) >= MEMO_MAX:
                self.clear()
            self[key] = compute()
        return self[key]

    def forget(self, profile: str, *, only_its_own: bool) -> None:
        """A change of `profile`'s statistics: its own answers go; every answer goes unless
        `only_its_own` (no other profile's answer reads them)."""
        if not only_its_own:
            self.clear()
            return
        for k in [k for k in self if k[0] == profile]:
            del self[k]


# Batch-size buckets per octave: B and 1.41 B share a bucket, so a straight line inside one is
# within ~1% of any smooth step-time curve, and an estimate at a batch size seen compares like
# with like (a line over all batch sizes misses a concave MoE curve by 10%+ at its ends).
BUCKETS_PER_OCTAVE = 2

# Guards a denominator against zero (a ridge, a variance, a ratio's parts).
TINY = 1e-12


def batch_bucket(batch: float) -> int:
    """Index of the half-octave batch-size bucket of `batch` (1 -> 0, 16 -> 8, 48 -> 11)."""
    return round(BUCKETS_PER_OCTAVE * math.log2(max(batch, 1.0)))


def decay(window_s: float, half_life_s: float) -> float:
    """Exponential forgetting factor for one window: the weight of old data halves every
    `half_life_s` seconds of observed time."""
    if half_life_s <= 0 or not math.isfinite(half_life_s):
        return 0.0
    return float(0.5 ** (max(window_s, 0.0) / half_life_s))


def carryover(factor: float, windows: float, max_windows: float | None) -> float:
    """The share of old evidence a discount keeps of a line holding `windows` (forgotten)
    windows: `factor`, and at most `max_windows` windows' worth (None: no cap)."""
    if max_windows is None or windows <= 0:
        return factor
    return min(factor, max(max_windows, 0.0) / windows)


def all_finite(*xs: float) -> bool:
    """Whether every one of `xs` is a finite number (a window with a NaN or inf is dropped)."""
    return all(math.isfinite(x) for x in xs)


def estimate_within(mean: float, half: float, lo_clip: float, hi_clip: float, n: float) -> Estimate:
    """`mean` +- `half` as an Estimate backed by `n`, its interval clipped to [lo_clip, hi_clip]
    (what the quantity can physically be: an accept length in [1, steps + 1], a time >= 0)."""
    half = abs(half)
    return Estimate(
        mean=mean,
        low=max(lo_clip, mean - half),
        high=min(hi_clip, mean + half),
        n=n,
    )
