"""`specpilot demo`: the README's main job runs end to end (short), exits 0 and summarises."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def test_demo_runs_and_summarises(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "demo",
            "--duration-s",
            "12",
            "--speed",
            "50",
            "--db",
            str(db),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # where the demo keeps the server's log
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    (log,) = tmp_path.glob("specpilot-demo-*/server.log")
    assert f"server log {log}" in out  # the header names it, unwrapped
    assert log.stat().st_size > 0
    assert "demo summary" in out
    assert "switch (start) -> baseline: start (ok" in out  # the controller started the simulator
    assert "client requests ok / failed attempts" in out
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


def test_demo_refuses_a_busy_port_and_an_unusable_db_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port in use was a RuntimeError traceback from inside the daemon, an unwritable --db a
    StoreError one: now one line and exit 2, before the simulator starts."""
    from controller.demo import run_demo

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert run_demo(duration_s=5, speed=50, port=port, db=None) == 2
        assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    for db, problem in (
        (tmp_path / "file" / "x.db", "is not a directory"),
        (tmp_path / "nodir" / "x.db", "does not exist"),
        (tmp_path, "is a directory"),
    ):
        assert run_demo(duration_s=5, speed=50, port=0, db=db) == 2
        assert problem in capsys.readouterr().err
    for bad in (
        {"duration_s": float("nan"), "speed": 50.0, "port": 0},
        {"duration_s": 5.0, "speed": float("inf"), "port": 0},
        {"duration_s": 5.0, "speed": 50.0, "port": 70000},
    ):
        assert run_demo(db=None, **bad) == 2  # type: ignore[arg-type]
        assert "specpilot demo:" in capsys.readouterr().err


def test_demo_store_errors_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import controller.demo as demo
    from store import StoreError

    async def broken(*_: object) -> int:
        raise StoreError("cannot open database x.db: unable to open database file")

    monkeypatch.setattr(demo, "_demo", broken)
    assert demo.run_demo(duration_s=5, speed=50, port=0, db=tmp_path / "x.db") == 1
    assert "specpilot demo: cannot open database x.db" in capsys.readouterr().err
