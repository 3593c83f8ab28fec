"""Fleet mode against the real `sglang-router` binary and simulator replicas (pip extra `fleet`).

Worker registration, a rolling switch under load with no failed request (the router's own
retries turned off, so that they cannot hide a failure; a naive restart without leaving the
router is shown to fail requests under the same conditions), a canary rolled back when the
candidate is worse, and a router that is down (a switch waits and touches nothing; once a
router answers again every replica is registered and the switch completes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip extra 'fleet')")

from controller.actuators.base import SwitchOutcome
from controller.clock import ScaledClock
from controller.fleet import controller as fleet_controller
from controller.fleet.actuator import FleetActuator
from controller.fleet.controller import FleetController
from controller.fleet.demo import fleet_sim_settings
from controller.fleet.router import RouterClient, free_port, router_argv
from controller.fleet.settings import RouterSettings
from policies.types import Action, Decision, Mode, Reason
from simulator.load import LoadGenerator

SPEED = 100.0
RESTART_S = 30.0  # simulated seconds per restart: 0.3 s real at 100x
EAGLE2 = [
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-draft-model-path",
    "lightseekorg/kimi-k2.5-eagle3",
    "--speculative-num-steps",
    "2",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "3",
]


def _settings(tmp_path: Path, replicas: int, **kw: Any) -> Any:
    return fleet_sim_settings(
        replicas=replicas, speed=SPEED, workdir=tmp_path, restart_s=RESTART_S, **kw
    )


@contextlib.asynccontextmanager
async def running_fleet(
    tmp_path: Path, replicas: int = 3, **kw: Any
) -> AsyncIterator[tuple[FleetActuator, httpx.AsyncClient]]:
    settings, fleet = _settings(tmp_path, replicas, **kw)
    clock = ScaledClock(SPEED)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        act = FleetActuator(settings, fleet, clock, client)
        try:
            res = await act.start("baseline")
            assert res.ok, res.error
            yield act, client
        finally:
            await act.shutdown()
            for r in act.replicas:
                assert r.actuator._child_pid() is None, f"{r.name} still runs"


def _launch_router(port: int, log: Path) -> subprocess.Popen[bytes]:
    rs = RouterSettings(port=port)
    argv = router_argv(rs, [], free_port())
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


async def test_replicas_register_with_the_router(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, replicas=2) as (act, _client):
        workers = await act.router.workers()
        assert sorted(w.url for w in workers) == sorted(r.url for r in act.replicas)
        assert all(w.healthy for w in workers)
        probe = await act.probe()
        assert probe.up and probe.profile == "baseline"
        assert await act.alive()
        # Requests through the router reach the replicas.
        stats = await LoadGenerator(act.router.base_url, concurrency=2, max_new_tokens=16).run(1.0)
        assert stats.ok > 0 and stats.failed == 0
        router_pid = act.router_proc.pid if act.router_proc else None
        assert router_pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(router_pid, 0)  # the router specpilot launched is gone with it


async def _max_out(act: FleetActuator, stop: asyncio.Event, seen: list[int]) -> None:
    """Largest number of replicas missing from the router's healthy list, sampled."""
    n = len(act.replicas)
    while not stop.is_set():
        with contextlib.suppress(Exception):
            healthy = [w for w in await act.router.workers() if w.healthy]
            seen.append(n - len(healthy))
        await asyncio.sleep(0.01)


async def test_rolling_switch_under_load_fails_no_request(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, replicas=3, router_extra_args=["--disable-retries"]) as (
        act,
        _client,
    ):
        assert act.fleet.max_unavailable() == 1
        load = LoadGenerator(act.router.base_url, concurrency=6, mix={"chat": 1.0})
        task = asyncio.create_task(load.run())
        stop, seen = asyncio.Event(), []  # type: ignore[var-annotated]
        watch = asyncio.create_task(_max_out(act, stop, seen))
        await asyncio.sleep(1.0)
        before = load.stats.ok
        res = await act.rolling_switch("eagle3-2step")
        await asyncio.sleep(0.5)
        stop.set()
        await load.stop()
        stats = await task
        await watch
        assert res.ok, res.error
        assert stats.failed == 0, stats.last_error
        assert stats.ok > before > 0
        assert [r.profile for r in act.replicas] == ["eagle3-2step"] * 3
        cycles = act.log.cycles
        assert len(cycles) == 3 and all(c.outcome == "ok" for c in cycles)
        assert max(seen) <= 1, f"more than one replica out at once: {max(seen)}"
        assert all(w.healthy for w in await act.router.workers())
        assert len(await act.router.workers()) == 3


