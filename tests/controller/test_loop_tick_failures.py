"""Controller.run's handling of a tick that raises: the daemon keeps ticking, the first failure
is logged with its traceback, and the same failure repeating (a full disk fails every tick's
writes) is one line per tick, not a journal of identical tracebacks; a different failure, or
one after a good tick, has its traceback again."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from controller.loop import Controller
from store import StoreError
from tests.controller.ops_support import make_rig


async def test_a_repeating_tick_failure_is_one_line_after_its_first_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    stop = asyncio.Event()
    outcomes: list[Exception | None] = [
        StoreError("write failed: database or disk is full"),
        StoreError("write failed: database or disk is full"),
        StoreError("write failed: database or disk is full"),
        RuntimeError("another bug"),
        None,  # a good tick
        RuntimeError("another bug"),
    ]
    real_tick = Controller.tick

    async def tick(self: Controller) -> object:
        outcome = outcomes.pop(0)
        if not outcomes:
            stop.set()
        if outcome is not None:
            raise outcome
        return await real_tick(self)

    try:
        with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.ERROR):
            mp.setattr(Controller, "tick", tick)
            await asyncio.wait_for(c.run(stop), 10)
        failed = [r for r in caplog.records if r.getMessage().startswith("tick failed")]
        assert [(r.getMessage(), r.exc_info is not None) for r in failed] == [
            ("tick failed", True),
            (
                "tick failed again (2 in a row): StoreError: write failed: database or disk "
                "is full",
                False,
            ),
            (
                "tick failed again (3 in a row): StoreError: write failed: database or disk "
                "is full",
                False,
            ),
            ("tick failed", True),  # another failure: its own traceback
            ("tick failed", True),  # after a good tick: a new story
        ]
    finally:
        await rig.close()
