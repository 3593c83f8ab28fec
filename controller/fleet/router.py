"""SGLang's router (`sglang-router`): launch or adopt it, and manage its workers over HTTP.

Owns the router process when specpilot launches it (own session, output to a file, stopped with
SIGTERM then SIGKILL) and the conversation with its worker API as the installed version
(sglang-router 0.3.x) serves it:
  GET /workers                 -> {"workers": [{"id", "url", "is_healthy", "load", ...}], ...}
  POST /workers {"url": URL}   -> 202 {"worker_id": ...}; registered in the background once the
                                  worker's /health answers (a worker that is not up yet is retried)
  DELETE /workers/{worker_id}  -> 202; removed in the background
  GET /liveness, /readiness    -> 200 when the router runs / has a healthy worker
Additions and removals are asynchronous on the router's side, so every call here waits until
GET /workers shows the result. Network errors become values or RouterUnavailable: a caller
decides whether to wait. Must not start, stop or judge replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from controller.actuators.endpoint import free_port
from controller.clock import Clock
from controller.fleet.settings import RouterSettings

log = logging.getLogger(__name__)

_HTTP_TIMEOUT_S = 5.0
_POLL_REAL_S = 0.05  # real seconds between polls of /workers after an add or remove


class RouterUnavailable(Exception):
    """The router does not answer (down, restarting, or not this kind of router)."""


class RouterError(Exception):
    """The router answered, but refused or did not do what was asked in time."""


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    healthy: bool
    load: float | None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Worker:
        load = d.get("load")
        return cls(
            id=str(d.get("id") or ""),
            url=normalise_url(str(d["url"])),
            healthy=bool(d.get("is_healthy", False)),
            load=float(load) if isinstance(load, int | float) else None,
        )


def normalise_url(url: str) -> str:
    return url.rstrip("/")


class RouterClient:
    """The router's worker API at `base_url`."""

    def __init__(
        self, client: httpx.AsyncClient, base_url: str, clock: Clock, api_key: str = ""
    ) -> None:
        self.client = client
        self.base_url = normalise_url(base_url)
        self.clock = clock
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return await self.client.request(
                method,
                self.base_url + path,
                headers=self.headers,
                timeout=_HTTP_TIMEOUT_S,
                **kw,
            )
        except httpx.HTTPError as e:
            raise RouterUnavailable(f"router {self.base_url}: {type(e).__name__}: {e}") from e

    async def alive(self) -> bool:
        """Whether the router answers /liveness."""
        try:
            r = await self._request("GET", "/liveness")
        except RouterUnavailable:
            return False
        return r.status_code == 200

    async def workers(self) -> list[Worker]:
        r = await self._request("GET", "/workers")
        if r.status_code != 200:
            raise RouterUnavailable(
                f"router {self.base_url}: GET /workers answered {r.status_code}: {r.text[:200]}"
            )
        try:
            return [Worker.from_json(w) for w in r.json()["workers"]]
        except (ValueError, KeyError, TypeError) as e:
            raise RouterUnavailable(
                f"router {self.base_url}: GET /workers is not a worker list ({e}): is this "
                "sglang-router >= 0.3?"
            ) from e

    async def find(self, url: str) -> Worker | None:
        url = normalise_url(url)
        return next((w for w in await self.workers() if w.url == url), None)

    async def add(self, url: str, timeout_s: float) -> Worker:
        """Register `url` and wait (server time) until the router lists it healthy."""
        url = normalise_url(url)
        found = await self.find(url)
        if found is None:
            r = await self._request("POST", "/workers", json={"url": url})
            if r.status_code not in (200, 201, 202):
                raise RouterError(f"POST /workers {url} answered {r.status_code}: {r.text[:300]}")
        deadline = self.clock.monotonic() + timeout_s
        while True:
            found = await self.find(url)
            if found is not None and found.healthy:
                return found
            if self.clock.monotonic() >= deadline:
                raise RouterError(
                    f"the router did not list {url} as a healthy worker within {timeout_s:g} s"
                    + ("" if found is None else " (listed, not healthy)")
                )
            await self._pause()

    async def remove(self, url: str, timeout_s: float) -> bool:
        """Deregister `url` and wait until the router no longer lists it: from then on it routes
        nothing new there. False when it was not registered."""
        url = normalise_url(url)
        found = await self.find(url)
        if found is None:
            return False
        r = await self._request("DELETE", f"/workers/{found.id}")
        if r.status_code not in (200, 202, 204, 404):
            raise RouterError(f"DELETE /workers/{found.id} ({url}) answered {r.status_code}")
        deadline = self.clock.monotonic() + timeout_s
        while await self.find(url) is not None:
            if self.clock.monotonic() >= deadline:
                raise RouterError(f"the router still lists {url} after {timeout_s:g} s")
            await self._pause()
        return True

    async def _pause(self) -> None:
        scale = float(getattr(self.clock, "time_scale", 1.0)) or 1.0
        await self.clock.sleep(_POLL_REAL_S * scale)

    async def wait_alive(self, timeout_s: float, gone: Callable[[], bool] = lambda: False) -> bool:
        """Wait (server time) until the router answers; False at the deadline, or as soon as
        `gone()` says no router is coming (the process launched for it exited)."""
        deadline = self.clock.monotonic() + timeout_s
        while not await self.alive():
            if gone() or self.clock.monotonic() >= deadline:
                return False
            scale = float(getattr(self.clock, "time_scale", 1.0)) or 1.0
            await self.clock.sleep(min(0.5 * scale, max(0.0, deadline - self.clock.monotonic())))
        return True