async def test_a_replica_that_died_before_a_rolling_switch_is_started_on_the_new_profile(
    tmp_path: Path,
) -> None:
    """With max_unavailable 1, a replica whose server died (listed unhealthy by the router) held
    the only slot: the rollout waited for it, gave up and touched nothing. A dead replica is out
    of service already: it is started on the new profile first, then the others roll."""
    quick = ["--health-failure-threshold", "1"]  # the router notices at its next check
    async with running_fleet(tmp_path, replicas=3, router_extra_args=quick) as (act, _client):
        assert act.fleet.max_unavailable() == 1
        victim = act.replicas[2]
        pid = victim.actuator._child_pid()
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            listed = {w.url: w.healthy for w in await act.router.workers()}
            if not listed.get(victim.url, False):
                break
            await asyncio.sleep(0.2)
        assert not listed.get(victim.url, False), "the router never noticed the dead replica"
        res = await act.rolling_switch("eagle3-2step")
        assert res.ok, res.error
        assert [r.profile for r in act.replicas] == ["eagle3-2step"] * 3
        assert act.log.cycles[0].replica == victim.name
        assert await act.alive()
        assert all(w.healthy for w in await act.router.workers())
        assert len(await act.router.workers()) == 3


async def test_restart_without_leaving_the_router_fails_requests(tmp_path: Path) -> None:
    """The control: the same load and router, but a replica restarted in place (no removal from
    the router first) makes clients see failures. Shows the test above can fail."""
    async with running_fleet(tmp_path, replicas=2, router_extra_args=["--disable-retries"]) as (
        act,
        _client,
    ):
        load = LoadGenerator(act.router.base_url, concurrency=6, mix={"chat": 1.0})
        task = asyncio.create_task(load.run())
        await asyncio.sleep(1.0)
        res = await act.replicas[0].actuator.switch("eagle3-2step")
        await asyncio.sleep(0.5)
        await load.stop()
        stats = await task
        assert res.ok, res.error
        assert stats.failed > 0


async def test_canary_of_a_worse_profile_is_rolled_back(tmp_path: Path) -> None:
    profiles = {
        "baseline": {"flags": []},
        # Same drafter, but verification five times as expensive: clearly worse.
        "eagle3-2step-slow": {"flags": [*EAGLE2, "--sim-cost-scale", "verify=5"]},
    }
    settings, fleet = _settings(
        tmp_path,
        3,
        profiles=profiles,
        poll_interval_s=10.0,
        fleet_overrides={"canary": {"min_windows": 4, "max_windows": 12}},
    )
    clock = ScaledClock(SPEED)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        ctl = FleetController(settings, fleet, clock=clock, client=client)
        # Its explorations are priced on the canary's share of the fleet: one replica of 3.
        assert ctl.psettings.explore_canary_share == pytest.approx(1 / 3)
        try:
            await ctl.startup()
            load = LoadGenerator(fleet.router.base_url, concurrency=6, mix={"chat": 1.0})
            task = asyncio.create_task(load.run())
            ctl.request_canary("eagle3-2step-slow")
            deadline = time.monotonic() + 60
            while not ctl.record.canaries and time.monotonic() < deadline:
                await ctl.tick()
                await asyncio.sleep(0.1)
            await load.stop()
            stats = await task
        finally:
            await ctl.shutdown()
    assert ctl.record.canaries, "no verdict within 60 s"
    rec = ctl.record.canaries[0]
    assert rec.outcome == "rolled_back", rec
    assert rec.verdict is not None and rec.verdict.why == "worse", rec.verdict.summary()
    assert rec.verdict.ratio is not None and rec.verdict.ratio < 0.9
    assert ctl.running == "baseline"
    assert [r.profile for r in ctl.actuator.replicas] == ["baseline"] * 3
    assert "eagle3-2step-slow" in ctl.rejected
    assert stats.failed == 0, stats.last_error
    # The policy backs the candidate off like a failed start, and the canary's windows are in
    # its estimates of the candidate (it is not predicted from the data that proposed it).
    assert ctl.state is not None and "eagle3-2step-slow" in ctl.state.failed
    assert ctl.state.model.cycle.has_data("eagle3-2step-slow")
    assert ctl.state.running == "baseline"


