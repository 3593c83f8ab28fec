"""THE end-to-end test: the daemon (build + serve, as `specpilot run` composes it), the simulator
as its managed server and a closed-loop load, in accelerated time. It must switch at least once
on its own and record it in SQLite: the switch, the decision with its reason, the observations
that led to it and those after it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.daemon_support import config, reader, running_daemon, server_pids, wait_for


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def actuator_log() -> Iterator[Lines]:
    logger = logging.getLogger("controller.actuators.process")
    lines, level = Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(lines)
    logger.setLevel(level)


async def test_daemon_simulator_load_switches_and_records(
    tmp_path: Path, actuator_log: Lines
) -> None:
    # One stream on the tuned field profile: speculation pays, so starting on baseline the
    # controller explores (and may then move on a predicted gain, judged as a trial).
    raw = config(tmp_path)
    async with running_daemon(raw, concurrency=1) as run:
        s = run.settings

        def switched_and_observed() -> bool:
            with reader(raw) as r:
                done = [sw for sw in r.switches() if sw["from_profile"] and sw["outcome"]]
                if not done:
                    return False
                later = r.observations(since_s=done[-1]["ended_s"], limit=10)
                return len(later) >= 2

        await wait_for(switched_and_observed, 40, "a switch of the controller's own")
        pids = server_pids(s)
        assert len(pids) == 1, f"one server, not {pids}"

    with reader(raw) as r:
        switches = list(reversed(r.switches()))
        decisions = list(reversed(r.recent_decisions(limit=10_000)))
        trials = list(reversed(r.trials()))
        observations = r.observations(limit=10_000)

    # The first row is the start of the initial profile; then the controller's own switches.
    assert switches[0]["from_profile"] is None and switches[0]["to_profile"] == "baseline"
    own = switches[1:]
    assert own, "the controller never switched"
    assert all(sw["outcome"] == "ok" for sw in own), own
    assert own[0]["from_profile"] == "baseline" and own[0]["reason"] in (
        "explore",
        "switch_predicted_gain",
    )
    for sw in own:
        assert sw["ended_s"] >= sw["started_s"]
        assert sw["downtime_s"] > 0
        # Each switch is linked to the decision that asked for it, recorded as acted.
        d = next(d for d in decisions if d["id"] == sw["decision_id"])
        assert d["action"] == "switch" and d["acted"] is True
        assert d["reason"] == sw["reason"] and d["profile"] == sw["to_profile"]
        assert d["diagnostics"]["from"] == sw["from_profile"]
    for gain in (sw for sw in own if sw["reason"] == "switch_predicted_gain"):
        # A predicted gain is a trial: pending from the decision, running once it serves.
        states = [t["state"] for t in trials if t["switch_id"] == gain["id"]]
        assert states[:2] == ["pending", "running"], states
        assert set(states[2:]) <= {"successful", "failed", "inconclusive"}
    # The new profile served: windows were observed and stored after the switch.
    assert any(o["profile"] == own[0]["to_profile"] for o in observations)
    # Holds between switches carry their reasons too, and every window was stored.
    assert {d["reason"] for d in decisions if d["action"] == "hold"} >= {"hold_insufficient_data"}
    assert len(observations) >= 4
    # Bounded drain under load: the in-server clients never go idle, so each switch drained for
    # drain_timeout_s and aborted the rest (and stopping took no longer than its own bound).
    assert any("aborted via /pause_generation" in m for m in actuator_log.messages)
    # owns_server: the daemon's clean stop stopped the server.
    assert not server_pids(s)
