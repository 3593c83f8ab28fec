"""The actuators' HTTP side on a manual clock with httpx.MockTransport: readiness with the
/health_generate fallback, in-flight counts from /v1/loads or /metrics, and the bounded drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

import httpx
import pytest

from controller.actuators import endpoint as endpoint_module
from controller.actuators.endpoint import Endpoint
from controller.clock import ManualClock

Handler = Callable[[httpx.Request], httpx.Response]


def endpoint(handler: Handler, clock: ManualClock | None = None) -> Endpoint:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return Endpoint(client, "127.0.0.1", 30000, clock or ManualClock())


async def test_ready_falls_back_to_health_generate_on_old_servers() -> None:
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.path)
        if req.url.path == "/ready":
            return httpx.Response(404)
        return httpx.Response(200 if req.url.path == "/health_generate" else 404)

    assert await endpoint(handler).ready()
    assert seen == ["/ready", "/health_generate"]


@pytest.mark.parametrize(("status", "ready"), [(200, True), (503, False)])
async def test_ready_status(status: int, ready: bool) -> None:
    assert await endpoint(lambda r: httpx.Response(status)).ready() is ready


async def test_ready_is_false_when_the_server_is_down() -> None:
    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    ep = endpoint(refuse)
    assert await ep.ready() is False
    assert await ep.server_info() is None
    assert await ep.in_flight() is None


async def test_server_info_uses_the_deprecated_path_on_old_servers() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/get_server_info":
            return httpx.Response(200, json={"speculative_algorithm": None})
        return httpx.Response(404)

    assert await endpoint(handler).server_info() == {"speculative_algorithm": None}


async def test_in_flight_sums_dp_ranks_from_v1_loads() -> None:
    loads = {
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1},
            {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0},
        ]
    }
    assert await endpoint(lambda r: httpx.Response(200, json=loads)).in_flight() == 6


async def test_in_flight_falls_back_to_metrics() -> None:
    exposition = (
        "# HELP sglang:num_running_reqs The number of running requests.\n"
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="0"} 4.0\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="1"} 1.0\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1",dp_rank="0"} 4.0\n'
        "# HELP sglang:num_queue_reqs The number of queued requests.\n"
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m",tp_rank="0",priority=""} 2.0\n'
        'sglang:num_queue_reqs{model_name="m",tp_rank="0",priority="1"} 2.0\n'
        "# HELP sglang:gen_throughput x\n# TYPE sglang:gen_throughput gauge\n"
        'sglang:gen_throughput{model_name="m",tp_rank="0"} 99.0\n'
    )

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/loads":
            return httpx.Response(404)
        return httpx.Response(200, text=exposition)

    # rank 1 and the per-priority breakdown are not counted twice
    assert await endpoint(handler).in_flight() == 7


class DrainingServer:
    """In-flight requests that finish at `done_at_s` (server time); records pauses."""

    def __init__(self, clock: ManualClock, n: int, done_at_s: float | None) -> None:
        self.clock, self.n, self.done_at_s = clock, n, done_at_s
        self.t0 = clock.monotonic()
        self.pauses: list[dict] = []

    def __call__(self, req: httpx.Request) -> httpx.Response:
        if req.url.path == "/pause_generation":
            self.pauses.append(json.loads(req.content))
            return httpx.Response(200, json={"status": "ok"})
        elapsed = self.clock.monotonic() - self.t0
        n = 0 if self.done_at_s is not None and elapsed >= self.done_at_s else self.n
        return httpx.Response(200, json={"loads": [{"num_running_reqs": n}]})


async def test_drain_waits_for_requests_to_finish() -> None:
    clock = ManualClock()
    server = DrainingServer(clock, 5, done_at_s=12.0)
    t0 = clock.monotonic()
    drained = await endpoint(server, clock).drain(30.0)
    assert not drained.paused and drained.text == "drain: idle"
    assert 12.0 <= clock.monotonic() - t0 < 14.0
    assert server.pauses == []


async def test_drain_is_bounded_then_aborts() -> None:
    clock = ManualClock()
    server = DrainingServer(clock, 5, done_at_s=None)
    t0 = clock.monotonic()
    drained = await endpoint(server, clock).drain(30.0)
    assert clock.monotonic() - t0 == pytest.approx(30.0)
    assert drained.paused and "5 requests still in flight" in drained.text
    assert server.pauses == [{"mode": "abort"}]


async def test_drain_of_an_idle_server_takes_no_time() -> None:
    clock = ManualClock()
    server = DrainingServer(clock, 0, done_at_s=None)
    t0 = clock.monotonic()
    await endpoint(server, clock).drain(30.0)
    assert clock.monotonic() == t0


async def test_wait_ready_objections_and_deadline() -> None:
    clock = ManualClock()
    calls = [0]

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/ready":
            return httpx.Response(200)
        calls[0] += 1  # the old profile answers three times, then the new one
        return httpx.Response(200, json={"speculative_num_steps": 2 if calls[0] <= 3 else 5})

    async def running() -> str | None:
        return None

    ep = endpoint(handler, clock)
    wait = await ep.wait_ready(
        clock.monotonic() + 100.0,
        running,
        lambda info: None if info["speculative_num_steps"] == 5 else "old profile",
    )
    assert wait.status == "ready" and wait.server_info == {"speculative_num_steps": 5}

    wait = await ep.wait_ready(clock.monotonic() + 10.0, running, lambda info: "never")
    assert wait.status == "timeout" and wait.detail == "never"

    async def gone() -> str | None:
        return "exited with status 1"

    wait = await ep.wait_ready(clock.monotonic() + 10.0, gone, lambda info: None)
    assert wait.status == "exited" and wait.detail == "exited with status 1"


def test_free_ports_are_distinct_and_free() -> None:
    """The fleet demo's replica and router ports: n calls of free_port could repeat one."""
    import socket

    from controller.actuators.endpoint import free_ports

    ports = free_ports(16)
    assert len(set(ports)) == 16
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # nothing holds it any more


