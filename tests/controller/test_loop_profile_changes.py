"""A config edited between two runs of the daemon: the restored policy state describes the
profiles configured now (a removed profile forgotten, its saved pin dropped and a pin to it
refused; a new one untried and usable; one whose flags changed re-measured; the others keep
their estimates), one INFO line says what changed, and nothing is said when nothing did."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from controller.clock import ManualClock
from controller.demo_server import eagle_flags
from controller.loop import STATE_KEY_POLICY, UnknownProfileError
from controller.settings import Settings, settings_from_dict
from tests.controller.ops_support import ProfileModel, Rig, make_rig, make_settings

LOGGER = "specpilot.loop"


def _edited(tmp_path: Path) -> Settings:
    """The test config with eagle3-5step removed, eagle3-3step added and eagle3-2step's draft
    model changed (same name, other flags)."""
    raw: dict[str, Any] = make_settings(tmp_path).model_dump()
    raw["profiles"].pop("eagle3-5step")
    raw["profiles"]["eagle3-3step"] = {"flags": eagle_flags(3)}
    raw["profiles"]["eagle3-2step"]["flags"] = [
        *eagle_flags(2),
        "--speculative-draft-model-path",
        "org/other-draft",
    ]
    return settings_from_dict(raw, source="edited")


async def _stop(rig: Rig) -> None:
    stop = asyncio.Event()
    stop.set()
    await rig.controller.run(stop)  # the loop stops: the whole state is saved
    await rig.close()


async def test_a_restart_with_an_edited_config_reconciles_the_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(30)
        c.pin("eagle3-2step", None, "measure 2-step", "test")
        await rig.ticks(30)
        c.pin("eagle3-5step", None, "measure 5-step", "test")  # saved with the overrides
        await rig.ticks(30)
        assert c.state is not None
        for name in c.specs:
            assert c.state.model.cycle.has_data(name), name
        assert c.state.digests == c.settings.profile_digests()
    finally:
        await _stop(rig)
    edited = _edited(tmp_path)
    caplog.set_level(logging.INFO, logger=LOGGER)
    again = await make_rig(tmp_path, settings=edited, clock=ManualClock(rig.clock.now()))
    again.server.models["eagle3-3step"] = ProfileModel(step_s=0.050, accept_length=2.6)
    c = again.controller
    try:
        st = c.state
        assert st is not None
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.INFO and "profiles changed" in r.message
        ]
        # eagle3-5step, pinned, served when the daemon stopped: the state's running profile
        # was the removed one.
        assert lines == [
            "profiles changed in the config since the saved state: added=eagle3-3step "
            "removed=eagle3-5step changed=eagle3-2step cleared=running"
        ]
        assert list(st.specs) == ["baseline", "eagle3-2step", "eagle3-3step"]
        assert st.digests == edited.profile_digests()
        assert st.digests["baseline"] == rig.controller.settings.profile_digests()["baseline"]
        assert (
            st.digests["eagle3-2step"] != rig.controller.settings.profile_digests()["eagle3-2step"]
        )
        # baseline kept what it learned; 2-step (changed) and 3-step (new) are untried.
        assert st.model.cycle.has_data("baseline")
        assert not st.model.cycle.has_data("eagle3-2step")
        assert not st.model.accept.has_data("eagle3-2step")
        assert not st.model.cycle.has_data("eagle3-3step")
        assert "eagle3-5step" not in st.model.specs
        assert st.tried == {"baseline"}
        # The saved pin to the removed profile was dropped: baseline started, not eagle3-5step.
        assert c.overrides.pin_profile is None and c.overrides.pin_until_s is None
        assert again.actuator.calls == [("start", "baseline")]
        with pytest.raises(UnknownProfileError):
            c.pin("eagle3-5step", None, "gone", "test")
        with pytest.raises(UnknownProfileError):
            c.start_manual_switch("eagle3-5step", "gone", "test")
        # The new profile can be pinned, and is measured once it serves.
        c.pin("eagle3-3step", None, "measure 3-step", "test")
        await again.ticks(30)
        assert ("switch", "eagle3-3step") in again.actuator.calls
        assert st is c.state and c.state.running == "eagle3-3step"
        assert c.state.model.cycle.has_data("eagle3-3step")
        c.unpin("", "test")
        # No decision ever named the removed profile.
        assert all(p != "eagle3-5step" for _, p in again.actuator.calls)
    finally:
        await _stop(again)
    # The same config again: nothing changed, nothing said, the state as it was saved.
    caplog.clear()
    third = await make_rig(tmp_path, settings=edited, clock=ManualClock(again.clock.now()))
    try:
        assert third.controller.state is not None
        assert third.store.load_state(STATE_KEY_POLICY) == third.controller.state.to_dict()
        assert not [r for r in caplog.records if "profiles changed" in r.getMessage()]
        assert third.controller.state.model.cycle.has_data("eagle3-3step")
    finally:
        await third.close()


async def test_a_state_saved_without_digests_keeps_its_estimates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await make_rig(tmp_path)
    try:
        await rig.ticks(30)
    finally:
        await _stop(rig)
    # As an older version saved it: no digests.
    from store import Store

    store = Store(Path(rig.controller.settings.controller.database))
    try:
        old = store.load_state(STATE_KEY_POLICY)
        assert old is not None
        del old["digests"]
        store.save_state(STATE_KEY_POLICY, old)
    finally:
        store.close()
    caplog.set_level(logging.INFO, logger=LOGGER)
    edited = _edited(tmp_path)  # eagle3-2step's flags changed too: unknowable, so unchanged
    again = await make_rig(tmp_path, settings=edited, clock=ManualClock(rig.clock.now()))
    try:
        st = again.controller.state
        assert st is not None
        assert st.digests == edited.profile_digests()
        assert st.model.cycle.has_data("baseline")
        lines = [r.getMessage() for r in caplog.records if "profiles changed" in r.getMessage()]
        assert len(lines) == 1
        assert "added=eagle3-3step removed=eagle3-5step" in lines[0]
        assert "changed=" not in lines[0]
    finally:
        await again.close()


def test_profile_digests_follow_what_runs_the_server(tmp_path: Path) -> None:
    s = make_settings(tmp_path)
    d = s.profile_digests()
    assert set(d) == set(s.profiles) and len(set(d.values())) == 3
    assert all(len(v) == 16 for v in d.values())
    assert make_settings(tmp_path).profile_digests() == d  # stable

    def edit(change: dict[str, Any], where: str = "eagle3-2step") -> dict[str, str]:
        raw: dict[str, Any] = s.model_dump()
        if where == "server":
            raw["server"].update(change)
        else:
            raw["profiles"][where].update(change)
        return settings_from_dict(raw, source="t").profile_digests()

    # The description is no part of the behaviour.
    assert edit({"description": "the same flags, other words"}) == d
    # Flags, environment, kind: this profile only.
    for change in (
        {"flags": eagle_flags(3)},
        {"env": {"NCCL_PROTO": "Simple"}},
        {"env": {}},
    ):
        e = edit(change)
        assert e["eagle3-2step"] != d["eagle3-2step"], change
        assert e["baseline"] == d["baseline"] and e["eagle3-5step"] == d["eagle3-5step"]
    # What every profile's server gets (model path, shared environment): every profile.
    for change in (
        {"common_flags": ["--model-path", "org/other-model"]},
        {"env": {"CUDA_VISIBLE_DEVICES": "1"}},
    ):
        e = edit(change, "server")
        assert all(e[n] != d[n] for n in d), change
    # Where it listens is not how fast it runs.
    assert edit({"port": 31000}, "server") == d
