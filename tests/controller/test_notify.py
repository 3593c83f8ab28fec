"""systemd notify protocol over a real AF_UNIX datagram socket (path and abstract)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller import notify
from controller.notify import Notifier


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield sock, path
    sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"specpilot-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    yield sock, "@" + name
    sock.close()


def recv(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_messages_reach_a_path_socket(path_socket: tuple[socket.socket, str]) -> None:
    sock, addr = path_socket
    n = Notifier({"NOTIFY_SOCKET": addr})
    assert n.enabled
    assert n.ready(status="profile baseline,  3 profiles\nok")
    assert recv(sock) == ["READY=1", "STATUS=profile baseline, 3 profiles ok"]
    assert n.watchdog()
    assert recv(sock) == ["WATCHDOG=1"]
    assert n.status("switching to eagle3-2step")
    assert recv(sock) == ["STATUS=switching to eagle3-2step"]
    assert n.stopping()
    assert recv(sock) == ["STOPPING=1"]
    assert n.reloading()
    msg = recv(sock)
    assert msg[0] == "RELOADING=1" and msg[1].startswith("MONOTONIC_USEC=")
    usec = int(msg[1].split("=")[1])
    assert abs(usec - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000) < 5_000_000


def test_messages_reach_an_abstract_socket(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, addr = abstract_socket
    n = Notifier({"NOTIFY_SOCKET": addr})
    assert n.ready()
    assert recv(sock) == ["READY=1"]


def test_no_socket_is_a_no_op() -> None:
    n = Notifier({})
    assert not n.enabled
    assert n.ready() is False and n.watchdog() is False
    assert n.watchdog_interval_s() is None


def test_a_vanished_socket_is_logged_not_raised(tmp_path: Path) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert n.enabled and n.ready() is False


def test_unsupported_address_is_ignored() -> None:
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "x"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert Notifier(env).watchdog_interval_s() == expected


def test_module_level_notify_uses_the_environment(
    path_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, addr = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    notify.reset_default()
    try:
        assert notify.notify("READY=1", "STATUS=up")
        assert recv(sock) == ["READY=1", "STATUS=up"]
        assert notify.notify("RELOADING=1")
        msg = recv(sock)
        assert msg[0] == "RELOADING=1" and msg[1].startswith("MONOTONIC_USEC=")
    finally:
        notify.reset_default()
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify.notify("READY=1") is False
    notify.reset_default()


async def test_watchdog_task_pings_while_healthy(path_socket: tuple[socket.socket, str]) -> None:
    sock, addr = path_socket
    n = Notifier({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "100000"})  # ping every 0.05 s
    healthy = [True]
    task = asyncio.create_task(notify.watchdog_task(lambda: healthy[0], n))
    await asyncio.sleep(0.18)
    healthy[0] = False
    await asyncio.sleep(0.02)
    sock.setblocking(False)
    pings = []
    while True:
        try:
            pings.append(sock.recv(64))
        except BlockingIOError:
            break
    assert 1 <= len(pings) <= 5 and set(pings) == {b"WATCHDOG=1"}
    await asyncio.sleep(0.15)  # unhealthy: no more pings
    with pytest.raises(BlockingIOError):
        sock.recv(64)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_watchdog_task_returns_when_off() -> None:
    await asyncio.wait_for(notify.watchdog_task(lambda: True, Notifier({})), 1.0)
