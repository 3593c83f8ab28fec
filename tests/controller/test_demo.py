"""`specpilot demo`: the README's main job runs end to end (short), exits 0 and summarises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_runs_and_summarises(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "demo",
            "--duration-s",
            "25",
            "--speed",
            "50",
            "--db",
            str(db),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "demo summary" in out
    assert "switch (start) -> baseline" in out  # the simulator was started by the controller
    assert "client requests ok / failed" in out
    assert db.exists()


def test_demo_rejects_bad_arguments() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "controller.cli", "demo", "--duration-s", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "must be > 0" in r.stdout + r.stderr
