"""The shipped deployment files: deploy/config.example.toml loads, and the systemd units pass
`systemd-analyze verify` and carry the settings the daemon and the actuators rely on."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller.settings import ServerSettings, load_settings
from policies.types import Mode

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# Options that would hide /dev/nvidia* or break CUDA/Triton/NCCL in SGLang, which the process
# actuator runs inside specpilot's unit.
GPU_BREAKING = (
    "PrivateDevices",
    "DevicePolicy",
    "DeviceAllow",
    "ProtectClock",
    "ProtectKernelLogs",
    "MemoryDenyWriteExecute",
    "SystemCallFilter",
    "RestrictAddressFamilies",
    "ProtectHome",
    "ProtectKernelModules",
    "PrivateUsers",
)


def directives(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;[" or "=" not in line:
            continue
        key, value = line.split("=", 1)
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_example_config_loads_in_advisory_mode() -> None:
    s = load_settings(DEPLOY / "config.example.toml")
    assert s.controller.mode is Mode.ADVISORY
    assert s.controller.time_scale == 1.0
    assert s.server.launch[-2:] == ["-m", "sglang.launch_server"]
    specs = {p.name: p for p in s.profile_specs()}
    assert set(specs) == {"baseline", "eagle3-2step", "eagle3-5step"}
    assert not specs["baseline"].speculative
    assert (specs["eagle3-2step"].num_steps, specs["eagle3-2step"].draft_tokens) == (2, 3)
    assert (specs["eagle3-5step"].num_steps, specs["eagle3-5step"].draft_tokens) == (5, 6)
    nccl = {
        "NCCL_PROTO": "LL",
        "NCCL_ALGO": "Ring",
        "NCCL_P2P_LEVEL": "SYS",
        "NCCL_MAX_NCHANNELS": "16",
        "NCCL_BUFFSIZE": "16777216",
        "NCCL_NTHREADS": "512",
    }
    for name in specs:
        env = s.launch_env(name, base={"NOTIFY_SOCKET": "/run/systemd/notify"})
        assert nccl.items() <= env.items()
        assert "NOTIFY_SOCKET" not in env
    # Same concurrency for every profile (SGLang forces 48 with speculation when unset).
    assert "--max-running-requests" in s.server.common_flags


def test_example_config_matches_the_sglang_unit() -> None:
    s = load_settings(DEPLOY / "config.example.toml")
    unit = directives(DEPLOY / "sglang@.service")
    instance = s.server.systemd_unit.split("@", 1)[1].removesuffix(".service")
    (env_file,) = unit["EnvironmentFile"]
    assert env_file.replace("%i", instance) == s.server.systemd_env_file


def test_specpilot_unit_directives() -> None:
    d = directives(DEPLOY / "specpilot.service")
    assert d["Type"] == ["notify"]
    assert d["ExecStart"] == ["specpilot run --config /etc/specpilot/config.toml"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["Restart"] == ["on-failure"]
    assert d["RestartPreventExitStatus"] == ["78"]
    assert d["StateDirectory"] == ["specpilot"]
    assert d["ConfigurationDirectory"] == ["specpilot"]
    assert "WatchdogSec" in d
    # READY=1 comes after the first good scrape: the start covers a cold start of SGLang up to
    # start_timeout_s (systemd's default 90 s killed every start of a large model).
    (start,) = d["TimeoutStartSec"]
    minutes = re.fullmatch(r"(\d+)min", start)
    assert minutes is not None, start
    assert int(minutes.group(1)) * 60 > ServerSettings().start_timeout_s
    # A stop lets a switch in flight finish: drain, stop and a start of the new server.
    (stop,) = d["TimeoutStopSec"]
    minutes = re.fullmatch(r"(\d+)min", stop)
    srv = ServerSettings()
    assert minutes is not None, stop
    assert int(minutes.group(1)) * 60 > (
        srv.drain_timeout_s + srv.stop_timeout_s + srv.start_timeout_s
    )
    assert d["NoNewPrivileges"] == ["yes"]
    assert not [k for k in GPU_BREAKING if k in d]


def test_sglang_unit_directives() -> None:
    d = directives(DEPLOY / "sglang@.service")
    assert d["ExecStart"] == ["/bin/sh -c 'eval \"exec $$SGLANG_LAUNCH $$SGLANG_ARGS\"'"]
    assert d["KillMode"] == ["control-group"]
    assert not [k for k in GPU_BREAKING if k in d]


@pytest.mark.parametrize("unit", ["specpilot.service", "sglang@.service"])
def test_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    text = (DEPLOY / unit).read_text()
    # systemd resolves a bare `specpilot` on its own search path (/usr/local/bin...), where this
    # checkout is not installed: point it at this interpreter's entry point for the check.
    entry = Path(sys.executable).with_name("specpilot")
    text = text.replace(
        "ExecStart=specpilot ", f"ExecStart={entry if entry.exists() else '/bin/true'} "
    )
    (tmp_path / unit).write_text(text)
    name = "sglang@specpilot.service" if unit.startswith("sglang@") else unit
    r = subprocess.run(
        [tool, "verify", name], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    if r.returncode != 0 and "Failed to initialize" in r.stderr + r.stdout:
        pytest.skip(f"systemd-analyze cannot run here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr + r.stdout
    assert r.stderr.strip() == "", r.stderr
