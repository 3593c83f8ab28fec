"""Synthetic SGLang 0.5.23-shaped /metrics expositions, written with prometheus_client.

Owns `synth_large_exposition`, the large exposition used to hold the observe pipeline to its
latency target and to test TP/DP folding: every TP rank reporting (as with
--enable-metrics-for-all-schedulers), ~40 scheduler gauges, scheduler counters, and the four
per-request latency histograms per workload. Values are deterministic functions of the rank, so a
wrong fold gives a visibly wrong number (non-zero TP ranks add 100s/1000s). It must not be used
as a source of realistic numbers: it models the shape (names, label sets, sizes), not a server.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from controller import sglang_names as sg

__all__ = ["SYNTH_WORKLOADS", "synth_large_exposition"]

MODEL = "kimi-k2.5"
# The last one is a request without the workload label: SGLang leaves the label "".
SYNTH_WORKLOADS: tuple[str, ...] = ("chat", "code", "math", "summarize", "agent", "")

# Scheduler gauges SGLang 0.5.23 exports besides the ones specpilot reads (filler of the right
# names, so the filter has realistic work to do).
_OTHER_GAUGES = (
    "sglang:num_grammar_queue_reqs",
    "sglang:cache_hit_rate",
    "sglang:decode_sum_seq_lens",
    "sglang:token_usage",
    "sglang:full_token_usage",
    "sglang:swa_token_usage",
    "sglang:mamba_usage",
    "sglang:num_used_tokens",
    "sglang:kv_available_tokens",
    "sglang:kv_evictable_tokens",
    "sglang:kv_used_tokens",
    "sglang:swa_available_tokens",
    "sglang:swa_evictable_tokens",
    "sglang:swa_used_tokens",
    "sglang:mamba_available_tokens",
    "sglang:mamba_evictable_tokens",
    "sglang:mamba_used_tokens",
    "sglang:spec_cap_length",
    "sglang:spec_block_accept_length",
    "sglang:num_retracted_reqs",
    "sglang:num_paused_reqs",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
    "sglang:num_decode_host_receive_queue_reqs",
    "sglang:pending_prealloc_token_usage",
    "sglang:utilization",
    "sglang:fwd_occupancy",
    "sglang:new_token_ratio",
    "sglang:is_cuda_graph",
    "sglang:context_len",
)

_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
_E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
    1800, 2400,
)  # fmt: skip


def _sched_value(role: str, tp: int, dp: int) -> float:
    """The folded answer is the tp=0 value of each DP rank; other TP ranks differ on purpose."""
    base = {
        "running": 32.0 + 4 * dp,
        "queue": 3.0 + dp,
        "gen": 900.0 + 10 * dp,
        "accept_len": 2.5 + 0.25 * dp,
        "accept_rate": 0.6 + 0.05 * dp,
        "steps": 3.0,
        "draft_tokens": 4.0,
    }[role]
    return base + (100.0 * tp if role in ("running", "queue", "gen") else 0.5 * tp)


class _SynthCollector(Collector):
    def __init__(self, tp: int, workloads: int, dp: int) -> None:
        self.tp = tp
        self.workloads = (
            SYNTH_WORKLOADS[:workloads]
            if workloads <= len(SYNTH_WORKLOADS)
            else (
                *SYNTH_WORKLOADS,
                *(f"w{i}" for i in range(workloads - len(SYNTH_WORKLOADS))),
            )
        )
        self.dp = dp

    def _ranks(self) -> Iterator[tuple[int, int, list[str]]]:
        for d in range(self.dp):
            for t in range(self.tp):
                labels = [MODEL, "unified", str(t), "0", str(t)]
                if self.dp > 1:
                    labels.append(str(d))
                yield d, t, labels

    def _sched_labelnames(self) -> list[str]:
        names = [
            sg.LABEL_MODEL_NAME,
            sg.LABEL_ENGINE_TYPE,
            sg.LABEL_TP_RANK,
            sg.LABEL_PP_RANK,
            sg.LABEL_MOE_EP_RANK,
        ]
        return [*names, sg.LABEL_DP_RANK] if self.dp > 1 else names

    def collect(self) -> Iterator[Metric]:
        ln = self._sched_labelnames()
        read = (
            (sg.NUM_RUNNING_REQS, "running"),
            (sg.NUM_QUEUE_REQS, "queue"),
            (sg.GEN_THROUGHPUT, "gen"),
            (sg.SPEC_ACCEPT_LENGTH, "accept_len"),
            (sg.SPEC_ACCEPT_RATE, "accept_rate"),
            (sg.SPEC_NUM_STEPS, "steps"),
            (sg.SPEC_NUM_DRAFT_TOKENS, "draft_tokens"),
        )
        for name, role in read:
            g = GaugeMetricFamily(name, f"SGLang gauge {name}.", labels=ln)
            for d, t, labels in self._ranks():
                g.add_metric(labels, _sched_value(role, t, d))
            yield g
        for i, name in enumerate(_OTHER_GAUGES):
            g = GaugeMetricFamily(name, f"SGLang gauge {name}.", labels=ln)
            for d, t, labels in self._ranks():
                g.add_metric(labels, float(i * 7 + t + d))
            yield g
        counters = (
            (sg.REALTIME_TOKENS, sg.LABEL_MODE, ("prefill_compute", "prefill_cache", "decode")),
            (
                sg.CUDA_GRAPH_PASSES,
                sg.LABEL_MODE,
                ("decode_cuda_graph", "decode_none", "prefill_cuda_graph", "prefill_none"),
            ),
            (
                sg.FORWARD_EXECUTION_SECONDS,
                sg.LABEL_CATEGORY,
                ("decode", "target_verify", "eagle_draft", "eagle_draft_extend", "extend", "idle"),
            ),
        )
        for name, extra, values in counters:
            c = CounterMetricFamily(name, f"SGLang counter {name}.", labels=[*ln, extra])
            for d, t, labels in self._ranks():
                for k, v in enumerate(values):
                    c.add_metric([*labels, v], (k + 1) * 1e5 * (d + 1) + 1e7 * t)
            yield c
        yield from self._tokenizer()

    def _tokenizer(self) -> Iterator[Metric]:
        base = [sg.LABEL_MODEL_NAME, sg.LABEL_ENGINE_TYPE, sg.LABEL_WORKLOAD]
        # A server sees streaming clients only here; series appear only once a request has them.
        streaming = ("true",)
        per_stream = (
            (sg.GENERATION_TOKENS, 1000.0),
            ("sglang:prompt_tokens", 3000.0),
            (sg.NUM_REQUESTS, 10.0),
        )
        for name, scale in per_stream:
            c = CounterMetricFamily(
                name, f"SGLang counter {name}.", labels=[*base, sg.LABEL_IS_STREAMING]
            )
            for i, w in enumerate(self.workloads):
                for s, st in enumerate(streaming):
                    c.add_metric([MODEL, "unified", w, st], scale * (i + 1) / (s + 1))
            yield c
        c = CounterMetricFamily(sg.SPEC_VERIFY_CALLS, "SGLang verify calls.", labels=base)
        for i, w in enumerate(self.workloads):
            c.add_metric([MODEL, "unified", w], 400.0 * (i + 1) * 1.5)
        yield c
        hists = (
            ("sglang:time_to_first_token_seconds", _TTFT_BUCKETS, True),
            ("sglang:inter_token_latency_seconds", _ITL_BUCKETS, False),
            ("sglang:request_time_per_output_token_seconds", _ITL_BUCKETS, True),
            ("sglang:e2e_request_latency_seconds", _E2E_BUCKETS, True),
        )
        for name, buckets, by_stream in hists:
            labelnames = [*base, sg.LABEL_IS_STREAMING] if by_stream else base
            h = HistogramMetricFamily(name, f"SGLang histogram {name}.", labels=labelnames)
            for i, w in enumerate(self.workloads):
                for st in streaming if by_stream else ("",):
                    cum = 0.0
                    rows: list[tuple[str, float]] = []
                    for j, le in enumerate(buckets):
                        cum += float((i + j) % 5)
                        rows.append((repr(float(le)), cum))
                    rows.append(("+Inf", cum + 1.0))
                    labels = [MODEL, "unified", w, *([st] if by_stream else [])]
                    h.add_metric(labels, rows, sum_value=cum * 0.37)
            yield h


def synth_large_exposition(tp: int = 8, workloads: int = 6, dp: int = 1) -> str:
    """SGLang 0.5.23-shaped exposition with `tp` TP ranks (x `dp` DP ranks) all reporting and
    `workloads` values of the `workload` label (~112 KB at the defaults)."""
    if tp < 1 or dp < 1 or workloads < 1:
        raise ValueError("tp, dp and workloads must be >= 1")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SynthCollector(tp, workloads, dp))
    return generate_latest(registry).decode()
