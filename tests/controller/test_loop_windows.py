"""A window never spans a gap (controller/loop.py, Controller._observe): after failed scrapes
(a hung server: its counters stand still while its scrapes fail) the next good scrape starts a
new window instead of reading the hang as a slow rate of the running profile, and so does a
scrape that comes more than scrape_error_limit + 1 polls after the last one."""

from __future__ import annotations

from pathlib import Path

from policies.types import Action, Reason
from tests.controller.ops_support import make_rig


async def test_failed_scrapes_start_a_new_window(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    poll = c.settings.controller.poll_interval_s
    try:
        await rig.ticks(5)
        assert c.last_obs is not None and c.last_obs.window_s == poll
        rate = c.last_obs.output_tok_s
        before = len(rig.store.observations())
        # Hung for 7 polls (past scrape_error_limit = 6): scrapes fail, nothing is served.
        rig.server.fail_scrapes = True
        await rig.ticks(7)
        assert c.scrape_errors == 7
        rig.server._t = rig.clock.now()  # the hang served no token: its counters stood still
        rig.server.fail_scrapes = False
        rig.clock.advance(poll)
        d = await c.tick()
        # The first good scrape after the failures is a new baseline snapshot, not a window
        # across the hang (which would read 1/8 of the rate).
        assert (d.action, d.reason) == (Action.HOLD, Reason.HOLD_INSUFFICIENT_DATA)
        assert c.scrape_errors == 0
        assert len(rig.store.observations()) == before
        await rig.ticks(1)
        assert c.last_obs is not None and c.last_obs.window_s == poll
        assert c.last_obs.output_tok_s == rate
        assert all(o["window_s"] == poll for o in rig.store.observations())
    finally:
        await rig.close()


async def test_a_window_longer_than_the_error_limit_is_not_counted(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    ctl = c.settings.controller
    try:
        await rig.ticks(3)
        before = len(rig.store.observations())
        # A silence as long as scrape_error_limit failed polls would have been: not a window.
        await rig.ticks(1, step_s=(ctl.scrape_error_limit + 1) * ctl.poll_interval_s + 1)
        assert len(rig.store.observations()) == before
        # Up to that long is still one window.
        await rig.ticks(1, step_s=(ctl.scrape_error_limit + 1) * ctl.poll_interval_s)
        assert len(rig.store.observations()) == before + 1
    finally:
        await rig.close()
