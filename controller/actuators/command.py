"""The command actuator: user-given commands switch the server (Kubernetes, Slurm, a script).

Owns: expanding the placeholders of server.switch_command / server.status_command safely,
running the switch command with a deadline, and waiting until the server on the port answers
/ready *with the asked profile* (an orchestrator may keep the old server serving for a while).
Placeholders: {profile} (the name), {flags} (the profile's full flag list: common flags, the
profile's, --host/--port), {env} (KEY=VALUE of [server].env and the profile's env), {host},
{port}. A placeholder that is a whole argument expands to separate arguments (no shell is
involved); inside a longer argument (`sh -c "... {flags}"`) it is shell-quoted with shlex, so no
value can break out of its word. The command also gets SPECPILOT_PROFILE, SPECPILOT_FLAGS and
SPECPILOT_ENV in its environment. Must not check advisory mode (the funnel does).
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Mapping, Sequence

import httpx

from controller.actuators.base import (
    ServerState,
    SwitchOutcome,
    SwitchResult,
    already_up,
    check_profile,
)
from controller.actuators.endpoint import Endpoint, at_least_real
from controller.actuators.identify import describe_shape, matching_profiles
from controller.actuators.subproc import run_command
from controller.clock import Clock
from controller.settings import Settings

log = logging.getLogger(__name__)

_STATUS_TIMEOUT_S = 30.0  # seconds for status_command (server time, at least as many real)


def expand(template: Sequence[str], values: Mapping[str, str | Sequence[str]]) -> list[str]:
    """Expand `{name}` placeholders of an argv template (see the module docstring)."""
    out: list[str] = []
    for arg in template:
        whole = arg[1:-1] if arg.startswith("{") and arg.endswith("}") else None
        if whole is not None and whole in values:
            value = values[whole]
            out.extend([value] if isinstance(value, str) else list(value))
            continue
        for name, value in values.items():
            token = "{" + name + "}"
            if token in arg:
                quoted = shlex.quote(value) if isinstance(value, str) else shlex.join(value)
                arg = arg.replace(token, quoted)
        out.append(arg)
    return out


def placeholder_values(settings: Settings, profile: str) -> dict[str, str | list[str]]:
    argv = settings.launch_argv(profile)
    env = {**settings.server.env, **settings.profiles[profile].env}
    return {
        "profile": profile,
        "flags": argv[len(settings.server.launch) :],
        "env": [f"{k}={v}" for k, v in env.items()],
        "host": settings.server.host,
        "port": str(settings.server.port),
    }


class CommandActuator:
    def __init__(self, settings: Settings, clock: Clock, client: httpx.AsyncClient) -> None:
        if not settings.server.switch_command:
            raise ValueError("server.actuator = 'command' needs server.switch_command")
        self.settings = settings
        self.server = settings.server
        self.clock = clock
        self.specs = settings.profile_specs()
        self.endpoint = Endpoint(client, self.server.host, self.server.port, clock)
        self._last_profile: str | None = None

    def command_env(self, profile: str) -> dict[str, str]:
        values = placeholder_values(self.settings, profile)
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        env["SPECPILOT_PROFILE"] = profile
        env["SPECPILOT_FLAGS"] = shlex.join(values["flags"])
        env["SPECPILOT_ENV"] = shlex.join(values["env"])
        return env

    async def status_profile(self) -> str | None:
        """The profile status_command prints (first line), if it names a configured one."""
        if not self.server.status_command:
            return None
        argv = expand(
            self.server.status_command,
            {"host": self.server.host, "port": str(self.server.port)},
        )
        timeout = at_least_real(self.clock, _STATUS_TIMEOUT_S, _STATUS_TIMEOUT_S)
        r = await run_command(argv, self.clock, timeout)
        if not r.ok:
            return None
        lines = r.stdout.strip().splitlines()
        name = lines[0].strip() if lines else ""
        return name if name in self.settings.profiles else None

    def _identify(self, info: Mapping[str, object], hint: str | None) -> str | None:
        names = matching_profiles(info, self.specs)
        if len(names) == 1:
            return names[0]
        for candidate in (hint, self._last_profile):
            if candidate in names:
                return candidate
        return None

    async def probe(self) -> ServerState:
        info, up = await self.endpoint.server_info_or_port()
        if info is None:
            return ServerState(up, None, None, None, "/server_info does not answer")
        names = matching_profiles(info, self.specs)
        hint = await self.status_profile() if len(names) != 1 else None
        profile = self._identify(info, hint)
        detail = "up" if profile else f"up ({describe_shape(info)}; no single profile matches)"
        return ServerState(True, profile, None, info, detail)

    async def alive(self) -> bool:
        if await self.endpoint.port_open():
            return True
        return await self.status_profile() is not None

    async def shutdown(self) -> None:
        """The orchestrator owns the server: the controller stopping never stops it."""
        return None

    async def start(self, profile: str) -> SwitchResult:
        check_profile(profile, self.settings.profiles)
        up = already_up(
            await self.probe(), profile, self.server.port, ": switch to change its profile"
        )
        if up is not None:
            return up
        return await self._run(profile, None, drain=False)

    async def switch(self, profile: str) -> SwitchResult:
        check_profile(profile, self.settings.profiles)
        current = await self.probe()
        return await self._run(profile, current.profile if current.up else None, current.up)

    async def _run(self, profile: str, from_profile: str | None, drain: bool) -> SwitchResult:
        paused = False
        if drain:
            drained = await self.endpoint.drain(self.server.drain_timeout_s)
            log.info("%s", drained)
            paused = drained.paused
        t0 = self.clock.monotonic()

        def result(outcome: SwitchOutcome, error: str | None = None) -> SwitchResult:
            return SwitchResult(outcome, from_profile, profile, self.clock.monotonic() - t0, error)

        argv = expand(self.server.switch_command, placeholder_values(self.settings, profile))
        budget = self.server.stop_timeout_s + self.server.start_timeout_s
        r = await run_command(argv, self.clock, budget, env=self.command_env(profile))
        if not r.ok:
            # The orchestrator refused, never ran, or was killed at the deadline: the old server
            # (if any) may still be there, paused by the drain; let it serve.
            if paused:
                await self.endpoint.resume()
            if r.returncode is None and not r.error:
                # Killed at the deadline: what the orchestrator did is not known.
                return result(SwitchOutcome.UNKNOWN, r.describe())
            return result(SwitchOutcome.START_FAILED, r.describe())
        self._last_profile = profile

        def accept(info: Mapping[str, object]) -> str | None:
            if profile in matching_profiles(info, self.specs):
                return None
            return f"the server still shows {describe_shape(info)}"

        async def never_exits() -> str | None:
            return None

        wait = await self.endpoint.wait_ready(
            t0 + budget,
            never_exits,
            accept,  # the command's own run counts against the budget
        )
        if wait.status != "ready":
            # The orchestrator kept the old server (paused by the drain), or is still rolling
            # out: resuming is harmless when the old one is gone, and lets it serve if not.
            if paused:
                await self.endpoint.resume()
            why = f"not ready as {profile!r} within {budget:g} s of the switch command"
            return result(
                SwitchOutcome.START_FAILED, f"{why}: {wait.detail}" if wait.detail else why
            )
        return SwitchResult(
            SwitchOutcome.OK,
            from_profile,
            profile,
            self.clock.monotonic() - t0,
            server_args=wait.server_info,
        )
