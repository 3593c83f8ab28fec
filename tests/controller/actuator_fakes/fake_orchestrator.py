"""A fake orchestrator for the command actuator's tests (think `kubectl apply` + a rollout).

`switch PROFILE FLAG...` returns at once (exit 0) and rolls out in the background: after
FAKE_ORCH_DELAY_S real seconds it stops the old server and starts `python -m simulator FLAG...`
with the variables of $SPECPILOT_ENV. `status` prints the profile of the server it runs.
FAKE_ORCH_FAIL=1: `switch` exits 3 with a message; FAKE_ORCH_HANG=1: `switch` never returns.
State lives in $FAKE_ORCH_DIR. Test code only.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ["FAKE_ORCH_DIR"])
PID = STATE / "pid"
PROFILE = STATE / "profile"


def running_pid() -> int | None:
    try:
        pid = int(PID.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def rollout(profile: str, flags: list[str]) -> None:
    time.sleep(float(os.environ.get("FAKE_ORCH_DELAY_S", "0")))
    old = running_pid()
    if old is not None:
        os.killpg(old, signal.SIGTERM)
        end = time.monotonic() + 5
        while time.monotonic() < end and running_pid() is not None:
            time.sleep(0.02)
        if running_pid() is not None:
            os.killpg(old, signal.SIGKILL)
    env = dict(os.environ)
    for item in shlex.split(os.environ.get("SPECPILOT_ENV", "")):
        key, _, value = item.partition("=")
        env[key] = value
    with open(STATE / "server.log", "ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "simulator", *flags],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    PID.write_text(str(child.pid))
    PROFILE.write_text(profile)
    child.wait()  # the rollout process is this server's parent: it reaps it


def main(argv: list[str]) -> int:
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "calls", "a") as fh:
        fh.write(shlex.join(argv) + "\n")
    if argv[0] == "status":
        if running_pid() is None:
            return 1
        print(PROFILE.read_text())
        return 0
    if argv[0] == "switch":
        if os.environ.get("FAKE_ORCH_FAIL") == "1":
            print("error: deployments.apps 'sglang' is forbidden", file=sys.stderr)
            return 3
        if os.environ.get("FAKE_ORCH_HANG") == "1":
            time.sleep(600)
        subprocess.Popen(
            [sys.executable, __file__, "_rollout", *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return 0
    if argv[0] == "_rollout":
        rollout(argv[1], argv[2:])
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
