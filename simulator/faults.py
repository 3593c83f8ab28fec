"""Faults the simulator injects on demand, so the controller's failure paths can be exercised.

Owns: which faults are active for this launch (`--sim-fault-*`, optionally scoped to one
speculative shape with `--sim-fault-scope`), the broken `/metrics` answers, the slow-response
ASGI middleware and the crash timer. Must not: change the simulation's numbers or run anything
at import time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import PlainTextResponse, Response

from simulator.flags import FaultFlags
from simulator.model import SpecConfig

logger = logging.getLogger("simulator.faults")

# Exposition text that prometheus_client's parser refuses (unterminated label set, bad value).
GARBAGE_METRICS = (
    "# HELP sglang:num_running_reqs The number of running requests.\n"
    "# TYPE sglang:num_running_reqs gauge\n"
    'sglang:num_running_reqs{model_name="sim",tp_rank="0" 12 oops\n'
    "\x00\x01 not an exposition }}}\n"
)
CRASH_EXIT_CODE = 1
START_FAIL_EXIT_CODE = 1

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def spec_shape_matches(scope: str, spec: SpecConfig) -> bool:
    """Whether a fault scope covers this speculative shape: any | baseline | spec | adaptive |
    steps=N (a static speculative launch with N draft steps)."""
    if scope == "any":
        return True
    if scope == "baseline":
        return not spec.speculative
    if scope == "spec":
        return spec.speculative
    if scope == "adaptive":
        return spec.adaptive
    if scope.startswith("steps="):
        wanted = int(scope.removeprefix("steps="))
        return spec.speculative and not spec.adaptive and spec.num_steps == wanted
    raise ValueError(f"unknown fault scope {scope!r}")


@dataclass(frozen=True)
class Faults:
    """The faults in force for this launch (all off when the scope does not match)."""

    start_fail: bool = False
    hang_start: bool = False
    crash_after_s: float | None = None
    metrics: str | None = None
    slow_s: float = 0.0

    @classmethod
    def from_flags(cls, flags: FaultFlags, spec: SpecConfig) -> Faults:
        if not spec_shape_matches(flags.scope, spec):
            return cls()
        return cls(
            start_fail=flags.start_fail,
            hang_start=flags.hang_start,
            crash_after_s=flags.crash_after_s,
            metrics=flags.metrics,
            slow_s=flags.slow_ms / 1000.0,
        )

    @property
    def any(self) -> bool:
        return self != Faults()


def metrics_fault_response(mode: str) -> Response:
    """What a broken /metrics answers: HTTP 500, or 200 with text no parser accepts."""
    if mode == "500":
        return PlainTextResponse("Internal Server Error", status_code=500)
    if mode == "garbage":
        return PlainTextResponse(GARBAGE_METRICS, media_type="text/plain; version=0.0.4")
    raise ValueError(f"unknown metrics fault {mode!r}")


class SlowResponses:
    """ASGI middleware: every HTTP request waits `delay_s` wall seconds before it is served."""

    def __init__(self, app: ASGIApp, delay_s: float) -> None:
        self.app = app
        self.delay_s = delay_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        await self.app(scope, receive, send)


async def crash_after(seconds: float) -> None:
    """Die abruptly after `seconds` wall seconds, as a scheduler crash takes SGLang down
    (no drain, no clean shutdown, non-zero exit)."""
    await asyncio.sleep(seconds)
    logger.error("simulated fault: scheduler crashed (--sim-fault-crash-after-s %s)", seconds)
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)
