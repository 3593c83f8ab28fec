"""Shared helpers for the bench tests: small in-memory scenarios, and a policy's every tick."""

from __future__ import annotations

from typing import Any

import pytest

from controller.bench.peers import BenchPolicy
from controller.bench.scenario import Scenario, scenario_from_dict
from policies.types import Decision, Observation


def record_ticks(policy: BenchPolicy) -> list[tuple[Observation, Decision]]:
    """From now on, every (observation, decision) of `policy`'s ticks, in order, in the list
    returned (a replay keeps the decisions' reasons, not their diagnostics)."""
    log: list[tuple[Observation, Decision]] = []
    tick = policy.tick

    def logged(obs: Observation, now_s: float) -> Decision:
        d = tick(obs, now_s)
        log.append((obs, d))
        return d

    policy.tick = logged  # type: ignore[method-assign]
    return log


def make_scenario(**over: Any) -> Scenario:
    """A short two-phase scenario (strong drafter at one stream, then 64 streams)."""
    raw: dict[str, Any] = {
        "name": "t",
        "profile": "kimi-k2.5-pcie-tuned",
        "seed": 3,
        "poll_interval_s": 10.0,
        "max_running_requests": 64,
        "phases": [
            {"duration_s": 1800, "concurrency": 1, "workloads": {"chat": 0.7, "code": 0.3}},
            {"duration_s": 1800, "concurrency": 64, "workloads": {"chat": 0.7, "code": 0.3}},
        ],
    }
    raw.update(over)
    return scenario_from_dict(raw)


@pytest.fixture
def two_phase() -> Scenario:
    return make_scenario()
