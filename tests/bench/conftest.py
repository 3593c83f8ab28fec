"""Shared helpers for the bench tests: small in-memory scenarios."""

from __future__ import annotations

from typing import Any

import pytest

from controller.bench.scenario import Scenario, scenario_from_dict


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
