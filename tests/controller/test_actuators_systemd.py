"""The systemd actuator with a fake `systemctl` on PATH that runs the shipped
deploy/sglang@.service's ExecStart= (sh + eval of the environment file) with the simulator."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.actuators import SwitchOutcome, envfile, make_actuator
from controller.actuators.systemd import SystemdActuator, env_assignments
from controller.clock import ScaledClock
from controller.settings import Settings
from tests.controller.actuator_fakes.support import (
    FAKE_SYSTEMCTL_DIR,
    PROFILES,
    REPO,
    SPEED,
    alive,
    kill_everything,
    port_pids,
    python_env,
    settings,
)

UNIT = "sglang@specpilot.service"
Factory = Callable[..., tuple[SystemdActuator, Settings]]


@pytest.fixture
async def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Factory]:
    state = tmp_path / "systemd"
    monkeypatch.setenv("PATH", f"{FAKE_SYSTEMCTL_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SYSTEMD_DIR", str(state))
    monkeypatch.setenv("FAKE_SYSTEMD_UNIT_FILE", str(REPO / "deploy" / "sglang@.service"))
    monkeypatch.setenv("FAKE_SYSTEMD_SPEED", f"{SPEED:g}")
    env_file = tmp_path / "etc" / "sglang-specpilot.env"
    monkeypatch.setenv("FAKE_SYSTEMD_ENV_FILE", str(env_file))
    client = httpx.AsyncClient(trust_env=False)
    made: list[Settings] = []

    def factory(**kw: Any) -> tuple[SystemdActuator, Settings]:
        kw.setdefault("systemd_env_file", str(env_file))
        s = settings(tmp_path, actuator="systemd", systemd_unit=UNIT, **kw)
        made.append(s)
        act = make_actuator(s, ScaledClock(SPEED), client)
        assert isinstance(act, SystemdActuator)
        return act, s

    yield factory
    proc = await asyncio.create_subprocess_exec("systemctl", "stop", UNIT)
    await proc.wait()
    await client.aclose()
    kill_everything({p for s in made for p in port_pids(s.server.port)})


def calls(tmp_path: Path) -> list[str]:
    f = tmp_path / "systemd" / "calls"
    return f.read_text().splitlines() if f.exists() else []


async def test_start_switch_and_the_environment_file(tmp_path: Path, make: Factory) -> None:
    act, s = make()
    assert not await act.alive()
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    state = await act.probe()
    assert state.up and state.profile == "baseline" and state.pid
    assert await act.alive()
    env_path = Path(s.server.systemd_env_file)
    assert stat.S_IMODE(env_path.stat().st_mode) == 0o600
    assert envfile.parse(env_path.read_text())["SPECPILOT_PROFILE"] == "baseline"
    pid0 = state.pid

    r = await act.switch("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert (r.from_profile, r.to_profile) == ("baseline", "eagle3-2step")
    assert r.downtime_s > 10.0
    assert f"restart {UNIT}" in calls(tmp_path)
    state = await act.probe()
    assert state.profile == "eagle3-2step" and state.pid != pid0
    assert not alive(pid0)
    # The profile's environment reached SGLang through the unit's EnvironmentFile.
    server_env = psutil.Process(state.pid).environ()
    assert server_env["NCCL_PROTO"] == "LL"
    assert server_env["SPECPILOT_PROFILE"] == "eagle3-2step"
    assert not any(f.name.endswith(".tmp") for f in env_path.parent.iterdir())  # atomic write


async def test_the_controller_going_away_never_stops_the_server(make: Factory) -> None:
    act, s = make()
    assert (await act.start("eagle3-2step")).outcome is SwitchOutcome.OK
    pid = (await act.probe()).pid
    await act.shutdown()
    assert pid is not None and alive(pid)
    # A new controller finds it as it is.
    again, _ = make(port=s.server.port)
    state = await again.probe()
    assert state.profile == "eagle3-2step" and state.pid == pid
    r = await again.start("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK and r.downtime_s == 0.0
    assert (await again.start("baseline")).outcome is SwitchOutcome.REFUSED_BUSY
    assert (await again.probe()).pid == pid


async def test_start_failure_reports_the_journal(make: Factory) -> None:
    act, _ = make(extra_flags=["--sim-fault-start-fail", "--sim-fault-scope", "steps=5"])
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    r = await act.switch("eagle3-5step")
    assert r.outcome is SwitchOutcome.START_FAILED
    assert "failed/failed" in (r.error or "") and "exit status 1" in (r.error or "")
    assert "CUDA out of memory" in (r.error or "")
    assert not await act.alive()
    # Rollback: the last good profile starts again.
    r = await act.switch("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.from_profile is None


async def test_crash_is_detected(make: Factory) -> None:
    # The crash timer runs from the process's start: 2 s leave the start (well under a second
    # idle) room to finish on a loaded machine, where 0.3 s sometimes did not.
    act, _ = make(extra_flags=["--sim-fault-crash-after-s", "2.0"])
    assert (await act.start("baseline")).outcome is SwitchOutcome.OK
    for _ in range(200):
        if not await act.alive():
            break
        await asyncio.sleep(0.05)
    assert not await act.alive()


async def test_hang_at_start_hits_the_deadline(make: Factory) -> None:
    act, _ = make(extra_flags=["--sim-fault-hang-start"], start_timeout_s=150.0)
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.START_FAILED
    assert "not ready within start_timeout_s=150" in (r.error or "")
    assert not await act.alive()  # stopped, not left loading forever


async def test_a_unit_reading_another_file_is_refused(
    tmp_path: Path, make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FAKE_SYSTEMD_ENV_FILE")  # the unit reads /etc/specpilot/sglang-%i.env
    act, s = make()
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.UNKNOWN
    assert "/etc/specpilot/sglang-specpilot.env" in (r.error or "")
    assert not Path(s.server.systemd_env_file).exists()
    assert not any(c.startswith(("restart", "start")) for c in calls(tmp_path))


async def test_awkward_flag_values_survive_the_unit_quoting(make: Factory) -> None:
    """JSON with spaces and quotes, a $ and a backtick: env file -> systemd's parser -> sh eval ->
    the server's argv, unchanged."""
    labels = {"team": "a b", "note": 'it\'s $HOME `x` \\ "q"'}
    profiles = dict(PROFILES)
    profiles["baseline"] = {"flags": ["--extra-metric-labels", json.dumps(labels)]}
    act, _ = make(profiles=profiles)
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert r.server_args is not None and r.server_args["extra_metric_labels"] == labels


