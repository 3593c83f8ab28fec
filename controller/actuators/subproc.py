"""Running a short command (systemctl, a user's switch command) with a server-time deadline.

Owns: asyncio subprocesses in their own session, bounded by the Clock (a command that outlives
its deadline is killed with its whole process group), with captured output. Must not interpret
what the command means.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controller.clock import Clock

_POLL_S = 0.5  # server seconds between deadline checks
_MIN_REAL_POLL_S = 0.02


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed at the deadline (or could not be killed)
    stdout: str
    stderr: str
    error: str | None = None  # could not run at all (not found, not executable)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self, limit: int = 2000) -> str:
        if self.error:
            return f"{self.argv[0]}: {self.error}"
        how = "timed out" if self.returncode is None else f"exited with status {self.returncode}"
        text = (self.stderr.strip() or self.stdout.strip())[-limit:]
        return f"`{' '.join(self.argv)}` {how}" + (f": {text}" if text else "")


async def run_command(
    argv: Sequence[str],
    clock: Clock,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> CommandResult:
    """Run `argv` to completion, at most `timeout_s` of server time."""
    args = tuple(argv)
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except OSError as e:
        return CommandResult(args, None, "", "", error=str(e))
    comm = asyncio.ensure_future(proc.communicate())
    deadline = clock.monotonic() + timeout_s
    scale = float(getattr(clock, "time_scale", 1.0)) or 1.0
    step = max(_POLL_S, _MIN_REAL_POLL_S * scale)
    # Wait on the Clock (server time): race the command against one poll step of the Clock.
    while not comm.done() and clock.monotonic() < deadline:
        tick = asyncio.ensure_future(clock.sleep(min(step, deadline - clock.monotonic())))
        await asyncio.wait({comm, tick}, return_when=asyncio.FIRST_COMPLETED)
        tick.cancel()
    if comm.done():
        out, err = comm.result()
        return CommandResult(
            args, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
        )
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        out, err = await asyncio.wait_for(comm, timeout=5.0)
    except TimeoutError:
        comm.cancel()
        out, err = b"", b""
    return CommandResult(args, None, out.decode(errors="replace"), err.decode(errors="replace"))
