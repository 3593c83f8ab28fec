"""Advisory mode against the real simulator: the daemon decides and explains (a switch decision
is recorded, not acted on) and never touches the server: the server's pid never changes, no
switch is recorded, a crash is not restarted, and stopping the daemon leaves the server alone
even with owns_server."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx

from tests.controller.actuator_fakes.support import alive, port_pids
from tests.controller.daemon_support import (
    cleanup,
    config,
    reader,
    running_daemon,
    settings,
    wait_for,
)


async def test_advisory_mode_never_touches_the_server(tmp_path: Path) -> None:
    raw = config(tmp_path, controller={"mode": "advisory"}, server={"owns_server": True})
    s = settings(raw)
    # The server is started by someone else (here: the test), as on a real advisory host.
    log = (tmp_path / "own-server.log").open("wb")
    server = subprocess.Popen(
        s.launch_argv("baseline"), env=s.launch_env("baseline"), stdout=log, stderr=log
    )
    log.close()
    try:

        def up() -> bool:
            try:
                return httpx.get(s.server.base_url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_for(up, 30, "the server")
        pids_seen: set[int] = set()

        def check_pid(_: object) -> None:
            pids_seen.update(port_pids(s.server.port))

        async with running_daemon(raw, concurrency=1, on_tick=check_pid, keep_server=True) as run:
            assert run.ctl.running == "baseline"  # adopted, not started

            def advised() -> bool:
                with reader(raw) as r:
                    return any(d["action"] == "switch" for d in r.recent_decisions(limit=1000))

            # One stream on baseline: the policy would explore a speculative profile.
            await wait_for(advised, 30, "a switch decision", db=raw)
            assert pids_seen == {server.pid} and alive(server.pid)
        # The daemon stopped (owns_server = true): advisory leaves the server running.
        assert alive(server.pid) and port_pids(s.server.port) == {server.pid}

        async with running_daemon(raw, concurrency=0, on_tick=check_pid, keep_server=True) as run:
            assert run.ctl.running == "baseline"
            # A crash is not restarted in advisory mode either.
            os.kill(server.pid, signal.SIGKILL)
            server.wait(5)
            n = len(run.ticks)
            await wait_for(lambda: len(run.ticks) >= n + 4, 10, "ticks after the crash")
            assert not port_pids(s.server.port)
            assert run.ctl.running is None
        with reader(raw) as r:
            assert r.switches() == []
            decisions = r.recent_decisions(limit=10_000)
        switch = [d for d in decisions if d["action"] == "switch"]
        assert switch and not any(d["acted"] for d in switch)
        assert all(d["mode"] == "advisory" and not d["acted"] for d in decisions)
        assert pids_seen == {server.pid}
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        cleanup(s)
