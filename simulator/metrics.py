"""The simulator's Prometheus exposition, spelled exactly as SGLang 0.5.23 spells it.

Owns: one dedicated `CollectorRegistry` with SGLang's metric families (names, types, label
names, help texts and default buckets read from srt/observability/metrics_collector.py of the
0.5.23 wheel), the scheduler label sets per TP/DP rank (only TP rank 0 reports unless
--enable-metrics-for-all-schedulers, as SGLang), the tokenizer label set (custom labels,
extra labels), and small typed methods the server calls. Must not: decide anything about the
simulation (values come from simulator.server), invent a metric name, or format text by hand.
All durations it receives are simulated seconds.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from simulator.flags import ServerArgs

# Default buckets of TokenizerMetricsCollector (metrics_collector.py, 0.5.23).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
    2400,
)  # fmt: skip
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
PROMPT_TOKENS_BUCKETS = (
    100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 12500,
    15000, 17500, 20000, 22500, 25000, 27500, 30000, 35000, 40000, 60000, 80000, 100000, 200000,
    300000, 400000, 600000, 800000, 1000000, 1100000,
)  # fmt: skip
GET_LOADS_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
# GRAPH_MEMORY_USAGE_KEYS of srt/model_executor/graph_memory_usage.py: every phase is reported.
CUDA_GRAPH_PHASES = (
    "prefill",
    "decode",
    "target_verify",
    "draft_prefill",
    "draft_decode",
    "draft_extend",
)
STARTUP_PHASES = ("load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e")
# Gauges SchedulerMetricsCollector.log_stats sets every --decode-log-interval decode steps.
SCHEDULER_GAUGES: dict[str, str] = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_grammar_queue_reqs": "The number of requests in the grammar waiting queue.",
    "gen_throughput": "The generation throughput (token/s).",
    "cache_hit_rate": "The prefix cache hit rate.",
    "decode_sum_seq_lens": "The sum of all sequence lengths in decode.",
    "token_usage": "The token usage.",
    "full_token_usage": "The token usage for full attention layers.",
    "swa_token_usage": "The token usage for SWA layers.",
    "mamba_usage": "The token usage for Mamba layers.",
    "num_used_tokens": "The number of used tokens.",
    "kv_available_tokens": "Number of free token slots in the KV cache pool.",
    "kv_evictable_tokens": "Number of evictable (radix-cached) token slots in the KV cache pool.",
    "kv_used_tokens": "Number of actively used token slots in the KV cache pool.",
    "spec_accept_length": "Mean acceptance length of speculative decoding (accepted drafts + "
    "bonus token per forward).",
    "spec_accept_rate": "Speculative acceptance rate (`accepted drafts / proposed drafts` in "
    "batch).",
    "spec_num_steps": "Currently active speculative_num_steps.",
    "spec_num_draft_tokens": "Currently active speculative_num_draft_tokens (decouples from steps "
    "under topk>1).",
    "num_retracted_reqs": "The number of retracted requests.",
    "num_paused_reqs": "The number of paused requests by async weight sync.",
    "utilization": "The utilization.",
    "new_token_ratio": "The new token ratio.",
    "is_cuda_graph": "Whether the batch is using CUDA graph.",
}
# Set once at startup (SchedulerMetricsCollector.emit_constants).
CONSTANT_GAUGES: dict[str, str] = {
    "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "page_size": "KV cache page size in tokens.",
    "num_pages": "Number of KV cache pages.",
    "context_len": "Maximum context length.",
}


class _MultiprocessView(Collector):
    """The registry as SGLang's multiprocess collector exposes it: without the `_created`
    samples a single-process registry adds to counters and histograms, and without families
    that have no series yet (the multiprocess files only hold what was set)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            if family.samples:
                yield family


@dataclass
class IntervalStats:
    """What one DP rank's scheduler logs at a --decode-log-interval boundary."""

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    decode_sum_seq_lens: int = 0
    token_usage: float = 0.0
    num_used_tokens: int = 0
    kv_available_tokens: int = 0
    spec_accept_length: float = 0.0
    spec_accept_rate: float = 0.0
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    num_paused_reqs: int = 0
    utilization: float = 0.0
    new_token_ratio: float = 0.0
    is_cuda_graph: int = 1

    def gauges(self) -> dict[str, float]:
        return {
            "num_running_reqs": self.num_running_reqs,
            "num_queue_reqs": self.num_queue_reqs,
            "num_grammar_queue_reqs": 0,
            "gen_throughput": self.gen_throughput,
            "cache_hit_rate": self.cache_hit_rate,
            "decode_sum_seq_lens": self.decode_sum_seq_lens,
            "token_usage": self.token_usage,
            "full_token_usage": self.token_usage,
            "swa_token_usage": 0.0,
            "mamba_usage": 0.0,
            "num_used_tokens": self.num_used_tokens,
            "kv_available_tokens": self.kv_available_tokens,
            "kv_evictable_tokens": 0,
            "kv_used_tokens": self.num_used_tokens,
            "spec_accept_length": self.spec_accept_length,
            "spec_accept_rate": self.spec_accept_rate,
            "spec_num_steps": self.spec_num_steps,
            "spec_num_draft_tokens": self.spec_num_draft_tokens,
            "num_retracted_reqs": 0,
            "num_paused_reqs": self.num_paused_reqs,
            "utilization": self.utilization,
            "new_token_ratio": self.new_token_ratio,
            "is_cuda_graph": self.is_cuda_graph,
        }