def test_free_ports_skip_reserved_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port promised to a replica that is not up yet is never handed out (the router's
    metrics port is picked before the replicas start)."""
    from controller.actuators import endpoint

    handed = iter([41000, 41001, 41002, 41003])

    class FakeSocket:
        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, addr: tuple[str, int]) -> None:
            self.port = next(handed)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(endpoint.socket, "socket", FakeSocket)
    assert endpoint.free_ports(2, avoid={41000, 41002}) == [41001, 41003]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/loads", '{"loads": [{"num_running_reqs": Infinity, "num_waiting_reqs": 0}]}'),
        ("/metrics", "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs +Inf\n"),
    ],
)
async def test_an_infinite_in_flight_count_is_unavailable_not_an_exception(
    path: str, body: str
) -> None:
    """A broken endpoint (or a proxy in front of it) that answers an infinite count: int(inf)
    raised OverflowError out of drain(), so the switch ended UNKNOWN and blocked actuation."""

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=body) if req.url.path == path else httpx.Response(404)

    ep = endpoint(handler)
    assert await ep.in_flight() is None
    drained = await ep.drain(30.0)
    assert not drained.paused and "unavailable" in drained.text


async def test_a_server_trickling_its_answer_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx's timeout bounds each read, not the exchange: a server that sends its headers, then
    one byte every 0.2 s, held server_info() and ready() (so a switch's wait, while the watchdog
    counts a switch in flight as healthy) for as long as it went on."""
    monkeypatch.setattr(endpoint_module, "_HTTP_TIMEOUT_S", 0.5)

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            for _ in range(100):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)
        writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            ep = Endpoint(client, "127.0.0.1", port, ManualClock())
            t0 = loop.time()
            assert await ep.server_info() is None
            assert await ep.ready() is False
            assert await ep.in_flight() is None
            assert loop.time() - t0 < 5.0
    finally:
        server.close()


async def test_a_server_binding_its_port_between_the_asks_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/server_info refused (the port is not bound yet), then the server binds it before the
    port is tried: the probe's asks must not read that as a server up that does not answer (a
    starting controller refused to adopt the server an earlier one was loading)."""
    info = {"speculative_algorithm": None}
    bound = False
    asks: list[bool] = []

    def handler(req: httpx.Request) -> httpx.Response:
        asks.append(bound)
        if not bound:
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(200, json=info)

    ep = endpoint(handler)

    async def port_open() -> bool:
        nonlocal bound
        bound = True  # the server binds its port just after /server_info was refused
        return True

    monkeypatch.setattr(ep, "port_open", port_open)
    assert await ep.server_info_or_port() == (info, True)
    assert asks == [False, True]


@pytest.mark.parametrize("port_open", [True, False])
async def test_server_info_or_port_without_an_answer(
    monkeypatch: pytest.MonkeyPatch, port_open: bool
) -> None:
    """No answer: (None, True) for an open port that does not answer /server_info (asked twice),
    (None, False) for a closed one (asked once)."""
    asks: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        asks.append(req.url.path)
        raise httpx.ConnectError("refused", request=req)

    ep = endpoint(handler)

    async def port() -> bool:
        return port_open

    monkeypatch.setattr(ep, "port_open", port)
    assert await ep.server_info_or_port() == (None, port_open)
    assert asks == ["/server_info"] * (2 if port_open else 1)


async def test_server_info_or_port_answers_without_trying_the_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ep = endpoint(lambda r: httpx.Response(200, json={"tp_size": 8}))

    async def port() -> bool:
        raise AssertionError("the port is tried only when /server_info does not answer")

    monkeypatch.setattr(ep, "port_open", port)
    assert await ep.server_info_or_port() == ({"tp_size": 8}, True)
