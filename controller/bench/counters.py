"""The counters one simulated SGLang process keeps, fed by `simulator.engine.WindowEngine` windows.

Owns `ServerCounters`: cumulative per-workload generation tokens, verify calls and requests, decode
tokens, decode passes, the six decode moments of /v1/loads and the accepted-drafts histogram,
all since the process started (as SGLang's are), plus the gauges of its last window; and the
Snapshot fields a scrape reads from them. The virtual servers of the policy bench
(controller.bench.harness) and of the estimator bench (controller.estimator_bench) both count
this way. Must not: know about time, phases, restarts or policies (its owner does).
"""

from __future__ import annotations

from typing import Any

from simulator.engine import WindowResult


class ServerCounters:
    """Mixed into a virtual server: `_reset_counters` at each launch, `_accumulate` per window."""

    gen: dict[str, float]
    ver: dict[str, float]
    req: dict[str, float]
    decode_tokens: float
    cycles: float
    moments: list[float]
    hist: list[float]
    last: WindowResult | None

    def _reset_counters(self, hist_len: int) -> None:
        """A new process: every counter at 0 (the accepted-drafts histogram exists, all zeros,
        with `hist_len` buckets, as the simulator reports it)."""
        self.gen = {}
        self.ver = {}
        self.req = {}
        self.decode_tokens = 0.0
        self.cycles = 0.0
        self.moments = [0.0] * 6
        self.hist = [0.0] * hist_len
        self.last = None

    def _accumulate(self, r: WindowResult) -> None:
        for src, dst in (
            (r.generation_tokens, self.gen),
            (r.verify_calls, self.ver),
            (r.requests, self.req),
        ):
            for k, v in src.items():
                dst[k] = dst.get(k, 0.0) + v
        # SGLang counts decode tokens (realtime_tokens_total{mode="decode"}, decode_moments) from
        # decode/verify cycles only: each request's first token comes from its prefill.
        decode = max(0.0, r.output_tokens - sum(r.requests.values()))
        self.decode_tokens += decode
        self.cycles += r.cycles
        self.moments = [
            a + b
            for a, b in zip(
                self.moments,
                (r.cycles, r.sum_bs, r.sum_step_s, r.sum_bs2, r.sum_bs_step_s, decode),
                strict=True,
            )
        ]
        h = r.accepted_drafts_hist
        if len(h) > len(self.hist):  # an adaptive server's tiers can reach further
            self.hist += [0.0] * (len(h) - len(self.hist))
        self.hist[: len(h)] = [a + float(b) for a, b in zip(self.hist, h, strict=False)]
        self.last = r

    def _window_gauges(
        self, speculative: bool
    ) -> tuple[float | None, float | None, float | None, float | None]:
        """Of the last window: running and queued requests, gen_throughput, and the mean number
        of accepted drafts per verify (None without a speculative window that verified)."""
        r = self.last
        if r is None:
            return None, None, None, None
        gen_tp = r.output_tokens / r.duration_s if r.duration_s > 0 else 0.0
        mean_acc = None
        h = r.accepted_drafts_hist
        total = sum(h)
        if speculative and total > 0:
            mean_acc = sum(k * x for k, x in enumerate(h)) / total
        return r.mean_running, r.mean_queued, gen_tp, mean_acc

    def _counter_fields(self, speculative: bool) -> dict[str, Any]:
        """The cumulative Snapshot fields (a baseline server has no verify calls or histogram)."""
        return {
            "generation_tokens": dict(self.gen),
            "verify_calls": dict(self.ver) if speculative else {},
            "requests": dict(self.req),
            "decode_tokens": self.decode_tokens,
            "decode_passes": self.cycles,
            "moments": tuple(self.moments),
            "accepted_drafts_hist": tuple(self.hist) if speculative else None,
        }
