"""The systemd actuator: SGLang runs as a unit of its own (deploy/sglang@.service).

Owns: the unit's EnvironmentFile (the profile's launch command, flags and environment, written
atomically), `systemctl restart UNIT` to switch (after `reset-failed`: the unit's start rate
limit counts manual starts too), the unit's state (`systemctl show`) for
alive() and crash detection, the wait for /ready and the check of /server_info. systemd does the
stopping (KillMode=control-group: SIGTERM, then SIGKILL after the unit's TimeoutStopSec), so the
controller's own death never stops the server. Must not check advisory mode (the funnel does).
"""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path

import httpx

from controller.actuators import envfile
from controller.actuators.base import (
    ServerState,
    SwitchOutcome,
    SwitchResult,
    already_up,
    check_profile,
)
from controller.actuators.endpoint import Endpoint, at_least_real
from controller.actuators.identify import describe_shape, matching_profiles, verify_started
from controller.actuators.subproc import CommandResult, run_command
from controller.clock import Clock
from controller.settings import Settings

log = logging.getLogger(__name__)

ENV_PROFILE = "SPECPILOT_PROFILE"
ENV_LAUNCH = "SGLANG_LAUNCH"  # the launch command (python -m sglang.launch_server), shell-quoted
ENV_ARGS = "SGLANG_ARGS"  # every flag: common, the profile's, --host/--port, shell-quoted
# The unit's ExecStart= runs: /bin/sh -c 'eval "exec $SGLANG_LAUNCH $SGLANG_ARGS"'
SYSTEMCTL = "systemctl"
# Seconds (server time, and at least as many real seconds) a systemctl call may take beyond the
# unit's own stop timeout (systemctl restart returns once the old process is gone and the new one
# is forked).
_SYSTEMCTL_MARGIN_S = 30.0
_ACTIVE_STATES = ("active", "activating", "reloading", "deactivating")


def env_assignments(settings: Settings, profile: str) -> dict[str, str]:
    """What the unit's environment file holds for `profile`: [server].env, the profile's env,
    then SPECPILOT_PROFILE, SGLANG_LAUNCH and SGLANG_ARGS (reserved: they win)."""
    argv = settings.launch_argv(profile)
    n_launch = len(settings.server.launch)
    out = dict(settings.server.env)
    out.update(settings.profiles[profile].env)
    for reserved in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        out.pop(reserved, None)
    out[ENV_PROFILE] = profile
    out[ENV_LAUNCH] = shlex.join(argv[:n_launch])
    out[ENV_ARGS] = shlex.join(argv[n_launch:])
    return out


def env_file_text(settings: Settings, profile: str) -> str:
    return envfile.render(
        env_assignments(settings, profile),
        header=f"Written by specpilot for profile {profile!r}; rewritten at every switch.\n"
        f"Unit: {settings.server.systemd_unit}",
    )


