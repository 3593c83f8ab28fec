"""Endpoint shapes of the simulated SGLang 0.5.23 server (in-process, accelerated time)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.simulator.conftest import EAGLE2, LABELS, in_process

# A workload whose requests run for thousands of tokens (simulated minutes): always in flight.
LONG = ["--sim-workload", "long=0.5:20000"]
SPEC_META = {
    "spec_accept_rate",
    "spec_accept_length",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_verify_ct",
}


def _check_spec_meta(meta: dict, draft_tokens: int) -> None:
    assert meta.keys() >= SPEC_META
    v = meta["spec_verify_ct"]
    hist = meta["spec_correct_drafts_histogram"]
    assert len(hist) == draft_tokens  # 0 .. steps accepted drafts
    assert sum(hist) == v
    assert sum(k * n for k, n in enumerate(hist)) == meta["spec_num_correct_drafts"]
    assert meta["spec_num_proposed_drafts"] == v * (draft_tokens - 1)
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / v)
    assert meta["spec_accept_rate"] == pytest.approx(
        meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"]
    )


async def test_generate_non_streaming_spec_meta() -> None:
    async with in_process([*EAGLE2, *LABELS]) as s:
        r = await s.client.post(
            "/generate",
            json={"text": "x" * 400, "custom_labels": {"workload": "code"}},
        )
        assert r.status_code == 200
        body = r.json()
        assert set(body) == {"text", "output_ids", "meta_info"}
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == 100  # ~4 characters per token
        assert meta["completion_tokens"] == len(body["output_ids"]) > 1
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert meta["e2e_latency"] > 0
        _check_spec_meta(meta, draft_tokens=3)


async def test_generate_length_cap_and_input_ids() -> None:
    async with in_process(EAGLE2) as s:
        r = await s.client.post(
            "/generate", json={"input_ids": [1] * 37, "sampling_params": {"max_new_tokens": 5}}
        )
        meta = r.json()["meta_info"]
        assert meta["prompt_tokens"] == 37
        assert meta["completion_tokens"] == 5
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        bad = await s.client.post("/generate", json={"sampling_params": {}})
        assert bad.status_code == 400
        bad = await s.client.post(
            "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": "x"}}
        )
        assert bad.status_code == 400


async def test_generate_streaming_is_cumulative_and_ends_with_done() -> None:
    async with in_process(EAGLE2, speed=5) as s:
        r = await s.client.post(
            "/generate",
            json={"text": "hi there", "stream": True, "sampling_params": {"max_new_tokens": 40}},
        )
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert len(chunks) > 2
        counts = [c["meta_info"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 40
        assert all(len(c["output_ids"]) == c["meta_info"]["completion_tokens"] for c in chunks)
        assert chunks[0]["meta_info"]["finish_reason"] is None
        _check_spec_meta(chunks[-1]["meta_info"], draft_tokens=3)


async def test_baseline_has_no_spec_meta() -> None:
    async with in_process([]) as s:
        r = await s.client.post("/generate", json={"text": "hi"})
        meta = r.json()["meta_info"]
        assert not SPEC_META & meta.keys()
        assert meta["completion_tokens"] >= 1


async def test_openai_completions_and_chat() -> None:
    async with in_process([*EAGLE2, *LABELS, "--enable-metrics"]) as s:
        hdr = {"x-custom-labels": json.dumps({"workload": "math", "other": "dropped"})}
        r = await s.client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "abcd" * 10, "max_tokens": 12,
                  "return_spec_tokens_details": True},
            headers=hdr,
        )  # fmt: skip
        body = r.json()
        assert body["object"] == "text_completion"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 12
        assert body["usage"]["prompt_tokens"] == 10
        det = body["sglext"]["spec_tokens_details"]
        assert det["spec_verify_ct"] == sum(det["spec_correct_drafts_histogram"])
        r = await s.client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hello"}]},
            headers=hdr,
        )
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["message"]["content"]
        assert "sglext" not in body  # only with return_spec_tokens_details
        text = s.sim.metrics.exposition().decode()
        assert 'workload="math"' in text and "other=" not in text


async def test_openai_streaming_chat_with_usage_and_sglext() -> None:
    async with in_process([*EAGLE2, *LABELS]) as s:
        r = await s.client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                  "max_tokens": 20, "stream_options": {"include_usage": True},
                  "return_spec_tokens_details": True},
        )  # fmt: skip
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finals and finals[0]["choices"][0]["finish_reason"] == "length"
        sglext = [c["sglext"] for c in chunks if "sglext" in c]
        assert sglext and sglext[0]["spec_tokens_details"]["spec_verify_ct"] > 0
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
        content = "".join(
            c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]
        )
        assert content.strip()


async def test_v1_loads_core_spec_and_moments() -> None:
    async with in_process([*EAGLE2, "--decode-log-interval", "5"]) as s:
        r = await s.client.get("/v1/loads", params={"include": "core,spec"})
        body = r.json()
        assert body["version"] == "0.5.23" and len(body["loads"]) == 1
        load = body["loads"][0]
        assert load["decode_moments"] is None  # no decode step yet
        assert "speculative" not in load
        await asyncio.gather(*[s.client.post("/generate", json={"text": "hi"}) for _ in range(6)])
        load = (await s.client.get("/v1/loads", params={"include": "core,spec"})).json()
        load = load["loads"][0]
        for key in ("num_running_reqs", "num_waiting_reqs", "gen_throughput", "token_usage",
                    "max_running_requests", "dp_rank"):  # fmt: skip
            assert key in load
        assert load["max_running_requests"] == 48
        n, sbs, sus, sbs2, sbsus, gen = load["decode_moments"]
        assert n > 0 and sbs >= n and sus > 0 and gen >= sbs
        assert sbs2 >= sbs * sbs / n - 1e-6  # Cauchy-Schwarz: moments are consistent
        assert sbsus >= sus  # every batch has at least one sequence
        spec = load["speculative"]
        assert set(spec) == {"accept_length", "accept_rate"}
        assert 1.0 <= spec["accept_length"] <= 3.0
        core = (await s.client.get("/v1/loads", params={"include": "core"})).json()["loads"][0]
        assert "speculative" not in core and "queues" not in core
        full = (await s.client.get("/v1/loads")).json()["loads"][0]
        assert {"speculative", "queues", "disaggregation"} <= full.keys()
        assert (await s.client.get("/v1/loads", params={"include": "bogus"})).status_code == 400
        prom = await s.client.get("/v1/loads", params={"format": "prometheus"})
        assert 'sglang_num_running_reqs{dp_rank="0"}' in prom.text


async def test_server_info_and_alias() -> None:
    async with in_process([*EAGLE2, "--decode-log-interval", "5", "--dp-size", "2"]) as s:
        await asyncio.gather(*[s.client.post("/generate", json={"text": "hi"}) for _ in range(8)])
        info = (await s.client.get("/server_info")).json()
        assert info["version"] == "0.5.23"
        assert info["speculative_algorithm"] == "EAGLE3"
        assert info["speculative_num_steps"] == 2
        assert info["speculative_eagle_topk"] == 1
        assert info["speculative_num_draft_tokens"] == 3
        assert info["max_running_requests"] == 48
        assert "--speculative-num-steps 2" in info["launch_command"]
        states = info["internal_states"]
        assert len(states) == 2
        for st in states:
            assert st["speculative_num_steps"] == 2
            assert "last_gen_throughput" in st
        assert any("avg_spec_accept_length" in st for st in states)
        alias = (await s.client.get("/get_server_info")).json()
        assert alias.keys() == info.keys()


async def test_health_ready_pause_continue() -> None:
    async with in_process([*EAGLE2, *LONG], speed=50, up=False) as s:
        assert (await s.client.get("/health")).status_code == 503
        assert (await s.client.get("/ready")).status_code == 503
        assert (await s.client.post("/generate", json={"text": "a"})).status_code == 503
        s.sim.status = "up"
        assert (await s.client.get("/health")).status_code == 200
        assert (await s.client.get("/health_generate")).status_code == 200
        assert (await s.client.get("/ready")).status_code == 200
        long = asyncio.create_task(
            s.client.post("/generate", json={"text": "a", "custom_labels": {"workload": "long"}})
        )
        await asyncio.sleep(0.05)
        r = await s.client.post("/pause_generation", json={"mode": "abort"})
        assert r.json()["status"] == "ok"
        meta = (await long).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert (await s.client.get("/ready")).status_code == 503
        waiting = asyncio.create_task(s.client.post("/generate", json={"text": "a"}))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # paused: accepted but not served
        await s.client.post("/continue_generation", json={})
        assert (await waiting).status_code == 200
        assert (await s.client.get("/ready")).status_code == 200
        bad = await s.client.post("/pause_generation", json={"mode": "freeze"})
        assert bad.status_code == 422


async def test_flush_cache_resets_lifetime_accept_length() -> None:
    async with in_process([*EAGLE2, *LONG, "--decode-log-interval", "5"], speed=200) as s:
        await asyncio.gather(*[s.client.post("/generate", json={"text": "a"}) for _ in range(4)])
        info = (await s.client.get("/server_info")).json()
        assert "avg_spec_accept_length" in info["internal_states"][0]
        long = asyncio.create_task(
            s.client.post("/generate", json={"text": "a", "custom_labels": {"workload": "long"}})
        )
        await asyncio.sleep(0.05)
        assert (await s.client.post("/flush_cache")).status_code == 400  # work in flight
        await long
        assert (await s.client.post("/flush_cache")).status_code == 200
        info = (await s.client.get("/server_info")).json()
        assert "avg_spec_accept_length" not in info["internal_states"][0]


async def test_model_info_and_metrics_disabled() -> None:
    async with in_process([]) as s:
        info = (await s.client.get("/model_info")).json()
        assert info["model_path"] == "kimi" and info["is_generation"] is True
        assert (await s.client.get("/metrics")).status_code == 404  # no --enable-metrics


async def test_time_runs_speed_times_faster() -> None:
    # 200 cycles of a 2-step EAGLE-3 at batch 1 take ~4 simulated seconds on the tuned
    # profile; at 100x the wall time is ~40 ms, at 10x ~400 ms. The server paces itself, so a
    # request never finishes sooner than its simulated time / speed; a loaded host (CI runs
    # other tests beside this one) only adds wall time (HTTP, scheduling), so the upper bounds
    # are loose: they catch a server that ignores --sim-speed (10x slower or faster), not load.
    async def one(speed: float) -> tuple[float, float]:
        async with in_process(EAGLE2, speed=speed) as s:
            t = time.monotonic()
            r = await s.client.post(
                "/generate", json={"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 400}}
            )
            return time.monotonic() - t, r.json()["meta_info"]["e2e_latency"]

    wall_fast, sim_fast = await one(100)
    wall_slow, sim_slow = await one(10)
    assert sim_fast / 100 * 0.9 <= wall_fast < sim_fast / 100 * 4 + 0.5
    assert sim_slow / 10 * 0.9 <= wall_slow < sim_slow / 10 * 4


async def test_cost_scale_endpoint_slows_verify() -> None:
    async with in_process(EAGLE2, speed=1000) as s:
        body = {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 200}}
        before = (await s.client.post("/generate", json=body)).json()["meta_info"]
        r = await s.client.post("/sim/cost_scale", json={"verify": 2.0})
        assert r.json() == {"verify": 2.0, "base": 1.0, "draft": 1.0}
        after = (await s.client.post("/generate", json=body)).json()["meta_info"]
        # verify is ~95% of a cycle (FIELD.md): doubling it nearly doubles the decode time
        per_verify_before = before["e2e_latency"] / before["spec_verify_ct"]
        per_verify_after = after["e2e_latency"] / after["spec_verify_ct"]
        assert 1.5 < per_verify_after / per_verify_before < 2.1
        assert (await s.client.post("/sim/cost_scale", json={"gpu": 2})).status_code == 400
        assert (await s.client.post("/sim/cost_scale", json={"verify": -1})).status_code == 400


async def test_adaptive_launch_reports_live_tier() -> None:
    argv = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
            "--speculative-adaptive", "--decode-log-interval", "5", "--enable-metrics"]  # fmt: skip
    async with in_process(argv) as s:
        await asyncio.gather(*[s.client.post("/generate", json={"text": "a"}) for _ in range(4)])
        info = (await s.client.get("/server_info")).json()
        assert info["speculative_adaptive"] is True
        assert info["internal_states"][0]["speculative_num_steps"] in (0, 1, 3, 5, 7)
        text = (await s.client.get("/metrics")).text
        steps = [ln for ln in text.splitlines() if ln.startswith("sglang:spec_num_steps{")]
        assert float(steps[0].rsplit(" ", 1)[1]) in (0, 1, 3, 5, 7)


async def test_a_closing_server_aborts_what_slipped_in_and_refuses_the_rest() -> None:
    """The SIGTERM drain found nothing in flight, and a client retrying an aborted request got
    one in while generation was paused: closing aborts it (an answer, where uvicorn's shutdown
    cancelled its handler and logged a traceback per request), and refuses what comes later."""
    async with in_process([*EAGLE2]) as s:
        await s.client.post("/pause_generation", json={"mode": "abort"})
        waiting = asyncio.create_task(s.client.post("/generate", json={"text": "a"}))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        s.sim.close()
        r = await asyncio.wait_for(waiting, 2)
        assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
        for path, body in (
            ("/generate", {"text": "a"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ):
            late = await s.client.post(path, json=body)
            assert late.status_code == 503 and "shutting down" in late.text
