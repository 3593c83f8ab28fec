"""The command actuator with a fake orchestrator whose switch command returns before the
rollout is done, and the safe expansion of {profile} / {flags} / {env} placeholders."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.actuators import SwitchOutcome, make_actuator
from controller.actuators.command import CommandActuator, expand
from controller.actuators.subproc import run_command
from controller.clock import ScaledClock
from controller.settings import Settings
from tests.controller.actuator_fakes.support import (
    FAKE_ORCHESTRATOR,
    FAKE_SGLANG,
    PROFILES,
    SPEED,
    alive,
    kill_everything,
    port_pids,
    settings,
    wait_until,
)

Factory = Callable[..., tuple[CommandActuator, Settings]]
SWITCH = [sys.executable, str(FAKE_ORCHESTRATOR), "switch", "{profile}", "{flags}"]
STATUS = [sys.executable, str(FAKE_ORCHESTRATOR), "status"]


@pytest.fixture
async def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Factory]:
    orch = tmp_path / "orch"
    monkeypatch.setenv("FAKE_ORCH_DIR", str(orch))
    client = httpx.AsyncClient(trust_env=False)
    made: list[Settings] = []

    def factory(**kw: Any) -> tuple[CommandActuator, Settings]:
        kw.setdefault("switch_command", SWITCH)
        kw.setdefault("status_command", STATUS)
        s = settings(tmp_path, actuator="command", **kw)
        made.append(s)
        act = make_actuator(s, ScaledClock(SPEED), client)
        assert isinstance(act, CommandActuator)
        return act, s

    yield factory
    await client.aclose()
    pids = {p for s in made for p in port_pids(s.server.port)}
    if (orch / "pid").exists():
        pids.add(int((orch / "pid").read_text()))
    kill_everything(pids)


async def test_switch_waits_for_the_new_profile_not_just_ready(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    act, _ = make()
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert (await act.probe()).profile == "baseline"
    # The orchestrator keeps the old server serving for 1 s after the command returned.
    monkeypatch.setenv("FAKE_ORCH_DELAY_S", "1.0")
    r = await act.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert (r.from_profile, r.to_profile) == ("baseline", "eagle3-2step")
    assert r.server_args is not None and r.server_args["speculative_num_steps"] == 2
    assert r.downtime_s >= 100.0  # >= the 1 real s of delay, in server seconds
    assert await act.alive()
    assert await act.status_profile() == "eagle3-2step"
    # The command got the profile's env (through SPECPILOT_ENV) and separate flag arguments.
    assert (await act.probe()).profile == "eagle3-2step"


async def test_a_failing_command_is_start_failed_with_its_stderr(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ORCH_FAIL", "1")
    act, _ = make()
    r = await act.switch("baseline")
    assert r.outcome is SwitchOutcome.START_FAILED
    assert "exited with status 3" in (r.error or "") and "forbidden" in (r.error or "")


async def test_a_hanging_command_is_killed_and_unknown(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ORCH_HANG", "1")
    act, _ = make(start_timeout_s=100.0, stop_timeout_s=50.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r = await act.switch("baseline")
    assert r.outcome is SwitchOutcome.UNKNOWN
    assert "timed out" in (r.error or "")
    assert loop.time() - t0 < 6.0  # 150 server s = 1.5 real s


async def test_status_command_breaks_ties_between_identical_shapes(make: Factory) -> None:
    profiles = {**PROFILES, "baseline-nccl": {"flags": [], "env": {"NCCL_ALGO": "Ring"}}}
    act, _ = make(profiles=profiles)
    r = await act.start("baseline-nccl")
    assert r.outcome is SwitchOutcome.OK, r.error
    fresh, _ = make(profiles=profiles, port=act.server.port)  # a restarted controller
    state = await fresh.probe()
    assert state.profile == "baseline-nccl"
    assert state.server_args is not None


def test_command_actuator_needs_a_switch_command(tmp_path: Path) -> None:
    # Caught when the configuration is read (exit 78), before any actuator is built.
    with pytest.raises(ValueError, match="switch_command"):
        settings(tmp_path, actuator="command")


def test_expand_whole_arguments_and_quoted_embedding() -> None:
    values = {"profile": "eagle3-2step", "flags": ["--a", "x y", "--b"], "port": "30000"}
    assert expand(["deploy", "{profile}", "{flags}", "--port={port}"], values) == [
        "deploy",
        "eagle3-2step",
        "--a",
        "x y",
        "--b",
        "--port=30000",
    ]
    assert expand(["sh", "-c", "run {profile} {flags}"], values) == [
        "sh",
        "-c",
        "run eagle3-2step --a 'x y' --b",
    ]
    assert expand(["keep {unknown} {flags"], values) == ["keep {unknown} {flags"]


def test_expanded_flags_cannot_escape_a_shell_string(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    out = tmp_path / "out"
    evil = f"$(touch {marker}); `touch {marker}` ' \" ; touch {marker}"
    argv = expand(["sh", "-c", "printf '%s\\n' {flags} > " + str(out)], {"flags": ["--x", evil]})
    subprocess.run(argv, check=True)
    assert not marker.exists()
    assert out.read_text().splitlines() == ["--x", evil]


def test_command_env_carries_the_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    s = settings(tmp_path, actuator="command", switch_command=SWITCH, env={"A": "1 2"})
    act = make_actuator(s, ScaledClock(SPEED), httpx.AsyncClient())
    assert isinstance(act, CommandActuator)
    env = act.command_env("eagle3-2step")
    assert env["SPECPILOT_PROFILE"] == "eagle3-2step"
    assert "--speculative-num-steps 2" in env["SPECPILOT_FLAGS"]
    assert env["SPECPILOT_ENV"] == "'A=1 2' NCCL_PROTO=LL"
    assert "NOTIFY_SOCKET" not in env


@contextlib.asynccontextmanager
async def busy_old_server(port: int, events: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A fake SGLang on `port` with two requests in flight (a drain pauses it), recording the
    pause and continue calls in `events`; yields a client whose base URL is that server."""
    env = {**os.environ, "FAKE_IN_FLIGHT": "2", "FAKE_EVENTS": str(events)}
    server = subprocess.Popen(
        [sys.executable, str(FAKE_SGLANG), "--port", str(port)], env=env, stdout=subprocess.DEVNULL
    )
    try:
        async with httpx.AsyncClient(trust_env=False, base_url=f"http://127.0.0.1:{port}") as c:
            for _ in range(200):
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get("/ready")).status_code == 200:
                        break
                await asyncio.sleep(0.02)
            yield c
    finally:
        server.kill()
        server.wait()