def test_env_assignments_order_and_reserved_keys(tmp_path: Path) -> None:
    s = settings(
        tmp_path,
        actuator="systemd",
        env={"NCCL_PROTO": "Simple", "NOTIFY_SOCKET": "/run/x", "SPECPILOT_PROFILE": "spoof"},
    )
    env = env_assignments(s, "eagle3-2step")
    assert env["NCCL_PROTO"] == "LL"  # the profile's env wins over [server].env
    assert "NOTIFY_SOCKET" not in env
    assert env["SPECPILOT_PROFILE"] == "eagle3-2step"
    assert env["SGLANG_ARGS"].endswith(f"--host 127.0.0.1 --port {s.server.port}")
    assert " -m simulator" in env["SGLANG_LAUNCH"]


@given(st.text(alphabet=st.characters(blacklist_characters="\n\r\x00", codec="utf-8")))
def test_envfile_round_trip(value: str) -> None:
    text = envfile.render({"A": value, "B": "x"})
    assert envfile.parse(text) == {"A": value, "B": "x"}


def test_envfile_refuses_newlines_and_bad_names() -> None:
    with pytest.raises(ValueError, match="newline"):
        envfile.render({"A": "x\ny"})
    with pytest.raises(ValueError, match="not a valid"):
        envfile.render({"1A": "x"})


