"""Record exposition fixtures from the real `python -m simulator` CLI into tests/fixtures/.

Run from the repository root: `.venv/bin/python -m tests.simulator.record_fixtures`. Each
fixture starts with comment lines giving the exact launch command and load; the observation
code's tests read them as recorded SGLang 0.5.23-shaped text (the simulator's, not a real
server's). test_fixtures.py checks the committed files.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from pathlib import Path

import httpx

from simulator.load import run_load
from tests.simulator.conftest import EAGLE2, LABELS, SimProcess

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
COMMON = ["--enable-metrics", "--sim-override", "restart_s=100", "--sim-speed", "100", *LABELS]
SIX = ["--sim-workload", "sql=0.75:300", "--sim-workload", "summarize=0.6:250",
       "--sim-workload", "translate=0.7:350"]  # fmt: skip
RECORDINGS = [
    ("sim-baseline", [*COMMON, "--max-running-requests", "48"], "chat=0.5,code=0.5", {}),
    ("sim-eagle3-2step-workloads", [*COMMON, *EAGLE2], "chat=0.4,code=0.3,math=0.3", {}),
    (
        "sim-eagle3-2step-tp8-allsched-6workloads",
        [*COMMON, *EAGLE2, *SIX, "--tp-size", "8", "--ep-size", "8",
         "--enable-metrics-for-all-schedulers"],
        "chat=1,code=1,math=1,sql=1,summarize=1,translate=1",
        {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"},
    ),
]  # fmt: skip
CONCURRENCY = 24
LOAD_S = 3.0


def record(name: str, argv: list[str], mix: str, env: dict[str, str]) -> None:
    p = SimProcess(argv, env=env)
    try:
        p.wait_up()
        stats = asyncio.run(run_load(p.url, CONCURRENCY, mix, LOAD_S))
        metrics = httpx.get(f"{p.url}/metrics").text
        loads = httpx.get(f"{p.url}/v1/loads", params={"include": "core,spec"}).json()
        info = httpx.get(f"{p.url}/server_info").json()
    finally:
        p.stop()
    env_text = "".join(f"{k}={v} " for k, v in env.items())
    header = (
        f"# Recorded from the simulator: {env_text}python -m simulator --model-path kimi "
        f"{shlex.join(argv)}\n"
        f"# Load: python -m simulator.load --concurrency {CONCURRENCY} --workload {mix} "
        f"--duration-s {LOAD_S:g} ({stats.ok} requests, {stats.output_tokens} tokens)\n"
    )
    (FIXTURES / f"{name}.prom").write_text(header + metrics)
    (FIXTURES / f"{name}.loads.json").write_text(json.dumps(loads, indent=1) + "\n")
    (FIXTURES / f"{name}.server_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{name}: {stats.ok} requests, {len(metrics.splitlines())} lines", file=sys.stderr)


def main() -> int:
    for name, argv, mix, env in RECORDINGS:
        record(name, argv, mix, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
