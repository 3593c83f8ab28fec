"""The daemon's start-up order (controller.daemon.serve / run_daemon), in this process without a
server: the API token is resolved and the API socket bound before the controller's start-up
touches a server, so a daemon that cannot serve (its API address in use, e.g. by a daemon
already running; a host that is not one; a bad api.token_file) neither adopts, starts nor stops
a server; and a start-up that fails never stops the server it adopted. The database comes
before all of that: a bad one (damaged, newer, read-only) or one another daemon writes exits 1
with one line naming it, touching no server. The API serves during the start-up (a cold start
takes minutes): reads answer, an operator switch is a 409, and a start-up that fails or a
SIGTERM during it stops the API and exits as without it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller import daemon as daemon_mod
from controller.actuators.base import SwitchResult
from controller.clock import Clock, ScaledClock
from controller.daemon import ApiBindError, Daemon, build, run_daemon, serve
from controller.loop import Controller
from controller.metrics import ControllerMetrics
from controller.settings import EXIT_CONFIG, ConfigError, Settings
from store import Reader, Store
from tests.controller.actuator_fakes.support import free_port
from tests.controller.daemon_support import config, settings, write_config
from tests.controller.ops_support import TOKEN, FakeActuator, FakeServer, make_settings
from tests.store.test_open import BAD, HOLDER

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else (the API of a daemon already running) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


class Touches:
    """Records every call that would adopt, start or stop a server."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, startup_error: str | None = None):
        self.calls: list[str] = []
        touches = self

        async def startup(ctl: Controller) -> None:
            touches.calls.append("startup")
            if startup_error is not None:
                ctl.running = "baseline"  # adopted the server on the port, then failed
                raise RuntimeError(startup_error)

        monkeypatch.setattr(Controller, "startup", startup)
        self.monkeypatch = monkeypatch

    def watch(self, ctl: Controller) -> None:
        async def shutdown() -> None:
            self.calls.append("shutdown")

        self.monkeypatch.setattr(ctl.actuator, "shutdown", shutdown)


@pytest.mark.parametrize("host", ["127.0.0.1", "not a host"])
async def test_api_that_cannot_bind_touches_no_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy_port: int, host: str
) -> None:
    touches = Touches(monkeypatch)
    d = await build(
        settings(config(tmp_path, api={"enabled": True, "host": host, "port": busy_port}))
    )
    touches.watch(d.controller)
    with pytest.raises(ApiBindError) as e:
        await serve(d, install_signals=False)
    assert touches.calls == []
    msg = str(e.value)
    assert f"host={host!r} port={busy_port}" in msg and "\n" not in msg
    assert ("in use" in msg) if host == "127.0.0.1" else ("cannot resolve the host" in msg)


async def test_bad_token_file_touches_no_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECPILOT_API_TOKEN", raising=False)
    (tmp_path / "tok").write_text("")
    touches = Touches(monkeypatch)
    raw = config(tmp_path, api={"enabled": True, "token_file": str(tmp_path / "tok")})
    d = await build(settings(raw))
    touches.watch(d.controller)
    with pytest.raises(ConfigError, match=r"api\.token_file .*: its first line is empty"):
        await serve(d, install_signals=False)
    assert touches.calls == []


async def test_failed_startup_never_stops_the_server_it_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    touches = Touches(monkeypatch, startup_error="boom after adopting")
    d = await build(settings(config(tmp_path, api={"enabled": True, "port": 0})))
    assert d.settings.server.owns_server
    touches.watch(d.controller)
    with pytest.raises(RuntimeError, match="boom after adopting"):
        await serve(d, install_signals=False)
    assert touches.calls == ["startup"]  # no shutdown: the server was never this daemon's


async def test_a_stop_during_start_up_does_not_wait_for_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the start-up waits for a cold start (up to start_timeout_s, 15 minutes by
    default) stops at once: the start-up is cancelled and no server is stopped (it was not yet
    this daemon's; the next one adopts it)."""
    touches = Touches(monkeypatch)
    loading = asyncio.Event()

    async def startup(ctl: Controller) -> None:
        touches.calls.append("startup")
        loading.set()
        try:
            await asyncio.Event().wait()  # a server that takes forever to be ready
        except asyncio.CancelledError:
            touches.calls.append("cancelled")
            raise

    monkeypatch.setattr(Controller, "startup", startup)
    d = await build(settings(config(tmp_path, api={"enabled": True, "port": 0})))
    touches.watch(d.controller)
    stop = asyncio.Event()
    served = asyncio.create_task(serve(d, stop=stop, install_signals=False))
    await asyncio.wait_for(loading.wait(), 5)
    stop.set()
    assert await asyncio.wait_for(served, 5) == 0
    assert touches.calls == ["startup", "cancelled"]  # no shutdown


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, startup_error: str | None = None, **api: Any
) -> tuple[int, Touches]:
    monkeypatch.setattr(daemon_mod, "setup_logging", lambda level: None)  # pytest's handlers
    monkeypatch.delenv("SPECPILOT_API_TOKEN", raising=False)
    touches = Touches(monkeypatch, startup_error)
    cfg = write_config(tmp_path / "config.toml", config(tmp_path, api={"enabled": True, **api}))
    return run_daemon(cfg), touches