async def test_a_refused_switch_resumes_the_paused_old_server(
    tmp_path: Path, make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain aborted requests and paused the old server; the orchestrator then refused the
    switch: the old server must serve again, not stay paused."""
    events = tmp_path / "events"
    act, s = make(drain_timeout_s=20.0)
    async with busy_old_server(s.server.port, events) as c:
        monkeypatch.setenv("FAKE_ORCH_FAIL", "1")
        r = await act.switch("eagle3-2step")
        assert r.outcome is SwitchOutcome.START_FAILED
        assert r.from_profile == "baseline"
        assert events.read_text().splitlines()[-1] == "continue"
        assert (await c.get("/ready")).status_code == 200


async def test_a_command_that_starts_the_server_in_the_background_is_done_when_it_exits(
    make: Factory,
) -> None:
    """`sh -c '... &'`: the server inherits the command's stdout. The command counted as
    running until that pipe closed, so the switch timed out (UNKNOWN) after stop + start
    timeouts and the kill of its process group took the server that had come up with it."""
    launch = f"{shlex.quote(sys.executable)} -m simulator {{flags}} &"
    act, s = make(switch_command=["sh", "-c", launch], start_timeout_s=1000.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert loop.time() - t0 < 8.0  # the server's start (20 s at 100x, plus Python), not 10 s
    state = await act.probe()
    assert state.up and state.profile == "baseline"
    assert port_pids(s.server.port)  # still serving after the command's end


@pytest.mark.parametrize(
    ("command", "outcome"),
    [(["true"], SwitchOutcome.START_FAILED), (["sleep", "60"], SwitchOutcome.UNKNOWN)],
)
async def test_a_switch_that_never_replaces_the_paused_old_server_resumes_it(
    tmp_path: Path,
    make: Factory,
    command: list[str],
    outcome: SwitchOutcome,
) -> None:
    """The drain paused the old server; the orchestrator then exited 0 without replacing it
    (or hung until killed): the old server stayed paused (/ready 503), serving nothing."""
    events = tmp_path / "events"
    act, s = make(
        switch_command=command, drain_timeout_s=20.0, start_timeout_s=100.0, stop_timeout_s=50.0
    )
    async with busy_old_server(s.server.port, events) as c:
        r = await act.switch("eagle3-2step")
        assert r.outcome is outcome, r.error
        assert events.read_text().splitlines()[-1] == "continue"
        assert (await c.get("/ready")).status_code == 200


async def test_a_cancelled_command_is_killed_with_its_process_group(tmp_path: Path) -> None:
    """The daemon stopping during its start-up cancels the start: the switch command (in a
    session of its own, so no terminal signal reaches it) went on running, orphaned."""
    pid_file = tmp_path / "pids"
    script = f"sleep 60 & echo $$ $! > {shlex.quote(str(pid_file))}; wait"
    task = asyncio.ensure_future(run_command(["sh", "-c", script], ScaledClock(SPEED), 1e6))
    for _ in range(500):
        if pid_file.exists() and len(pid_file.read_text().split()) == 2:
            break
        await asyncio.sleep(0.01)
    pids = [int(p) for p in pid_file.read_text().split()]
    try:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert wait_until(lambda: not any(alive(p) for p in pids), timeout=5.0)
    finally:
        kill_everything(set(pids))


async def test_command_output_is_bounded_and_may_be_any_bytes() -> None:
    """A chatty command (log following, a binary dump) was buffered whole in the daemon."""
    script = "head -c 3000000 /dev/zero | tr '\\0' x; printf 'end \\377\\376\\n'; exit 4"
    r = await run_command(["sh", "-c", script], ScaledClock(SPEED), 1000.0)
    assert r.returncode == 4
    assert len(r.stdout) < 200_000
    assert r.stdout.startswith("x" * 1000)
    assert r.stdout.rstrip().endswith("end \ufffd\ufffd")
    assert "bytes left out" in r.stdout
    assert "exited with status 4" in r.describe()
