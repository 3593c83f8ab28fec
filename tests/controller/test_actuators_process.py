"""The process actuator against the real simulator (`python -m simulator`) and, for what the
simulator cannot do (ignore SIGTERM, report a wrong profile, hold requests), a fake server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.actuators import Funnel, SwitchOutcome, UnknownProfileError, make_actuator
from controller.actuators.process import ProcessActuator
from controller.actuators.proctree import read_pid_file
from controller.clock import ScaledClock
from controller.settings import Settings
from policies.types import Mode
from tests.controller.actuator_fakes.support import (
    PROFILES,
    alive,
    kill_everything,
    port_pids,
    settings,
    wait_until,
)

Factory = Callable[..., ProcessActuator]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


@pytest.fixture
async def make(client: httpx.AsyncClient) -> AsyncIterator[Factory]:
    """Builds process actuators; at teardown shuts them down and kills anything left on their
    ports (by pid)."""
    made: list[tuple[ProcessActuator, Settings]] = []

    def factory(s: Settings) -> ProcessActuator:
        act = make_actuator(s, ScaledClock(s.controller.time_scale), client)
        assert isinstance(act, ProcessActuator)
        made.append((act, s))
        return act

    yield factory
    pids: set[int] = set()
    for act, s in made:
        await act.shutdown()
        pids |= port_pids(s.server.port)
        pid = read_pid_file(s.server.pid_file) if s.server.pid_file else None
        if pid:
            pids.add(pid)
        if act._proc is not None:
            pids.add(act._proc.pid)
    kill_everything({p for p in pids if alive(p)})


async def test_start_probe_switch_shutdown(tmp_path: Path, make: Factory) -> None:
    s = settings(tmp_path)
    act = make(s)
    assert (await act.probe()).up is False
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.from_profile is None and r.to_profile == "baseline"
    state = await act.probe()
    assert state.up and state.profile == "baseline"
    pid0 = state.pid
    assert pid0 is not None and read_pid_file(s.server.pid_file) == pid0
    assert await act.alive()

    r = await act.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert (r.from_profile, r.to_profile) == ("baseline", "eagle3-2step")
    # Downtime is server time: at least the simulated restart (load + graphs + warmup).
    assert r.downtime_s > 10.0
    assert r.server_args is not None and r.server_args["speculative_num_steps"] == 2
    state = await act.probe()
    assert state.profile == "eagle3-2step" and state.pid not in (None, pid0)
    assert not alive(pid0)
    assert read_pid_file(s.server.pid_file) == state.pid
    # The profile's environment reached the server, NOTIFY_SOCKET did not.
    import psutil

    env = psutil.Process(state.pid).environ()
    assert env["NCCL_PROTO"] == "LL" and env["SPECPILOT_PROFILE"] == "eagle3-2step"
    assert "NOTIFY_SOCKET" not in env
    # Own process group, so that killpg reaches every child.
    import os

    assert os.getpgid(state.pid) == state.pid

    await act.shutdown()
    assert not alive(state.pid)
    assert not Path(s.server.pid_file).exists()
    assert (await act.probe()).up is False
    assert not await act.alive()


async def test_start_failure_returns_log_tail_and_leaves_nothing(
    tmp_path: Path, make: Factory
) -> None:
    s = settings(tmp_path, extra_flags=["--sim-fault-start-fail", "--sim-fault-scope", "spec"])
    act = make(s)
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    r = await act.switch("eagle3-5step")
    assert r.outcome is SwitchOutcome.START_FAILED
    assert r.from_profile == "baseline"
    assert "exited with status 1" in (r.error or "")
    assert "CUDA out of memory" in (r.error or "")  # the server's own last words
    assert not await act.alive()
    assert (await act.probe()).up is False
    assert not Path(s.server.pid_file).exists()
    # The failed profile did not poison the actuator: the last good one starts again.
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error


async def test_hang_at_start_hits_the_deadline_and_is_killed(tmp_path: Path, make: Factory) -> None:
    s = settings(tmp_path, extra_flags=["--sim-fault-hang-start"], start_timeout_s=150.0)
    act = make(s)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r = await act.start("baseline")
    real = loop.time() - t0
    assert r.outcome is SwitchOutcome.START_FAILED
    assert "not ready within start_timeout_s=150" in (r.error or "")
    assert r.downtime_s >= 150.0
    assert real < 8.0  # 150 server s = 1.5 real s, plus the stop
    assert not await act.alive()
    assert port_pids(s.server.port) == set()


async def test_crash_is_detected(tmp_path: Path, make: Factory) -> None:
    # The crash timer runs from the process's start: 2 s leave the start room to finish on a
    # loaded machine (the systemd actuator's twin of this test failed so at 0.3 s).
    s = settings(tmp_path, extra_flags=["--sim-fault-crash-after-s", "2.0"])
    act = make(s)
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    pid = (await act.probe()).pid
    for _ in range(200):
        if not await act.alive():
            break
        await asyncio.sleep(0.05)
    assert not await act.alive()
    assert pid is not None and not alive(pid)
    # After a crash, switch() simply starts (the loop's restart of the crashed profile).
    s2 = settings(tmp_path, port=s.server.port)
    act2 = make(s2)
    r = await act2.switch("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.from_profile is None


async def test_sigterm_ignored_escalates_to_sigkill_of_the_tree(
    tmp_path: Path, make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    s = settings(
        tmp_path,
        fake=True,
        env={"FAKE_IGNORE_SIGTERM": "1", "FAKE_CHILD": "1"},
        stop_timeout_s=50.0,
    )
    act = make(s)
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    import psutil

    pid = (await act.probe()).pid
    assert pid is not None
    assert wait_until(lambda: len(psutil.Process(pid).children()) == 1)
    child = psutil.Process(pid).children()[0].pid
    caplog.set_level(logging.INFO, logger="controller.actuators")
    r = await act.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.downtime_s >= 50.0  # waited the whole stop_timeout_s before SIGKILL
    assert "SIGKILL" in caplog.text
    assert not alive(pid) and not alive(child)


async def test_unkillable_state_is_unknown(tmp_path: Path, make: Factory) -> None:
    """A stop that cannot be verified (here: the process is not ours to signal) is UNKNOWN, and
    the funnel then blocks automatic switching."""
    s = settings(tmp_path, fake=True)
    act = make(s)
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    pid = (await act.probe()).pid
    assert pid is not None

    from controller.actuators import proctree

    async def cannot_stop(self: Any, clock: Any, timeout: float, reap: Any = None) -> Any:
        return proctree.StopReport(False, f"pids [{pid}] still alive after SIGKILL", True)

    orig = proctree.ProcessTree.stop
    proctree.ProcessTree.stop = cannot_stop  # type: ignore[method-assign]
    try:
        funnel = Funnel(act, lambda: Mode.ACTIVE)
        r = await funnel.switch("eagle3-2step")
    finally:
        proctree.ProcessTree.stop = orig  # type: ignore[method-assign]
    assert r.outcome is SwitchOutcome.UNKNOWN
    assert "could not stop the old server" in (r.error or "")
    assert funnel.blocked_reason and "still alive" in funnel.blocked_reason
    assert (await funnel.switch("baseline")).outcome is SwitchOutcome.REFUSED_BUSY
    assert alive(pid)  # nothing else was touched


async def test_adoption_never_starts_a_second_server(tmp_path: Path, make: Factory) -> None:
    s = settings(tmp_path)
    first = make(s)
    assert (await first.start("eagle3-2step")).outcome is SwitchOutcome.OK
    pid = (await first.probe()).pid
    assert pid is not None

    # A new controller (the first one died): it finds the server by its pid file.
    second = make(s)
    state = await second.probe()
    assert state.up and state.profile == "eagle3-2step" and state.pid == pid
    assert "adopted" in state.detail
    r = await second.start("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK and r.downtime_s == 0.0
    r = await second.start("baseline")
    assert r.outcome is SwitchOutcome.REFUSED_BUSY
    assert "already up" in (r.error or "")
    assert (await second.probe()).pid == pid and port_pids(s.server.port) == {pid}

    # Without a pid file: found by the port it listens on, and a switch stops it.
    s3 = settings(tmp_path, port=s.server.port, pid_file="")
    third = make(s3)
    state = await third.probe()
    assert state.pid == pid and state.profile == "eagle3-2step"
    assert await third.alive()
    r = await third.switch("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.from_profile == "eagle3-2step"
    assert not alive(pid)
    assert (await third.probe()).profile == "baseline"


async def test_a_foreign_listener_is_never_touched(tmp_path: Path, make: Factory) -> None:
    """Something that is not SGLang holds the port (an HTTP server answering 404 to everything):
    start refuses, switch refuses, nothing is killed and nothing is launched."""

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *a: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        s = settings(tmp_path, port=httpd.server_address[1])
        act = make(s)
        state = await act.probe()
        assert state.up and state.profile is None and state.pid is None
        r = await act.start("baseline")
        assert r.outcome is SwitchOutcome.REFUSED_BUSY
        r = await act.switch("baseline")
        assert r.outcome is SwitchOutcome.UNKNOWN
        assert "cannot stop" in (r.error or "")
        assert act._proc is None  # nothing was launched
        assert thread.is_alive()
    finally:
        httpd.shutdown()
        httpd.server_close()


async def test_stale_pid_file_naming_another_process_is_ignored(
    tmp_path: Path, make: Factory
) -> None:
    import os

    s = settings(tmp_path)
    Path(s.server.pid_file).write_text(f"{os.getpid()}\n")  # pytest itself: not the server
    act = make(s)
    state = await act.probe()
    assert state.pid is None and not state.up
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert read_pid_file(s.server.pid_file) != os.getpid()


async def test_profile_mismatch_is_unknown(tmp_path: Path, make: Factory) -> None:
    s = settings(tmp_path, fake=True, env={"FAKE_REPORT_STEPS": "4"})
    act = make(s)
    r = await act.start("eagle3-2step")
    assert r.outcome is SwitchOutcome.UNKNOWN
    assert "not 'eagle3-2step'" in (r.error or "")
    assert await act.alive()  # left serving: a person decides


async def test_drain_waits_then_aborts_in_flight_requests(tmp_path: Path, make: Factory) -> None:
    events = tmp_path / "events"
    s = settings(
        tmp_path,
        fake=True,
        env={"FAKE_IN_FLIGHT": "3", "FAKE_EVENTS": str(events)},
        drain_timeout_s=100.0,
    )
    act = make(s)
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r = await act.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK
    assert loop.time() - t0 >= 1.0  # 100 server s of drain = 1 real s
    lines = events.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0].removeprefix("pause ")) == {"mode": "abort"}

    # An idle server is stopped at once, without a pause.
    await act.shutdown()
    events.unlink()
    s2 = settings(
        tmp_path,
        fake=True,
        port=s.server.port,
        env={"FAKE_EVENTS": str(events)},
        drain_timeout_s=1000.0,
    )
    act2 = make(s2)
    assert (await act2.start("baseline")).outcome is SwitchOutcome.OK
    t0 = loop.time()
    r = await act2.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK
    assert loop.time() - t0 < 8.0  # not the 10 real s of drain_timeout_s
    assert not events.exists()


async def test_advisory_mode_never_touches_the_server(tmp_path: Path, make: Factory) -> None:
    s = settings(tmp_path)
    act = make(s)
    funnel = Funnel(act, lambda: Mode.ADVISORY)
    r = await funnel.start("baseline")
    assert r.outcome is SwitchOutcome.SKIPPED_ADVISORY
    assert (await act.probe()).up is False and act._proc is None

    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    pid = (await act.probe()).pid
    r = await funnel.switch("eagle3-5step")
    assert r.outcome is SwitchOutcome.SKIPPED_ADVISORY
    r = await funnel.switch("eagle3-5step", manual=True)
    assert r.outcome is SwitchOutcome.SKIPPED_ADVISORY
    state = await act.probe()
    assert state.profile == "baseline" and state.pid == pid


async def test_unknown_profile_is_an_error_before_anything_happens(
    tmp_path: Path, make: Factory
) -> None:
    act = make(settings(tmp_path))
    with pytest.raises(UnknownProfileError, match="unknown profile 'nope'"):
        await act.start("nope")
    with pytest.raises(UnknownProfileError):
        await Funnel(act, lambda: Mode.ACTIVE).switch("nope")
    assert act._proc is None


async def test_missing_launch_binary_is_start_failed(tmp_path: Path, make: Factory) -> None:
    s = settings(tmp_path, launch=[str(tmp_path / "no-such-sglang")])
    act = make(s)
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.START_FAILED
    assert "cannot run" in (r.error or "")


async def test_shutdown_without_ownership_leaves_the_server(tmp_path: Path, make: Factory) -> None:
    s = settings(tmp_path, fake=True, owns_server=False)
    act = make(s)
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    pid = (await act.probe()).pid
    await act.shutdown()
    assert pid is not None and alive(pid)
    # Teardown: an owning actuator adopts and stops it.
    owner = make(settings(tmp_path, fake=True, port=s.server.port))
    await owner.shutdown()
    assert wait_until(lambda: not alive(pid), 5.0)


async def test_start_waits_for_a_server_an_earlier_controller_is_loading(
    tmp_path: Path, make: Factory
) -> None:
    # restart_s=300 at 100x: about 3 real seconds of loading with the port closed.
    s = settings(tmp_path, extra_flags=["--sim-override", "restart_s=300"])
    first = make(s)
    task = asyncio.create_task(first.start("eagle3-2step"))
    for _ in range(200):
        if Path(s.server.pid_file).exists():
            break
        await asyncio.sleep(0.02)
    task.cancel()  # the first controller dies while its server loads
    with contextlib.suppress(asyncio.CancelledError):
        await task
    pid = read_pid_file(s.server.pid_file)
    assert pid is not None and alive(pid)

    second = make(s)
    state = await second.probe()
    assert not state.up and state.pid == pid
    r = await second.start("baseline")
    assert r.outcome is SwitchOutcome.REFUSED_BUSY
    assert "eagle3-2step" in (r.error or "") and "not up yet" in (r.error or "")
    r = await second.start("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK, r.error
    state = await second.probe()
    assert state.pid == pid and state.profile == "eagle3-2step"
    assert port_pids(s.server.port) == {pid}


async def test_an_adaptive_profile_is_identified(tmp_path: Path, make: Factory) -> None:
    profiles = {
        **PROFILES,
        "adaptive": {
            "kind": "adaptive",
            "flags": [
                "--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", "lightseekorg/kimi-k2.5-eagle3",
                "--speculative-adaptive",
            ],
        },
    }  # fmt: skip
    act = make(settings(tmp_path, profiles=profiles))
    r = await act.start("adaptive")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.server_args is not None and r.server_args["speculative_adaptive"] is True
    assert (await act.probe()).profile == "adaptive"


async def test_an_unwritable_log_file_is_start_failed(tmp_path: Path, make: Factory) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    act = make(settings(tmp_path, log_file=str(blocker / "server.log")))
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.START_FAILED
    assert "log_file" in (r.error or "")
    assert act._proc is None


async def test_a_zombie_leader_with_live_threads_is_still_running(
    tmp_path: Path, make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """The server's main thread is gone (its pid shows as a zombie) while its other threads
    serve the port and take 0.5 real s to exit after SIGTERM: the stop waits for them, and the
    switch then starts the new server instead of finding the port in use."""
    from controller.actuators import proctree

    s = settings(tmp_path, fake=True, env={"FAKE_ZOMBIE_LEADER_S": "0.5"}, stop_timeout_s=200.0)
    act = make(s)
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    pid = (await act.probe()).pid
    assert pid is not None
    import psutil

    assert wait_until(lambda: psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    assert proctree.running(pid) and proctree.ProcessTree(pid).alive() == [pid]
    caplog.set_level(logging.INFO, logger="controller.actuators")
    r = await act.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.downtime_s >= 40.0  # 0.5 real s of teardown at 100x (and not a SIGKILL)
    assert "exited after SIGTERM" in caplog.text and "SIGKILL" not in caplog.text
    assert not proctree.running(pid)


async def test_switch_waits_a_bounded_time_for_the_port_after_the_stop(
    tmp_path: Path, make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """Something outside the server's tree (here a detached process that inherited the socket)
    keeps the port for 0.5 real s after the server is gone: the switch waits for it (at most
    stop_timeout_s) instead of calling the outcome unknown."""
    s = settings(tmp_path, fake=True, env={"FAKE_PORT_HOLDER_S": "0.5"}, stop_timeout_s=200.0)
    act = make(s)
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    caplog.set_level(logging.INFO, logger="controller.actuators")
    r = await act.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.downtime_s >= 40.0
    assert "released" in caplog.text

    # Held longer than stop_timeout_s (50 server s = 0.5 real s): UNKNOWN, and nothing started.
    s2 = settings(
        tmp_path, fake=True, port=s.server.port, env={"FAKE_PORT_HOLDER_S": "20"},
        stop_timeout_s=50.0,
    )  # fmt: skip
    await act.shutdown()
    act2 = make(s2)
    assert (await act2.start("baseline")).outcome is SwitchOutcome.OK
    pid = (await act2.probe()).pid
    r = await act2.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.UNKNOWN
    assert "still in use 50 s after the stop" in (r.error or "")
    assert pid is not None and not alive(pid) and act2._proc is None


async def test_a_server_binding_its_port_between_the_probes_asks_is_identified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server an earlier controller launched binds its port after the probe's /server_info
    was refused and before its port check: the probe asks again and finds it up and running
    its profile. It had read 'up, /server_info does not answer', and a starting controller
    refused to start at all ('refusing to start a second one'): CI's flaky SIGKILL test."""
    s = settings(tmp_path)
    bound = False

    def handler(req: httpx.Request) -> httpx.Response:
        if not bound:
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(200, json={"speculative_algorithm": None})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as mock:
        act = make_actuator(s, ScaledClock(s.controller.time_scale), mock)
        assert isinstance(act, ProcessActuator)

        async def port_open() -> bool:
            nonlocal bound
            bound = True
            return True

        monkeypatch.setattr(act.endpoint, "port_open", port_open)
        state = await act.probe()
    assert state.up and state.profile == "baseline", state
