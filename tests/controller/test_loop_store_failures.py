"""The loop when the history cannot be written (a full disk, a database gone read-only): ticks
still finish (the watchdog is fed), a crashed server is still restarted, a switch away from a
serving profile is not made unrecorded, an operator's change either is recorded and in effect
or neither (the API's 503), and once writes succeed again one line says so."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.loop import Controller
from policies.types import Action, Reason
from store import Store, StoreError
from tests.controller.ops_support import Rig, make_rig

FULL = "write failed: database or disk is full"


@contextlib.contextmanager
def _full_disk(mp: pytest.MonkeyPatch) -> Iterator[None]:
    """Every write transaction of the Store (single writes and batches) fails, as SQLite's
    SQLITE_FULL does; reads still work."""

    @contextlib.contextmanager
    def fail(*_: object) -> Iterator[None]:
        raise StoreError(FULL)
        yield  # pragma: no cover

    with mp.context() as m:
        m.setattr(Store, "_tx", fail)
        m.setattr(Store, "batch", fail)
        yield


def _errors(c: Controller) -> float:
    return c.metrics.store_write_errors._value.get()


def _row_count(rig: Rig, table: str) -> int:
    return int(rig.store.db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


async def test_a_crash_is_restarted_while_nothing_can_be_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    ticked: list[float] = []
    c._on_tick.append(lambda ctl: ticked.append(ctl.clock.now()))
    try:
        await rig.ticks(3)
        switches = _row_count(rig, "switches")
        rig.server.profile = None  # the server dies
        with pytest.MonkeyPatch.context() as mp, _full_disk(mp), caplog.at_level(logging.DEBUG):
            restarted = None
            for i in range(60):
                rig.clock.advance(c.settings.controller.poll_interval_s)
                d = await c.tick()  # never raises: the history is best effort
                if d.action is Action.SWITCH:
                    restarted = (i, d.reason)
                    break
            assert restarted is not None and restarted[1] is Reason.RESTART_CRASHED
            assert rig.actuator.calls[-1] == ("start", "baseline")
            assert c.running == "baseline" and rig.server.profile == "baseline"
            await rig.ticks(5)  # and it goes on observing and deciding from memory
            assert c.last_obs is not None and c.last_obs.t_s == rig.clock.now()
        assert len(ticked) == restarted[0] + 1 + 5 + 3  # every tick finished
        assert _errors(c) > 0
        errors = [
            r
            for r in caplog.records
            if r.levelno == logging.ERROR and "was not recorded" in r.getMessage()
        ]
        assert len(errors) == 1  # the first of the run; the rest are debug and the metric
        assert _row_count(rig, "switches") == switches  # nothing was written meanwhile
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            await rig.ticks(1)
        assert any("history writes succeed again" in r.getMessage() for r in caplog.records)
        assert c.store_failures == 0
    finally:
        await rig.close()


async def test_a_switch_that_cannot_be_recorded_is_not_made(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(3)
        c.pin("eagle3-5step", None, "measure", "test")  # recorded; the next tick switches
        n = len(rig.actuator.calls)
        with pytest.MonkeyPatch.context() as mp, _full_disk(mp):
            for _ in range(3):
                await rig.ticks(1)
            assert rig.actuator.calls[n:] == []  # wanted, not made: no record
            assert c.running == "baseline" and c.state is not None and c.state.pending is None
        await rig.ticks(1)
        assert rig.actuator.calls[n:] == [("switch", "eagle3-5step")]
        row = rig.store.db.execute(
            "SELECT to_profile, outcome FROM switches ORDER BY id DESC LIMIT 1"
        ).fetchone()
        assert tuple(row) == ("eagle3-5step", "ok")
    finally:
        await rig.close()


async def test_an_operator_change_that_cannot_be_recorded_changes_nothing(
    tmp_path: Path,
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(2)
        before = (c.overrides, c.mode)
        with pytest.MonkeyPatch.context() as mp, _full_disk(mp):
            with pytest.raises(StoreError):
                c.pin("eagle3-5step", 600.0, "try it", "ops")
            with pytest.raises(StoreError):
                c.pause(600.0, "hands off", "ops")
            with pytest.raises(StoreError):
                c.set_mode(c.mode.__class__("advisory"), "look only", "ops")
            assert (c.overrides, c.mode) == before
            await rig.ticks(3)
            assert c.running == "baseline"  # no pin took effect
        c.pin("eagle3-5step", 600.0, "try it", "ops")
        assert c.overrides.pin_profile == "eagle3-5step"
        saved = rig.store.load_state("overrides")
        assert saved is not None and saved["pin_profile"] == "eagle3-5step"
    finally:
        await rig.close()
