"""The process actuator against a real SGLang 0.5.23 server on a GPU host.

Skipped unless SPECPILOT_REAL_PYTHON (an interpreter with sglang==0.5.23) and
SPECPILOT_REAL_MODEL (a model path or hub id the host can load) are set and `nvidia-smi` exists;
see README.md beside this file. specpilot itself never imports sglang: the server is launched
as `$SPECPILOT_REAL_PYTHON -m sglang.launch_server` exactly as the daemon would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psutil
import pytest

from controller.actuators import SwitchOutcome, make_actuator
from controller.actuators.process import ProcessActuator
from controller.clock import ScaledClock
from controller.settings import Settings

PYTHON = os.environ.get("SPECPILOT_REAL_PYTHON", "")
MODEL = os.environ.get("SPECPILOT_REAL_MODEL", "")
DRAFT = os.environ.get("SPECPILOT_REAL_DRAFT", "")  # EAGLE-3 draft for MODEL; no draft: no switch
TP = os.environ.get("SPECPILOT_REAL_TP", "1")
PORT = int(os.environ.get("SPECPILOT_REAL_PORT", "31000"))
START_TIMEOUT_S = float(os.environ.get("SPECPILOT_REAL_START_TIMEOUT_S", "1800"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (PYTHON and MODEL and shutil.which("nvidia-smi")),
        reason="needs SPECPILOT_REAL_PYTHON, SPECPILOT_REAL_MODEL and a GPU (see README.md)",
    ),
]


def real_settings(tmp_path: Path) -> Settings:
    profiles: dict[str, dict[str, list[str]]] = {"baseline": {"flags": []}}
    if DRAFT:
        profiles["eagle3-2step"] = {
            "flags": [
                "--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", DRAFT,
                "--speculative-num-steps", "2",
                "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", "3",
            ]
        }  # fmt: skip
    return Settings.model_validate(
        {
            "server": {
                "actuator": "process",
                "port": PORT,
                "launch": [PYTHON, "-m", "sglang.launch_server"],
                "common_flags": [
                    "--model-path",
                    MODEL,
                    "--tp-size",
                    TP,
                    "--enable-metrics",
                    "--max-running-requests",
                    "16",
                    "--trust-remote-code",
                ],
                "start_timeout_s": START_TIMEOUT_S,
                "stop_timeout_s": 60.0,
                "drain_timeout_s": 10.0,
                "pid_file": str(tmp_path / "sglang.pid"),
                "log_file": str(tmp_path / "sglang.log"),
            },
            "profiles": profiles,
        }
    )


def gpu_pids() -> set[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {int(x) for x in out.split() if x.strip().isdigit()}


@pytest.fixture
async def actuator(tmp_path: Path) -> AsyncIterator[ProcessActuator]:
    async with httpx.AsyncClient(trust_env=False) as client:
        act = make_actuator(real_settings(tmp_path), ScaledClock(1.0), client)
        assert isinstance(act, ProcessActuator)
        try:
            yield act
        finally:
            await act.shutdown()
            print((tmp_path / "sglang.log").read_text()[-3000:])


async def test_start_identify_switch_and_stop_a_real_server(actuator: ProcessActuator) -> None:
    assert not (await actuator.probe()).up, f"something already listens on port {PORT}"
    r = await actuator.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    print(f"baseline start: {r.downtime_s:.1f} s")
    state = await actuator.probe()
    assert state.profile == "baseline" and state.pid is not None
    tree = {state.pid, *(c.pid for c in psutil.Process(state.pid).children(recursive=True))}
    assert len(tree) > 1  # SGLang's scheduler / detokenizer children
    if DRAFT:
        r = await actuator.switch("eagle3-2step")
        assert r.outcome is SwitchOutcome.OK, r.error
        print(f"switch baseline -> eagle3-2step: downtime {r.downtime_s:.1f} s")
        assert r.server_args is not None
        assert r.server_args["speculative_num_draft_tokens"] == 3
        assert all(not psutil.pid_exists(p) for p in tree)  # the whole old tree is gone
        state = await actuator.probe()
        assert state.profile == "eagle3-2step"
    pid = state.pid
    await actuator.shutdown()
    assert pid is not None and not psutil.pid_exists(pid)
    assert pid not in gpu_pids()  # GPU memory released


async def test_a_bad_flag_is_start_failed_with_sglangs_message(tmp_path: Path) -> None:
    s = real_settings(tmp_path)
    bad = s.model_copy(
        update={
            "server": s.server.model_copy(
                update={"common_flags": [*s.server.common_flags, "--no-such-flag"]}
            )
        }
    )
    async with httpx.AsyncClient(trust_env=False) as client:
        act = make_actuator(bad, ScaledClock(1.0), client)
        r = await act.start("baseline")
        assert r.outcome is SwitchOutcome.START_FAILED
        assert r.error and "unrecognized arguments" in r.error  # argparse, via the log tail
        assert not await act.alive()
