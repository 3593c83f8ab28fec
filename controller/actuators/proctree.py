"""Finding and stopping a server's process tree with psutil and os.killpg.

Owns: which pid is the server (the pid file, checked against the command line so that a stale
file never names an unrelated process; or the process listening on the port), its descendants,
and the SIGTERM -> wait -> SIGKILL escalation over the whole tree (the process group when the
server leads its own session, every collected descendant in any case, since SGLang's scheduler
and detokenizer children must die with it). Waits use the Clock. Must not speak HTTP.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from controller.clock import Clock

# Server seconds to wait for processes to disappear after SIGKILL (a GPU process may need a
# moment in the kernel to release device memory); at least _KILL_GRACE_REAL_S real seconds.
_KILL_GRACE_S = 10.0
_KILL_GRACE_REAL_S = 2.0
_POLL_REAL_S = 0.05


def read_pid_file(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    try:
        pid = int(text.split()[0]) if text else 0
    except ValueError:
        return None
    return pid if pid > 0 else None


def write_pid_file(path: str, pid: int) -> None:
    """Atomically: a reader never sees a half-written file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, p)


def remove_pid_file(path: str, pid: int | None = None) -> None:
    """Remove the pid file (only if it still names `pid`, when given)."""
    if not path:
        return
    if pid is not None and read_pid_file(path) not in (None, pid):
        return
    with contextlib.suppress(FileNotFoundError):
        Path(path).unlink()


def _live(proc: psutil.Process) -> bool:
    """Not a zombie, or a zombie thread-group leader whose other threads still run: the leader of
    a multi-threaded process (SGLang's) can turn zombie before its other threads have exited,
    and they still hold the process's sockets (the port) and device memory. A true zombie
    holds nothing (PID 1 of a container may never reap it). Raises psutil.Error when gone."""
    if proc.status() != psutil.STATUS_ZOMBIE:
        return True
    return proc.num_threads() > 1


def running(pid: int) -> bool:
    """Alive (see _live: a zombie leader with live threads still runs)."""
    try:
        return _live(psutil.Process(pid))
    except (psutil.Error, OSError):
        return False


def serves_port(pid: int, port: int) -> bool:
    """Whether `pid` looks like the server on `port`: its command line carries `--port PORT`
    (as every server the controller launches does) or it, or a descendant, listens on the port."""
    try:
        proc = psutil.Process(pid)
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    for i, tok in enumerate(cmd):
        if tok == "--port" and i + 1 < len(cmd) and cmd[i + 1] == str(port):
            return True
        if tok == f"--port={port}":
            return True
    return pid in listeners(port) or any(c.pid in listeners(port) for c in _children(proc))


def listeners(port: int) -> set[int]:
    """Pids listening on TCP `port` (on any address). Empty when the system does not tell
    (sockets of other users without privileges)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return set()
    return {
        c.pid
        for c in conns
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
    }


def port_listening(port: int) -> bool | None:
    """Whether any socket listens on TCP `port` (on any address, whoever owns it); None when the
    system does not tell. Unlike a connect, this does not hang on a listener whose backlog is
    full because nothing accepts any more (a server that is half gone)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def port_owner(port: int) -> int | None:
    """The top-most process of the tree that listens on `port` (SGLang's main process listens
    itself; a wrapper like `sh -c` would be its parent and is included when it shares the port's
    command line)."""
    pids = listeners(port)
    if not pids:
        return None
    # Several listeners (SO_REUSEPORT workers): take the one whose parent is not a listener.
    for pid in sorted(pids):
        try:
            parent = psutil.Process(pid).ppid()
        except psutil.Error:
            continue
        if parent not in pids:
            return pid
    return min(pids)


def process_environ(pid: int) -> dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except (psutil.Error, OSError):
        return {}


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


@dataclass
class StopReport:
    stopped: bool
    detail: str
    escalated: bool = False


class ProcessTree:
    """The server's main process and every descendant seen since; `own_group` when the main
    process leads its own process group (started with start_new_session)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.procs: dict[int, psutil.Process] = {}
        try:
            self.own_group = os.getpgid(pid) == pid
        except OSError:
            self.own_group = False
        self.collect()

    def collect(self) -> None:
        """Add the main process and its descendants now alive (children reparent to init once
        their parent dies, so the tree must be collected before and during the stop)."""
        try:
            main = psutil.Process(self.pid)
        except psutil.Error:
            return
        self.procs.setdefault(main.pid, main)
        for child in _children(main):
            self.procs.setdefault(child.pid, child)

    def alive(self) -> list[int]:
        out = []
        for pid, proc in self.procs.items():
            try:
                if proc.is_running() and _live(proc):
                    out.append(pid)
            except psutil.Error:
                continue
        if self.own_group and not out:
            # Members of the group that were never seen as descendants (a double fork).
            out.extend(self._group_members())
        return out

    def _group_members(self) -> list[int]:
        members = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == self.pid and _live(proc):
                    members.append(proc.pid)
            except (OSError, psutil.Error):
                continue
        return members

    def signal(self, sig: int) -> None:
        self.collect()
        if self.own_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
        for proc in list(self.procs.values()):
            with contextlib.suppress(psutil.Error, OSError):
                proc.send_signal(sig)

    async def _wait_gone(
        self, clock: Clock, seconds: float, reap: Callable[[], object] | None
    ) -> bool:
        deadline = clock.monotonic() + seconds
        scale = float(getattr(clock, "time_scale", 1.0)) or 1.0
        while True:
            if reap is not None:
                reap()
            self.collect()
            if not self.alive():
                return True
            if clock.monotonic() >= deadline:
                return False
            await clock.sleep(min(_POLL_REAL_S * scale, deadline - clock.monotonic()))

    async def stop(
        self, clock: Clock, stop_timeout_s: float, reap: Callable[[], object] | None = None
    ) -> StopReport:
        """SIGTERM the tree, wait `stop_timeout_s` (server time), then SIGKILL what is left and
        wait a short grace. `reap` (the child's Popen.poll) collects our own child's exit status
        so it does not linger as a zombie."""
        t0 = clock.monotonic()
        self.signal(signal.SIGTERM)
        if await self._wait_gone(clock, stop_timeout_s, reap):
            return StopReport(True, f"exited after SIGTERM in {clock.monotonic() - t0:.1f} s")
        left = self.alive()
        self.signal(signal.SIGKILL)
        scale = float(getattr(clock, "time_scale", 1.0)) or 1.0
        grace = max(_KILL_GRACE_S, _KILL_GRACE_REAL_S * scale)
        if await self._wait_gone(clock, grace, reap):
            return StopReport(
                True,
                f"SIGTERM ignored for {stop_timeout_s:g} s by pids {left}; killed with SIGKILL",
                escalated=True,
            )
        return StopReport(
            False,
            f"pids {self.alive()} still alive {grace:g} s after SIGKILL (SIGTERM sent "
            f"{stop_timeout_s:g} s before)",
            escalated=True,
        )
