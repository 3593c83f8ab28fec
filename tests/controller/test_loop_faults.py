"""The control loop against the real simulator's fault modes (`--sim-fault-*`), in accelerated
time: a profile that fails to start or hangs at start is rolled back and quarantined; a crash
outside a switch restarts the same profile with a growing backoff; a crash of the profile on
trial rolls back at once; /metrics down during a trial gives no verdict from the failed scrapes
and, past the consecutive-error limit, ends the trial inconclusive and rolls back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.controller.daemon_support import (
    ALL_PROFILES,
    Running,
    config,
    reader,
    running_daemon,
    server_pids,
    wait_for,
)

BASE_5STEP = {k: ALL_PROFILES[k] for k in ("baseline", "eagle3-5step")}


def switches(raw: dict[str, Any]) -> list[dict[str, Any]]:
    with reader(raw) as r:
        return list(reversed(r.switches()))


def decisions(raw: dict[str, Any]) -> list[dict[str, Any]]:
    with reader(raw) as r:
        return list(reversed(r.recent_decisions(limit=10_000)))


def trials(raw: dict[str, Any], switch_id: int) -> list[str]:
    with reader(raw) as r:
        return [t["state"] for t in reversed(r.trials(switch_id=switch_id))]


def finished(raw: dict[str, Any], n: int) -> Any:
    rows = switches(raw)
    return rows if len(rows) >= n and all(r["outcome"] for r in rows[:n]) else None


async def _failed_start_rolls_back(raw: dict[str, Any], error_text: str) -> None:
    async with running_daemon(raw) as run:
        rows = await wait_for(lambda: finished(raw, 3), 40, "explore, failure, rollback", db=raw)
        start, failed, back = rows[:3]
        assert (start["to_profile"], start["outcome"]) == ("baseline", "ok")
        assert (failed["from_profile"], failed["to_profile"]) == ("baseline", "eagle3-5step")
        assert failed["reason"] == "explore" and failed["outcome"] == "start_failed"
        assert error_text in failed["error"]
        # The policy rolled back to the last good profile on its next decision.
        assert back["reason"] == "rollback_start_failed" and back["outcome"] == "ok"
        assert back["to_profile"] == "baseline" and back["from_profile"] is None
        assert run.ctl.running == "baseline"
        # Quarantined for [policy] failed_profile_backoff_s: with the dwell long over, the
        # policy keeps off the failed profile (it would explore it again otherwise).
        assert run.ctl.state is not None and "eagle3-5step" in run.ctl.state.failed
        until = run.ctl.clock.now() + 400.0  # 4 s real, 13 dwells of 30 s
        await wait_for(lambda: run.ctl.clock.now() > until, 10, "time after the rollback")
        assert len(switches(raw)) == 3, switches(raw)[3:]
        assert len(server_pids(run.settings)) == 1
        later = [d for d in decisions(raw) if d["t_s"] > back["ended_s"]]
        assert later and all(d["action"] == "hold" for d in later)


async def test_start_failure_rolls_back_and_quarantines(tmp_path: Path) -> None:
    raw = config(
        tmp_path,
        profiles=BASE_5STEP,
        fault_flags=["--sim-fault-start-fail", "--sim-fault-scope", "spec"],
    )
    await _failed_start_rolls_back(raw, "exited with status 1")


async def test_hang_at_start_hits_the_deadline_and_rolls_back(tmp_path: Path) -> None:
    raw = config(
        tmp_path,
        profiles=BASE_5STEP,
        fault_flags=["--sim-fault-hang-start", "--sim-fault-scope", "spec"],
        # 5 s real: a healthy start takes 1-3 s on this box, the hung one never comes up.
        server={"start_timeout_s": 500.0},
    )
    await _failed_start_rolls_back(raw, "not ready within start_timeout_s=500 s; stopped it")


async def test_crash_restarts_the_same_profile_with_backoff(tmp_path: Path) -> None:
    raw = config(
        tmp_path,
        profiles=BASE_5STEP,
        policy={"explore": False},  # no switch of the policy's own: only crash restarts
        # Every launch crashes 0.3 s (real) after it serves.
        fault_flags=["--sim-fault-crash-after-s", "0.3"],
        server={"crash_backoff_s": 40.0, "crash_backoff_max_s": 1000.0},
    )
    async with running_daemon(raw, concurrency=0) as run:
        rows = await wait_for(lambda: finished(raw, 3), 40, "two crash restarts", db=raw)
        for row in rows[1:3]:
            assert row["reason"] == "restart_crashed" and row["outcome"] == "ok"
            assert row["to_profile"] == "baseline" and row["from_profile"] is None
        before = [d for d in decisions(raw) if d["t_s"] <= rows[2]["started_s"]]
        restarts = [d for d in before if d["reason"] == "restart_crashed"]
        assert [d["diagnostics"]["crash_restarts"] for d in restarts] == [1, 2]
        # The wait before each restart doubles: crash_backoff_s (40), then 80.
        waits = [
            (d["t_s"], d["diagnostics"]["restart_in_s"])
            for d in before
            if d["diagnostics"].get("server_down") and d["action"] == "hold"
        ]
        first = [w for t, w in waits if t < restarts[0]["t_s"]]
        second = [w for t, w in waits if restarts[0]["t_s"] < t < restarts[1]["t_s"]]
        assert first and max(first) <= 40.0 + 1e-6, waits
        assert second and 40.0 < max(second) <= 80.0 + 1e-6, waits
        # Each wait is really waited (server time between the crash and the restart).
        assert restarts[1]["t_s"] - restarts[0]["t_s"] > 80.0
        assert len(server_pids(run.settings)) <= 1


def _trial_config(tmp_path: Path, fault: list[str]) -> dict[str, Any]:
    """Exploration off, and a policy that trusts its predictions (margin_z 0): the one switch it
    makes on its own is a predicted gain, which is a trial. The fault hits 2-step only."""
    return config(
        tmp_path,
        fault_flags=[*fault, "--sim-fault-scope", "steps=2"],
        policy={"explore": False, "margin_z": 0.0},
        controller={"scrape_error_limit": 3},
    )


async def _learn_then_trial(run: Running, raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Baseline and 5-step data make 2-step predictable (one stream: 2-step is best). An
    operator pin teaches the policy 5-step; after the unpin the policy moves to 2-step on a
    predicted gain. Returns the switch rows once the trial's switch and what followed it are
    done."""

    def windows(profile: str) -> int:
        with reader(raw) as r:
            return sum(1 for o in r.observations(limit=1000) if o["profile"] == profile)

    await wait_for(lambda: windows("baseline") >= 4, 20, "baseline windows", db=raw)
    run.ctl.pin("eagle3-5step", None, "learn 5-step", "test")
    await wait_for(lambda: windows("eagle3-5step") >= 4, 20, "5-step windows", db=raw)
    run.ctl.unpin("learned", "test")
    rows = await wait_for(lambda: finished(raw, 4), 30, "trial switch and what followed", db=raw)
    assert [r["reason"] for r in rows[:3]] == [
        "start",
        "switch_pinned",
        "switch_predicted_gain",
    ]
    gain = rows[2]
    assert (gain["from_profile"], gain["to_profile"], gain["outcome"]) == (
        "eagle3-5step",
        "eagle3-2step",
        "ok",
    )
    return rows


