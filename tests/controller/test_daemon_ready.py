"""READY=1 waits for the first good scrape: against a simulator whose /metrics is broken the
daemon (build + serve in this process, notifying a real AF_UNIX datagram socket) sends WATCHDOG=1
and STATUS= every tick but never READY=1; past scrape_error_limit the target counts as down, the
status says so, and outside a trial the loop holds (no restart of a server that runs).
A SIGHUP reload that rejects its file (not UTF-8) or fails keeps the old configuration and
always follows RELOADING=1 with READY=1 (systemd would otherwise stay "reloading")."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from controller import daemon as daemon_mod
from controller import notify
from controller.daemon import Daemon, reload_config
from tests.controller.daemon_support import config, reader, running_daemon, wait_for


@pytest.fixture
def notify_sock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    notify.reset_default()
    yield sock
    sock.close()
    monkeypatch.delenv("NOTIFY_SOCKET")
    notify.reset_default()


def received(sock: socket.socket, into: list[str]) -> list[str]:
    while True:
        try:
            into.extend(sock.recv(65536).decode().split("\n"))
        except BlockingIOError:
            return into


async def test_no_ready_without_a_good_scrape_and_status_says_target_down(
    tmp_path: Path, notify_sock: socket.socket
) -> None:
    raw = config(
        tmp_path,
        fault_flags=["--sim-fault-metrics", "garbage"],
        controller={"scrape_error_limit": 3},
    )
    lines: list[str] = []
    async with running_daemon(raw, concurrency=0) as run:
        await wait_for(lambda: run.ctl.scrape_errors >= 5, 20, "failed scrapes", db=raw)
        received(notify_sock, lines)
        assert "READY=1" not in lines
        assert lines.count("WATCHDOG=1") >= 5
        status = [x for x in lines if x.startswith("STATUS=")]
        assert "target down: " in status[-1] and "consecutive failed scrapes" in status[-1]
        st = run.ctl.status()
        assert st["ready"] is False and st["target"]["up"] is False
        assert st["target"]["consecutive_scrape_errors"] >= 5
        assert run.ctl.running == "baseline"
    with reader(raw) as r:
        assert len(r.switches()) == 1  # the start only: no restart for a monitoring fault
        reasons = {d["reason"] for d in r.recent_decisions(limit=100)}
    assert "hold_scrape_failed" in reasons
    received(notify_sock, lines)
    assert "STOPPING=1" in lines and "READY=1" not in lines


def _reloadable(cfg: Path) -> Daemon:
    """What reload_config reads of a daemon whose config file is rejected: its path and the
    status line READY=1 carries."""
    ctl = SimpleNamespace(status_line=lambda: "profile=baseline mode=active last=-")
    return cast(Daemon, SimpleNamespace(config_path=cfg, controller=ctl))


def test_reload_of_a_file_that_is_not_utf8_keeps_the_config_and_sends_ready(
    tmp_path: Path, notify_sock: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "config.toml"
    text = b"[controller]\nmode = 'active' # \xff\n[profiles.baseline]\n"
    cfg.write_bytes(text)
    assert reload_config(_reloadable(cfg)) is False
    lines = received(notify_sock, [])
    assert lines.index("RELOADING=1") < lines.index("READY=1")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        "reload rejected, keeping the old configuration: "
        f"{cfg}: not UTF-8 text (byte 0xff at offset {text.index(0xFF)}); TOML must be UTF-8"
    ]


def test_reload_that_fails_unexpectedly_still_sends_ready(
    tmp_path: Path, notify_sock: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(path: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(daemon_mod, "load_settings", broken)
    assert reload_config(_reloadable(tmp_path / "config.toml")) is False
    lines = received(notify_sock, [])
    assert lines.index("RELOADING=1") < lines.index("READY=1")


def test_reload_before_ready_sends_neither(tmp_path: Path, notify_sock: socket.socket) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_bytes(b"\xff")
    assert reload_config(_reloadable(cfg), ready=False) is False
    lines = received(notify_sock, [])
    assert "RELOADING=1" not in lines and "READY=1" not in lines
