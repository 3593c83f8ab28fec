"""systemd's notify protocol (sd_notify(3)): READY=1, WATCHDOG=1, STATUS=, STOPPING=1, RELOADING=1.

Owns the datagram to $NOTIFY_SOCKET (a path, or an abstract socket written with a leading '@')
and the watchdog interval from $WATCHDOG_USEC (honouring $WATCHDOG_PID). Without NOTIFY_SOCKET
every call is a no-op, so the daemon runs the same under systemd, in a container or in a test.
A small module of our own: the PyPI packages are unmaintained (sdnotify, last release 2017) or
need libsystemd at build time (systemd-python, cysystemd). Must not decide when to notify (the
daemon does) and must never raise into the caller for a lost notification.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def _address(raw: str) -> str | bytes | None:
    if not raw:
        return None
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()  # abstract namespace
    if raw.startswith("/"):
        return raw
    return None  # vsock: and other address families are not supported


class Notifier:
    """Sends notifications to the service manager. `enabled` is False outside systemd."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address = _address(raw)
        if raw and self.address is None:
            log.warning("NOTIFY_SOCKET=%r is not a path or an abstract socket: ignored", raw)
        self._watchdog_usec = _watchdog_usec(env)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1: half of WatchdogSec (sd_watchdog_enabled(3)), or None
        when the watchdog is off for this process."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 1e6 / 2

    def notify(self, **fields: str | int) -> bool:
        """Send KEY=VALUE lines in one datagram. Returns whether it was sent."""
        return self.send_raw("\n".join(f"{k.upper()}={v}" for k, v in fields.items()))

    def send_raw(self, text: str) -> bool:
        """Send `text` (newline-separated KEY=VALUE) as one datagram."""
        if self.address is None or not text:
            return False
        payload = text.encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                sock.sendall(payload)
        except OSError as e:
            log.warning("sd_notify %s failed: %s", payload[:60], e)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        fields: dict[str, str | int] = {"READY": 1}
        if status:
            fields["STATUS"] = _one_line(status)
        return self.notify(**fields)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def status(self, text: str) -> bool:
        return self.notify(STATUS=_one_line(text))

    def stopping(self, status: str | None = None) -> bool:
        fields: dict[str, str | int] = {"STOPPING": 1}
        if status:
            fields["STATUS"] = _one_line(status)
        return self.notify(**fields)

    def reloading(self) -> bool:
        """RELOADING=1 with MONOTONIC_USEC (systemd >= 253 needs the timestamp to match the
        reload to its READY=1); send ready() when the reload is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(RELOADING=1, MONOTONIC_USEC=usec)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    raw = env.get("WATCHDOG_USEC", "")
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None  # the watchdog is meant for another process (sd_watchdog_enabled)
    return usec


_default: Notifier | None = None


def default() -> Notifier:
    """The process-wide Notifier, built from the environment at first use."""
    global _default
    if _default is None:
        _default = Notifier()
    return _default


def reset_default() -> None:
    """Forget the process-wide Notifier (tests that change NOTIFY_SOCKET)."""
    global _default
    _default = None


def notify(*states: str) -> bool:
    """sd_notify(0, "READY=1\\nSTATUS=..."): send raw KEY=VALUE states in one datagram through the
    process-wide Notifier. RELOADING=1 gets its MONOTONIC_USEC when the caller gave none."""
    lines = [_one_line(s) for s in states if s]
    if any(s == "RELOADING=1" for s in lines) and not any(
        s.startswith("MONOTONIC_USEC=") for s in lines
    ):
        lines.append(f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
    return default().send_raw("\n".join(lines))


async def watchdog_task(healthy: Callable[[], bool], notifier: Notifier | None = None) -> None:
    """Send WATCHDOG=1 every half WatchdogSec (real time, systemd's) while `healthy()` (e.g. the
    loop ticked recently, allowing for a switch in progress) is true; returns at once when the
    watchdog is off. Run it as its own task, so that a long switch does not starve it."""
    n = notifier or default()
    interval = n.watchdog_interval_s()
    if interval is None or not n.enabled:
        return
    while True:
        if healthy():
            n.watchdog()
        await asyncio.sleep(interval)
