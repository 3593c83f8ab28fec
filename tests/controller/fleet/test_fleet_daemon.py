"""`specpilot run` with a [fleet] table (controller.daemon.serve_fleet): what it leaves behind.

A second specpilot on the same deployment is refused before it touches anything (it would
adopt the first one's replicas and stop them on its way out), and a start-up that fails stops
the router it launched (nobody would ever stop it otherwise), as does a SIGTERM during the
start-up, which does not wait for the replicas' cold start. SIGHUP (`systemctl reload`) does
not end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip extra 'fleet')")

from controller.actuators.endpoint import free_ports
from controller.actuators.proctree import port_owner
from controller.clock import ScaledClock
from controller.daemon import serve_fleet
from controller.fleet.demo import fleet_sim_settings
from controller.fleet.router import RouterClient
from controller.settings import Settings
from store import StoreError

SPEED = 100.0


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    settings, fleet = fleet_sim_settings(
        replicas=2, speed=SPEED, workdir=tmp_path, restart_s=30.0, **kw
    )
    return settings.model_copy(update={"fleet": fleet})


async def _router_answers(settings: Settings) -> bool:
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        router = RouterClient(client, settings.fleet.router.base_url, ScaledClock(1.0))
        return await router.alive()


async def test_a_second_fleet_daemon_on_the_same_database_touches_nothing(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from store import writer_lock; "
            f"lock = writer_lock({settings.controller.database!r}); "
            "print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(StoreError, match="in use by another specpilot"):
            await asyncio.wait_for(serve_fleet(settings), timeout=60)
        assert not await _router_answers(settings), "no router launched"
        assert not list(tmp_path.glob("server.replica*.log")), "no replica launched"
    finally:
        holder.kill()
        holder.wait(timeout=10)


async def test_a_fleet_start_up_that_fails_stops_the_router_it_launched(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    broken = settings.server.model_copy(
        update={"common_flags": [*settings.server.common_flags, "--sim-profile", "no-such"]}
    )
    settings = settings.model_copy(update={"server": broken})
    try:
        with pytest.raises(RuntimeError, match="fleet could not start"):
            await asyncio.wait_for(serve_fleet(settings), timeout=120)
        assert not await _router_answers(settings), "the router specpilot launched still runs"
    finally:
        pid = port_owner(settings.fleet.router.port)
        if pid is not None:  # a router left behind: not ours to leave on this machine
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _fleet_config(tmp_path: Path) -> Path:
    """A config.toml of 2 simulator replicas behind a router specpilot launches."""
    *ports, router_port = free_ports(3)
    path = tmp_path / "fleet.toml"
    path.write_text(
        f"""
[controller]
database = "{tmp_path / "fleet.db"}"
time_scale = {SPEED}
poll_interval_s = 10.0
log_level = "info"

[server]
launch = ["{{python}}", "-m", "simulator"]
common_flags = ["--model-path", "moonshotai/Kimi-K2.5", "--enable-metrics",
  "--sim-profile", "kimi-k2.5-pcie-tuned", "--sim-speed", "{SPEED:g}",
  "--sim-override", "restart_s=30"]
initial_profile = "baseline"
owns_server = true
log_file = "{tmp_path / "server.log"}"

[profiles.baseline]
flags = []

[fleet]
replicas = 2
ports = {ports}

[fleet.router]
port = {router_port}
log_file = "{tmp_path / "router.log"}"
"""
    )
    return path


def _wait_for(path: Path, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def _daemon(config: Path, out: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`specpilot run --config config`, its output in `out`; killed if it outlives the block."""
    with out.open("wb") as fh:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", "run", "--config", str(config)],
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        yield daemon
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=10)


def test_sighup_does_not_end_a_fleet_daemon(tmp_path: Path) -> None:
    config = _fleet_config(tmp_path)
    out = tmp_path / "daemon.out"
    try:
        with _daemon(config, out) as daemon:
            assert _wait_for(out, "fleet up", 60), out.read_text()
            daemon.send_signal(signal.SIGHUP)
            assert _wait_for(out, "does not reload", 10), out.read_text()
            time.sleep(1.0)
            assert daemon.poll() is None, f"SIGHUP ended the daemon: {out.read_text()}"
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=90) == 0
    finally:
        left = _stop_what_serves(_ports_of(config))
    assert not left, f"left running: {left}"


def _stop_what_serves(ports: list[int]) -> dict[int, int]:
    """Kill whatever still serves `ports` (left behind by the daemon), or was launched to and
    has not bound its port yet (a replica in its cold start); {port: pid} of those."""
    left = {}
    for port in ports:
        pid = port_owner(port)
        if pid is None:
            pid = next((p.pid for p in psutil.process_iter(["cmdline"]) if _on(p, port)), None)
        if pid is not None:
            left[port] = pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    return left


def _on(proc: psutil.Process, port: int) -> bool:
    """Whether `proc` was launched with `--port port`."""
    cmd = proc.info["cmdline"] or []
    return any(a == "--port" and b == str(port) for a, b in itertools.pairwise(cmd))


def _ports_of(config: Path) -> list[int]:
    """The replica and router ports of a config written by _fleet_config."""
    fleet = tomllib.loads(config.read_text())["fleet"]
    return [*fleet["ports"], fleet["router"]["port"]]


def test_sigterm_during_a_fleet_start_up_does_not_wait_for_the_replicas(tmp_path: Path) -> None:
    """The replicas' cold start (here 50 minutes of server time, 30 s real at 100x; 15 minutes
    of start_timeout_s by default) is not waited out: the daemon exits 0 at once and stops the
    router it launched. The replicas, not yet this daemon's, are left for the next one."""
    config = _fleet_config(tmp_path)
    config.write_text(config.read_text().replace("restart_s=30", "restart_s=3000"))
    out = tmp_path / "daemon.out"
    try:
        with _daemon(config, out) as daemon:
            deadline = time.monotonic() + 30
            while not list(tmp_path.glob("server.replica*.log")) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert list(tmp_path.glob("server.replica*.log")), out.read_text()
            time.sleep(0.5)
            assert daemon.poll() is None, out.read_text()
            t0 = time.monotonic()
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=30) == 0, out.read_text()
            assert time.monotonic() - t0 < 4.0, "the stop waited for the replicas' start"
            assert "stop requested during start-up" in out.read_text()
            assert "fleet up" not in out.read_text()
            assert port_owner(_ports_of(config)[-1]) is None, "the router specpilot launched runs"
    finally:
        _stop_what_serves(_ports_of(config))
