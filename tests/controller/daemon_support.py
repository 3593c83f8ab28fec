"""Shared helpers of the loop, daemon and end-to-end tests: configurations for the real simulator
at high speed, an in-process daemon (controller.daemon.build + serve) with a load, a daemon run as
a subprocess (`specpilot run --config FILE`), store reads, and a teardown that leaves no process
behind (killed by pid, never by name).

Every *_s in these configurations is server time: at SPEED 100 one real second is 100 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from controller.daemon import Daemon, build, serve
from controller.demo_server import SIM_PROFILE
from controller.loop import Controller
from controller.settings import Settings, settings_from_dict
from simulator.load import LoadGenerator
from store import Reader
from tests.controller.actuator_fakes.support import (
    alive,
    free_port,
    kill_everything,
    port_pids,
    python_env,
)

SPEED = 100.0
DRAFT = ["--speculative-draft-model-path", "lightseekorg/kimi-k2.5-eagle3"]


def eagle(steps: int) -> list[str]:
    return [
        "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1),
    ]  # fmt: skip


ALL_PROFILES: dict[str, dict[str, Any]] = {
    "baseline": {"flags": []},
    "eagle3-2step": {"flags": eagle(2)},
    "eagle3-5step": {"flags": eagle(5)},
}

# Decisions within a few real seconds: a 30 s dwell and restart prior (the simulator restarts in
# 20 s of server time plus Python's start-up), 3-window estimates as by default.
FAST_POLICY: dict[str, Any] = {"min_dwell_s": 30.0, "restart_prior_s": 30.0}


def config(
    tmp_path: Path,
    *,
    profiles: Mapping[str, Mapping[str, Any]] | None = None,
    fault_flags: list[str] | None = None,
    controller: Mapping[str, Any] | None = None,
    server: Mapping[str, Any] | None = None,
    policy: Mapping[str, Any] | None = None,
    api: Mapping[str, Any] | None = None,
    speed: float = SPEED,
    restart_s: float = 20.0,
) -> dict[str, Any]:
    """A config.toml (as a dict) for the simulator on a free port, in tmp_path."""
    ctl: dict[str, Any] = {
        "mode": "active",
        "poll_interval_s": 10.0,
        "database": str(tmp_path / "specpilot.db"),
        "log_level": "info",
        "time_scale": speed,
        "scrape_timeout_s": 100.0,  # 1 s real: a loaded 2-core box answers late at times
    }
    ctl.update(controller or {})
    srv: dict[str, Any] = {
        "actuator": "process",
        "host": "127.0.0.1",
        "port": free_port(),
        "launch": ["{python}", "-m", "simulator"],
        "common_flags": [
            "--model-path",
            "moonshotai/Kimi-K2.5",
            "--enable-metrics",
            "--max-running-requests",
            "64",
            "--sim-profile",
            SIM_PROFILE,
            "--sim-speed",
            f"{speed:g}",
            "--sim-override",
            f"restart_s={restart_s:g}",
            *(fault_flags or []),
        ],
        # One thread per server process: a killed multi-threaded process shows as a zombie
        # while its last thread still holds the port for a moment (see the report).
        "env": {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        "initial_profile": "baseline",
        "owns_server": True,
        "start_timeout_s": 1500.0,  # 15 s real: Python starts slowly on a loaded machine
        "drain_timeout_s": 30.0,
        # The simulator's SIGTERM waits for its in-server load; SIGKILL after 0.5 s real.
        "stop_timeout_s": 50.0,
        "crash_backoff_s": 50.0,
        "crash_backoff_max_s": 1000.0,
        "pid_file": str(tmp_path / "server.pid"),
        "log_file": str(tmp_path / "server.log"),
    }
    srv.update(server or {})
    return {
        "controller": ctl,
        "api": {"enabled": False, "host": "127.0.0.1", "port": 0, **(api or {})},
        "server": srv,
        "policy": {**FAST_POLICY, **(policy or {})},
        "profiles": {k: dict(v) for k, v in (profiles or ALL_PROFILES).items()},
    }


def settings(raw: Mapping[str, Any]) -> Settings:
    return settings_from_dict(raw, source="test")


def write_config(path: Path, raw: Mapping[str, Any]) -> Path:
    path.write_text(tomli_w.dumps(dict(raw)))
    return path


def reader(raw: Mapping[str, Any]) -> Reader:
    return Reader(raw["controller"]["database"])


def server_pids(s: Settings) -> set[int]:
    """Every process that may be a server of this configuration: listening on its port, or named
    by its pid file."""
    pids = set(port_pids(s.server.port))
    with contextlib.suppress(OSError, ValueError):
        pids.add(int(Path(s.server.pid_file).read_text().strip()))
    return {p for p in pids if alive(p)}


def cleanup(s: Settings, extra: set[int] | None = None) -> None:
    kill_everything(server_pids(s) | (extra or set()))


async def wait_for(
    pred: Callable[[], Any],
    timeout_s: float,
    what: str,
    step: float = 0.05,
    db: Mapping[str, Any] | None = None,
) -> Any:
    """Poll `pred` (real seconds) until it returns something truthy. On a timeout the message
    carries the switches and the last decisions of `db` (a config), to say what happened."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        await asyncio.sleep(step)
    story = ""
    if db is not None:
        with reader(db) as r:
            sw = [
                f"{x['from_profile']}->{x['to_profile']} {x['reason']} {x['outcome']}"
                for x in reversed(r.switches())
            ]
            ds = [
                f"{d['action']} {d['profile']} {d['reason']}"
                for d in reversed(r.recent_decisions(limit=12))
            ]
        story = f"\nswitches: {sw}\nlast decisions: {ds}"
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{story}")