@dataclass
class _ItlBatch:
    """Inter-token latency observations gathered between two flushes (per label set)."""

    total_s: float = 0.0
    counts: list[int] = field(default_factory=lambda: [0] * (len(ITL_BUCKETS) + 1))


def scheduler_label_sets(args: ServerArgs) -> dict[int, list[dict[str, str]]]:
    """dp_rank -> label dicts of every TP rank's scheduler (tp_rank 0 first)."""
    out: dict[int, list[dict[str, str]]] = {}
    for dp in range(args.dp_size):
        ranks = []
        for tp in range(args.tp_size):
            labels = {
                "model_name": args.served_model_name,
                "engine_type": "unified",
                "tp_rank": str(tp),
                "pp_rank": "0",
                # runtime_context: tp_rank % (tp / moe_dp) // (tp / moe_dp / ep), moe_dp 1
                "moe_ep_rank": str(tp // (args.tp_size // args.ep_size)),
            }
            if args.dp_size > 1:
                labels["dp_rank"] = str(dp)
            labels.update(args.extra_metric_labels or {})
            ranks.append(labels)
        out[dp] = ranks
    return out


def tokenizer_base_labels(args: ServerArgs) -> dict[str, str]:
    """tokenizer_metric_labels(): custom labels start empty; each request fills them in."""
    labels = {"model_name": args.served_model_name, "engine_type": "unified"}
    for label in args.tokenizer_metrics_allowed_custom_labels or ():
        labels[label] = ""
    labels.update(args.extra_metric_labels or {})
    return labels


class SimMetrics:
    """SGLang 0.5.23's scheduler + tokenizer metric families on one dedicated registry."""

    def __init__(self, args: ServerArgs, *, device_timer: bool = False) -> None:
        self.args = args
        self.device_timer = device_timer
        self.registry = CollectorRegistry()
        self._view = _MultiprocessView(self.registry)
        self.rank_labels = scheduler_label_sets(args)
        # Only the stats-logging rank reports gauges and realtime tokens, unless every
        # scheduler is asked to (SchedulerMetricsCollector.init_new).
        self.reporting_labels = {
            dp: (ranks if args.enable_metrics_for_all_schedulers else ranks[:1])
            for dp, ranks in self.rank_labels.items()
        }
        self.tokenizer_labels = tokenizer_base_labels(args)
        self._allowed_custom = set(args.tokenizer_metrics_allowed_custom_labels or ())
        self._itl: dict[tuple[tuple[str, str], ...], _ItlBatch] = {}

        sched = list(next(iter(self.rank_labels.values()))[0].keys())
        tok = list(self.tokenizer_labels.keys())
        r = self.registry

        def gauge(name: str, doc: str, extra: Sequence[str] = (), labels: Sequence[str] = sched):
            return Gauge(f"sglang:{name}", doc, [*labels, *extra], registry=r)

        self.gauges = {name: gauge(name, doc) for name, doc in SCHEDULER_GAUGES.items()}
        self.constants = {name: gauge(name, doc) for name, doc in CONSTANT_GAUGES.items()}
        self.cuda_graph_passes = Counter(
            "sglang:cuda_graph_passes_total",
            "Total number of forward passes categorized by CUDA graph.",
            [*sched, "mode"],
            registry=r,
        )
        self.realtime_tokens = Counter(
            "sglang:realtime_tokens_total",
            "Total number of tokens processed (updated on each log interval). "
            "mode: prefill_compute, prefill_cache, decode.",
            [*sched, "mode"],
            registry=r,
        )
        self.prefill_effective_tokens = Counter(
            "sglang:prefill_effective_tokens_total",
            "Effective prefill tokens with retracted-request re-counts excluded, updated on "
            "each log interval. mode: device_hit, host_hit, storage_hit, input. Windowed prefix "
            "cache hit rate = rate(sum of *_hit) / rate(sum of all modes); per-tier rate uses a "
            "single *_hit mode in the numerator.",
            [*sched, "mode"],
            registry=r,
        )
        self.forward_execution_seconds = Counter(
            "sglang:forward_execution_seconds_total",
            "Total time that GPU is busy executing model forward passes. "
            "Refer to ForwardMode for category labels.",
            [*sched, "category"],
            registry=r,
        )
        self.scheduler_idle_seconds = Counter(
            "sglang:scheduler_idle_seconds_total",
            "Total wall time while the scheduler has no runnable or queued work.",
            sched,
            registry=r,
        )
        # Gauge children of the reporting ranks, resolved once (they are set many times a
        # second at high --sim-speed).
        self._gauge_children = {
            dp: {name: [g.labels(**labels) for labels in ranks] for name, g in self.gauges.items()}
            for dp, ranks in self.reporting_labels.items()
        }
        for ranks in self.reporting_labels.values():
            for labels in ranks:
                # SGLang pre-seeds these series at 0 so rate() has operands from the start.
                for mode in ("input", "device_hit", "host_hit", "storage_hit"):
                    self.prefill_effective_tokens.labels(**labels, mode=mode)
                self.scheduler_idle_seconds.labels(**labels)

        # Tokenizer side.
        self.startup_time = Gauge(
            "sglang:startup_time_seconds",
            "Engine startup duration by phase in seconds.",
            [*tok, "phase"],
            registry=r,
        )
        self.startup_cuda_graph_time = Gauge(
            "sglang:startup_cuda_graph_time_seconds",
            "CUDA graph capture duration by phase in seconds.",
            [*tok, "phase"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            [*tok, "is_streaming"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            [*tok, "is_streaming"],
            registry=r,
        )
        self.spec_verify_calls = Counter(
            "sglang:spec_verify_calls_total",
            "Number of speculative decoding verification calls.",
            tok,
            registry=r,
        )
        self.prompt_tokens_histogram = Histogram(
            "sglang:prompt_tokens_histogram",
            "Histogram of prompt token length.",
            tok,
            buckets=PROMPT_TOKENS_BUCKETS,
            registry=r,
        )
        self.uncached_prompt_tokens_histogram = Histogram(
            "sglang:uncached_prompt_tokens_histogram",
            "Histogram of uncached (compute) prompt token length.",
            tok,
            buckets=PROMPT_TOKENS_BUCKETS,
            registry=r,
        )
        self.generation_tokens_histogram = Histogram(
            "sglang:generation_tokens_histogram",
            "Histogram of generation token length.",
            tok,
            buckets=PROMPT_TOKENS_BUCKETS,
            registry=r,
        )
        self.num_requests = Counter(
            "sglang:num_requests_total",
            "Number of requests processed.",
            [*tok, "is_streaming"],
            registry=r,
        )
        self.get_loads_duration = Histogram(
            "sglang:get_loads_duration_seconds",
            "Time spent serving /v1/loads requests (seconds).",
            tok,
            buckets=GET_LOADS_BUCKETS,
            registry=r,
        )
        self.num_aborted_requests = Counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted.", tok, registry=r
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            [*tok, "is_streaming"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            tok,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "sglang:request_time_per_output_token_seconds",
            "Per-request TPOT in seconds: (finished_time - first_token_time) / "
            "(completion_tokens - 1).",
            [*tok, "is_streaming"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            [*tok, "is_streaming"],
            buckets=E2E_BUCKETS,
            registry=r,
        )

    # ---- labels -------------------------------------------------------------------------
    def request_labels(self, custom_labels: Mapping[str, object] | None) -> dict[str, str]:
        """Tokenizer labels of one request: only allowed custom labels are kept (as the
        OpenAI front end filters the header; a /generate body label outside the allowed set
        would make SGLang's collector raise, the simulator drops it)."""
        labels = dict(self.tokenizer_labels)
        for key, value in (custom_labels or {}).items():
            if key in self._allowed_custom:
                labels[key] = str(value)
        return labels

    # ---- startup --------------------------------------------------------------------------
    def emit_startup(self, startup: Mapping[str, float], cuda_graph: Mapping[str, float]) -> None:
        for phase in STARTUP_PHASES:
            self.startup_time.labels(**self.tokenizer_labels, phase=phase).set(startup[phase])
        for phase in CUDA_GRAPH_PHASES:
            value = float(cuda_graph.get(phase, 0.0))
            self.startup_cuda_graph_time.labels(**self.tokenizer_labels, phase=phase).set(value)

    def emit_constants(self, max_total_num_tokens: int, context_len: int | None) -> None:
        for ranks in self.reporting_labels.values():
            for labels in ranks:
                self.constants["max_total_num_tokens"].labels(**labels).set(max_total_num_tokens)
                self.constants["page_size"].labels(**labels).set(1)
                self.constants["num_pages"].labels(**labels).set(max_total_num_tokens)
                if context_len is not None:
                    self.constants["context_len"].labels(**labels).set(context_len)

    # ---- scheduler ------------------------------------------------------------------------
    def add_decode_passes(
        self, dp_rank: int, passes: int, decode_tokens: int, phase_s: Mapping[str, float]
    ) -> None:
        """Decode forwards since the last call: cuda_graph_passes counts on every TP rank
        (batch_result_processor gates it on --enable-metrics only), realtime tokens on the
        reporting ranks, forward_execution_seconds (device timer) on every rank."""
        if passes:
            for labels in self.rank_labels[dp_rank]:
                self.cuda_graph_passes.labels(**labels, mode="decode_cuda_graph").inc(passes)
        if decode_tokens:
            for labels in self.reporting_labels[dp_rank]:
                self.realtime_tokens.labels(**labels, mode="decode").inc(decode_tokens)
        if self.device_timer:
            for category, seconds in phase_s.items():
                if seconds > 0:
                    for labels in self.rank_labels[dp_rank]:
                        self.forward_execution_seconds.labels(**labels, category=category).inc(
                            seconds
                        )

    def add_prefill_tokens(self, dp_rank: int, tokens: int) -> None:
        if tokens:
            for labels in self.reporting_labels[dp_rank]:
                self.realtime_tokens.labels(**labels, mode="prefill_compute").inc(tokens)
                self.prefill_effective_tokens.labels(**labels, mode="input").inc(tokens)

    def add_idle_seconds(self, dp_rank: int, seconds: float) -> None:
        if seconds > 0:
            for labels in self.reporting_labels[dp_rank]:
                self.scheduler_idle_seconds.labels(**labels).inc(seconds)

    def log_stats(
        self, dp_rank: int, stats: IntervalStats, only: Sequence[str] | None = None
    ) -> None:
        """Set the scheduler gauges of one DP rank (all of them, or the names in `only`)."""
        values = stats.gauges()
        children = self._gauge_children[dp_rank]
        for name in values if only is None else only:
            value = values[name]
            for child in children[name]:
                child.set(value)

    # ---- tokenizer ------------------------------------------------------------------------
    def observe_ttft(self, labels: Mapping[str, str], seconds: float, *, stream: bool) -> None:
        self.ttft.labels(**labels, is_streaming=_bool(stream)).observe(seconds)

    def observe_itl(self, labels: Mapping[str, str], interval_s: float, new_tokens: int) -> None:
        """observe_inter_token_latency: `new_tokens` observations of interval/new_tokens,
        gathered here and applied in bulk by flush_itl() (SGLang bulk-updates the buckets too)."""
        if new_tokens <= 0:
            return
        key = tuple(labels.items())
        batch = self._itl.get(key)
        if batch is None:
            batch = self._itl[key] = _ItlBatch()
        batch.total_s += interval_s
        batch.counts[bisect_left(ITL_BUCKETS, interval_s / new_tokens)] += new_tokens

    def flush_itl(self) -> None:
        for key, batch in self._itl.items():
            child = self.itl.labels(**dict(key))
            # prometheus_client has no bulk observe; SGLang's observe_inter_token_latency
            # updates _sum and one bucket the same way (its buckets are not cumulative inside).
            child._sum.inc(batch.total_s)
            for i, n in enumerate(batch.counts):
                if n:
                    child._buckets[i].inc(n)
        self._itl.clear()

    def observe_finished(
        self,
        labels: Mapping[str, str],
        *,
        prompt_tokens: int,
        completion_tokens: int,
        e2e_s: float,
        tpot_s: float | None,
        spec_verify_ct: int,
        stream: bool,
    ) -> None:
        stream_labels = {**labels, "is_streaming": _bool(stream)}
        self.prompt_tokens.labels(**stream_labels).inc(prompt_tokens)
        self.generation_tokens.labels(**stream_labels).inc(completion_tokens)
        if spec_verify_ct > 0:
            self.spec_verify_calls.labels(**labels).inc(spec_verify_ct)
        self.num_requests.labels(**stream_labels).inc(1)
        self.e2e.labels(**stream_labels).observe(e2e_s)
        if tpot_s is not None:
            self.tpot.labels(**stream_labels).observe(tpot_s)
        self.prompt_tokens_histogram.labels(**labels).observe(prompt_tokens)
        self.uncached_prompt_tokens_histogram.labels(**labels).observe(prompt_tokens)
        self.generation_tokens_histogram.labels(**labels).observe(completion_tokens)

    def observe_aborted(self, labels: Mapping[str, str]) -> None:
        self.num_aborted_requests.labels(**labels).inc(1)

    def observe_get_loads(self, seconds: float) -> None:
        self.get_loads_duration.labels(**self.tokenizer_labels).observe(seconds)

    # ---- exposition -----------------------------------------------------------------------
    def exposition(self) -> bytes:
        self.flush_itl()
        return generate_latest(self._view)


def _bool(flag: bool) -> str:
    return "true" if flag else "false"