class SystemdActuator:
    def __init__(self, settings: Settings, clock: Clock, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.server = settings.server
        self.clock = clock
        self.specs = settings.profile_specs()
        self.endpoint = Endpoint(client, self.server.host, self.server.port, clock)
        self.unit = self.server.systemd_unit
        self.env_path = Path(self.server.systemd_env_file)

    def _margin(self, server_s: float = 0.0) -> float:
        return server_s + at_least_real(self.clock, _SYSTEMCTL_MARGIN_S, _SYSTEMCTL_MARGIN_S)

    async def _systemctl(self, *args: str, timeout_s: float = 0.0) -> CommandResult:
        return await run_command([SYSTEMCTL, *args], self.clock, self._margin(timeout_s))

    async def unit_state(self) -> dict[str, str]:
        """ActiveState, SubState, MainPID, ExecMainStatus, EnvironmentFiles of the unit."""
        r = await self._systemctl(
            "show",
            self.unit,
            "--property=ActiveState,SubState,MainPID,ExecMainStatus,EnvironmentFiles",
        )
        if not r.ok:
            return {}
        out: dict[str, str] = {}
        for line in r.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                # EnvironmentFiles= comes once per file: keep them all.
                out[key] = f"{out[key]}\n{value}" if key in out else value
        return out

    def configured_profile(self) -> str | None:
        """The profile the environment file names (what the unit starts next)."""
        try:
            return envfile.read(self.env_path).get(ENV_PROFILE)
        except OSError:
            return None

    def _identify(self, info: object) -> str | None:
        if not isinstance(info, dict):
            return None
        names = matching_profiles(info, self.specs)
        if len(names) == 1:
            return names[0]
        configured = self.configured_profile()
        return configured if configured in names else None

    async def probe(self) -> ServerState:
        state = await self.unit_state()
        pid = int(state.get("MainPID", "0") or 0) or None
        info, up = await self.endpoint.server_info_or_port()
        unit_line = f"{self.unit} {state.get('ActiveState', '?')}/{state.get('SubState', '?')}"
        if info is None:
            return ServerState(up, None, pid, None, f"{unit_line}; /server_info does not answer")
        profile = self._identify(info)
        detail = f"{unit_line}; up" + ("" if profile else f" ({describe_shape(info)})")
        return ServerState(True, profile, pid, info, detail)

    async def alive(self) -> bool:
        state = await self.unit_state()
        if not state:  # systemctl itself failed: fall back to the port
            return await self.endpoint.port_open()
        return state.get("ActiveState") in _ACTIVE_STATES

    async def shutdown(self) -> None:
        """The server is its own unit: the controller stopping never stops it."""
        return None

    def _unit_reads_env_file(self, state: dict[str, str]) -> str | None:
        """An objection when the unit does not read the file this controller writes (a switch
        would then restart the server into the old profile and look like a failure)."""
        files = state.get("EnvironmentFiles", "")
        if not files:
            return None  # systemctl of this host does not report it
        listed = [ln.split(" (")[0].strip() for ln in files.splitlines() if ln.strip()]
        if listed and os.path.realpath(self.env_path) not in {os.path.realpath(f) for f in listed}:
            return (
                f"{self.unit} reads EnvironmentFile {', '.join(listed)}, not "
                f"server.systemd_env_file {self.env_path}: fix one of them"
            )
        return None

    async def start(self, profile: str) -> SwitchResult:
        check_profile(profile, self.settings.profiles)
        up = already_up(
            await self.probe(), profile, self.server.port, ": switch to change its profile"
        )
        if up is not None:
            return up
        state = await self.unit_state()
        if (
            state.get("ActiveState") in ("active", "activating", "reloading")
            and state.get("SubState") != "auto-restart"
            and self.configured_profile() == profile
        ):
            # Already loading this profile (boot, or a controller restarted mid-switch): wait
            # for it rather than restart it.
            return await self._await_start(profile, None, self.clock.monotonic())
        return await self._restart(profile, None, drain=False)

    async def switch(self, profile: str) -> SwitchResult:
        check_profile(profile, self.settings.profiles)
        current = await self.probe()
        return await self._restart(
            profile, current.profile if current.up else None, drain=current.up
        )

    async def _restart(self, profile: str, from_profile: str | None, drain: bool) -> SwitchResult:
        t_begin = self.clock.monotonic()

        def result(outcome: SwitchOutcome, t0: float, error: str | None = None) -> SwitchResult:
            return SwitchResult(outcome, from_profile, profile, self.clock.monotonic() - t0, error)

        objection = self._unit_reads_env_file(await self.unit_state())
        if objection:
            return result(SwitchOutcome.UNKNOWN, t_begin, objection)
        try:
            envfile.write_atomic(self.env_path, env_file_text(self.settings, profile))
        except (OSError, ValueError) as e:
            return result(SwitchOutcome.UNKNOWN, t_begin, f"cannot write {self.env_path}: {e}")
        paused = False
        if drain:
            drained = await self.endpoint.drain(self.server.drain_timeout_s)
            log.info("%s", drained)
            paused = drained.paused
        t0 = self.clock.monotonic()
        # systemd's start rate limit (the unit's StartLimitBurst=) counts manual starts too:
        # specpilot's own restarts (switches, rollbacks, crash restarts; bounded by its restart
        # budget and failure limit) would otherwise have the unit refuse one and stay down
        # ("start-limit-hit") until a person ran reset-failed. Crash loops between them, the
        # unit's own Restart=, still meet the limit. Best effort: a unit that is not failed and
        # has no count to clear answers 0 anyway.
        await self._systemctl("reset-failed", self.unit)
        r = await self._systemctl("restart", self.unit, timeout_s=self.server.stop_timeout_s)
        if not r.ok:
            # The old server was (maybe) stopped and the new one did not start: ask the unit.
            if paused:
                await self.endpoint.resume()  # harmless when it is gone; it serves if not
            after = await self.unit_state()
            if after.get("ActiveState") in ("failed", "inactive"):
                return result(
                    SwitchOutcome.START_FAILED, t0, await self._with_journal(r.describe())
                )
            return result(SwitchOutcome.UNKNOWN, t0, r.describe())
        return await self._await_start(profile, from_profile, t0)

    async def _await_start(self, profile: str, from_profile: str | None, t0: float) -> SwitchResult:
        """Wait for /ready within start_timeout_s (from now), then check /server_info."""

        def result(outcome: SwitchOutcome, error: str | None = None) -> SwitchResult:
            return SwitchResult(outcome, from_profile, profile, self.clock.monotonic() - t0, error)

        async def exited() -> str | None:
            s = await self.unit_state()
            # failed/inactive, or waiting for systemd's Restart= after the process died.
            if (
                s.get("ActiveState") in ("failed", "inactive")
                or s.get("SubState") == "auto-restart"
            ):
                return (
                    f"{self.unit} is {s.get('ActiveState')}/{s.get('SubState')} "
                    f"(exit status {s.get('ExecMainStatus', '?')}) while starting"
                )
            return None

        deadline = self.clock.monotonic() + self.server.start_timeout_s
        wait = await self.endpoint.wait_ready(deadline, exited, lambda info: None)
        if wait.status == "exited":
            stop = await self._systemctl("stop", self.unit, timeout_s=self.server.stop_timeout_s)
            if not stop.ok:
                return result(SwitchOutcome.UNKNOWN, f"{wait.detail}; {stop.describe()}")
            return result(SwitchOutcome.START_FAILED, await self._with_journal(wait.detail))
        if wait.status == "timeout":
            why = f"not ready within start_timeout_s={self.server.start_timeout_s:g} s"
            stop = await self._systemctl("stop", self.unit, timeout_s=self.server.stop_timeout_s)
            if not stop.ok:
                return result(SwitchOutcome.UNKNOWN, f"{why}; {stop.describe()}")
            return result(SwitchOutcome.START_FAILED, await self._with_journal(why))
        return verify_started(
            wait.server_info or {},
            self.specs,
            profile=profile,
            from_profile=from_profile,
            downtime_s=self.clock.monotonic() - t0,
            subject=self.unit,
        )

    async def _with_journal(self, why: str | None) -> str:
        r = await run_command(
            ["journalctl", "--unit", self.unit, "--lines", "30", "--no-pager", "--output", "cat"],
            self.clock,
            self._margin(),
        )
        tail = r.stdout.strip() if r.ok else ""
        return f"{why}; journal:\n{tail}" if tail else f"{why or 'failed'}"