async def test_start_waits_for_a_unit_already_loading_the_profile(
    tmp_path: Path, make: Factory
) -> None:
    from controller.actuators.systemd import env_file_text

    act, s = make(extra_flags=["--sim-override", "restart_s=200"])
    envfile.write_atomic(s.server.systemd_env_file, env_file_text(s, "eagle3-2step"))
    proc = await asyncio.create_subprocess_exec("systemctl", "start", UNIT)
    assert await proc.wait() == 0  # booted with that profile: loading, port still closed
    state = await act.probe()
    assert not state.up and state.pid
    r = await act.start("eagle3-2step")
    assert r.outcome is SwitchOutcome.OK, r.error
    assert (await act.probe()).pid == state.pid
    assert not [c for c in calls(tmp_path) if c.startswith("restart")]


def test_a_hand_edited_env_file_in_another_encoding_still_names_the_profile(
    tmp_path: Path,
) -> None:
    """A Latin-1 byte (an operator's edit) in the environment file: configured_profile() raised
    UnicodeDecodeError out of start() and probe() instead of reading the profile."""
    env_file = tmp_path / "sglang.env"
    env_file.write_bytes(b'# caf\xe9 (edited by hand)\nSPECPILOT_PROFILE="eagle3-2step"\n')
    s = settings(tmp_path, actuator="systemd", systemd_env_file=str(env_file))
    act = SystemdActuator(s, ScaledClock(SPEED), httpx.AsyncClient())
    assert act.configured_profile() == "eagle3-2step"


def test_the_env_file_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """systemd reads environment files as UTF-8; under an ASCII locale (LC_ALL=C without
    Python's UTF-8 mode) writing a non-ASCII value raised UnicodeEncodeError."""
    path = tmp_path / "sglang.env"
    code = (
        "import sys; from controller.actuators import envfile; "
        "text = envfile.render({'NOTE': 'mod\\u00e8le \\u00e9t\\u00e9'}); "
        "envfile.write_atomic(sys.argv[1], text)"
    )
    env = {**python_env(), "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert path.read_bytes() == 'NOTE="modèle été"\n'.encode()
    assert envfile.read(path) == {"NOTE": "modèle été"}


async def test_switches_are_not_refused_by_the_units_start_rate_limit(
    tmp_path: Path, make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd's StartLimitBurst= counts manual starts too: the unit refused specpilot's third
    restart within the interval here (the shipped unit: its sixth within an hour) and stayed
    failed (start-limit-hit) until a person ran reset-failed. specpilot clears the count before
    each restart of its own."""
    unit_file = tmp_path / "sglang@.service"
    shipped = (REPO / "deploy" / "sglang@.service").read_text()
    assert "StartLimitBurst=5" in shipped
    unit_file.write_text(shipped.replace("StartLimitBurst=5", "StartLimitBurst=2"))
    monkeypatch.setenv("FAKE_SYSTEMD_UNIT_FILE", str(unit_file))

    def systemctl(*args: str) -> int:
        return subprocess.run(["systemctl", *args], capture_output=True).returncode

    act, _ = make()
    r = await act.start("baseline")
    assert r.outcome is SwitchOutcome.OK, r.error
    # The fake enforces the limit: a third start within the interval is refused, and the unit
    # stays failed.
    assert systemctl("restart", UNIT) == 0
    assert systemctl("restart", UNIT) == 1
    assert (await act.unit_state())["ActiveState"] == "failed"
    for profile in ("eagle3-2step", "baseline", "eagle3-2step"):
        r = await act.switch(profile)
        assert r.outcome is SwitchOutcome.OK, r.error
    restarts = [i for i, c in enumerate(calls(tmp_path)) if c == f"restart {UNIT}"]
    assert all(calls(tmp_path)[i - 1] == f"reset-failed {UNIT}" for i in restarts[-3:])