async def test_a_canary_without_traffic_runs_out_of_time(tmp_path: Path) -> None:
    """An idle fleet (no client at all): the canary cannot be judged, and is rolled back once it
    has had its ticks (first scrape, warmup, max_windows), the fleet back on its profile; it is
    not kept on the candidate, the deployment's decisions on hold, until traffic comes."""
    settings, fleet = _settings(
        tmp_path,
        2,
        poll_interval_s=10.0,
        fleet_overrides={"canary": {"min_windows": 2, "max_windows": 3, "warmup_windows": 1}},
    )
    clock = ScaledClock(SPEED)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        ctl = FleetController(settings, fleet, clock=clock, client=client)
        try:
            await ctl.startup()
            ctl.request_canary("eagle3-2step")
            await ctl.tick()
            assert ctl.canary is not None
            ticks = 0
            while ctl.canary is not None and ticks < 20:
                await ctl.tick()
                ticks += 1
        finally:
            await ctl.shutdown()
    assert ticks == 1 + 1 + 3, ticks
    (rec,) = ctl.record.canaries
    assert rec.outcome == "rolled_back", rec
    assert rec.verdict is not None and rec.verdict.why == "insufficient_windows"
    # Unjudged: no evidence against the candidate, nothing backed off; the next switch to it
    # rolls through without a canary (plan_move).
    assert "eagle3-2step" in ctl.unjudged and "eagle3-2step" not in ctl.rejected
    assert ctl.state is not None and "eagle3-2step" not in ctl.state.failed
    assert ctl.running == "baseline"
    assert [r.profile for r in ctl.actuator.replicas] == ["baseline"] * 2


