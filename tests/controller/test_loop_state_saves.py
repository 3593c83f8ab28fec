"""Warm-start state on the tick's path: the policy state is saved on a milestone (first tick,
switch) and otherwise at most every POLICY_STATE_SAVE_EVERY_S of server time, the loop's own
state only when it changed, and the whole policy state when the loop stops; a controller started
on the same database restores what was saved."""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.clock import ManualClock
from controller.loop import POLICY_STATE_SAVE_EVERY_S, STATE_KEY_LOOP, STATE_KEY_POLICY
from tests.controller.ops_support import make_rig


def _saved(rig: object) -> dict:
    saved = rig.store.load_state(STATE_KEY_POLICY)  # type: ignore[attr-defined]
    assert saved is not None
    return saved


async def test_policy_state_saved_on_milestones_and_at_most_every_interval(
    tmp_path: Path,
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        assert rig.store.load_state(STATE_KEY_POLICY) is None  # nothing before the first tick
        await rig.ticks(1)
        assert c.state is not None
        assert _saved(rig) == c.state.to_dict()  # the first tick saves
        await rig.ticks(3)  # learning only, within the interval: not saved yet
        assert c.state.last_window_t_s is not None
        assert _saved(rig) != c.state.to_dict()
        assert (_saved(rig)["last_window_t_s"] or 0.0) < c.state.last_window_t_s
        poll = c.settings.controller.poll_interval_s
        await rig.ticks(int(POLICY_STATE_SAVE_EVERY_S // poll) - 3)
        assert _saved(rig) == c.state.to_dict()  # the interval passed: saved
        await rig.ticks(1)
        assert _saved(rig) != c.state.to_dict()
        # A switch is a milestone: the tick that made it saves, whatever the interval says.
        c.pin("eagle3-2step", None, "measure 2-step", "test")
        await rig.ticks(1)
        assert ("switch", "eagle3-2step") in rig.actuator.calls
        assert c.state.running == "eagle3-2step"
        assert _saved(rig) == c.state.to_dict()
        assert _saved(rig)["running"] == "eagle3-2step"
    finally:
        await rig.close()


async def test_loop_state_written_only_when_it_changes(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    writes: list[str] = []
    save = rig.store.save_state

    def counting(key: str, value: dict, t_s: float | None = None) -> None:
        writes.append(key)
        save(key, value, t_s)

    rig.store.save_state = counting  # type: ignore[method-assign]
    try:
        await rig.ticks(5)
        assert writes.count(STATE_KEY_LOOP) == 1
        assert rig.store.load_state(STATE_KEY_LOOP) == {
            "last_good": c.last_good,
            "trial_switch_id": c.trial_switch_id,
        }
        c.last_good = "eagle3-5step"
        await rig.ticks(1)
        assert writes.count(STATE_KEY_LOOP) == 2
        assert rig.store.load_state(STATE_KEY_LOOP)["last_good"] == "eagle3-5step"
    finally:
        await rig.close()


async def test_stop_saves_the_state_and_a_warm_start_restores_it(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(8)
        assert c.state is not None
        assert _saved(rig) != c.state.to_dict()  # learned since the last save
        stop = asyncio.Event()
        stop.set()
        await c.run(stop)  # the loop stops: the whole state is saved
        final = c.state.to_dict()
        assert _saved(rig) == final
    finally:
        await rig.close()
    again = await make_rig(tmp_path, clock=ManualClock(rig.clock.now()))
    try:
        assert again.controller.state is not None
        assert again.controller.state.to_dict() == final
    finally:
        await again.close()


async def test_a_kill_loses_at_most_the_save_interval(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(20)
        c.pin("eagle3-2step", None, "measure 2-step", "test")
        await rig.ticks(1)
        switch_s = c.state.last_switch_s if c.state is not None else None
        await rig.ticks(9)
        assert c.state is not None
        last_window = c.state.last_window_t_s
        assert last_window is not None
    finally:
        await rig.close()  # killed: no stop, no final save
    again = await make_rig(tmp_path, clock=ManualClock(rig.clock.now()))
    try:
        st = again.controller.state
        assert st is not None
        # The switch (a milestone) is there, and at most the interval of learning is missing.
        assert st.running == "eagle3-2step"
        assert st.last_switch_s == switch_s
        assert st.last_window_t_s is not None
        assert st.last_window_t_s >= last_window - POLICY_STATE_SAVE_EVERY_S
    finally:
        await again.close()
