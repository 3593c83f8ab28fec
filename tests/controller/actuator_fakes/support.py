"""Shared helpers of the actuator tests: configurations for the simulator and the fake server,
free ports, and a teardown that leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from controller.actuators.endpoint import free_port
from controller.settings import Settings

HERE = Path(__file__).resolve().parent
FAKE_SGLANG = HERE / "fake_sglang.py"
FAKE_SYSTEMCTL_DIR = HERE / "bin"
FAKE_ORCHESTRATOR = HERE / "fake_orchestrator.py"
REPO = HERE.parents[2]

# The simulator runs 100x faster than real time; every *_s below is server time.
SPEED = 100.0
DRAFT = ["--speculative-draft-model-path", "lightseekorg/kimi-k2.5-eagle3"]
PROFILES: dict[str, dict[str, Any]] = {
    "baseline": {"flags": []},
    "eagle3-2step": {
        "flags": [
            "--speculative-algorithm", "EAGLE3", *DRAFT,
            "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "3",
        ],
        "env": {"NCCL_PROTO": "LL"},
    },
    "eagle3-5step": {
        "flags": [
            "--speculative-algorithm", "EAGLE3", *DRAFT,
            "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "6",
        ],
    },
}  # fmt: skip


def settings(
    tmp_path: Path,
    *,
    fake: bool = False,
    extra_flags: list[str] | None = None,
    profiles: dict[str, dict[str, Any]] | None = None,
    **server: Any,
) -> Settings:
    """A config for the simulator (or, with fake=True, the fake SGLang server) on a free port."""
    if fake:
        launch = ["{python}", str(FAKE_SGLANG)]
        common = ["--model-path", "fake"]
    else:
        launch = ["{python}", "-m", "simulator"]
        common = [
            "--model-path", "moonshotai/Kimi-K2.5", "--enable-metrics",
            "--max-running-requests", "64", "--sim-speed", f"{SPEED:g}",
            "--sim-override", "restart_s=20",
        ]  # fmt: skip
    srv: dict[str, Any] = {
        "actuator": "process",
        "host": "127.0.0.1",
        "port": free_port(),
        "launch": launch,
        "common_flags": common + (extra_flags or []),
        "start_timeout_s": 1500.0,  # 15 s real: a loaded 2-core machine starts Python slowly
        "stop_timeout_s": 200.0,
        "drain_timeout_s": 50.0,
        "pid_file": str(tmp_path / "server.pid"),
        "log_file": str(tmp_path / "server.log"),
    }
    srv.update(server)
    raw = {
        "controller": {"time_scale": SPEED, "database": str(tmp_path / "specpilot.db")},
        "server": srv,
        "profiles": profiles if profiles is not None else PROFILES,
    }
    s = Settings.model_validate(raw)
    s.profile_specs()  # the flags resolve as SGLang would
    return s


def port_pids(port: int) -> set[int]:
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {
        c.pid
        for c in conns
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
    }


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(pred: Any, timeout: float = 10.0, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def kill_everything(pids: set[int]) -> None:
    """Teardown safety net: SIGKILL the given processes and their descendants (only those, by
    pid: never by name)."""
    procs: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            procs.extend([p, *p.children(recursive=True)])
    for p in procs:
        with contextlib.suppress(psutil.Error, OSError):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=5)


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHON", sys.executable)
    return env