async def test_router_down_switch_waits_and_loses_nothing(tmp_path: Path) -> None:
    port = free_port()
    router = _launch_router(port, tmp_path / "ext-router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as probe_client:
            assert await RouterClient(probe_client, url, ScaledClock(1.0)).wait_alive(30.0)
        async with running_fleet(tmp_path, replicas=2, router_url=url) as (act, _client):
            assert len(await act.router.workers()) == 2
            _kill(router)  # the router dies: clients cannot reach the fleet now
            switch = asyncio.create_task(act.rolling_switch("eagle3-2step"))
            await asyncio.sleep(1.5)
            assert not switch.done(), "the switch must wait for the router"
            assert [r.profile for r in act.replicas] == ["baseline"] * 2, "nothing touched"
            assert all(r.actuator._child_pid() is not None for r in act.replicas)
            # A new router on the same address (empty registrations, as after any restart).
            router = _launch_router(port, tmp_path / "ext-router.log")
            res = await asyncio.wait_for(switch, timeout=60)
            assert res.ok, res.error
            assert [r.profile for r in act.replicas] == ["eagle3-2step"] * 2
            workers = await act.router.workers()
            assert sorted(w.url for w in workers) == sorted(r.url for r in act.replicas)
            assert all(w.healthy for w in workers)
            stats = await LoadGenerator(url, concurrency=2, max_new_tokens=16).run(1.0)
            assert stats.ok > 0 and stats.failed == 0
    finally:
        _kill(router)


async def test_a_launched_router_that_dies_is_relaunched(tmp_path: Path) -> None:
    async with running_fleet(tmp_path, replicas=2) as (act, _client):
        assert act.router_proc is not None and act.router_proc.proc is not None
        os.killpg(act.router_proc.proc.pid, signal.SIGKILL)
        act.router_proc.proc.wait(timeout=10)
        assert await act.ensure_router()
        assert act.log.router_relaunches == 1
        workers = await act.router.workers()
        assert sorted(w.url for w in workers) == sorted(r.url for r in act.replicas)


async def test_a_router_that_exits_at_launch_is_relaunched_on_another_metrics_port(
    tmp_path: Path,
) -> None:
    """The Prometheus port picked for the router was taken before it bound it (another process
    got it from the OS in between): the router exits at once. specpilot sees the exit (it does
    not wait out start_timeout_s), picks another port and launches again."""
    settings, fleet = _settings(tmp_path, 2)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        act = FleetActuator(settings, fleet, ScaledClock(SPEED), client)
        assert act.router_proc is not None
        act.router_proc.prometheus_port = taken.getsockname()[1]
        try:
            t0 = time.monotonic()
            res = await act.start("baseline")
            assert res.ok, res.error
            assert time.monotonic() - t0 < 30.0
            assert act.router_proc.prometheus_port not in (taken.getsockname()[1], 0)
            assert act.router_proc.prometheus_port not in act.fleet.replica_ports()
            assert act.log.router_relaunches == 1
            assert "Address already in use" in (tmp_path / "router.log").read_text()
        finally:
            taken.close()
            await act.shutdown()


async def test_a_router_that_cannot_start_says_why_and_starts_nothing(tmp_path: Path) -> None:
    """A configured Prometheus port that is taken: every launch exits. Nothing is started, and
    the error says what the router said."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    settings, fleet = _settings(tmp_path, 2)
    fleet = fleet.model_copy(
        update={"router": fleet.router.model_copy(update={"prometheus_port": port})}
    )
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        act = FleetActuator(settings, fleet, ScaledClock(SPEED), client)
        try:
            t0 = time.monotonic()
            res = await act.start("baseline")
            assert time.monotonic() - t0 < 30.0
            assert not res.ok and res.outcome is SwitchOutcome.REFUSED_BUSY
            assert res.error is not None
            assert "exited with code 1" in res.error and "Address already in use" in res.error
            assert act.router_proc is not None and act.router_proc.prometheus_port == port
            assert all(r.actuator._child_pid() is None for r in act.replicas), "nothing started"
        finally:
            taken.close()
            await act.shutdown()


def test_router_binary_runs_from_this_interpreter() -> None:
    """What RouterSettings.launch runs by default is there and is the router."""
    out = subprocess.run(
        [sys.executable, "-m", "sglang_router.launch_router", "--help"],
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0 and b"--worker-urls" in out.stdout


async def test_a_crashed_replica_is_restarted_and_registered(tmp_path: Path) -> None:
    settings, fleet = _settings(tmp_path, 2)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        ctl = FleetController(settings, fleet, clock=ScaledClock(SPEED), client=client)
        try:
            await ctl.startup()
            victim = ctl.actuator.replicas[0]
            pid = victim.actuator._child_pid()
            assert pid is not None
            os.killpg(pid, signal.SIGKILL)
            await asyncio.sleep(0.2)
            tick = await ctl.tick()
            assert tick.action == "restart", tick
            new_pid = victim.actuator._child_pid()
            assert new_pid is not None and new_pid != pid
            workers = await ctl.actuator.router.workers()
            assert victim.url in {w.url for w in workers}
            assert await ctl.actuator.alive()
        finally:
            await ctl.shutdown()


async def test_a_launched_router_that_dies_between_switches_is_relaunched_by_the_tick(
    tmp_path: Path,
) -> None:
    """The router dies while no switch runs: the next tick launches it again and registers
    every replica (clients reach the fleet again without waiting for a switch)."""
    settings, fleet = _settings(tmp_path, 2)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        ctl = FleetController(settings, fleet, clock=ScaledClock(SPEED), client=client)
        try:
            await ctl.startup()
            proc = ctl.actuator.router_proc
            assert proc is not None and proc.proc is not None
            old = proc.proc.pid
            os.killpg(old, signal.SIGKILL)
            proc.proc.wait(timeout=10)
            tick = await ctl.tick()
            assert tick.action == "restart" and "router" in tick.detail, tick
            assert proc.pid is not None and proc.pid != old
            workers = await ctl.actuator.router.workers()
            assert sorted(w.url for w in workers) == sorted(r.url for r in ctl.actuator.replicas)
            stats = await LoadGenerator(ctl.actuator.router.base_url, concurrency=2).run(1.0)
            assert stats.ok > 0 and stats.failed == 0
            assert (await ctl.tick()).action != "restart", "a healthy router is left alone"
        finally:
            await ctl.shutdown()


async def test_a_canary_whose_replica_dies_ends_at_once_and_backs_the_candidate_off(
    tmp_path: Path,
) -> None:
    """The canary's replica crashes: it comes back on the current profile, so the trial could
    never get another window; it ends at the restart instead of holding every decision until
    it runs out of time, and the candidate is backed off as after a failed start."""
    settings, fleet = _settings(tmp_path, 2)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        ctl = FleetController(settings, fleet, clock=ScaledClock(SPEED), client=client)
        try:
            await ctl.startup()
            ctl.request_canary("eagle3-2step")
            assert (await ctl.tick()).action == "canary"
            victim = ctl.actuator.canary
            pid = victim.actuator._child_pid()
            assert pid is not None and victim.profile == "eagle3-2step"
            os.killpg(pid, signal.SIGKILL)
            await asyncio.sleep(0.2)
            tick = await ctl.tick()
            assert tick.action == "rollback" and "died" in tick.detail, tick
            assert ctl.canary is None
            assert [r.profile for r in ctl.actuator.replicas] == ["baseline"] * 2
            assert [c.outcome for c in ctl.record.canaries] == ["crashed"]
            assert "eagle3-2step" in ctl.rejected and "eagle3-2step" not in ctl.unjudged
            assert await ctl.actuator.alive()
        finally:
            await ctl.shutdown()


async def test_an_advisory_fleet_leaves_the_replicas_it_adopted_running(tmp_path: Path) -> None:
    """Advisory mode only decides: on its way out it stops no replica it adopted (an earlier
    controller's), as on one server; the router it launched goes with it."""
    settings, fleet = _settings(tmp_path, 2)
    advisory = settings.model_copy(
        update={"controller": settings.controller.model_copy(update={"mode": Mode.ADVISORY})}
    )
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        earlier = FleetActuator(settings, fleet, ScaledClock(SPEED), client)
        try:
            assert (await earlier.start("baseline")).ok
            await earlier.stop_router()  # that controller is gone; its replicas serve on
            pids = [r.actuator._child_pid() for r in earlier.replicas]
            ctl = FleetController(advisory, fleet, clock=ScaledClock(SPEED), client=client)
            await ctl.startup()
            assert [r.profile for r in ctl.actuator.replicas] == ["baseline"] * 2
            await ctl.shutdown()
            assert [r.actuator._child_pid() for r in earlier.replicas] == pids
            assert all(await asyncio.gather(*(r.actuator.alive() for r in earlier.replicas)))
            assert ctl.actuator.router_proc is not None and not ctl.actuator.router_proc.running()
        finally:
            await earlier.shutdown()


async def test_a_replica_port_taken_by_another_server_is_named_when_the_start_up_fails(
    tmp_path: Path,
) -> None:
    """Something that is not SGLang answers on a replica's port: the start-up fails, and its
    error says so (not only what the roll that followed met: no slot in the router)."""
    settings, fleet = _settings(tmp_path, 2)
    port = fleet.replica_ports()[1]
    other = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        ctl = FleetController(settings, fleet, clock=ScaledClock(SPEED), client=client)
        try:
            deadline = time.monotonic() + 30
            while not await ctl.actuator.replicas[1].actuator.endpoint.port_open():
                assert time.monotonic() < deadline, "http.server did not start"
                await asyncio.sleep(0.1)
            with pytest.raises(RuntimeError) as e:
                await ctl.startup()
            assert f"port {port} is open but /server_info does not answer" in str(e.value)
        finally:
            await ctl.shutdown()
            other.kill()
            other.wait(timeout=10)


async def test_a_router_found_on_our_port_is_adopted_once_not_at_every_tick(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A router already answers on the port of the router specpilot would launch (one that
    outlived an earlier specpilot, say): it is adopted, and the loop, which checks the router
    every poll, says so once."""
    port = free_port()
    router = _launch_router(port, tmp_path / "ext-router.log")
    settings, fleet = _settings(tmp_path, 2)
    fleet = fleet.model_copy(update={"router": fleet.router.model_copy(update={"port": port})})
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            assert await RouterClient(
                client, f"http://127.0.0.1:{port}", ScaledClock(1.0)
            ).wait_alive(30.0)
            ctl = FleetController(settings, fleet, clock=ScaledClock(SPEED), client=client)
            try:
                await ctl.startup()
                for _ in range(3):
                    assert (await ctl.tick()).action == "hold"
                adopted = [r for r in caplog.records if "already answers" in r.getMessage()]
                assert len(adopted) == 1, [r.getMessage() for r in adopted]
            finally:
                await ctl.shutdown()
    finally:
        _kill(router)


HYBRID = {
    "kind": "adaptive",
    "candidate_steps": [0, 1, 3],
    "flags": [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "lightseekorg/kimi-k2.5-eagle3",
        "--speculative-num-steps",
        "1",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "2",
        "--speculative-adaptive",
    ],
}


async def test_a_rewritten_adaptive_table_restarts_every_replica_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deployment's hybrid profile: every replica launches with the table file specpilot
    writes, and a decision that rewrites the table rolls all of them (one at a time, the
    router's retries off, no failed request) onto the new file; the status shows the table."""
    settings, fleet = _settings(
        tmp_path,
        2,
        profiles={"baseline": {"flags": []}, "hybrid": HYBRID},
        router_extra_args=["--disable-retries"],
        fleet_overrides={"canary": {"enabled": False}},
    )
    new_table = {"1": {"candidate_steps": [0, 3]}, "16": {"candidate_steps": [0, 1]}}
    script = iter(["hybrid", "rewrite"])

    def decide(state: Any, obs: Any, now: float, *_a: Any) -> tuple[Any, Decision]:
        step = next(script, None)
        if step == "hybrid" and state.running != "hybrid":
            return state, Decision(now, Action.SWITCH, "hybrid", Reason.EXPLORE, {})
        if step == "rewrite":
            state.hybrid.tables["hybrid"]["table"] = new_table
            diag = {"adaptive_table_rewrite": True}
            return state, Decision(now, Action.SWITCH, "hybrid", Reason.SWITCH_PREDICTED_GAIN, diag)
        return state, Decision(now, Action.HOLD, state.running, Reason.HOLD_BEST, {})

    clock = ScaledClock(SPEED)
    path = settings.adaptive_table_path("hybrid")
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        ctl = FleetController(settings, fleet, clock=clock, client=client)
        monkeypatch.setattr(fleet_controller.policy, "decide", decide)
        try:
            await ctl.startup()
            load = LoadGenerator(fleet.router.base_url, concurrency=4, mix={"chat": 1.0})
            task = asyncio.create_task(load.run())
            deadline = time.monotonic() + 60
            while ctl.running != "hybrid" and time.monotonic() < deadline:
                await ctl.tick()
            assert ctl.running == "hybrid"
            seed = json.loads(path.read_text())
            assert seed != new_table
            pids = [r.actuator._child_pid() for r in ctl.actuator.replicas]
            before = len(ctl.actuator.log.cycles)
            while len(ctl.actuator.log.cycles) < before + 2 and time.monotonic() < deadline:
                await ctl.tick()
            await load.stop()
            stats = await task
            status = ctl.status()
            after = [r.actuator._child_pid() for r in ctl.actuator.replicas]
        finally:
            await ctl.shutdown()
    assert json.loads(path.read_text()) == new_table
    rewrite = ctl.actuator.log.cycles[before:]
    assert [(c.from_profile, c.to_profile, c.outcome) for c in rewrite] == [
        ("hybrid", "hybrid", "ok")
    ] * 2
    assert all(p is not None for p in pids + after)
    assert all(a != b for a, b in zip(pids, after, strict=True)), "each replica restarted"
    assert [r.profile for r in ctl.actuator.replicas] == ["hybrid"] * 2
    assert ctl.record.switches[-1].ok
    assert stats.failed == 0, stats.last_error
    assert status["adaptive_tables"]["hybrid"]["table"] == new_table
