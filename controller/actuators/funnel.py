"""THE actuation funnel: every start and switch of the server passes through here.

Owns the three gates in front of an actuator: advisory mode (returns SKIPPED_ADVISORY here and
nowhere else, before anything is touched), one actuation in flight (a second one is
REFUSED_BUSY, never queued: the loop re-decides on its next tick), and the block an UNKNOWN
outcome sets (automatic switches are REFUSED_BUSY, with the block in `error`, until
`clear_block()`; a manual switch, a person acting, still passes). An exception or a
cancellation inside the actuator is an UNKNOWN outcome too: the server's state is then not
known. `on_start`, when given, is called once every gate has passed and right before the
actuator is called (the loop records the switch as started there, so that a controller killed
mid-switch leaves an open record); it is never called for a switch that does not happen.
Must not decide what to switch to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from controller.actuators.base import Actuator, SwitchOutcome, SwitchResult, UnknownProfileError
from policies.types import Mode

log = logging.getLogger(__name__)


class Funnel:
    def __init__(self, actuator: Actuator, mode_getter: Callable[[], Mode]) -> None:
        self.actuator = actuator
        self._mode = mode_getter
        self._lock = asyncio.Lock()
        self.blocked_reason: str | None = None
        self.last_result: SwitchResult | None = None

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def block(self, reason: str) -> None:
        """Stop automatic actuation until `clear_block()` (the loop's failure limit uses it)."""
        self.blocked_reason = reason

    def clear_block(self) -> None:
        if self.blocked_reason is not None:
            log.warning("actuation block cleared (was: %s)", self.blocked_reason)
        self.blocked_reason = None

    async def switch(
        self,
        profile: str,
        *,
        manual: bool = False,
        on_start: Callable[[], None] | None = None,
    ) -> SwitchResult:
        """Drain, restart into `profile`, verify. A down server is simply started."""
        return await self._run("switch", profile, manual, self.actuator.switch, on_start)

    async def start(
        self,
        profile: str,
        *,
        manual: bool = False,
        on_start: Callable[[], None] | None = None,
    ) -> SwitchResult:
        """Start `profile` when nothing runs (adopts a server already on the port)."""
        return await self._run("start", profile, manual, self.actuator.start, on_start)

    async def _run(
        self,
        what: str,
        profile: str,
        manual: bool,
        act: Callable[[str], Awaitable[SwitchResult]],
        on_start: Callable[[], None] | None = None,
    ) -> SwitchResult:
        if self._mode() is Mode.ADVISORY:
            return SwitchResult(
                SwitchOutcome.SKIPPED_ADVISORY,
                None,
                profile,
                0.0,
                error="advisory mode: the server is never restarted",
            )
        if self.blocked_reason is not None and not manual:
            return SwitchResult(
                SwitchOutcome.REFUSED_BUSY,
                None,
                profile,
                0.0,
                error=f"automatic switching is blocked until cleared: {self.blocked_reason}",
            )
        if self._lock.locked():
            return SwitchResult(
                SwitchOutcome.REFUSED_BUSY,
                None,
                profile,
                0.0,
                error="another switch is in flight",
            )
        async with self._lock:
            if on_start is not None:
                on_start()  # may raise (e.g. the record cannot be written): nothing touched yet
            try:
                result = await act(profile)
            except asyncio.CancelledError:
                self.blocked_reason = f"{what} to {profile!r} was cancelled half-way"
                raise
            except UnknownProfileError:
                raise  # a caller's mistake, caught before anything was touched
            except Exception as e:  # the actuator's contract is results, not exceptions
                log.exception("%s to %s failed with an exception", what, profile)
                result = SwitchResult(
                    SwitchOutcome.UNKNOWN, None, profile, 0.0, error=f"{type(e).__name__}: {e}"
                )
            if result.outcome is SwitchOutcome.UNKNOWN:
                self.blocked_reason = (
                    f"{what} {result.from_profile or '?'} -> {profile} ended in an unknown "
                    f"state: {result.error or 'no detail'}"
                )
                log.error("actuation blocked: %s", self.blocked_reason)
            self.last_result = result
            return result
