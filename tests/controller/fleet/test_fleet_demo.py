"""`specpilot demo --fleet N` stopped by a signal: nothing it started outlives it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip extra 'fleet')")


def _children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is `pid`."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def _serves(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_the_fleet_demo_and_everything_it_started(
    tmp_path: Path, sig: signal.Signals
) -> None:
    out = (tmp_path / "demo.out").open("wb")
    demo = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "demo", "--fleet", "2", "--duration-s", "120"],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # its files (logs, database) stay here
    )
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(started) < 3 and time.monotonic() < deadline:  # the router and 2 replicas
            started |= _children(demo.pid)
            time.sleep(0.2)
        assert len(started) >= 3, (tmp_path / "demo.out").read_text()
        # Signalled once the replicas serve (the live table has rows): its last frame, then
        # the summary on a line of its own.
        head = (tmp_path / "demo.out").read_text()
        ports = re.search(r"on ports \[([\d, ]+)\]", head)
        assert ports, head
        for port in ports.group(1).split(", "):
            while not _serves(int(port)) and time.monotonic() < deadline:
                time.sleep(0.2)
        time.sleep(1.0)  # the loop's ticks (every 0.2 s at 50x) fill the table
        demo.send_signal(sig)
        demo.wait(timeout=90)
        left = sorted(p for p in started if _alive(p))
        assert not left, f"left running after {sig.name}: {left}"
        lines = [ln.strip() for ln in (tmp_path / "demo.out").read_text().splitlines()]
        assert "fleet demo summary" in lines  # a line of its own, not the live table's end
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
        for pid in started:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        out.close()
