"""The daemon's clock (controller.daemon.daemon_clock): the wall clock for a real server; in
accelerated (simulator) mode it starts no earlier than the database's history ends, so that a
restarted daemon's rows never date before the last run's (that run wrote up to time_scale - 1
times its length ahead of the wall clock) and the saved policy times are not in the future."""

from __future__ import annotations

import time
from pathlib import Path

from controller.daemon import build, daemon_clock
from policies.types import Action, Decision, Mode, Reason
from store import Store
from tests.controller.daemon_support import config, settings

DAY = 86_400.0


def _decision(t_s: float) -> Decision:
    return Decision(t_s, Action.HOLD, "baseline", Reason.HOLD_INSUFFICIENT_DATA, {})


def test_latest_time_is_the_latest_of_every_table(tmp_path: Path) -> None:
    with Store(tmp_path / "h.db") as store:
        assert store.latest_time_s() is None
        store.record_decision(_decision(1_000.0), mode=Mode.ACTIVE, acted=False)
        sid = store.start_switch("baseline", "eagle3-2step", "switch_manual", 2_000.0, None)
        store.finish_switch(sid, ended_s=2_500.0, outcome="ok", downtime_s=30.0)
        assert store.latest_time_s() == 2_500.0  # a switch's end counts, not only its start
        store.record_override("pin", 3_000.0, "ops", profile="baseline", ttl_s=60.0)
        assert store.latest_time_s() == 3_000.0


def test_an_accelerated_clock_resumes_after_the_history(tmp_path: Path) -> None:
    ahead = time.time() + DAY  # what a run at x100 for 15 minutes wrote
    with Store(tmp_path / "h.db") as store:
        store.record_decision(_decision(ahead), mode=Mode.ACTIVE, acted=False)
        clock = daemon_clock(100.0, store)
        assert ahead <= clock.now() < ahead + 100.0  # on from there, not back to the wall clock
        assert clock.time_scale == 100.0
        wall = daemon_clock(1.0, store)  # a real server keeps the wall clock, whatever is stored
        assert abs(wall.now() - time.time()) < 5.0


def test_an_accelerated_clock_with_an_older_history_starts_at_the_wall_clock(
    tmp_path: Path,
) -> None:
    with Store(tmp_path / "h.db") as store:
        store.record_decision(_decision(time.time() - DAY), mode=Mode.ACTIVE, acted=False)
        assert abs(daemon_clock(100.0, store).now() - time.time()) < 5.0
    with Store(tmp_path / "empty.db") as store:
        assert abs(daemon_clock(100.0, store).now() - time.time()) < 5.0


async def test_build_gives_the_controller_the_resumed_clock(tmp_path: Path) -> None:
    raw = config(tmp_path)  # the simulator at x100, time_scale 100
    ahead = time.time() + DAY
    with Store(raw["controller"]["database"]) as store:
        store.record_decision(_decision(ahead), mode=Mode.ACTIVE, acted=False)
    d = await build(settings(raw))
    try:
        assert d.controller.clock.now() >= ahead
    finally:
        await d.client.aclose()
        d.store.close()
