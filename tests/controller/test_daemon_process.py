"""`specpilot run --config FILE` as a real process: the systemd notify protocol over a real
AF_UNIX datagram NOTIFY_SOCKET (READY=1 after the first good scrape, WATCHDOG=1, STATUS=,
RELOADING=1/READY=1 around SIGHUP, STOPPING=1), journald-friendly logging (JOURNAL_STREAM set: no
timestamps), SIGHUP reload of a valid and an invalid file, SIGTERM (the server keeps running
without owns_server, stops with it), a SIGKILL in the middle of a switch followed by a
restart that adopts the server, starts no second one and loses no record, and a second daemon
whose API address is taken (by the daemon already running) that exits without touching the
server."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.controller.actuator_fakes.support import alive, free_port, port_pids
from tests.controller.daemon_support import (
    cleanup,
    config,
    reader,
    server_pids,
    settings,
    start_daemon,
    stop_daemon,
    write_config,
)

TOKEN = "test-token"


class NotifySocket:
    """What systemd listens on: an AF_UNIX datagram socket; every datagram is kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[list[str]] = []

    def close(self) -> None:
        self.sock.close()

    def drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return
            self.messages.append(data.decode().split("\n"))

    def wait(self, line: str, timeout_s: float, after: int = 0) -> int:
        """Index of the first datagram from `after` on with a line equal to (or starting with,
        for `KEY=`) `line`."""
        end = time.monotonic() + timeout_s
        while True:
            for i in range(after, len(self.messages)):
                if any(
                    x == line or (line.endswith("=") and x.startswith(line))
                    for x in self.messages[i]
                ):
                    return i
            if time.monotonic() > end:
                raise AssertionError(f"no {line!r} in {timeout_s:g} s; got {self.messages[-8:]}")
            self.drain()

    def values(self, key: str, after: int = 0) -> list[str]:
        self.drain()
        return [
            x[len(key) + 1 :] for m in self.messages[after:] for x in m if x.startswith(key + "=")
        ]


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    s = NotifySocket(tmp_path / "notify.sock")
    yield s
    s.close()


def _wait_log(path: Path, text: str, timeout_s: float) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the daemon's log:\n{content[-3000:]}")


