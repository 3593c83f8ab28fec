"""The mode a start runs in (Controller._start_mode): a mode set through the API survives a
restart while the config file's mode is unchanged; an edit of the file's mode wins at the next
start, also over a mode saved with a pin or a pause, and over a row saved before the file's mode
was recorded beside it. Whenever the saved mode and the file differ, one log line says which
mode is in force and why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from controller.loop import STATE_KEY_MODE_SOURCE, STATE_KEY_OVERRIDES
from policies.types import Mode, Overrides
from store import Store
from tests.controller.ops_support import make_rig, make_settings


async def _restart(tmp_path: Path, mode: str) -> Mode:
    rig = await make_rig(tmp_path, settings=make_settings(tmp_path, mode=mode))
    try:
        return rig.controller.mode
    finally:
        await rig.close()


async def test_an_edit_of_the_file_mode_beats_a_mode_saved_with_a_pause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await make_rig(tmp_path, settings=make_settings(tmp_path, mode="advisory"))
    rig.controller.pause(600, "maintenance", "test")  # saves the overrides row, mode included
    await rig.close()
    with caplog.at_level(logging.WARNING, logger="specpilot.loop"):
        assert await _restart(tmp_path, "active") is Mode.ACTIVE
    lines = [r.getMessage() for r in caplog.records if "mode=active" in r.getMessage()]
    assert len(lines) == 1 and "wins over the saved mode=advisory" in lines[0], lines
    # The row follows the file now: the next start with the same file says nothing.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specpilot.loop"):
        assert await _restart(tmp_path, "active") is Mode.ACTIVE
    assert not [r for r in caplog.records if "mode=" in r.getMessage()]


async def test_a_mode_set_through_the_api_survives_a_restart_with_the_same_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await make_rig(tmp_path)  # the file says active
    rig.controller.set_mode(Mode.ADVISORY, "look only", "test")
    rig.controller.pin("eagle3-2step", 60.0, "later save", "test")
    await rig.close()
    with caplog.at_level(logging.WARNING, logger="specpilot.loop"):
        assert await _restart(tmp_path, "active") is Mode.ADVISORY
    assert any("set through the API" in r.getMessage() for r in caplog.records)
    # Until the file's mode is edited: then the file wins.
    assert await _restart(tmp_path, "advisory") is Mode.ADVISORY
    rig = await make_rig(tmp_path)
    try:
        rig.controller.set_mode(Mode.ACTIVE, "act again", "test")
    finally:
        await rig.close()
    assert await _restart(tmp_path, "advisory") is Mode.ADVISORY


async def test_a_row_saved_before_the_file_mode_was_recorded_lets_the_file_win(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path / "specpilot.db")
    store.save_overrides(Overrides(paused_until_s=None, mode=Mode.ADVISORY))
    assert store.load_state(STATE_KEY_MODE_SOURCE) is None
    store.close()
    with caplog.at_level(logging.WARNING, logger="specpilot.loop"):
        assert await _restart(tmp_path, "active") is Mode.ACTIVE
    assert any("before the config's mode was recorded" in r.getMessage() for r in caplog.records)
    store = Store(tmp_path / "specpilot.db")
    try:
        assert (store.load_state(STATE_KEY_OVERRIDES) or {})["mode"] == "active"
        assert store.load_state(STATE_KEY_MODE_SOURCE) == {"mode": "active", "file_mode": "active"}
    finally:
        store.close()
