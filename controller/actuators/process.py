"""The process actuator: specpilot runs the server as its own child process.

Owns the child's life: launch (own process group via start_new_session, environment from
Settings.launch_env without NOTIFY_SOCKET, output to server.log_file or inherited, the pid
file), the bounded drain, SIGTERM -> SIGKILL of the whole tree, the start deadline, the check of
/server_info against the profile, and adoption of a server that is already on the port (started
by an earlier controller, found by the pid file or by the port). The child survives the
controller's death (own session, output to a file, never to a pipe) so that the next controller
adopts it. Must not decide whether to switch, and must not check advisory mode (the funnel does).
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import BinaryIO

import httpx

from controller.actuators.base import (
    ServerState,
    SwitchOutcome,
    SwitchResult,
    already_up,
    check_profile,
)
from controller.actuators.endpoint import Endpoint, poll_interval
from controller.actuators.identify import describe_shape, matching_profiles, verify_started
from controller.actuators.proctree import (
    ProcessTree,
    port_listening,
    port_owner,
    process_environ,
    read_pid_file,
    remove_pid_file,
    running,
    serves_port,
    write_pid_file,
)
from controller.clock import Clock
from controller.settings import Settings

log = logging.getLogger(__name__)

# The profile a server was launched with, in its environment: breaks ties between profiles that
# /server_info cannot tell apart (same speculation shape, different NCCL environment) when an
# adopted server's environment is readable.
PROFILE_ENV = "SPECPILOT_PROFILE"
_LOG_TAIL_CHARS = 3000


class ProcessActuator:
    def __init__(self, settings: Settings, clock: Clock, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.server = settings.server
        self.clock = clock
        self.specs = settings.profile_specs()
        self.endpoint = Endpoint(client, self.server.host, self.server.port, clock)
        self._proc: subprocess.Popen[bytes] | None = None  # our own child
        self._adopted_pid: int | None = None  # a server found on the port, not our child
        self._profile: str | None = None  # the profile we launched or adopted
        self._log_offset = 0

    # ---------------------------------------------------------------- what runs

    def _child_pid(self) -> int | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc.pid
        return None

    def launched_here(self) -> bool:
        """Whether the server that runs is this actuator's own child (not an adopted one)."""
        return self._child_pid() is not None

    def _server_pid(self, answered: bool) -> int | None:
        """Our child; else the adopted pid; else the pid file's (if that process carries our port
        on its command line); else, only when the port answered /server_info, the process
        listening on the port. Never a pid that cannot be shown to be the server."""
        pid = self._child_pid()
        if pid is not None:
            return pid
        if self._adopted_pid is not None and running(self._adopted_pid):
            return self._adopted_pid
        self._adopted_pid = None
        if self.server.pid_file:
            pid = read_pid_file(self.server.pid_file)
            if pid is not None and running(pid) and serves_port(pid, self.server.port):
                return pid
        if answered:
            pid = port_owner(self.server.port)
            if pid is not None and running(pid):
                return pid
        return None

    def _identify(self, info: object, pid: int | None) -> str | None:
        if not isinstance(info, dict):
            return None
        names = matching_profiles(info, self.specs)
        if len(names) <= 1:
            return names[0] if names else None
        # Same speculation shape: what we launched, or what the adopted process was told.
        if self._profile in names:
            return self._profile
        if pid is not None:
            env_profile = process_environ(pid).get(PROFILE_ENV)
            if env_profile in names:
                return env_profile
        return None

    async def probe(self) -> ServerState:
        info, port_open = await self.endpoint.server_info_or_port()
        pid = self._server_pid(answered=info is not None)
        if info is None:
            if port_open:
                return ServerState(
                    up=True,
                    profile=None,
                    pid=pid,
                    server_args=None,
                    detail=f"port {self.server.port} is open but /server_info does not answer",
                )
            detail = "no server on the port"
            if pid is not None:
                detail = f"process {pid} runs but the port is not open yet (starting?)"
            return ServerState(up=False, profile=None, pid=pid, server_args=None, detail=detail)
        if pid is not None and pid != self._child_pid():
            self._adopted_pid = pid
        profile = self._identify(info, pid)
        if profile is not None:
            self._profile = profile
        detail = "up" if profile else f"up, no profile matches ({describe_shape(info)})"
        if pid is None:
            detail += "; its pid is unknown (cannot be stopped by this controller)"
        elif pid != self._child_pid():
            detail += f"; adopted pid {pid}"
        return ServerState(up=True, profile=profile, pid=pid, server_args=info, detail=detail)

    async def alive(self) -> bool:
        if self._proc is not None:
            # Our child exited: a crash (stop() forgets the child it stopped).
            return self._proc.poll() is None
        if self._adopted_pid is not None:
            return running(self._adopted_pid)
        return await self.endpoint.port_open()

    # ---------------------------------------------------------------- start

    async def start(self, profile: str) -> SwitchResult:
        self._check_profile(profile)
        state = await self.probe()
        up = already_up(
            state,
            profile,
            self.server.port,
            "; adopted it instead of starting a second one: switch to change its profile",
        )
        if up is not None:
            return up
        if state.pid is not None:
            loading = self._profile if state.pid == self._child_pid() else None
            loading = loading or process_environ(state.pid).get(PROFILE_ENV)
            if loading == profile:
                # Already loading this profile (an earlier controller launched it): wait for it
                # instead of starting a second one.
                self._adopted_pid = None if state.pid == self._child_pid() else state.pid
                return await self._await_ready(state.pid, profile, None, self.clock.monotonic())
            return SwitchResult(
                SwitchOutcome.REFUSED_BUSY,
                None,
                profile,
                0.0,
                error=f"server process {state.pid} (profile {loading or 'unknown'}) is running "
                "but not up yet: not starting a second one",
            )
        return await self._launch(profile, None, self.clock.monotonic())

    def _check_profile(self, profile: str) -> None:
        check_profile(profile, self.settings.profiles)

    async def _launch(self, profile: str, from_profile: str | None, t0: float) -> SwitchResult:
        argv = self.settings.launch_argv(profile)
        env = self.settings.launch_env(profile)
        env[PROFILE_ENV] = profile

        def failed(outcome: SwitchOutcome, error: str) -> SwitchResult:
            return SwitchResult(outcome, from_profile, profile, self.clock.monotonic() - t0, error)

        try:
            out = self._open_log(profile, argv)
        except OSError as e:
            return failed(SwitchOutcome.START_FAILED, f"cannot open server.log_file: {e}")
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                start_new_session=True,  # own group: killpg reaches every child, and the
                # controller's SIGINT/SIGTERM does not
                close_fds=True,
            )
        except OSError as e:
            return failed(SwitchOutcome.START_FAILED, f"cannot run {argv[0]}: {e}")
        finally:
            if out is not None:
                out.close()  # the child has its own descriptor
        self._proc = proc
        self._adopted_pid = None
        self._profile = profile
        if self.server.pid_file:
            try:
                write_pid_file(self.server.pid_file, proc.pid)
            except OSError as e:  # the server runs; only a later adoption by pid file is lost
                log.warning("cannot write server.pid_file %s: %s", self.server.pid_file, e)
        log.info("started %s as pid %d: %s", profile, proc.pid, " ".join(argv))

        return await self._await_ready(proc.pid, profile, from_profile, t0)

    async def _await_ready(
        self, pid: int, profile: str, from_profile: str | None, t0: float
    ) -> SwitchResult:
        """Wait for /ready within start_timeout_s from now; stop the process when it misses the
        deadline; check /server_info. `t0` is when the downtime began."""
        proc = self._proc if self._proc is not None and self._proc.pid == pid else None

        def failed(outcome: SwitchOutcome, error: str) -> SwitchResult:
            return SwitchResult(outcome, from_profile, profile, self.clock.monotonic() - t0, error)

        async def exited() -> str | None:
            if proc is not None:
                rc = proc.poll()
                return None if rc is None else f"server exited with status {rc} while starting"
            return None if running(pid) else "server process exited while starting"

        deadline = self.clock.monotonic() + self.server.start_timeout_s
        wait = await self.endpoint.wait_ready(deadline, exited, lambda info: None)
        if wait.status == "exited":
            self._forget(pid)
            return failed(SwitchOutcome.START_FAILED, self._with_tail(wait.detail or "exited"))
        if wait.status == "timeout":
            why = f"not ready within start_timeout_s={self.server.start_timeout_s:g} s"
            report = await ProcessTree(pid).stop(
                self.clock, self.server.stop_timeout_s, proc.poll if proc is not None else None
            )
            if not report.stopped:
                return failed(SwitchOutcome.UNKNOWN, f"{why}; could not stop it: {report.detail}")
            self._forget(pid)
            return failed(SwitchOutcome.START_FAILED, self._with_tail(f"{why}; stopped it"))
        result = verify_started(
            wait.server_info or {},
            self.specs,
            profile=profile,
            from_profile=from_profile,
            downtime_s=self.clock.monotonic() - t0,
            subject="server",
        )
        if result.ok:
            self._profile = profile
        return result

    # ---------------------------------------------------------------- switch / stop

    async def switch(self, profile: str) -> SwitchResult:
        self._check_profile(profile)
        state = await self.probe()
        from_profile = state.profile if state.up else None
        if state.up and state.pid is None:
            return SwitchResult(
                SwitchOutcome.UNKNOWN,
                from_profile,
                profile,
                0.0,
                error=f"{state.detail}: cannot stop the server on port {self.server.port}",
            )
        paused = False
        if state.up and state.server_args is not None:
            drained = await self.endpoint.drain(self.server.drain_timeout_s)
            log.info("%s", drained)
            paused = drained.paused
        t0 = self.clock.monotonic()
        child = self._proc if state.pid is not None and state.pid == self._child_pid() else None
        if state.pid is not None:
            ok, detail = await self._stop(state.pid)
            log.info("stop %s (pid %d): %s", from_profile, state.pid, detail)
            if not ok:
                if paused:
                    await self.endpoint.resume()  # it still runs: let it serve again
                return SwitchResult(
                    SwitchOutcome.UNKNOWN,
                    from_profile,
                    profile,
                    self.clock.monotonic() - t0,
                    error=f"could not stop the old server: {detail}",
                )
        if not await self._released(child):
            return SwitchResult(
                SwitchOutcome.UNKNOWN,
                from_profile,
                profile,
                self.clock.monotonic() - t0,
                error=f"port {self.server.port} is still in use "
                f"{self.server.stop_timeout_s:g} s after the stop: not starting a second server",
            )
        return await self._launch(profile, from_profile, t0)

    async def _released(self, child: subprocess.Popen[bytes] | None) -> bool:
        """Whether the port is closed and `child` (our stopped server, if it was ours) reaped,
        waiting up to stop_timeout_s (server time) more: a stopped server's socket and device
        memory can outlive what the process table shows for a moment (a killed multi-threaded
        process exits thread by thread), and a second server must not start on them."""
        t0 = self.clock.monotonic()
        deadline = t0 + self.server.stop_timeout_s
        slept = False
        while True:
            reaped = child is None or child.poll() is not None
            if reaped and not await self._port_in_use():
                if slept:
                    log.info(
                        "port %d released %.1f s after the stop",
                        self.server.port,
                        self.clock.monotonic() - t0,
                    )
                return True
            now = self.clock.monotonic()
            if now >= deadline:
                return False
            await self.clock.sleep(min(poll_interval(self.clock), deadline - now))
            slept = True

    async def _port_in_use(self) -> bool:
        listening = port_listening(self.server.port)
        if listening is not None:
            return listening
        return await self.endpoint.port_open()  # the system does not tell: try to connect

    async def _stop(self, pid: int) -> tuple[bool, str]:
        reap = self._proc.poll if self._proc is not None and self._proc.pid == pid else None
        report = await ProcessTree(pid).stop(self.clock, self.server.stop_timeout_s, reap)
        if report.stopped:
            self._forget(pid)
        return report.stopped, report.detail

    def _forget(self, pid: int) -> None:
        remove_pid_file(self.server.pid_file, pid)
        if self._proc is not None and self._proc.pid == pid:
            self._proc.poll()
            self._proc = None
        if self._adopted_pid == pid:
            self._adopted_pid = None

    async def shutdown(self) -> None:
        """With owns_server: drain, then stop the server (ours or adopted). Without: leave it
        running; the next controller adopts it."""
        if not self.server.owns_server:
            return
        pid = self._server_pid(answered=False)
        if pid is None:
            return
        if await self.endpoint.port_open():
            log.info("%s", await self.endpoint.drain(self.server.drain_timeout_s))
        ok, detail = await self._stop(pid)
        (log.info if ok else log.error)("shutdown: server pid %d %s", pid, detail)

    # ---------------------------------------------------------------- log

    def _open_log(self, profile: str, argv: list[str]) -> BinaryIO | None:
        if not self.server.log_file:
            self._log_offset = -1
            return None
        path = Path(self.server.log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = path.open("ab")
        fh.write(f"=== specpilot: starting profile {profile}: {' '.join(argv)}\n".encode())
        fh.flush()
        self._log_offset = fh.tell()
        return fh

    def _with_tail(self, why: str) -> str:
        tail = self.log_tail()
        if tail is None:
            return f"{why} (server output is not captured: set server.log_file)"
        return f"{why}; last output:\n{tail}" if tail else f"{why}; no output"

    def log_tail(self) -> str | None:
        """The end of what the last launched server wrote (None when its output is not in a
        file)."""
        if self._log_offset < 0 or not self.server.log_file:
            return None
        try:
            with open(self.server.log_file, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                start = max(self._log_offset, size - _LOG_TAIL_CHARS)
                fh.seek(start)
                return fh.read().decode(errors="replace").strip()
        except OSError:
            return None