async def test_metrics_down_during_a_trial_gives_no_verdict_then_rolls_back(
    tmp_path: Path,
) -> None:
    raw = _trial_config(tmp_path, ["--sim-fault-metrics", "500"])
    async with running_daemon(raw) as run:
        rows = await _learn_then_trial(run, raw)
        gain, back = rows[2], rows[3]
        # Failed scrapes are not evidence: no failed/successful verdict, only inconclusive once
        # the consecutive-error limit (3) is reached.
        assert trials(raw, gain["id"]) == ["pending", "running", "inconclusive"]
        held = [
            d["reason"]
            for d in decisions(raw)
            if gain["ended_s"] <= d["t_s"] < back["started_s"] and d["action"] == "hold"
        ]
        assert held == ["hold_scrape_failed", "hold_scrape_failed"], held
        assert back["reason"] == "rollback_trial_failed" and back["to_profile"] == "eagle3-5step"
        assert back["outcome"] == "ok"
        d = next(d for d in decisions(raw) if d["id"] == back["decision_id"])
        assert d["diagnostics"]["trial_outcome"] == "inconclusive"
        assert d["diagnostics"]["scrape_errors"] == 3
        await wait_for(lambda: run.ctl.ready and run.ctl.last_obs is not None, 10, "scrapes")
        await wait_for(lambda: run.ctl.scrape_errors == 0, 10, "scrapes again")
        assert run.ctl.running == "eagle3-5step"
        assert run.ctl.state is not None and "eagle3-2step" in run.ctl.state.failed


async def test_crash_on_trial_rolls_back_at_once(tmp_path: Path) -> None:
    raw = _trial_config(tmp_path, ["--sim-fault-crash-after-s", "0.3"])
    async with running_daemon(raw) as run:
        rows = await _learn_then_trial(run, raw)
        gain, back = rows[2], rows[3]
        assert trials(raw, gain["id"])[:2] == ["pending", "running"]
        assert trials(raw, gain["id"])[2:] == ["failed"]
        # No backoff: the profile before the trial comes back on the next tick.
        assert back["reason"] == "rollback_crash" and back["to_profile"] == "eagle3-5step"
        assert back["outcome"] == "ok" and back["from_profile"] is None
        assert back["started_s"] - gain["ended_s"] < 100.0
        assert run.ctl.running == "eagle3-5step"
        assert run.ctl.state is not None and "eagle3-2step" in run.ctl.state.failed
        assert run.ctl.crash_restarts == 0
