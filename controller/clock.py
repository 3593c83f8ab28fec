"""Clocks: the one place the shell reads time.

Owns `now()` (UTC epoch seconds, for records and for the policy's now_s), `monotonic()` (for
durations) and `sleep()`. `ScaledClock` runs `time_scale` times faster than real time so that the
controller and an accelerated simulator agree on what a second is (time_scale 1 in production).
`ManualClock` is advanced by tests and never sleeps for real. Nothing else in the controller may
call time.time(), time.monotonic() or asyncio.sleep() for durations of the server's time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class ScaledClock:
    """Wall clock, optionally accelerated: `now()` starts at the real epoch time, or at
    `not_before_s` when that is later, and advances `time_scale` seconds per real second;
    `sleep(s)` sleeps s / time_scale real seconds."""

    def __init__(self, time_scale: float = 1.0, *, not_before_s: float | None = None) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._wall0 = max(time.time(), not_before_s or 0.0)
        self._mono0 = time.monotonic()

    def monotonic(self) -> float:
        return (time.monotonic() - self._mono0) * self.time_scale

    def now(self) -> float:
        return self._wall0 + self.monotonic()

    def real_seconds(self, seconds: float) -> float:
        return seconds / self.time_scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.time_scale)


class ManualClock:
    """A clock tests advance by hand; `sleep` advances it instantly and yields to the loop."""

    def __init__(self, start_s: float = 1_700_000_000.0) -> None:
        self._t = start_s
        self._start = start_s
        self.time_scale = 1.0

    def advance(self, seconds: float) -> None:
        self._t += seconds

    def now(self) -> float:
        return self._t

    def monotonic(self) -> float:
        return self._t - self._start

    def real_seconds(self, seconds: float) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        self._t += max(0.0, seconds)
        await asyncio.sleep(0)
