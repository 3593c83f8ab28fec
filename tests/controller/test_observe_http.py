"""controller.observe over HTTP: scrape (/metrics + /v1/loads), server_info, the benchmarks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from controller import observe
from controller.observe import ObserveError, parse_loads, scrape, server_info
from controller.observe_fixtures import synth_large_exposition

METRICS = (
    "# TYPE sglang:num_running_reqs gauge\n"
    'sglang:num_running_reqs{tp_rank="0"} 7\n'
    "# TYPE sglang:generation_tokens_total counter\n"
    'sglang:generation_tokens_total{workload="code"} 100\n'
)

# The shape of SGLang 0.5.23's GET /v1/loads?include=core,spec (srt/entrypoints/v1_loads.py,
# srt/managers/load_snapshot.py LoadSnapshot.to_dict): core keys flat, spec under "speculative".
LOADS = {
    "timestamp": "2026-01-01T00:00:00+00:00",
    "version": "0.5.23",
    "accelerator": "NVIDIA H200",
    "num_accelerators": 4,
    "loads": [
        {
            "timestamp": 1.7e9,
            "dp_rank": 0,
            "num_running_reqs": 7,
            "num_waiting_reqs": 2,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": 1000,
            "num_total_tokens": 1000,
            "num_active_tokens": 1000,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": 400000,
            "max_running_requests": 64,
            "token_usage": 0.01,
            "gen_throughput": 512.5,
            "cache_hit_rate": 0.0,
            "utilization": 0.5,
            "total_prefill_uncached_tokens": 5000,
            "total_prefill_busy_us": 300000,
            "decode_moments": [100.0, 700.0, 2_000_000.0, 5100.0, 14_000_000.0, 1400.0],
            "speculative": {"accept_length": 2.1, "accept_rate": 0.55},
        },
        {
            "timestamp": 1.7e9,
            "dp_rank": 1,
            "num_running_reqs": 3,
            "num_waiting_reqs": 0,
            "max_running_requests": 64,
            "gen_throughput": 200.0,
            "decode_moments": [50.0, 150.0, 1_000_000.0, 500.0, 3_000_000.0, 300.0],
        },
    ],
}


def _client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _routes(routes: dict[str, httpx.Response], seen: list[httpx.Request] | None = None):
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return routes.get(request.url.path, httpx.Response(404, text="Not Found"))

    return handler


def test_parse_loads_sums_dp_and_converts_microseconds() -> None:
    s = parse_loads(LOADS)
    assert s.running_reqs == 10.0
    assert s.waiting_reqs == 2.0
    assert s.gen_throughput_tok_s == 712.5
    assert s.max_running_requests == 128.0
    assert s.moments is not None
    n, sb, st, sb2, sbt, sg = s.moments
    assert (n, sb, sb2, sg) == (150.0, 850.0, 5600.0, 1700.0)
    assert st == pytest.approx(3.0)  # 2e6 us + 1e6 us
    assert sbt == pytest.approx(17.0)


def test_parse_loads_null_and_malformed_moments() -> None:
    idle = {"loads": [{"dp_rank": 0, "num_running_reqs": 0, "decode_moments": None}]}
    assert parse_loads(idle).moments is None
    assert parse_loads(idle).running_reqs == 0.0
    mixed = {
        "loads": [
            {"dp_rank": 0, "decode_moments": None},
            {"dp_rank": 1, "decode_moments": [1, 2, 3e6, 4, 5e6, 6]},
        ]
    }
    assert parse_loads(mixed).moments == pytest.approx((1.0, 2.0, 3.0, 4.0, 5.0, 6.0))
    for bad in ([1, 2, 3], [1, 2, "x", 4, 5, 6], [1, 2, float("nan"), 4, 5, 6], "oops"):
        assert parse_loads({"loads": [{"decode_moments": bad}]}).moments is None
    for not_loads in ([], {"loads": "x"}, {"nope": []}, None):
        with pytest.raises(ObserveError):
            parse_loads(not_loads)


async def test_scrape_merges_metrics_and_loads() -> None:
    seen: list[httpx.Request] = []
    routes = {
        "/metrics": httpx.Response(200, text=METRICS),
        "/v1/loads": httpx.Response(200, json=LOADS),
    }
    async with _client(_routes(routes, seen)) as client:
        s = await scrape(client, "http://sglang:30000/", profile="eagle3-2", t_s=42.0)
    assert (s.profile, s.t_s) == ("eagle3-2", 42.0)
    assert s.running_reqs == 7.0  # from /metrics (same interval as the gauges it weights)
    assert s.queue_reqs == 2.0  # /metrics lacked it: from /v1/loads
    assert s.max_running_reqs == 128.0  # the cap the scheduler runs (summed over DP ranks)
    assert s.gen_throughput_tok_s == 712.5
    assert dict(s.generation_tokens) == {"code": 100.0}
    assert s.moments is not None and s.moments[2] == pytest.approx(3.0)
    loads_req = next(r for r in seen if r.url.path == "/v1/loads")
    assert loads_req.url.params["include"] == "core,spec"


async def test_scrape_without_v1_loads_keeps_moments_missing() -> None:
    routes = {"/metrics": httpx.Response(200, text=METRICS)}
    async with _client(_routes(routes)) as client:
        s = await scrape(client, "http://x", profile="p", t_s=0.0)
    assert s.moments is None
    assert s.running_reqs == 7.0
    assert s.queue_reqs is None and s.max_running_reqs is None


async def test_scrape_bad_loads_json_is_not_fatal() -> None:
    routes = {
        "/metrics": httpx.Response(200, text=METRICS),
        "/v1/loads": httpx.Response(200, text="<html>"),
    }
    async with _client(_routes(routes)) as client:
        s = await scrape(client, "http://x", profile="p", t_s=0.0)
    assert s.moments is None and s.running_reqs == 7.0


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(500, text="oops"),
        httpx.Response(404, text="Not Found"),
        httpx.Response(200, text="<html><body>login</body></html>"),
    ],
)
async def test_scrape_metrics_failure_raises(response: httpx.Response) -> None:
    routes = {"/metrics": response, "/v1/loads": httpx.Response(200, json=LOADS)}
    async with _client(_routes(routes)) as client:
        with pytest.raises(ObserveError):
            await scrape(client, "http://x", profile="p", t_s=0.0)


async def test_scrape_transport_error_raises() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with _client(handler) as client:
        with pytest.raises(ObserveError, match="ConnectError"):
            await scrape(client, "http://x", profile="p", t_s=0.0)


async def test_server_info_and_fallback() -> None:
    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 2, "version": "0.5.23"}
    async with _client(_routes({"/server_info": httpx.Response(200, json=info)})) as c:
        assert await server_info(c, "http://x") == info
    seen: list[httpx.Request] = []
    old = {"speculative_algorithm": None, "version": "0.4.6"}
    async with _client(_routes({"/get_server_info": httpx.Response(200, json=old)}, seen)) as c:
        assert await server_info(c, "http://x/") == old
    assert [r.url.path for r in seen] == ["/server_info", "/get_server_info"]
    async with _client(_routes({})) as c:
        with pytest.raises(ObserveError, match="404"):
            await server_info(c, "http://x")
    for bad in (httpx.Response(200, text="nope"), httpx.Response(200, json=[1]),
                httpx.Response(503, text="starting")):  # fmt: skip
        async with _client(_routes({"/server_info": bad})) as c:
            with pytest.raises(ObserveError):
                await server_info(c, "http://x")


def test_bench_parse_reports_median() -> None:
    text = synth_large_exposition()
    r = observe.bench_parse(text, repeats=30)
    print(
        f"\nparse+reduce of {r['bytes'] / 1024:.0f} KiB: median {r['parse_ms_median']:.2f} ms "
        f"(target <= 5 ms incl. fetch), p90 {r['parse_ms_p90']:.2f} ms"
    )
    assert 0.0 < r["parse_ms_median"] < 100.0  # sanity only; not a timing test
    with pytest.raises(ValueError):
        observe.bench_parse(text, repeats=0)


@pytest.fixture
def loopback_metrics() -> Iterator[str]:
    body = synth_large_exposition().encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the daemon's client uses

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


async def test_bench_fetch_parse_loopback(loopback_metrics: str) -> None:
    r = await observe.bench_fetch_parse(loopback_metrics, repeats=20)
    print(
        f"\nloopback {r['bytes'] / 1024:.0f} KiB: fetch median {r['fetch_ms_median']:.2f} ms, "
        f"fetch+parse+reduce median {r['fetch_parse_ms_median']:.2f} ms (target <= 5 ms)"
    )
    assert r["bytes"] > 100_000
    assert 0.0 < r["fetch_ms_median"] < 500.0
    assert r["fetch_parse_ms_median"] > 0.0
