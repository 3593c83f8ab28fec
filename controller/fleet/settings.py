"""The [fleet] table of config.toml: replicas behind sglang-router, rolling switches, canaries.

Owns the schema of fleet mode (frozen pydantic, extra keys refused like the rest of the file):
how many replicas and on which ports, the router (launched by specpilot or adopted at a URL),
how many replicas may be out of the router at once, and how a canary is judged. `replicas = 0`
(the default) means fleet mode is off and [server] describes the one server. Must not start
anything or touch the network.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.canary import CanaryTestSettings
from policies.settings import PolicySettings


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)


class RouterSettings(_Frozen):
    """[fleet.router]: SGLang's router (the `sglang-router` package, pip extra `fleet`)."""

    url: str = Field(
        "",
        description="Adopt a router that already runs at this URL (e.g. http://10.0.0.5:30000); "
        "empty: specpilot launches one on host:port and stops it when it stops.",
    )
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535, description="Where clients send their requests.")
    launch: list[str] = Field(
        default_factory=lambda: ["{python}", "-m", "sglang_router.launch_router"],
        description="Command before the flags; {python} is this interpreter.",
    )
    policy: Literal["random", "round_robin", "cache_aware", "power_of_two"] = Field(
        "round_robin",
        description="Load balancing. round_robin gives every replica the same arrivals, which "
        "makes a canary's comparison cleanest; the canary test normalises by traffic anyway.",
    )
    health_check_interval_s: float = Field(
        10.0,
        gt=0,
        description="--health-check-interval-secs (router default 60): how soon the router "
        "notices a replica that died outside a switch.",
    )
    prometheus_port: int = Field(
        0, ge=0, le=65535, description="The router's own /metrics port; 0 picks a free one."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More router flags, e.g. ['--disable-retries']."
    )
    api_key: str = Field(
        "", description="Bearer token of the router's worker API (--api-key), if it has one."
    )
    start_timeout_s: float = Field(
        60.0, gt=0, description="Real seconds for a launched router to answer /liveness."
    )
    wait_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Server seconds a switch waits for an unreachable router before giving up "
        "(nothing is touched while it waits).",
    )
    log_file: str = Field("", description="Router output; empty: discarded.")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/") if self.url else f"http://{self.host}:{self.port}"

    @property
    def owned(self) -> bool:
        return not self.url


class CanarySettings(_Frozen):
    """[fleet.canary]: how a candidate profile is tried on one replica before all of them."""

    enabled: bool = Field(True, description="false: a switch rolls straight through every replica.")
    min_windows: int = Field(6, ge=2, description="Poll windows per arm before any verdict.")
    max_windows: int = Field(
        30,
        ge=2,
        description="Windows after which an unproven candidate is rolled back; also the "
        "canary's time limit in polls (after its warmup), with or without traffic.",
    )
    alpha: float = Field(0.05, gt=0, lt=1, description="Two-sided significance level.")
    min_gain: float = Field(
        0.02, ge=0, description="Relative gain a candidate must show to be rolled out."
    )
    method: Literal["paired", "welch", "mannwhitney"] = Field(
        "paired", description="The test (policies/canary.py explains each)."
    )
    min_running_reqs: float = Field(
        0.5, ge=0, description="Replica-windows with less traffic in flight are not used."
    )
    warmup_windows: int = Field(
        1, ge=0, description="Windows skipped after the canary is back in the router."
    )
    retry_after_s: float = Field(
        1800.0, ge=0, description="A rolled-back candidate is not tried again before this."
    )

    @model_validator(mode="after")
    def _check(self) -> CanarySettings:
        self.test()  # same rules as the pure side (max >= min ...)
        return self

    def test(self) -> CanaryTestSettings:
        return CanaryTestSettings(
            min_windows=self.min_windows,
            max_windows=self.max_windows,
            alpha=self.alpha,
            min_gain=self.min_gain,
            method=self.method,
            min_running_reqs=self.min_running_reqs,
        )


class FleetSettings(_Frozen):
    """[fleet]: N replicas of [server] (same launch, flags and profiles), each on its own port,
    registered with one router."""

    replicas: int = Field(0, ge=0, description="0: fleet mode off (one server, [server]).")
    host: str = Field("127.0.0.1", description="Where the replicas listen.")
    base_port: int = Field(30001, ge=1, le=65535, description="Replica i listens on base_port + i.")
    ports: list[int] = Field(
        default_factory=list, description="Explicit replica ports (overrides base_port)."
    )
    max_unavailable_fraction: float = Field(
        0.34,
        gt=0,
        le=1,
        description="At most this fraction of the replicas is out of the router at once "
        "(rounded down, at least one): 0.34 of 3 is one replica at a time.",
    )
    canary_replica: int = Field(
        -1, description="Index of the replica that runs a canary (-1: the last one)."
    )
    router: RouterSettings = RouterSettings()
    canary: CanarySettings = CanarySettings()

    @model_validator(mode="after")
    def _check(self) -> FleetSettings:
        if self.ports and len(self.ports) != self.replicas:
            raise ValueError(
                f"fleet.ports has {len(self.ports)} entries for {self.replicas} replicas"
            )
        ports = self.replica_ports()
        if len(set(ports)) != len(ports):
            raise ValueError(f"fleet replica ports must be distinct, got {ports}")
        if any(not 1 <= p <= 65535 for p in ports):
            raise ValueError(f"fleet replica ports out of range: {ports}")
        if self.router.owned and self.router.port in ports:
            raise ValueError(f"fleet.router.port {self.router.port} is also a replica port")
        metrics = self.router.prometheus_port
        if self.router.owned and metrics and metrics in (*ports, self.router.port):
            # The router would take a replica's port (that replica never starts) or exit at
            # once on its own.
            raise ValueError(
                f"fleet.router.prometheus_port {metrics} is also the router's or a replica's port"
            )
        if self.replicas and not -self.replicas <= self.canary_replica < self.replicas:
            raise ValueError(
                f"fleet.canary_replica {self.canary_replica} is not a replica index "
                f"(0..{self.replicas - 1}, or negative from the end)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.replicas > 0

    def replica_ports(self) -> list[int]:
        return (
            list(self.ports) if self.ports else [self.base_port + i for i in range(self.replicas)]
        )

    def canary_share(self) -> float:
        """The share of the fleet an exploration restarts before its candidate has shown its
        rate (policies.decide's explore_canary_share): one replica of N with canaries on,
        the whole fleet without them."""
        return 1.0 / self.replicas if self.canary.enabled and self.replicas >= 2 else 1.0

    def policy_settings(self, psettings: PolicySettings) -> PolicySettings:
        """`psettings` as this fleet runs the policy: with its canary share."""
        return dataclasses.replace(psettings, explore_canary_share=self.canary_share())

    def max_unavailable(self) -> int:
        """How many replicas may be out of the router at once."""
        return max(1, math.floor(self.max_unavailable_fraction * self.replicas + 1e-9))
