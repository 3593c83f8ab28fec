"""Running a short command (systemctl, a user's switch command) with a server-time deadline.

Owns: asyncio subprocesses in their own session, bounded by the Clock (a command that outlives
its deadline, or whose caller is cancelled, e.g. by a daemon stopping mid-start-up, is killed
with its whole process group), with captured output. A command is done when its own process
exits, even if a process it left running (a server started in the background) still holds its
stdout: that output is read for a moment, then read and dropped until the pipe closes, so that
process never blocks on a full pipe. Only the first and last _KEEP_BYTES of each stream are kept.
Must not interpret what the command means.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from controller.clock import Clock

_POLL_S = 0.5  # server seconds between deadline checks
_MIN_REAL_POLL_S = 0.02
_KEEP_BYTES = 64 * 1024  # of each stream, at its start and at its end
_READ_CHUNK = 64 * 1024
_EOF_GRACE_S = 1.0  # real seconds to read what is left of the output once the command exited
_KILL_WAIT_S = 5.0  # real seconds for a killed command to be reaped
# Readers of pipes that processes left behind by a command still hold: kept until EOF.
_LINGERING: set[asyncio.Task[None]] = set()


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


class _Capture:
    """The first and the last _KEEP_BYTES of a stream, and how many bytes between were dropped."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = _KEEP_BYTES - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        excess = len(self.tail) - _KEEP_BYTES
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        gap = f"\n[... {self.dropped} bytes left out ...]\n".encode() if self.dropped else b""
        return (bytes(self.head) + gap + bytes(self.tail)).decode(errors="replace")


async def _read_all(fd: int, into: _Capture) -> None:
    """Read the pipe `fd` (ours: closed here) into `into` until EOF or cancellation."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    try:
        while chunk := await reader.read(_READ_CHUNK):
            into.add(chunk)
    except OSError:
        pass
    finally:
        transport.close()


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _linger(readers: Iterable[asyncio.Task[None]]) -> None:
    """Keep the readers still waiting for EOF alive (a task nobody holds may be collected)."""
    for task in readers:
        if not task.done():
            _LINGERING.add(task)
            task.add_done_callback(_LINGERING.discard)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the command's process group, unless the command already exited (its group may
    then hold only a server it started, which is not ours to kill)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


async def _exits_in_time(proc: asyncio.subprocess.Process, clock: Clock, timeout_s: float) -> bool:
    """Whether the process exits within `timeout_s` of server time."""
    waiter = asyncio.ensure_future(proc.wait())
    deadline = clock.monotonic() + timeout_s
    scale = float(getattr(clock, "time_scale", 1.0)) or 1.0
    step = max(_POLL_S, _MIN_REAL_POLL_S * scale)
    try:
        # Wait on the Clock (server time): race the exit against one poll step of the Clock.
        while not waiter.done() and clock.monotonic() < deadline:
            tick = asyncio.ensure_future(clock.sleep(min(step, deadline - clock.monotonic())))
            try:
                await asyncio.wait({waiter, tick}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                tick.cancel()
    finally:
        if not waiter.done():
            waiter.cancel()
    return proc.returncode is not None


async def run_command(
    argv: Sequence[str],
    clock: Clock,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> CommandResult:
    """Run `argv` to completion, at most `timeout_s` of server time."""
    args = tuple(argv)
    # Pipes of our own, not asyncio's: with asyncio's, proc.wait() (Python 3.11) also waits for
    # them to close, which a process the command left running may never do.
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except (OSError, ValueError) as e:  # not found, not executable, a NUL in an argument
        _close(out_r, err_r)
        return CommandResult(args, None, "", "", error=str(e))
    except BaseException:
        _close(out_r, err_r)
        raise
    finally:
        _close(out_w, err_w)
    out, err = _Capture(), _Capture()
    readers = [
        asyncio.ensure_future(_read_all(out_r, out)),
        asyncio.ensure_future(_read_all(err_r, err)),
    ]
    exited = False
    try:
        exited = await _exits_in_time(proc, clock, timeout_s)
        if not exited:
            _kill_group(proc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=_KILL_WAIT_S)
        await asyncio.wait(readers, timeout=_EOF_GRACE_S)
    except asyncio.CancelledError:
        _kill_group(proc)  # abandoned: it must not go on acting unobserved
        raise
    finally:
        _linger(readers)
    return CommandResult(args, proc.returncode if exited else None, out.text(), err.text())
