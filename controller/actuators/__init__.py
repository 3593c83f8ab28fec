"""Actuators: the only code that starts, stops or restarts the server.

`make_actuator` builds the one configured (process, systemd or command); the control loop wraps it
in a `Funnel`, the single gate for advisory mode, one-in-flight and the unknown-outcome block.
"""

from __future__ import annotations

import httpx

from controller.actuators.base import (
    Actuator,
    ServerState,
    SwitchOutcome,
    SwitchResult,
    UnknownProfileError,
)
from controller.actuators.funnel import Funnel
from controller.actuators.identify import identify_profile, matching_profiles
from controller.clock import Clock
from controller.settings import Settings

__all__ = [
    "Actuator",
    "Funnel",
    "ServerState",
    "SwitchOutcome",
    "SwitchResult",
    "UnknownProfileError",
    "identify_profile",
    "make_actuator",
    "matching_profiles",
]


def make_actuator(settings: Settings, clock: Clock, client: httpx.AsyncClient) -> Actuator:
    """The actuator `server.actuator` names."""
    kind = settings.server.actuator
    if kind == "process":
        from controller.actuators.process import ProcessActuator

        return ProcessActuator(settings, clock, client)
    if kind == "systemd":
        from controller.actuators.systemd import SystemdActuator

        return SystemdActuator(settings, clock, client)
    if kind == "command":
        from controller.actuators.command import CommandActuator

        return CommandActuator(settings, clock, client)
    raise ValueError(f"unknown server.actuator {kind!r}")
