"""An operator switch runs as a task beside the loop (Controller.start_manual_switch): while it
is in flight the loop neither scrapes nor decides (the server is being stopped and loaded), the
first scrape after it is the new profile's, and `run` returns only once it ended and was
recorded (a stop must not kill the server it loads)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.controller.ops_support import make_rig


async def test_no_scrape_or_decision_while_an_operator_switch_is_in_flight(
    tmp_path: Path,
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(3)
        rig.actuator.hold = asyncio.Event()
        c.start_manual_switch("eagle3-2step", "try it", "test")
        await asyncio.sleep(0)  # the task reaches the actuator and waits there
        assert c.funnel.busy
        rig.server.fail_scrapes = True  # the old server is being stopped
        decisions = len(rig.store.recent_decisions(limit=1000))
        errors = c.metrics.scrape_errors._value.get()
        await rig.ticks(10)  # past scrape_error_limit
        assert c.scrape_errors == 0
        assert c.metrics.scrape_errors._value.get() == errors
        assert len(rig.store.recent_decisions(limit=1000)) == decisions
        rig.server.fail_scrapes = False
        rig.actuator.hold.set()
        assert c._manual is not None
        await c._manual
        assert c.running == "eagle3-2step"
        await rig.ticks(2)
        obs = rig.store.observations()
        assert c.last_obs is not None and c.last_obs.profile == "eagle3-2step"
        assert c.last_obs.window_s == c.settings.controller.poll_interval_s
        assert c.served_since_s is not None
        assert [o["profile"] for o in obs if o["t_s"] > c.served_since_s] == ["eagle3-2step"]
    finally:
        await rig.close()


async def test_run_waits_for_an_operator_switch_in_flight_before_it_returns(
    tmp_path: Path,
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        rig.actuator.hold = asyncio.Event()
        c.start_manual_switch("eagle3-2step", "try it", "test")
        await asyncio.sleep(0)
        stop = asyncio.Event()
        stop.set()
        run = asyncio.create_task(c.run(stop))
        await asyncio.sleep(0.05)
        assert not run.done()  # the switch is still loading the server
        rig.actuator.hold.set()
        await asyncio.wait_for(run, 5)
        assert c._manual is not None and c._manual.done()
        assert c.running == "eagle3-2step"
        row = rig.store.switches()[0]
        assert (row["to_profile"], row["outcome"]) == ("eagle3-2step", "ok")
    finally:
        await rig.close()


async def test_an_operator_start_of_a_server_that_was_down_shows_in_the_status(
    tmp_path: Path,
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(3)
        rig.server.profile = None  # the server died
        await rig.ticks(1)
        assert c.running is None
        assert c.status()["target"]["down_reason"].startswith("server down: restart_crashed")
        rig.actuator.hold = asyncio.Event()
        c.start_manual_switch("eagle3-2step", "bring it back on 2-step", "test")
        await asyncio.sleep(0)
        st = c.status()
        assert st["switch_in_flight"] and st["target"]["down_reason"] == "switch in flight"
        rig.actuator.hold.set()
        assert c._manual is not None
        await c._manual
        assert c.running == "eagle3-2step" and c.status()["target"]["down_reason"] is None
    finally:
        await rig.close()