def test_notify_protocol_reload_journald_and_sigterm_leaves_the_server(
    tmp_path: Path, notify_socket: NotifySocket
) -> None:
    raw = config(tmp_path, server={"owns_server": False}, api={"enabled": True, "port": 0})
    s = settings(raw)
    cfg = write_config(tmp_path / "config.toml", raw)
    log = tmp_path / "daemon.log"
    env = {
        "NOTIFY_SOCKET": str(notify_socket.path),
        "WATCHDOG_USEC": "1000000",  # WATCHDOG=1 at least every 0.5 s from the watchdog task
        "JOURNAL_STREAM": "8:123456",  # as systemd sets it for a unit logging to the journal
    }
    proc = start_daemon(cfg, env, log)
    pids: set[int] = set()
    try:
        ready = notify_socket.wait("READY=1", 30)
        # READY=1 once: after the start of the server and a good scrape of it.
        assert all("READY=1" not in m for m in notify_socket.messages[:ready])
        pids = server_pids(s)
        assert len(pids) == 1
        with reader(raw) as r:
            assert r.switches()[0]["outcome"] == "ok"
        assert httpx.get(s.server.base_url + "/ready", timeout=5).status_code == 200
        notify_socket.wait("WATCHDOG=1", 5, after=ready + 1)
        status = notify_socket.values("STATUS", after=ready)
        assert status and status[-1].startswith("profile=baseline mode=active last=")

        # SIGHUP with a valid file: applied between ticks, RELOADING=1 ... READY=1.
        raw["controller"]["log_level"] = "debug"
        raw["policy"]["min_dwell_s"] = 60.0
        write_config(cfg, raw)
        mark = len(notify_socket.messages)
        proc.send_signal(signal.SIGHUP)
        rel = notify_socket.wait("RELOADING=1", 10, after=mark)
        assert any(x.startswith("MONOTONIC_USEC=") for x in notify_socket.messages[rel])
        notify_socket.wait("READY=1", 10, after=rel)
        _wait_log(log, "configuration reloaded from", 10)
        _wait_log(log, "DEBUG specpilot.loop: decision:", 10)  # the new log level is in force

        # SIGHUP with an invalid file: rejected with the key and why, the old config stays.
        bad = cfg.read_text().replace("[controller]\n", "[controller]\nbogus_key = 1\n", 1)
        cfg.write_text(bad)
        mark = len(notify_socket.messages)
        proc.send_signal(signal.SIGHUP)
        rel = notify_socket.wait("RELOADING=1", 10, after=mark)
        notify_socket.wait("READY=1", 10, after=rel)
        text = _wait_log(log, "reload rejected, keeping the old configuration", 10)
        assert "controller.bogus_key" in text and "Extra inputs are not permitted" in text
        assert proc.poll() is None

        # SIGTERM: finish the tick, STOPPING=1, exit 0; without owns_server the server stays.
        mark = len(notify_socket.messages)
        assert stop_daemon(proc, signal.SIGTERM, 30) == 0
        notify_socket.wait("STOPPING=1", 5, after=mark)
        assert all(alive(p) for p in pids), "the server was stopped without owns_server"
        assert httpx.get(s.server.base_url + "/ready", timeout=5).status_code == 200
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cleanup(s, pids)

    # journald stamps lines itself: no timestamps of ours, one "LEVEL logger: message" per line.
    lines = [x for x in log.read_text().splitlines() if x.strip()]
    assert lines
    for line in lines:
        assert not re.match(r"^\d{4}-\d\d-\d\d", line), line
    levelled = [x for x in lines if re.match(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ", x)]
    assert len(levelled) >= len(lines) // 2
    # One summary line per decision that changed: the reason and the numbers behind it.
    assert any(
        re.match(r"^INFO specpilot\.loop: decision: hold baseline reason=hold_", x) for x in lines
    )


def _api(raw: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{raw['api']['port']}"


def _healthz(raw: dict[str, Any]) -> dict[str, Any] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        r = httpx.get(_api(raw) + "/healthz", timeout=2)
        if r.status_code == 200:
            return r.json()
    return None


def _wait(
    pred: Any,
    timeout_s: float,
    what: str,
    daemon: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> Any:
    """`pred()`'s first true value within `timeout_s`; a `daemon` that exits meanwhile fails at
    once. A failure shows the end of the daemon's `log`."""

    def fail(why: str) -> AssertionError:
        tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
        return AssertionError(f"{why}; the daemon's log:\n{tail}" if log else why)

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        if daemon is not None and daemon.poll() is not None:
            raise fail(f"the daemon exited ({daemon.returncode}) while waiting for {what}")
        time.sleep(0.03)
    raise fail(f"timed out waiting for {what}")


def test_sigkill_mid_switch_then_restart_adopts_and_loses_no_record(tmp_path: Path) -> None:
    raw = config(
        tmp_path,
        api={"enabled": True, "port": free_port(), "token": TOKEN},
        # 2 s real per start, so that the new server is still loading when the next
        # controller comes up.
        restart_s=200.0,
    )
    s = settings(raw)
    cfg = write_config(tmp_path / "config.toml", raw)
    pid_file = Path(s.server.pid_file)
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_daemon(cfg, log_path=first_log)
    second = None
    extra: set[int] = set()
    try:
        _wait(lambda: (_healthz(raw) or {}).get("ready"), 40, "the daemon ready", first, first_log)
        old_pid = int(pid_file.read_text())
        r = httpx.post(
            _api(raw) + "/v1/switch",
            json={"profile": "eagle3-2step", "reason": "test"},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )
        assert r.status_code == 202, r.text

        def new_server() -> int | None:
            with contextlib.suppress(OSError, ValueError):
                pid = int(pid_file.read_text())
                return pid if pid != old_pid else None
            return None

        new_pid = _wait(new_server, 20, "the new server's launch", first, first_log)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        extra.add(new_pid)
        assert not alive(old_pid) and alive(new_pid)  # the new server outlives its controller
        with reader(raw) as db:
            before_decisions = {d["id"]: d for d in db.recent_decisions(limit=10_000)}
            before_switches = {sw["id"]: sw for sw in db.switches()}
            open_ = db.open_switch()
        # Recorded before the actuator ran: the decision and the open switch survive the kill.
        assert open_ is not None and (open_["from_profile"], open_["to_profile"]) == (
            "baseline",
            "eagle3-2step",
        )
        assert before_decisions[open_["decision_id"]]["acted"] is True

        second = start_daemon(cfg, log_path=second_log)
        health = _wait(
            lambda: (h := _healthz(raw)) and h.get("ready") and h,
            40,
            "adoption",
            second,
            second_log,
        )
        assert health["profile"] == "eagle3-2step"
        # No second server: the one the killed controller launched is the one serving.
        assert server_pids(s) == {new_pid} and port_pids(s.server.port) == {new_pid}
        with reader(raw) as db:
            after_decisions = {d["id"]: d for d in db.recent_decisions(limit=10_000)}
            after_switches = {sw["id"]: sw for sw in db.switches()}
            assert db.open_switch() is None
        assert set(before_decisions) <= set(after_decisions)
        assert set(before_switches) <= set(after_switches)
        closed = after_switches[open_["id"]]
        assert closed["outcome"] == "unknown"
        assert "controller restarted during the switch" in closed["error"]
        new_rows = [sw for i, sw in after_switches.items() if i not in before_switches]
        # The second controller waited for the loading server (no launch of its own).
        assert [(sw["from_profile"], sw["to_profile"], sw["outcome"]) for sw in new_rows] in (
            [],
            [(None, "eagle3-2step", "ok")],
        )
        # SIGTERM with owns_server: the server stops with the controller.
        assert stop_daemon(second, signal.SIGTERM, 30) == 0
        assert not alive(new_pid) and not port_pids(s.server.port)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        cleanup(s, extra)


def test_second_daemon_whose_api_cannot_bind_leaves_the_running_server_alone(
    tmp_path: Path,
) -> None:
    """`specpilot run` beside a daemon already running (its server up, its API on the port):
    exit 1 with a one-line error, and the server it would have adopted keeps serving."""
    with socket.socket() as api:  # the running daemon's API
        api.bind(("127.0.0.1", 0))
        api.listen()
        raw = config(tmp_path, api={"enabled": True, "port": api.getsockname()[1]})
        s = settings(raw)
        with (tmp_path / "server.log").open("ab") as out:
            server = subprocess.Popen(
                s.launch_argv("baseline"),
                env=s.launch_env("baseline"),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        pids = {server.pid}
        try:
            url = s.server.base_url + "/ready"
            _wait(lambda: _status(url) == 200, 30, "the running daemon's server")
            cfg = write_config(tmp_path / "config.toml", raw)
            log = tmp_path / "second.log"
            second = start_daemon(cfg, log_path=log)
            pids.add(second.pid)
            assert second.wait(30) == 1
            text = log.read_text()
            assert "Traceback" not in text, text
            errors = [x for x in text.splitlines() if " ERROR " in x]
            assert len(errors) == 1 and "Address already in use" in errors[0], text
            assert server.poll() is None and _status(url) == 200
        finally:
            cleanup(s, pids)
            server.wait(10)


def _status(url: str) -> int | None:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code
    return None