def router_argv(rs: RouterSettings, worker_urls: list[str], prometheus_port: int) -> list[str]:
    """The router's command line. Workers given here are registered at startup; specpilot passes
    none and adds every replica itself once it is ready."""
    launch = [sys.executable if a == "{python}" else a for a in rs.launch]
    argv = [
        *launch,
        "--host",
        rs.host,
        "--port",
        str(rs.port),
        "--policy",
        rs.policy,
        "--health-check-interval-secs",
        f"{max(1, round(rs.health_check_interval_s))}",
        "--prometheus-host",
        rs.host,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "warn",
    ]
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    if rs.api_key:
        argv += ["--api-key", rs.api_key]
    return argv + list(rs.extra_args)


class RouterProcess:
    """A router specpilot launched: its own session (signals to specpilot do not reach it), its
    output in a file. Not restarted here: FleetActuator decides when. A Prometheus port picked
    here (prometheus_port 0) stays the same across relaunches, unless a launch exited before the
    router answered (the port may be what it could not bind): the next launch picks another,
    never one of `reserved` (the replicas' ports, whose servers may not be up yet)."""

    def __init__(self, rs: RouterSettings, reserved: Collection[int] = ()) -> None:
        self.rs = rs
        self.proc: subprocess.Popen[bytes] | None = None
        self.prometheus_port = rs.prometheus_port
        self.reserved = frozenset(reserved) | {rs.port}
        self.failure = ""  # why the last launch exited before it answered; "" when none did

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def running(self) -> bool:
        return self.pid is not None

    def launch(self) -> None:
        if self.running():
            return
        port = self.prometheus_port or free_port(self.rs.host, self.reserved)
        self.prometheus_port = port
        argv = router_argv(self.rs, [], port)
        out: Any = subprocess.DEVNULL
        if self.rs.log_file:
            path = Path(self.rs.log_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            out = path.open("ab")
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        log.info("started the router as pid %d: %s", self.proc.pid, " ".join(argv))

    def launch_failed(self) -> str:
        """Record that the launched router exited before it answered, and say why: its exit code
        and the last line of its log. A picked Prometheus port is given up."""
        code = self.proc.poll() if self.proc is not None else None
        self.failure = f"the router launched on port {self.rs.port} exited with code {code}"
        tail = _last_line(self.rs.log_file)
        if tail:
            self.failure += f": {tail}"
        if not self.rs.prometheus_port:
            self.prometheus_port = 0
        return self.failure

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` real seconds (the router would otherwise wait
        its shutdown grace period for requests in flight)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            for _ in range(int(timeout_s / 0.05)):
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, timeout_s)
        self.proc = None


def _last_line(path: str, limit: int = 4096) -> str:
    """The last non-blank line of a log file (its last `limit` bytes); "" without one."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