@dataclass
class Running:
    """An in-process daemon the test drives."""

    daemon: Daemon
    settings: Settings
    load: LoadGenerator | None
    ticks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ctl(self) -> Controller:
        return self.daemon.controller


@contextlib.asynccontextmanager
async def running_daemon(
    raw: Mapping[str, Any],
    *,
    concurrency: int = 1,
    mix: Mapping[str, float] | None = None,
    on_tick: Callable[[Controller], None] | None = None,
    keep_server: bool = False,
) -> AsyncIterator[Running]:
    """build() + serve() in this event loop with a closed-loop load (inside the simulator, which
    keeps up at high speed) once a server runs; stops cleanly on exit and kills whatever server
    is left (by pid) unless `keep_server` (the test cleans up then)."""
    s = settings(raw)
    daemon = await build(s)
    stop = asyncio.Event()
    load = (
        LoadGenerator(s.server.base_url, concurrency=concurrency, mix=mix, route="internal")
        if concurrency
        else None
    )
    run = Running(daemon, s, load)

    def tick(c: Controller) -> None:
        d = c.last_decision
        run.ticks.append(
            {
                "t": c.clock.now(),
                "profile": c.running,
                "action": d.action.value if d else None,
                "reason": d.reason.value if d else None,
            }
        )
        if on_tick is not None:
            on_tick(c)

    async def drive_load() -> None:
        if load is None:
            return
        while daemon.controller.running is None and not stop.is_set():
            await asyncio.sleep(0.02)
        if stop.is_set():
            return
        task = asyncio.create_task(load.run())
        await stop.wait()
        await load.stop()
        await task

    served = asyncio.create_task(serve(daemon, stop=stop, on_tick=tick, install_signals=False))
    loader = asyncio.create_task(drive_load())
    try:
        await wait_for(lambda: served.done() or daemon.controller.state is not None, 30, "startup")
        if served.done():
            served.result()  # raise what startup raised
        yield run
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(loader, 10)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(served, 30)
        if not keep_server:
            cleanup(s)


# ------------------------------------------------------------------------------- subprocess
# The installed console script, as systemd runs it (the module when it is not installed).
_SCRIPT = Path(sys.executable).with_name("specpilot")
SPECPILOT = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "controller.cli"]


def start_daemon(
    config_path: Path, env: Mapping[str, str] | None = None, log_path: Path | None = None
) -> subprocess.Popen[bytes]:
    """`specpilot run --config FILE` as a child; stderr goes to `log_path` (a file, not a pipe,
    so that nothing blocks when the test does not read it)."""
    full_env = python_env()
    full_env.update(env or {})
    log = (log_path or config_path.with_suffix(".log")).open("ab")
    try:
        return subprocess.Popen(
            [*SPECPILOT, "run", "--config", str(config_path)],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


def stop_daemon(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 30
) -> int:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
