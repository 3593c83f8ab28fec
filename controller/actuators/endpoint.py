"""The few HTTP conversations an actuator has with the server it controls.

Owns: reading /server_info, the readiness check (/ready, falling back to /health_generate on
servers without /ready), counting in-flight requests (/v1/loads, falling back to /metrics),
the bounded drain before a stop, whether anything listens on the port at all, and picking a free
loopback port for a server specpilot launches itself (demos, a router's metrics). Every call is
bounded by a timeout and turns network errors into values (None / False): an actuator must never
raise because the server is down. Must not start or stop processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controller import sglang_names as names
from controller.clock import Clock

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port nothing listens on now (the OS picks it; a race with another binder is possible,
    which is why launches still check that their port came up)."""
    return free_ports(1, host, avoid)[0]


def free_ports(n: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> list[int]:
    """`n` distinct ports nothing listens on now and none in `avoid` (ports promised to servers
    that are not up yet): each stays bound until all are picked, so the OS cannot hand one out
    twice (n calls of free_port can)."""
    with contextlib.ExitStack() as stack:
        picked: list[int] = []
        while len(picked) < n:
            s = stack.enter_context(socket.socket())
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in avoid:
                picked.append(port)
        return picked


PATH_READY = "/ready"
PATH_HEALTH_GENERATE = "/health_generate"
PATH_PAUSE_GENERATION = "/pause_generation"
PATH_CONTINUE_GENERATION = "/continue_generation"

# Real seconds: one HTTP exchange with a local server. /health_generate runs a one-token
# generation that SGLang itself bounds at 20 s.
_HTTP_TIMEOUT_S = 5.0
_HEALTH_GENERATE_TIMEOUT_S = 25.0
# Server seconds between polls, and the fewest real seconds between them (an accelerated clock
# must not turn polling into a busy loop on a small machine).
POLL_S = 1.0
_MIN_REAL_POLL_S = 0.05


def time_scale(clock: Clock) -> float:
    return float(getattr(clock, "time_scale", 1.0)) or 1.0


def at_least_real(clock: Clock, server_s: float, real_s: float) -> float:
    """`server_s` seconds of server time, but never less than `real_s` real seconds: for work
    that takes real time whatever the clock's scale (a systemctl call, a fork)."""
    return max(server_s, real_s * time_scale(clock))


def poll_interval(clock: Clock) -> float:
    """Seconds of server time between two polls."""
    return max(POLL_S, _MIN_REAL_POLL_S * time_scale(clock))


class Endpoint:
    """The server's HTTP side at `base_url` (`http://host:port`)."""

    def __init__(self, client: httpx.AsyncClient, host: str, port: int, clock: Clock) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.clock = clock
        self.base_url = f"http://{host}:{port}"

    async def _request(
        self, method: str, path: str, timeout_s: float, **kwargs: Any
    ) -> httpx.Response:
        """One exchange, bounded as a whole by `timeout_s` real seconds (httpx's timeout bounds
        each read, so a server trickling its answer would hold the caller forever); the
        overrun is an httpx.TimeoutException, like httpx's own timeouts."""
        request = self.client.request(method, self.base_url + path, timeout=timeout_s, **kwargs)
        try:
            return await asyncio.wait_for(request, timeout_s)
        except TimeoutError as e:
            raise httpx.TimeoutException(f"{path}: no whole answer within {timeout_s:g} s") from e

    async def port_open(self) -> bool:
        """Whether anything accepts TCP connections on the port (SGLang binds it only once weights,
        KV cache and graphs are ready, so False also means 'still starting')."""
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), timeout=_HTTP_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def server_info_or_port(self) -> tuple[Mapping[str, Any] | None, bool]:
        """/server_info, and whether the port is open. A server binding its port between the two
        asks (one finishing its start-up) is asked again once the port is found open, so
        (None, True) is a server that does not answer, never one that came up just then."""
        info = await self.server_info()
        if info is not None:
            return info, True
        if not await self.port_open():
            return None, False
        return await self.server_info(), True

    async def server_info(self) -> Mapping[str, Any] | None:
        """The resolved server args (flat keys), or None when the server does not answer with
        JSON. Tries /server_info, then the deprecated /get_server_info of older servers."""
        for path in (names.PATH_SERVER_INFO, names.PATH_SERVER_INFO_DEPRECATED):
            try:
                r = await self._request("GET", path, _HTTP_TIMEOUT_S)
            except httpx.HTTPError:
                return None
            if r.status_code == 404:
                continue
            if r.status_code != 200:
                return None
            try:
                data = r.json()
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
        return None

    async def ready(self) -> bool:
        """/ready is 200 (up, not paused, not shutting down); servers without /ready (404) are
        asked /health_generate instead."""
        try:
            r = await self._request("GET", PATH_READY, _HTTP_TIMEOUT_S)
            if r.status_code != 404:
                return r.status_code == 200
            r = await self._request("GET", PATH_HEALTH_GENERATE, _HEALTH_GENERATE_TIMEOUT_S)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def in_flight(self) -> int | None:
        """Running + waiting requests over all DP ranks, from /v1/loads, else from the
        scheduler gauges on /metrics; None when neither answers."""
        try:
            r = await self._request(
                "GET", names.PATH_LOADS, _HTTP_TIMEOUT_S, params={"include": "core"}
            )
            if r.status_code == 200:
                loads = r.json().get(names.LOADS_KEY_LOADS)
                if isinstance(loads, list) and loads:
                    return int(
                        sum(
                            float(ld.get(names.LOADS_KEY_NUM_RUNNING) or 0)
                            + float(ld.get(names.LOADS_KEY_NUM_WAITING) or 0)
                            for ld in loads
                        )
                    )
        except (httpx.HTTPError, ValueError, TypeError, AttributeError, OverflowError):
            pass  # OverflowError: an infinite count (int() of inf)
        try:
            r = await self._request("GET", names.PATH_METRICS, _HTTP_TIMEOUT_S)
            if r.status_code != 200:
                return None
            return _in_flight_from_metrics(r.text)
        except (httpx.HTTPError, ValueError, OverflowError):
            return None

    async def pause_abort(self, timeout_s: float) -> bool:
        """POST /pause_generation {"mode": "abort"}: SGLang aborts every in-flight request (the
        clients get an abort answer instead of a reset connection), /ready turns 503 and new
        requests wait. Best effort: False when the server does not support it."""
        try:
            r = await self._request(
                "POST", PATH_PAUSE_GENERATION, max(0.5, timeout_s), json={"mode": "abort"}
            )
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def resume(self) -> bool:
        """POST /continue_generation: undo pause_abort when the server is kept after all (the
        switch failed before the old server was stopped)."""
        try:
            r = await self._request("POST", PATH_CONTINUE_GENERATION, _HTTP_TIMEOUT_S, json={})
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def drain(self, drain_timeout_s: float) -> Drain:
        """Bounded drain before a stop: wait until no request runs or waits, at most
        `drain_timeout_s` of server time; if requests remain, abort them through
        /pause_generation so that SIGTERM (which in SGLang waits without limit for in-flight
        requests) can finish. The server is left paused then: call `resume()` if it is kept."""
        deadline = self.clock.monotonic() + drain_timeout_s
        step = poll_interval(self.clock)
        n = await self.in_flight()
        while n and self.clock.monotonic() < deadline:
            await self.clock.sleep(min(step, max(0.0, deadline - self.clock.monotonic())))
            n = await self.in_flight()
        if n is None:
            return Drain("drain: in-flight count unavailable", paused=False)
        if n == 0:
            return Drain("drain: idle", paused=False)
        aborted = await self.pause_abort(_HTTP_TIMEOUT_S)
        text = f"drain: {n} requests still in flight after {drain_timeout_s:g} s"
        return Drain(text + (", aborted via /pause_generation" if aborted else ""), aborted)

    async def wait_ready(
        self,
        deadline: float,
        exited: Callable[[], Awaitable[str | None]],
        accept: Callable[[Mapping[str, Any]], str | None],
    ) -> ReadyWait:
        """Poll until the server is ready and `accept(server_info)` returns None (no objection),
        the server's process exits (`exited()` returns why), or the deadline (server time)
        passes. `accept` returning a string is an objection: the wait goes on, and the last
        objection is reported if the deadline passes."""
        step = poll_interval(self.clock)
        objection: str | None = None
        info: Mapping[str, Any] | None = None
        while True:
            why = await exited()
            if why is not None:
                return ReadyWait("exited", why, info)
            if await self.ready():
                info = await self.server_info()
                if info is not None:
                    objection = accept(info)
                    if objection is None:
                        return ReadyWait("ready", None, info)
            now = self.clock.monotonic()
            if now >= deadline:
                return ReadyWait("timeout", objection, info)
            await self.clock.sleep(min(step, deadline - now))


@dataclass(frozen=True)
class Drain:
    """How a drain ended: one line for the log, and whether the server was paused."""

    text: str
    paused: bool

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class ReadyWait:
    """How a wait for readiness ended: "ready", "exited" or "timeout"; `detail` says why."""

    status: str
    detail: str | None
    server_info: Mapping[str, Any] | None


def _in_flight_from_metrics(text: str) -> int | None:
    wanted = {names.NUM_RUNNING_REQS, names.NUM_QUEUE_REQS}
    # Parse only the two families (the exposition of a big server is large).
    lines = [
        ln
        for ln in text.splitlines()
        if any(ln.startswith(w) or ln.startswith(f"# TYPE {w} ") for w in wanted)
    ]
    total = 0.0
    seen = False
    for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
        if fam.name not in wanted:
            continue
        for s in fam.samples:
            # Only TP rank 0 reports by default; with every rank reporting, count rank 0 once.
            if s.labels.get(names.LABEL_TP_RANK, "0") != "0":
                continue
            # Priority scheduling: the total is under priority="", the breakdown elsewhere.
            if s.labels.get(names.LABEL_PRIORITY, "") != "":
                continue
            total += s.value
            seen = True
    return int(total) if seen else None
