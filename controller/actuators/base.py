"""The actuation contract: what the control loop may ask of a server, and what comes back.

Owns the value types of one actuation (`SwitchOutcome`, `ServerState`, `SwitchResult`) and the
`Actuator` protocol that the process, systemd and command implementations follow. Holds no I/O
and no policy: whether a switch *should* happen is decided elsewhere; whether it may happen now
(advisory mode, one in flight, blocked) is decided by `controller.actuators.funnel` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable


class UnknownProfileError(ValueError):
    """A start or switch named a profile the configuration does not define (raised before
    anything is touched)."""


def check_profile(profile: str, known: Mapping[str, Any]) -> None:
    if profile not in known:
        raise UnknownProfileError(f"unknown profile {profile!r} (have: {', '.join(sorted(known))})")


class SwitchOutcome(StrEnum):
    """How one start or switch ended. The value goes to SQLite, a metric label and a log line."""

    OK = "ok"  # the server answers /ready and /server_info shows the asked profile
    START_FAILED = "start_failed"  # the new profile did not come up (exited, deadline passed,
    # the switch command failed) and nothing of it is left running; the old server is gone, or,
    # when the command actuator's orchestrator refused, still serving as before
    UNKNOWN = "unknown"  # the state of the server is not known (could not kill, profile mismatch,
    # an error half-way): automatic switching stops until a person clears it
    SKIPPED_ADVISORY = "skipped_advisory"  # advisory mode: nothing was touched
    REFUSED_BUSY = "refused_busy"  # nothing was touched: another switch is in flight, an earlier
    # UNKNOWN blocks automatic switches (the error says so), or (start) a server already holds
    # the port


@dataclass(frozen=True)
class ServerState:
    """What a probe found. `up`: a server answers HTTP on the port. `profile`: the configured
    profile its /server_info matches (None: none or several match, or not up). `pid`: the server's
    main process when the actuator knows it."""

    up: bool
    profile: str | None
    pid: int | None
    server_args: Mapping[str, Any] | None
    detail: str = ""


@dataclass(frozen=True)
class SwitchResult:
    """The outcome of one start or switch. `downtime_s` is server time from the moment the old
    server stopped serving (SIGTERM / restart) until the new one was ready or the attempt ended;
    the drain before it is not downtime (the old server still serves)."""

    outcome: SwitchOutcome
    from_profile: str | None
    to_profile: str
    downtime_s: float
    error: str | None = None
    server_args: Mapping[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is SwitchOutcome.OK


def already_up(state: ServerState, profile: str, port: int, advice: str) -> SwitchResult | None:
    """What start() answers when the probe found a server up on the port: OK when it runs
    `profile`, REFUSED_BUSY otherwise (never a second server; `advice` ends the error). None when
    nothing is up (the caller starts one)."""
    if not state.up:
        return None
    if state.profile == profile:
        return SwitchResult(SwitchOutcome.OK, profile, profile, 0.0, server_args=state.server_args)
    return SwitchResult(
        SwitchOutcome.REFUSED_BUSY,
        state.profile,
        profile,
        0.0,
        error=f"a server is already up on port {port} ({state.detail}){advice}",
        server_args=state.server_args,
    )


@runtime_checkable
class Actuator(Protocol):
    """One way of running the server. Every method is safe to call at any time; none raises for
    an expected failure (a server that does not start is a result, not an exception)."""

    async def probe(self) -> ServerState:
        """Is a server up on the port, and which profile does its /server_info show?"""
        ...

    async def start(self, profile: str) -> SwitchResult:
        """Start `profile` when nothing runs. Never a second server on the port: a server already
        up is adopted (OK when it runs `profile`, REFUSED_BUSY otherwise)."""
        ...

    async def switch(self, profile: str) -> SwitchResult:
        """Bounded drain, stop, start `profile`, wait for /ready, verify /server_info."""
        ...

    async def alive(self) -> bool:
        """Whether the server's process (or unit) is still running."""
        ...

    async def shutdown(self) -> None:
        """Stop the server if the controller owns it; otherwise leave it running."""
        ...
