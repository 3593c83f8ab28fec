"""The operator's overrides against failures and restarts (Controller): a failed start is rolled
back under a pause or a pin, a pinned profile that cannot start is unpinned rather than retried
into a block, leaving advisory mode drops the advice not acted on, a manual switch away from a
pin is refused, and a restart starts what a pin or a pause restored from the store asks for."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.loop import ConflictError
from policies.types import Mode, Reason
from tests.controller.ops_support import Rig, make_rig

BROKEN = "eagle3-5step"


def _switch_reasons(rig: Rig) -> list[tuple[str, str, str | None]]:
    """Oldest first."""
    return [(r["to_profile"], r["reason"], r["outcome"]) for r in rig.store.switches()][::-1]


async def _manual(rig: Rig, profile: str) -> None:
    rig.controller.start_manual_switch(profile, "try it", "test")
    assert rig.controller._manual is not None
    await rig.controller._manual


async def test_a_failed_start_during_a_pause_is_rolled_back(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path, broken={BROKEN})
    c = rig.controller
    try:
        await rig.ticks(3)
        c.pause(100_000, "maintenance", "test")
        await _manual(rig, BROKEN)
        assert c.running is None
        await rig.ticks(1)
        assert c.running == "baseline"
        assert rig.server.profile == "baseline"
        last = c.last_decision
        assert last is not None and last.reason is Reason.ROLLBACK_START_FAILED
        assert last.diagnostics["failed_profile"] == BROKEN
        await rig.ticks(2)
        assert c.last_decision is not None and c.last_decision.reason is Reason.HOLD_PAUSED
    finally:
        await rig.close()


async def test_a_pinned_profile_that_fails_to_start_is_unpinned_and_rolled_back(
    tmp_path: Path,
) -> None:
    rig = await make_rig(tmp_path, broken={BROKEN})
    c = rig.controller
    try:
        await rig.ticks(3)
        c.pin(BROKEN, 3000.0, "try it", "test")
        await rig.ticks(1)  # the pin's switch fails
        assert c.overrides.pin_profile is None
        unpin = [r for r in rig.store.overrides_history() if r["kind"] == "unpin"]
        assert len(unpin) == 1 and unpin[0]["actor"] == "specpilot"
        assert f"{BROKEN} failed to start" in unpin[0]["reason"]
        await rig.ticks(3)
        assert c.running == "baseline" and c.funnel.blocked_reason is None
        assert _switch_reasons(rig)[-2:] == [
            (BROKEN, "switch_pinned", "start_failed"),
            ("baseline", "rollback_start_failed", "ok"),
        ]
    finally:
        await rig.close()


async def test_leaving_advisory_mode_drops_the_advice_not_acted_on(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(3)
        c.set_mode(Mode.ADVISORY, "look only", "test")
        c.pin("eagle3-2step", 3000.0, "want it", "test")
        await rig.ticks(2)  # advised, not acted on: the policy waits for that switch
        assert c.running == "baseline" and c.state is not None and c.state.pending is not None
        c.set_mode(Mode.ACTIVE, "act", "test")
        await rig.ticks(1)  # decided again at once, not when the advice would time out
        assert c.running == "eagle3-2step"
    finally:
        await rig.close()


async def test_a_manual_switch_away_from_a_pin_is_refused(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(3)
        c.pin("eagle3-2step", None, "keep it", "test")
        await rig.ticks(1)  # the pin's switch
        assert c.running == "eagle3-2step"
        with pytest.raises(ConflictError, match="pinned to eagle3-2step: DELETE /v1/pin first"):
            c.start_manual_switch("eagle3-5step", "try", "test")
        c.unpin("done", "test")
        c.start_manual_switch("eagle3-5step", "try", "test")
    finally:
        if c._manual is not None:
            await c._manual
        await rig.close()


async def test_a_restart_starts_the_pinned_profile(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    rig.controller.pin("eagle3-2step", None, "keep it", "test")
    await rig.ticks(2)
    await rig.close()
    rig = await make_rig(tmp_path)
    try:
        assert rig.actuator.calls == [("start", "eagle3-2step")]
        assert rig.controller.running == "eagle3-2step"
    finally:
        await rig.close()


async def test_a_restart_during_a_pause_starts_the_profile_that_served(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    await rig.ticks(3)
    await _manual(rig, "eagle3-2step")
    await rig.ticks(2)
    rig.controller.pause(100_000, "hold still", "test")
    await rig.ticks(1)
    await rig.close()
    rig = await make_rig(tmp_path)
    try:
        assert rig.actuator.calls == [("start", "eagle3-2step")]
    finally:
        await rig.close()


async def test_a_restored_pin_that_cannot_start_does_not_keep_the_daemon_down(
    tmp_path: Path,
) -> None:
    rig = await make_rig(tmp_path)
    rig.controller.pin(BROKEN, None, "keep it", "test")
    await rig.close()
    rig = await make_rig(tmp_path, broken={BROKEN})
    try:
        assert rig.actuator.calls == [("start", BROKEN), ("start", "baseline")]
        assert rig.controller.running == "baseline"
        assert rig.controller.overrides.pin_profile is None
    finally:
        await rig.close()
