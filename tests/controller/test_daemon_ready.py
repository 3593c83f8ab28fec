"""READY=1 waits for the first good scrape: against a simulator whose /metrics is broken the
daemon (build + serve in this process, notifying a real AF_UNIX datagram socket) sends WATCHDOG=1
and STATUS= every tick but never READY=1; past scrape_error_limit the target counts as down, the
status says so, and outside a trial the loop holds (no restart of a server that runs)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller import notify
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
