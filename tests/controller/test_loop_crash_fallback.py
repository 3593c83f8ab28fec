"""A profile that keeps crashing outside a trial (Controller._crash_fallback) is backed off like
one that failed to start: a crash inside the policy's min_dwell_s of its start, or the
start_failure_limit-th crash in a row, quarantines it (the policy's failed-profile backoff) and
brings back at once the profile that served before it; a crash of a profile that served long
restarts the same profile after the backoff, as before, and so does a pinned one."""

from __future__ import annotations

from pathlib import Path

from policies.types import Action, Reason
from tests.controller.ops_support import Rig, make_rig


async def _switch_to_5step(rig: Rig) -> None:
    """5-step runs after a switch that starts no trial (a pin, lifted at once)."""
    c = rig.controller
    await rig.ticks(3)
    c.pin("eagle3-5step", None, "measure", "test")
    await rig.ticks(1)
    c.unpin("", "test")
    assert c.running == "eagle3-5step" and c.state is not None and c.state.trial is None


async def test_a_crash_soon_after_a_switch_rolls_back_and_quarantines(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await _switch_to_5step(rig)
        await rig.ticks(3)
        rig.server.profile = None  # died, 30 s after its start: inside the dwell
        rig.clock.advance(c.settings.controller.poll_interval_s)
        d = await c.tick()
        assert (d.action, d.profile, d.reason) == (
            Action.SWITCH,
            "baseline",
            Reason.ROLLBACK_CRASH,
        )
        assert rig.actuator.calls[-1] == ("start", "baseline")
        assert c.running == "baseline" and c.last_good == "baseline"
        assert c.state is not None and "eagle3-5step" in c.state.failed
        n = len(rig.actuator.calls)
        await rig.ticks(40)  # past the dwell: the policy keeps off the quarantined profile
        assert rig.actuator.calls[n:] == []
        assert c.running == "baseline"
    finally:
        await rig.close()


async def test_repeated_crashes_roll_back_after_start_failure_limit(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    dwell = c.psettings.min_dwell_s
    poll = c.settings.controller.poll_interval_s
    limit = c.settings.server.start_failure_limit
    try:
        await _switch_to_5step(rig)
        reasons = []
        for _ in range(limit):
            # Served past the dwell (a pin keeps the policy's own switches off), then died.
            c.pin("eagle3-5step", dwell * 10, "hold it", "test")
            await rig.ticks(int(dwell / poll) + 1)
            c.unpin("", "test")
            rig.server.profile = None
            for _ in range(200):
                rig.clock.advance(poll)
                d = await c.tick()
                if d.action is Action.SWITCH:
                    reasons.append(d.reason)
                    break
        assert reasons == [Reason.RESTART_CRASHED] * (limit - 1) + [Reason.ROLLBACK_CRASH]
        assert c.running == "baseline"
        assert c.state is not None and "eagle3-5step" in c.state.failed
    finally:
        await rig.close()


async def test_a_pinned_profile_that_crashes_is_restarted_not_rolled_back(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await _switch_to_5step(rig)
        c.pin("eagle3-5step", None, "keep it", "test")
        await rig.ticks(3)
        rig.server.profile = None  # a pinned profile: restarted, never rolled back
        await rig.ticks(1)
        assert c.restart_plan is not None and c.restart_plan[:2] == (
            "eagle3-5step",
            Reason.RESTART_CRASHED,
        )
        assert c.state is not None and "eagle3-5step" not in c.state.failed
    finally:
        await rig.close()