def test_run_with_api_address_in_use_exits_1_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    busy_port: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    rc, touches = _run(tmp_path, monkeypatch, port=busy_port)
    assert rc == 1 and touches.calls == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert "Address already in use" in errors[0].getMessage()
    assert "\n" not in errors[0].getMessage()


@pytest.mark.parametrize(
    ("content", "problem"),
    [(None, "no such file"), ("", "its first line is empty"), ("dir", "is a directory")],
)
def test_run_with_bad_token_file_exits_78_naming_file_key_and_problem(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    problem: str,
) -> None:
    tok = tmp_path / "token"
    if content == "dir":
        tok.mkdir()
    elif content is not None:
        tok.write_text(content)
    rc, touches = _run(tmp_path, monkeypatch, port=0, token_file=str(tok))
    assert rc == EXIT_CONFIG and touches.calls == []
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"specpilot: {tmp_path / 'config.toml'}: api.token_file {tok}: ")
    assert problem in err and "\n" not in err and "Traceback" not in err


# -- the database: a bad file or a second daemon exits 1 with one line, before the server

# A start-up that got as far as the server fails (recorded in Touches.calls) instead of running.
REACHED_THE_SERVER = "reached the server's start-up"


@pytest.mark.parametrize("case", sorted(BAD))
def test_run_with_a_bad_database_exits_1_with_one_line_touching_no_server(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    db = tmp_path / "specpilot.db"
    make, problem = BAD[case]
    make(db)
    caplog.set_level(logging.INFO)
    rc, touches = _run(tmp_path, monkeypatch, REACHED_THE_SERVER, port=0)
    assert rc == 1 and touches.calls == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None, errors
    msg = errors[0].getMessage()
    assert str(db) in msg and problem in msg and "\n" not in msg, msg


def test_a_second_daemon_on_the_same_database_exits_1_touching_no_server(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A daemon already runs on this database (its own API port): the second one must not
    settle its open switch or adopt its server; it says who holds the database."""
    db = tmp_path / "specpilot.db"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(db)],
        cwd=Path(__file__).resolve().parents[2],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "ready"
        caplog.set_level(logging.INFO)
        rc, touches = _run(tmp_path, monkeypatch, REACHED_THE_SERVER, port=0)
        assert rc == 1 and touches.calls == []
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is None, errors
        assert errors[0].getMessage() == (
            f"database {db} is in use by another specpilot (pid {first.pid})"
        )
        with Reader(db) as r:  # the first daemon's history is as it wrote it
            assert r.load_state("holder") == {"v": 1}
            assert r.switches() == [] and r.recent_decisions() == []
    finally:
        first.kill()
        first.wait(10)


async def test_a_build_that_fails_releases_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_actuator(*_: Any) -> Any:
        raise ConfigError("server.actuator: no such actuator")

    monkeypatch.setattr(daemon_mod, "make_actuator", no_actuator)
    s = settings(config(tmp_path))
    with pytest.raises(ConfigError):
        await build(s)
    db = Path(s.controller.database)
    # Released: another process may open it now.
    code = "import sys; from store import Store; Store(sys.argv[1]).close()"
    probe = subprocess.run(
        [sys.executable, "-c", code, str(db)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr


# -- the API during the start-up: it answers while the server starts


def _held_start_daemon(tmp_path: Path) -> tuple[Daemon, FakeActuator]:
    """The real composition (serve: API on a free loopback port, loop, watchdog) over a
    FakeServer whose start is held (`start_hold`) until the test lets it finish; 100x time."""
    s = make_settings(tmp_path)
    clock = ScaledClock(100.0)
    server = FakeServer(clock)
    actuator = FakeActuator(server, clock)
    actuator.start_hold = asyncio.Event()
    client = httpx.AsyncClient(transport=httpx.MockTransport(server.handler))
    store = Store(Path(s.controller.database))
    ctl = Controller(
        s,
        clock=clock,
        store=store,
        actuator=actuator,
        client=client,
        metrics=ControllerMetrics(s.profiles),
    )
    return Daemon(None, s, ctl, store, client), actuator


async def _until(cond: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.02)


async def _start_held_with_api_up(d: Daemon, actuator: FakeActuator) -> int:
    """Wait until the start-up is in the held start and the API listens; its port."""
    await _until(
        lambda: actuator.calls == [("start", "baseline")] and d.api_port is not None,
        "the API serving during the held start",
    )
    assert d.api_port is not None
    return d.api_port


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_the_api_answers_while_the_start_up_starts_the_server(tmp_path: Path) -> None:
    """A cold start takes minutes: health checks, `specpilot status` and Prometheus must see a
    daemon starting a server (a switch in flight, not ready), not a dead one; an operator
    switch waits for the start (409) and the other writes are recorded for the first tick."""
    d, actuator = _held_start_daemon(tmp_path)
    assert actuator.start_hold is not None
    stop = asyncio.Event()
    served = asyncio.create_task(serve(d, stop=stop, install_signals=False))
    try:
        port = await _start_held_with_api_up(d, actuator)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=5
        ) as http:
            r = await http.get("/healthz")
            assert r.status_code == 200
            assert r.json() == {"ok": True, "ready": False, "profile": None}
            st = (await http.get("/v1/status")).json()
            assert st["switch_in_flight"] is True
            assert st["profile"] is None and st["ready"] is False
            assert st["last_decision"] is None  # no tick yet
            assert st["target"]["up"] is False
            assert st["target"]["down_reason"] == "start-up: starting baseline"
            assert "specpilot_switch_in_flight 1.0" in (await http.get("/metrics")).text
            for path in ("/v1/estimates", "/v1/decisions", "/v1/switches", "/v1/profiles", "/"):
                assert (await http.get(path)).status_code == 200, path

            for path, body in (
                ("/v1/switch", {"profile": "eagle3-2step"}),
                ("/v1/trial/abort", None),
            ):
                r = await http.post(path, json=body, headers=AUTH)
                assert r.status_code == 409, (path, r.text)
                assert r.json()["detail"].startswith("the server is starting"), r.text
            r = await http.put(
                "/v1/pause", json={"ttl_s": 600, "reason": "cold start"}, headers=AUTH
            )
            assert r.status_code == 200 and r.json()["pause"] is not None, r.text
            assert actuator.calls == [("start", "baseline")]  # still held: nothing else began

            actuator.start_hold.set()
            await _until(lambda: d.controller.ready, "the first good scrape after the start")
            assert (await http.get("/healthz")).json() == {
                "ok": True,
                "ready": True,
                "profile": "baseline",
            }
            st = (await http.get("/v1/status")).json()
            assert st["switch_in_flight"] is False and st["profile"] == "baseline"
            assert st["target"]["down_reason"] is None
            assert st["overrides"]["pause"] is not None  # recorded during the start, in force
            assert "specpilot_switch_in_flight 0.0" in (await http.get("/metrics")).text
            assert (await http.delete("/v1/pause", headers=AUTH)).status_code == 200
            r = await http.post("/v1/switch", json={"profile": "eagle3-2step"}, headers=AUTH)
            assert r.status_code == 202, r.text
    finally:
        actuator.start_hold.set()
        stop.set()
        assert await asyncio.wait_for(served, 10) == 0
    assert actuator.calls == [("start", "baseline"), ("switch", "eagle3-2step")]
    assert _refused(port)


async def test_a_sigterm_during_the_start_stops_the_api_and_the_daemon(tmp_path: Path) -> None:
    """SIGTERM while the API serves a start-up held in a cold start: serve returns 0 at once,
    the API is closed and no server is stopped or started (the next daemon adopts it)."""
    d, actuator = _held_start_daemon(tmp_path)
    served = asyncio.create_task(serve(d))  # the daemon's own SIGTERM handler
    port = await _start_held_with_api_up(d, actuator)
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(served, 10) == 0
    assert actuator.calls == [("start", "baseline")] and actuator.server.profile is None
    assert _refused(port)


def test_a_start_that_fails_while_the_api_serves_exits_1_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`specpilot run` whose server cannot start: the API answered during the start (not
    ready), and the daemon exits 1 with the start-up's one line, as it did before the API
    served during the start-up, its API closed and no server stopped."""
    port = free_port()
    seen: dict[str, Any] = {}

    class FailingStart(FakeActuator):
        async def start(self, profile: str) -> SwitchResult:
            async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
                seen["healthz"] = (await http.get(f"http://127.0.0.1:{port}/healthz")).json()
            return await super().start(profile)

    def fake_actuator(_: Settings, clock: Clock, __: httpx.AsyncClient) -> FakeActuator:
        actuator = FailingStart(FakeServer(clock), clock)
        actuator.broken = {"baseline"}
        seen["actuator"] = actuator
        return actuator

    monkeypatch.setattr(daemon_mod, "make_actuator", fake_actuator)
    monkeypatch.setattr(daemon_mod, "setup_logging", lambda level: None)  # pytest's handlers
    monkeypatch.delenv("SPECPILOT_API_TOKEN", raising=False)
    cfg = write_config(
        tmp_path / "config.toml", config(tmp_path, api={"enabled": True, "port": port})
    )
    caplog.set_level(logging.INFO)
    assert run_daemon(cfg) == 1
    assert seen["healthz"] == {"ok": True, "ready": False, "profile": None}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [(e.getMessage(), e.exc_info) for e in errors] == [
        ("could not start profile baseline: server exited with status 1", None)
    ]
    assert seen["actuator"].calls == [("start", "baseline")]  # nothing stopped
    assert _refused(port)
