"""Helpers for the simulator server tests: an in-process simulation behind httpx's ASGI transport,
and a real `python -m simulator` subprocess on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from simulator.__main__ import build_workloads, startup_times
from simulator.engine import StepEngine
from simulator.faults import Faults
from simulator.flags import parse_args, spec_config
from simulator.metrics import SimMetrics
from simulator.model import CostScale, load_profile
from simulator.server import Simulation, create_app

ROOT = Path(__file__).resolve().parents[2]
TSV = Path("/work/shared/data/sglang-0.5.23-metrics.tsv")
EAGLE2 = [
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-draft-model-path",
    "draft",
    "--speculative-num-steps",
    "2",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "3",
]
LABELS = [
    "--tokenizer-metrics-custom-labels-header",
    "x-custom-labels",
    "--tokenizer-metrics-allowed-custom-labels",
    "workload",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class InProcess:
    sim: Simulation
    client: httpx.AsyncClient


@contextlib.asynccontextmanager
async def in_process(
    argv: Sequence[str], *, speed: float = 2000.0, device_timer: bool = False, up: bool = True
) -> AsyncIterator[InProcess]:
    """A Simulation with its decode loop running in this event loop, served over ASGI."""
    args = parse_args(["--model-path", "kimi", "--sim-speed", str(speed), *argv])
    profile = load_profile(args.sim_profile, args.sim_overrides or None)
    spec = spec_config(args)
    workloads = build_workloads(args)
    max_running = args.max_running_requests or profile.max_running_requests(spec)
    metrics = SimMetrics(args, device_timer=device_timer)

    def engine(dp: int) -> StepEngine:
        return StepEngine(
            profile,
            spec,
            workloads,
            seed=args.sim_seed + dp,
            max_running_requests=max_running,
            scale=CostScale(**args.sim_cost_scale),
        )

    phases = profile.restart_phases_s(spec)
    startup = startup_times(phases)
    sim = Simulation(
        args,
        profile,
        spec,
        engine,
        metrics,
        faults=Faults.from_flags(args.faults, spec),
        startup_phases=startup,
    )
    metrics.emit_startup(startup, {"decode": phases["cuda_graph"]})
    if up:
        sim.status = "up"
    task = asyncio.create_task(sim.run())
    transport = httpx.ASGITransport(app=create_app(sim))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=30) as c:
        try:
            yield InProcess(sim, c)
        finally:
            sim.stop()
            await asyncio.wait_for(task, 5)


class SimProcess:
    """`python -m simulator` on a free port; stopped (by its pid) when the test ends."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "simulator", "--model-path", "kimi", "--port",
               str(self.port), *argv]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def port_open(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def wait_bound(self, timeout_s: float = 20.0) -> float:
        """Wall seconds until the port accepts connections."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise AssertionError(f"simulator exited {self.proc.returncode}: {self.output()}")
            if self.port_open():
                return time.monotonic() - t0
            time.sleep(0.02)
        raise AssertionError("simulator did not bind in time")

    def wait_up(self, timeout_s: float = 20.0) -> None:
        self.wait_bound(timeout_s)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.02)
        raise AssertionError("simulator did not become healthy")

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        out, _ = self.proc.communicate()
        return out or ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def sim_process() -> Iterator[type[SimProcess]]:
    started: list[SimProcess] = []

    class Tracked(SimProcess):
        def __init__(self, argv: Sequence[str], **kw: dict[str, str]) -> None:
            super().__init__(argv, **kw)
            started.append(self)

    yield Tracked
    for p in started:
        p.stop()


def tsv_families() -> dict[str, str]:
    """name (as exposed, counters with _total) -> type, from the shared TSV."""
    out = {}
    for line in TSV.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, typ, _ = line.split("\t")
        out[name] = typ
    return out
