"""The closed-loop load generator: mix parsing, live concurrency/mix changes, retries while the
server is down, and agreement with the server's own counters at high --sim-speed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.load import LoadGenerator, parse_mix, run_load
from tests.simulator.conftest import EAGLE2, LABELS, SimProcess, free_port, in_process


def test_parse_mix() -> None:
    assert parse_mix("chat=0.7,code=0.3") == {"chat": 0.7, "code": 0.3}
    assert parse_mix("math") == {"math": 1.0}
    for bad in ("", "chat=x", "=1", "chat=-1", "chat=0,code=0"):
        with pytest.raises(ValueError):
            parse_mix(bad)


async def test_live_concurrency_and_mix_changes() -> None:
    long = ["--sim-workload", "chat=0.8:3000", "--sim-workload", "code=0.9:3000"]
    async with in_process([*EAGLE2, *long, "--max-running-requests", "64"], speed=20) as s:
        gen = LoadGenerator("http://sim", concurrency=3, mix={"chat": 1.0}, client=s.client)
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(0.3)
        engine = s.sim.ranks[0].engine
        assert engine.num_running + engine.num_queued == 3
        gen.set_concurrency(7)
        gen.set_mix({"code": 1.0})
        await asyncio.sleep(0.3)
        assert engine.num_running + engine.num_queued == 7
        workloads = {r.workload for r in s.sim.requests.values()}
        assert "code" in workloads
        gen.set_concurrency(0)  # clients leave after their current request
        await gen.stop()
        stats = await asyncio.wait_for(task, 5)
        assert stats.failed == 0
        assert gen.concurrency == 0


async def test_failures_back_off_and_are_counted() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    stats = await run_load(url, concurrency=2, mix="chat", duration_s=0.6)
    assert stats.ok == 0
    # two clients, exponential back-off from 50 ms: a handful of attempts, not a spin
    assert 2 <= stats.failed <= 30
    assert stats.last_error is not None


async def test_returns_when_stop_event_set() -> None:
    stop = asyncio.Event()
    url = f"http://127.0.0.1:{free_port()}"
    task = asyncio.create_task(run_load(url, 1, {"chat": 1}, 60, stop_event=stop))
    await asyncio.sleep(0.1)
    stop.set()
    stats = await asyncio.wait_for(task, 5)
    assert stats.duration_s < 5


def test_against_live_simulator_at_high_speed(sim_process: type[SimProcess]) -> None:
    p = sim_process(
        ["--sim-override", "restart_s=50", "--sim-speed", "200", "--enable-metrics",
         *EAGLE2, *LABELS]
    )  # fmt: skip
    # Started before the server is up: refused connections and 503s are retried.
    stats = asyncio.run(run_load(p.url, 16, "chat=0.5,code=0.5", duration_s=3.0))
    assert stats.ok > 20
    assert set(stats.per_workload) == {"chat", "code"}
    text = httpx.get(f"{p.url}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    served = {
        s.labels["workload"]: s.value
        for s in fams["sglang:generation_tokens"].samples
        if s.name.endswith("_total")
    }
    for w, ws in stats.per_workload.items():
        # the server counts every finished request; the client may have been cancelled
        # while reading the last responses (at most one per client)
        assert served[w] >= ws.output_tokens
        assert served[w] - ws.output_tokens < 16 * 8 * 600
    assert stats.output_tok_s > 0


async def test_internal_route_drives_the_in_server_closed_loop() -> None:
    async with in_process([*EAGLE2, *LABELS, "--enable-metrics"], speed=200) as s:
        gen = LoadGenerator(
            "http://sim", concurrency=12, mix={"chat": 1.0}, route="internal", client=s.client
        )
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(0.4)
        engine = s.sim.ranks[0].engine
        assert engine.num_running + engine.num_queued == 12  # kept full by the server itself
        gen.set_concurrency(20)
        gen.set_mix({"code": 1.0})
        await asyncio.sleep(0.6)  # the driver pushes changes on its next poll
        assert engine.num_running + engine.num_queued == 20
        await gen.stop()
        stats = await asyncio.wait_for(task, 5)
        assert s.sim.internal.concurrency == 0  # stopped on the way out
        assert stats.ok > 10 and set(stats.per_workload) == {"chat", "code"}
        fams = {
            f.name: f for f in text_string_to_metric_families((await s.client.get("/metrics")).text)
        }
        served = sum(
            x.value for x in fams["sglang:generation_tokens"].samples if x.name.endswith("_total")
        )
        assert served >= stats.output_tokens > 0


def test_internal_counters_survive_a_server_restart() -> None:
    gen = LoadGenerator("http://x", route="internal")
    remote = {
        "ok": 5,
        "output_tokens": 500,
        "per_workload": {"chat": {"ok": 5, "output_tokens": 500}},
    }
    gen._absorb(remote)
    gen._absorb({**remote, "ok": 7, "output_tokens": 700,
                 "per_workload": {"chat": {"ok": 7, "output_tokens": 700}}})  # fmt: skip
    # restarted server: its counters start again from 0
    gen._absorb(
        {"ok": 2, "output_tokens": 150, "per_workload": {"chat": {"ok": 2, "output_tokens": 150}}}
    )
    assert gen.stats.ok == 9 and gen.stats.output_tokens == 850
    assert gen.stats.per_workload["chat"].ok == 9
