"""[fleet] settings: defaults, ports, the max-unavailable rule, refusals with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from controller.fleet.actuator import replica_settings
from controller.fleet.demo import fleet_sim_settings
from controller.fleet.settings import FleetSettings


def test_off_by_default() -> None:
    f = FleetSettings()
    assert not f.enabled and f.replica_ports() == []


def test_ports_and_max_unavailable() -> None:
    f = FleetSettings(replicas=3, base_port=31000)
    assert f.replica_ports() == [31000, 31001, 31002]
    assert f.max_unavailable() == 1  # 0.34 of 3
    assert FleetSettings(replicas=10, max_unavailable_fraction=0.25).max_unavailable() == 2
    assert FleetSettings(replicas=2, max_unavailable_fraction=0.1).max_unavailable() == 1
    assert FleetSettings(replicas=4, max_unavailable_fraction=0.5).max_unavailable() == 2


def test_an_exploration_restarts_the_canarys_share_of_the_fleet() -> None:
    """policies.decide prices an exploration's restart, dwell and way back on the replicas it
    runs on before the candidate has shown its rate: the canary, one of N; all of them where
    a switch rolls straight through (canaries off, or one replica)."""
    assert FleetSettings(replicas=3).canary_share() == pytest.approx(1 / 3)
    assert FleetSettings(replicas=8).canary_share() == pytest.approx(1 / 8)
    assert FleetSettings(replicas=3, canary={"enabled": False}).canary_share() == 1.0
    assert FleetSettings(replicas=1).canary_share() == 1.0
    assert FleetSettings().canary_share() == 1.0


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"replicas": 2, "ports": [1, 2, 3]}, "3 entries for 2 replicas"),
        ({"replicas": 2, "ports": [31000, 31000]}, "distinct"),
        ({"replicas": 2, "base_port": 30000}, "also a replica port"),
        ({"replicas": 2, "router": {"prometheus_port": 30002}}, "prometheus_port 30002"),
        ({"replicas": 2, "router": {"prometheus_port": 30000}}, "prometheus_port 30000"),
        ({"replicas": 2, "canary_replica": 2}, "canary_replica"),
        ({"replicas": 2, "max_unavailable_fraction": 0}, "greater than 0"),
        ({"replicas": 2, "canary": {"min_windows": 8, "max_windows": 4}}, "max_windows"),
        ({"replicas": 2, "router": {"polcy": "x"}}, "Extra inputs"),
        # inf passes every "> 0" bound: a rolling restart that never times out.
        ({"replicas": 2, "router": {"wait_timeout_s": float("inf")}}, "finite number"),
        ({"replicas": 2, "canary": {"alpha": float("nan")}}, "finite number"),
    ],
)
def test_bad_tables_are_refused(raw: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        FleetSettings.model_validate(raw)


def test_replica_settings_get_their_own_port_and_files(tmp_path: Path) -> None:
    settings, fleet = fleet_sim_settings(replicas=2, speed=50.0, workdir=tmp_path)
    r1 = replica_settings(settings, fleet, 1)
    assert r1.server.port == fleet.replica_ports()[1]
    assert r1.server.log_file.endswith("server.replica1.log")
    assert r1.profiles == settings.profiles
    assert r1.launch_argv("baseline")[-1] == str(fleet.replica_ports()[1])
