"""The simulator's /metrics against SGLang 0.5.23's families (the shared TSV), label sets,
buckets, rank reporting rules, and the consistency of counters with request outcomes."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from simulator.faults import Faults, metrics_fault_response
from simulator.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from tests.simulator.conftest import EAGLE2, LABELS, in_process, tsv_families

SCHED = ["engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"]


async def _exposition(argv: list[str], n: int = 8, workloads=("chat", "code"), **kw) -> str:
    """Serve n requests (every other one streamed) and return /metrics."""
    async with in_process(["--enable-metrics", *argv], **kw) as s:
        bodies = [
            {"text": "hello" * 20, "stream": i % 2 == 1,
             "custom_labels": {"workload": workloads[i % len(workloads)]}}
            for i in range(n)
        ]  # fmt: skip
        await asyncio.gather(*[s.client.post("/generate", json=b) for b in bodies])
        r = await s.client.get("/metrics")
        assert r.status_code == 200
        return r.text


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(fam, suffix: str = "") -> list[Sample]:
    return [s for s in fam.samples if s.name == fam.name + suffix]


async def test_every_family_is_sglangs_with_its_type() -> None:
    text = await _exposition([*EAGLE2, *LABELS, "--decode-log-interval", "10"])
    tsv = tsv_families()
    fams = _families(text)
    for name, fam in fams.items():
        exposed = name + "_total" if fam.type == "counter" else name
        assert exposed in tsv, f"{exposed} is not an SGLang 0.5.23 family"
        assert tsv[exposed] == fam.type, exposed
    required = {
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
        "sglang:token_usage", "sglang:cache_hit_rate", "sglang:spec_accept_length",
        "sglang:spec_accept_rate", "sglang:spec_num_steps", "sglang:spec_num_draft_tokens",
        "sglang:realtime_tokens", "sglang:cuda_graph_passes", "sglang:generation_tokens",
        "sglang:prompt_tokens", "sglang:spec_verify_calls", "sglang:num_requests",
        "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
        "sglang:request_time_per_output_token_seconds", "sglang:e2e_request_latency_seconds",
        "sglang:startup_time_seconds", "sglang:startup_cuda_graph_time_seconds",
    }  # fmt: skip
    assert required <= fams.keys()
    assert "sglang:forward_execution_seconds" not in fams  # needs the device timer env


async def test_label_sets_and_buckets() -> None:
    fams = _families(await _exposition([*EAGLE2, *LABELS, "--decode-log-interval", "10"]))
    g = fams["sglang:num_running_reqs"].samples[0]
    assert sorted(g.labels) == SCHED
    assert g.labels["tp_rank"] == "0" and g.labels["engine_type"] == "unified"
    gen = _samples(fams["sglang:generation_tokens"], "_total")
    assert {s.labels["workload"] for s in gen} == {"chat", "code"}
    assert sorted(gen[0].labels) == ["engine_type", "is_streaming", "model_name", "workload"]
    v = _samples(fams["sglang:spec_verify_calls"], "_total")[0]
    assert sorted(v.labels) == ["engine_type", "model_name", "workload"]
    for fam_name, buckets in (
        ("sglang:time_to_first_token_seconds", TTFT_BUCKETS),
        ("sglang:e2e_request_latency_seconds", E2E_BUCKETS),
        ("sglang:request_time_per_output_token_seconds", ITL_BUCKETS),
    ):
        les = [s.labels["le"] for s in _samples(fams[fam_name], "_bucket")]
        first = les[: len(buckets) + 1]
        assert [float(x) for x in first[:-1]] == [float(b) for b in buckets]
        assert first[-1] == "+Inf"
    phases = {s.labels["phase"] for s in fams["sglang:startup_time_seconds"].samples}
    assert phases == {"load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e"}
    graph = {s.labels["phase"] for s in fams["sglang:startup_cuda_graph_time_seconds"].samples}
    assert graph == {"prefill", "decode", "target_verify", "draft_prefill", "draft_decode",
                     "draft_extend"}  # fmt: skip


async def test_counters_agree_with_requests() -> None:
    async with in_process(
        ["--enable-metrics", *EAGLE2, *LABELS, "--decode-log-interval", "5"]
    ) as s:
        metas = []
        for i in range(6):
            r = await s.client.post(
                "/generate",
                json={"text": "x" * 40, "custom_labels": {"workload": ["chat", "math"][i % 2]}},
            )
            metas.append((["chat", "math"][i % 2], r.json()["meta_info"]))
        fams = _families((await s.client.get("/metrics")).text)
    gen = {
        s.labels["workload"]: s.value for s in _samples(fams["sglang:generation_tokens"], "_total")
    }
    ver = {
        s.labels["workload"]: s.value for s in _samples(fams["sglang:spec_verify_calls"], "_total")
    }
    req = {s.labels["workload"]: s.value for s in _samples(fams["sglang:num_requests"], "_total")}
    for w in ("chat", "math"):
        ms = [m for wl, m in metas if wl == w]
        assert gen[w] == sum(m["completion_tokens"] for m in ms)
        assert ver[w] == sum(m["spec_verify_ct"] for m in ms)
        assert req[w] == len(ms)
        assert 1.0 < gen[w] / ver[w] <= 3.0  # accept length incl. bonus, at most steps + 1
    passes = _samples(fams["sglang:cuda_graph_passes"], "_total")
    assert passes and passes[0].labels["mode"] == "decode_cuda_graph"
    decode_tokens = [
        s.value for s in _samples(fams["sglang:realtime_tokens"], "_total")
        if s.labels["mode"] == "decode"
    ]  # fmt: skip
    # decode tokens exclude the first token of each request (it comes from prefill)
    assert decode_tokens[0] == sum(m["completion_tokens"] for _, m in metas) - len(metas)
    acc = fams["sglang:spec_accept_length"].samples[0].value
    assert 1.0 < acc <= 3.0
    assert fams["sglang:spec_num_steps"].samples[0].value == 2
    assert fams["sglang:spec_num_draft_tokens"].samples[0].value == 3


async def test_baseline_spec_gauges_zero() -> None:
    fams = _families(await _exposition(["--decode-log-interval", "5"]))
    assert fams["sglang:spec_accept_length"].samples[0].value == 0
    assert fams["sglang:spec_num_steps"].samples[0].value == 0
    assert "sglang:spec_verify_calls" not in fams or not fams["sglang:spec_verify_calls"].samples


async def test_rank_reporting_rules() -> None:
    text = await _exposition(["--tp-size", "4", "--decode-log-interval", "5"])
    fams = _families(text)
    assert {s.labels["tp_rank"] for s in fams["sglang:num_running_reqs"].samples} == {"0"}
    passes = _samples(fams["sglang:cuda_graph_passes"], "_total")
    assert {s.labels["tp_rank"] for s in passes} == {"0", "1", "2", "3"}  # every rank counts
    text = await _exposition(
        ["--tp-size", "4", "--enable-metrics-for-all-schedulers", "--decode-log-interval", "5"]
    )
    fams = _families(text)
    assert {s.labels["tp_rank"] for s in fams["sglang:num_running_reqs"].samples} == {
        "0", "1", "2", "3"
    }  # fmt: skip
    text = await _exposition(
        ["--dp-size", "2", "--extra-metric-labels", '{"cluster": "a"}', "--decode-log-interval",
         "5"], n=12
    )  # fmt: skip
    fams = _families(text)
    g = fams["sglang:num_running_reqs"].samples
    assert {s.labels["dp_rank"] for s in g} == {"0", "1"}
    assert all(s.labels["cluster"] == "a" for s in g)
    assert all(s.labels["cluster"] == "a" for s in fams["sglang:num_requests"].samples)


async def test_device_timer_phases() -> None:
    fams = _families(await _exposition(EAGLE2, device_timer=True))
    cats = {
        s.labels["category"]: s.value
        for s in _samples(fams["sglang:forward_execution_seconds"], "_total")
    }
    assert {"extend", "target_verify", "eagle_draft", "eagle_draft_extend"} <= cats.keys()
    assert cats["target_verify"] > cats["eagle_draft"] > 0  # verify dominates (FIELD.md)
    base = _families(await _exposition([], device_timer=True))
    cats = {
        s.labels["category"] for s in _samples(base["sglang:forward_execution_seconds"], "_total")
    }
    assert cats == {"extend", "decode"}


async def test_metrics_faults() -> None:
    r = metrics_fault_response("500")
    assert r.status_code == 500
    garbage = metrics_fault_response("garbage")
    assert garbage.status_code == 200
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(garbage.body.decode()))
    async with in_process(["--enable-metrics", "--sim-fault-metrics", "500"]) as s:
        assert s.sim.faults == Faults(metrics="500")
        assert (await s.client.get("/metrics")).status_code == 500
        assert (await s.client.get("/health")).status_code == 200  # the rest still works


async def test_moe_ep_rank_follows_ep_size() -> None:
    text = await _exposition(
        ["--tp-size", "4", "--ep-size", "4", "--enable-metrics-for-all-schedulers",
         "--decode-log-interval", "5"]
    )  # fmt: skip
    g = _families(text)["sglang:num_running_reqs"].samples
    assert {(s.labels["tp_rank"], s.labels["moe_ep_rank"]) for s in g} == {
        ("0", "0"), ("1", "1"), ("2", "2"), ("3", "3")
    }  # fmt: skip
