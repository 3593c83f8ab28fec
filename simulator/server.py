"""The simulated SGLang 0.5.23 server: request lifecycle, the decode loop and the HTTP API.

Owns: `Simulation` (one `StepEngine` per DP rank, a virtual clock running `--sim-speed` times
faster than the wall clock, the decode loop that steps the engines and delivers tokens, SGLang's
scheduler bookkeeping: log-interval gauges, spec counters, decode moments, lifetime accept
length) and `create_app` (SGLang's endpoints and JSON shapes, read from the 0.5.23 wheel:
srt/entrypoints/http_server.py, v1_loads.py, openai/protocol.py, managers/tokenizer_manager.py).
Must not: model costs or acceptance (simulator.model / simulator.engine do), parse flags
(simulator.flags), or import controller, store or policies.

Time: every duration reported (latency histograms, decode_moments, startup gauges, gen_throughput)
is in simulated seconds; wall-clock rates are `--sim-speed` times the simulated ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from simulator.faults import Faults, SlowResponses, metrics_fault_response
from simulator.flags import SGLANG_VERSION, ServerArgs
from simulator.metrics import IntervalStats, SimMetrics
from simulator.model import CostScale, SimProfile, SpecConfig

logger = logging.getLogger("simulator.server")

# SGLang constants (0.5.23).
GEN_THROUGHPUT_STALENESS_S = 30.0  # metrics_reporter.GEN_THROUGHPUT_STALENESS_SECONDS
SIGTERM_POLL_S = 5.0  # tokenizer_manager.sigterm_watchdog polls every 5 s
VALID_LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
# Wall seconds between two wake-ups of the decode loop while busy: it steps the engines up to
# one tick ahead of the virtual clock and delivers every token whose step has ended. Small
# enough for smooth streaming, large enough that 200x time does not spin a core on sleeps.
DEFAULT_TICK_S = 0.005
# Filler vocabulary for generated text (the content of tokens is not simulated).
FILLER_WORDS = (
    " the", " model", " drafts", " tokens", " and", " the", " target", " verifies", " them",
    " in", " one", " pass", " so", " speculation", " pays", " when", " most", " are",
    " accepted", " by", " a", " cheap", " head", ".",
)  # fmt: skip
FILLER_TOKEN_ID_BASE = 1000
EOS_TOKEN_ID = 2


class EngineLike(Protocol):
    """What the server needs of simulator.engine.StepEngine."""

    num_running: int
    num_queued: int

    def add_request(
        self, rid: str, workload: str, prompt_tokens: int, max_new_tokens: int | None = None
    ) -> None: ...

    def abort(self, rid: str) -> None: ...

    def advance_idle(self, duration_s: float) -> None: ...

    def step(self) -> Any: ...

    scale: Any  # CostScale, settable (drift)


EngineFactory = Callable[[int], EngineLike]  # dp_rank -> engine


@dataclass
class SimRequest:
    """One request's server-side state; times are virtual seconds."""

    rid: str
    dp_rank: int
    workload: str
    labels: dict[str, str]
    prompt_tokens: int
    max_new_tokens: int | None
    stream: bool
    arrival_v: float
    tokens: int = 0
    first_token_v: float | None = None
    last_token_v: float | None = None
    finish_v: float | None = None
    result: Any = None  # FinishedRequest once done
    aborted: bool = False
    internal: bool = False  # sent by the in-server closed loop (POST /sim/load)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.result is not None or self.aborted


@dataclass
class InternalLoad:
    """Closed-loop clients simulated inside the server (`POST /sim/load`): the same requests
    as HTTP clients would send, without one HTTP round trip per request, so that high
    --sim-speed and concurrency stay closed-loop on a small host. They send nothing new while
    generation is paused or the server drains, as a router stops routing to a server whose
    /ready is 503 (SGLang's is_ready() is false while paused or after SIGTERM; a request that
    does arrive while paused waits in SGLang's tokenizer manager and holds the SIGTERM drain)."""

    concurrency: int = 0
    mix: dict[str, float] = field(default_factory=lambda: {"default": 1.0})
    prompt_tokens: int = 256
    max_new_tokens: int | None = None
    in_flight: set[str] = field(default_factory=set)
    ok: int = 0
    output_tokens: int = 0
    per_workload: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "mix": self.mix,
            "prompt_tokens": self.prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
            "in_flight": len(self.in_flight),
            "ok": self.ok,
            "output_tokens": self.output_tokens,
            "per_workload": self.per_workload,
        }


@dataclass
class RankState:
    """Scheduler bookkeeping of one DP rank (SGLang's SchedulerMetricsReporter)."""

    dp_rank: int
    engine: EngineLike
    cursor_v: float = 0.0  # virtual time the engine has simulated up to
    forward_ct_decode: int = 0
    interval_tokens: int = 0
    last_log_v: float = 0.0
    last_decode_stats_v: float = 0.0
    last_gen_throughput: float = 0.0
    spec_accept_tokens: int = 0
    spec_forward_ct: int = 0
    spec_correct: int = 0
    spec_proposed: int = 0
    spec_total_accept_tokens: int = 0
    spec_total_forward_ct: int = 0
    last_accept_rate: float = 0.0
    steps_now: int = 0
    busy: bool = False
    prefill_logged: bool = False
    used_tokens: int = 0
    moments: list[float] = field(default_factory=lambda: [0.0] * 6)
    prefill_tokens: int = 0  # cumulative uncached prompt tokens prefilled
    prefill_busy_us: float = 0.0
    pending: deque[tuple[float, Any]] = field(default_factory=deque)
    # Per-tick accumulators flushed into the metrics once per wake-up.
    tick_passes: int = 0
    tick_decode_tokens: int = 0
    tick_prefill_tokens: int = 0
    tick_phase_s: dict[str, float] = field(default_factory=dict)
    tick_idle_s: float = 0.0

    def gen_throughput(self, now_v: float) -> float:
        if now_v - self.last_decode_stats_v > GEN_THROUGHPUT_STALENESS_S:
            self.last_gen_throughput = 0.0
        return self.last_gen_throughput

    def avg_accept_length(self) -> float | None:
        if self.spec_total_forward_ct <= 0:
            return None
        return self.spec_total_accept_tokens / self.spec_total_forward_ct


class Simulation:
    """One simulated SGLang server: DP ranks, requests, virtual clock, status."""

    def __init__(
        self,
        args: ServerArgs,
        profile: SimProfile,
        spec: SpecConfig,
        engine_factory: EngineFactory,
        metrics: SimMetrics,
        *,
        faults: Faults | None = None,
        startup_phases: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = DEFAULT_TICK_S,
    ) -> None:
        self.args = args
        self.profile = profile
        self.spec = spec
        self.metrics = metrics
        self.faults = faults or Faults()
        self.startup_phases = dict(startup_phases or {})
        self.speed = args.sim_speed
        self.tick_s = tick_s
        self._clock = clock
        self._t0 = clock()
        self.max_running_requests = (
            args.max_running_requests
            if args.max_running_requests is not None
            else profile.max_running_requests(spec)
        )
        self.kv_capacity = int(profile.serving.kv_capacity_tokens)
        self.ranks = [RankState(dp, engine_factory(dp)) for dp in range(args.dp_size)]
        for rank in self.ranks:
            rank.steps_now = spec.num_steps
        self.requests: dict[str, SimRequest] = {}
        self._rr = itertools.cycle(range(args.dp_size))
        self.status = "starting"  # starting -> up
        self.draining = False
        # Drained, about to exit: what arrives now is refused and what slipped in is aborted, so
        # that no request handler is still waiting when the HTTP server closes (SGLang kills its
        # process tree at this point; its clients see the connection drop).
        self.closing = False
        self.paused = False
        self._wake = asyncio.Event()
        self._stopped = False
        self.steps_total = 0
        self.lost_v = 0.0  # simulated seconds skipped because the host fell behind
        self.internal = InternalLoad()
        self._internal_rng = random.Random(args.sim_seed)
        self.max_lag_s = max(0.05, 4 * tick_s)  # wall lag a busy engine may still catch up

    # ---- clock ------------------------------------------------------------------------------
    def mark_up(self) -> None:
        """Warmup done: serve (and start the in-server clients, if configured)."""
        self.status = "up"
        self._wake.set()

    def vnow(self) -> float:
        """Simulated seconds since the server started serving."""
        return (self._clock() - self._t0) * self.speed

    def wall_until(self, v: float) -> float:
        """Wall seconds from now until virtual time `v`."""
        return max(0.0, v / self.speed - (self._clock() - self._t0))

    # ---- requests ----------------------------------------------------------------------------
    def submit(
        self,
        *,
        workload: str,
        custom_labels: Mapping[str, object] | None,
        prompt_tokens: int,
        max_new_tokens: int | None,
        stream: bool,
        rid: str | None = None,
        arrival_v: float | None = None,
        internal: bool = False,
    ) -> SimRequest:
        rid = rid or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"Duplicate request ID: {rid}")
        dp = next(self._rr)
        req = SimRequest(
            rid=rid,
            dp_rank=dp,
            workload=workload,
            labels=self.metrics.request_labels(custom_labels),
            prompt_tokens=max(1, int(prompt_tokens)),
            max_new_tokens=max_new_tokens,
            stream=stream,
            arrival_v=self.vnow() if arrival_v is None else arrival_v,
            internal=internal,
        )
        self.requests[rid] = req
        self.ranks[dp].engine.add_request(rid, workload, req.prompt_tokens, max_new_tokens)
        self._wake.set()
        return req

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.done:
            return
        self.ranks[req.dp_rank].engine.abort(rid)
        self._finish_aborted(req)

    def abort_all(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)

    def close(self) -> None:
        """The SIGTERM drain is over: refuse what arrives from now on and abort what slipped in
        since the drain last looked (clients retrying aborted requests), so that every request
        handler answers before the HTTP server shuts down instead of being cancelled mid-wait."""
        self.closing = True
        self.abort_all()

    def _finish_aborted(self, req: SimRequest) -> None:
        req.aborted = True
        req.finish_v = self.vnow()
        if req.internal:
            self._internal_done(req)
        if req.first_token_v is not None:
            self.ranks[req.dp_rank].used_tokens -= req.prompt_tokens + req.tokens
        self.metrics.observe_aborted(req.labels)
        self.requests.pop(req.rid, None)
        req.changed.set()

    def set_internal_load(
        self,
        concurrency: int,
        mix: Mapping[str, float],
        prompt_tokens: int = 256,
        max_new_tokens: int | None = None,
    ) -> None:
        if concurrency < 0 or prompt_tokens < 1:
            raise ValueError("concurrency must be >= 0 and prompt_tokens >= 1")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        weights = {str(k): float(v) for k, v in mix.items()}
        if not weights or any(not v >= 0 for v in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"mix needs non-negative weights with a positive sum: {mix}")
        load = self.internal
        load.concurrency, load.mix = int(concurrency), weights
        load.prompt_tokens, load.max_new_tokens = int(prompt_tokens), max_new_tokens
        self._refill_internal()

    def _refill_internal(self, arrival_v: float | None = None) -> None:
        """Top the in-server clients up to their concurrency; a client whose request the
        engine just finished sends its next one at that instant (`arrival_v`). Nothing while
        paused or draining: requests sent then would never finish before the SIGTERM drain
        (see InternalLoad); the run loop refills after /continue_generation."""
        load = self.internal
        if self.paused or self.draining or self.status != "up":
            return
        names, weights = list(load.mix), list(load.mix.values())
        while len(load.in_flight) < load.concurrency:
            workload = self._internal_rng.choices(names, weights)[0]
            req = self.submit(
                workload=workload,
                custom_labels={"workload": workload},
                prompt_tokens=load.prompt_tokens,
                max_new_tokens=load.max_new_tokens,
                stream=False,
                rid=f"sim-load-{uuid.uuid4().hex}",
                arrival_v=arrival_v,
                internal=True,
            )
            load.in_flight.add(req.rid)

    def _internal_done(self, req: SimRequest) -> None:
        load = self.internal
        load.in_flight.discard(req.rid)  # already gone when the engine finished it
        if req.result is not None:
            load.ok += 1
            load.output_tokens += req.tokens
            w = load.per_workload.setdefault(req.workload, {"ok": 0, "output_tokens": 0})
            w["ok"] += 1
            w["output_tokens"] += req.tokens

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    # ---- decode loop --------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        """Step the engines in virtual time and deliver tokens until stop()."""
        while not self._stopped:
            now_v = self.vnow()
            horizon_v = now_v + self.tick_s * self.speed
            busy = False
            for rank in self.ranks:
                busy |= self._advance(rank, now_v, horizon_v)
            self._release(self.vnow())
            self._refill_internal()
            self._flush_tick()
            if busy or any(r.pending for r in self.ranks):
                # Tokens whose cycle ends inside this tick are delivered when it is over.
                await asyncio.sleep(max(self.wall_until(horizon_v), 0.0005))
            else:
                self._wake.clear()
                # Idle: wake on a new request or a resume; now and then anyway so that the
                # idle time is accounted while nothing happens.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)

    def _advance(self, rank: RankState, now_v: float, horizon_v: float) -> bool:
        """Run engine cycles of one rank up to the horizon; False when it has nothing to do."""
        lag = now_v - rank.cursor_v
        # An idle (or paused) engine jumps to now. A busy one catches up on a short lag (a late
        # wake-up); a long one means the host cannot keep up with --sim-speed: that time is
        # lost rather than replayed in a burst.
        if lag > 0 and (not rank.busy or self.paused or lag > self.max_lag_s * self.speed):
            if not rank.busy or self.paused:
                rank.tick_idle_s += lag
            else:
                self.lost_v += lag
            rank.engine.advance_idle(lag)
            rank.cursor_v = now_v
        if self.paused:
            rank.busy = False
            return False
        while rank.cursor_v < horizon_v:
            res = rank.engine.step()
            if res is None:
                rank.busy = False
                return False
            self.steps_total += 1
            rank.cursor_v += res.duration_s
            self._account_step(rank, res, rank.cursor_v)
            rank.pending.append((rank.cursor_v, res))
        rank.busy = True
        return True

    def _account_step(self, rank: RankState, res: Any, end_v: float) -> None:
        """Scheduler-side bookkeeping of one engine step (at its end time)."""
        if res.finished and self.internal.in_flight:
            closed = [f.rid for f in res.finished if f.rid in self.internal.in_flight]
            if closed:
                self.internal.in_flight.difference_update(closed)
                self._refill_internal(arrival_v=end_v)
        for cat, sec in res.phase_s.items():
            rank.tick_phase_s[cat] = rank.tick_phase_s.get(cat, 0.0) + sec
        if res.kind != "decode":
            # a prefill (extend) step: its first tokens are delivered with the rest
            rank.prefill_busy_us += res.duration_s * 1e6
            rank.prefill_tokens += sum(
                r.prompt_tokens for rid in res.new_tokens if (r := self.requests.get(rid))
            )
            return
        generated = sum(res.new_tokens.values())
        rank.forward_ct_decode += 1
        rank.interval_tokens += generated
        rank.steps_now = res.steps
        rank.tick_passes += 1
        rank.tick_decode_tokens += generated
        if self.spec.speculative and res.accepted_drafts:
            # every sequence of a decode cycle is verified: accept tokens = tokens generated
            verified = res.accepted_drafts
            rank.spec_forward_ct += len(verified)
            rank.spec_accept_tokens += generated
            rank.spec_correct += sum(verified.values())
            per_round = self.spec.draft_tokens - 1 if self.spec.topk > 1 else res.steps
            rank.spec_proposed += len(verified) * per_round
        # decode_moments: batch size, step time (us), tokens generated, as SGLang accumulates
        # them per decode batch (here: per simulated cycle, in simulated microseconds).
        step_us = res.duration_s * 1e6
        if res.batch_size > 0 and step_us > 0:
            m = rank.moments
            b = float(res.batch_size)
            m[0] += 1.0
            m[1] += b
            m[2] += step_us
            m[3] += b * b
            m[4] += b * step_us
            m[5] += float(generated)
        if rank.forward_ct_decode % self.args.decode_log_interval == 0:
            self._log_decode_stats(rank, end_v)

    def _log_decode_stats(self, rank: RankState, end_v: float) -> None:
        gap = max(end_v - rank.last_log_v, 1e-9)
        rank.last_log_v = end_v
        rank.last_decode_stats_v = end_v
        rank.last_gen_throughput = rank.interval_tokens / gap
        rank.interval_tokens = 0
        accept_length = accept_rate = 0.0
        steps = draft_tokens = 0
        if self.spec.speculative:
            if rank.spec_forward_ct > 0:
                accept_length = rank.spec_accept_tokens / rank.spec_forward_ct
            if rank.spec_proposed > 0:
                accept_rate = rank.spec_correct / rank.spec_proposed
            rank.spec_total_accept_tokens += rank.spec_accept_tokens
            rank.spec_total_forward_ct += rank.spec_forward_ct
            rank.spec_accept_tokens = rank.spec_correct = 0
            rank.spec_forward_ct = rank.spec_proposed = 0
            rank.last_accept_rate = accept_rate
            steps = rank.steps_now
            draft_tokens = self.spec.draft_tokens if self.spec.topk > 1 else steps + 1
        self.metrics.log_stats(
            rank.dp_rank, self._stats(rank, end_v, accept_length, accept_rate, steps, draft_tokens)
        )

    def _stats(
        self,
        rank: RankState,
        now_v: float,
        accept_length: float,
        accept_rate: float,
        steps: int,
        draft_tokens: int,
    ) -> IntervalStats:
        used = max(rank.used_tokens, 0)
        running = rank.engine.num_running
        return IntervalStats(
            num_running_reqs=running,
            num_queue_reqs=rank.engine.num_queued,
            gen_throughput=rank.gen_throughput(now_v),
            decode_sum_seq_lens=used,
            token_usage=round(used / self.kv_capacity, 4) if self.kv_capacity else 0.0,
            num_used_tokens=used,
            kv_available_tokens=max(self.kv_capacity - used, 0),
            spec_accept_length=accept_length,
            spec_accept_rate=accept_rate,
            spec_num_steps=steps,
            spec_num_draft_tokens=draft_tokens,
            utilization=min(running / self.max_running_requests, 1.0)
            if self.max_running_requests
            else 0.0,
        )

    def _release(self, now_v: float) -> None:
        """Deliver the outcome of every cycle that has ended by `now_v`."""
        for rank in self.ranks:
            while rank.pending and rank.pending[0][0] <= now_v:
                end_v, res = rank.pending.popleft()
                self._deliver(rank, res, end_v)

    def _deliver(self, rank: RankState, res: Any, end_v: float) -> None:
        admitted = 0
        for rid, n in res.new_tokens.items():
            req = self.requests.get(rid)
            if req is None or n <= 0:
                continue
            if req.first_token_v is None:
                req.first_token_v = end_v
                rank.used_tokens += req.prompt_tokens
                rank.tick_prefill_tokens += req.prompt_tokens
                admitted += 1
                if req.stream:
                    self.metrics.observe_ttft(
                        req.labels, max(end_v - req.arrival_v, 0.0), stream=True
                    )
            elif req.stream:
                # Streaming requests are sent out every step (stream_interval 1), so the
                # tokenizer observes an inter-token latency per step; others only at finish.
                self.metrics.observe_itl(req.labels, end_v - (req.last_token_v or end_v), n)
            req.tokens += n
            rank.used_tokens += n
            req.last_token_v = end_v
            if req.stream:  # non-streaming handlers only wait for the end
                req.changed.set()
        for fin in res.finished:
            req = self.requests.pop(fin.rid, None)
            if req is None:
                continue
            self._finish(rank, req, fin, end_v)
        if admitted:
            rank.prefill_logged = True  # applied once per tick by _flush_tick

    def _finish(self, rank: RankState, req: SimRequest, fin: Any, end_v: float) -> None:
        if req.first_token_v is None:  # finished within its admitting cycle
            req.first_token_v = end_v
            rank.used_tokens += req.prompt_tokens
            rank.tick_prefill_tokens += req.prompt_tokens
            if req.stream:
                self.metrics.observe_ttft(req.labels, max(end_v - req.arrival_v, 0.0), stream=True)
        rank.used_tokens -= req.prompt_tokens + req.tokens
        req.tokens = int(fin.completion_tokens)
        req.result = fin
        req.finish_v = end_v
        if req.internal:
            self._internal_done(req)
        if not req.stream:
            # Non-streaming output reaches the tokenizer once, at finish: TTFT is observed
            # then (from the scheduler's first-token time) and no inter-token latency.
            self.metrics.observe_ttft(
                req.labels, max(req.first_token_v - req.arrival_v, 0.0), stream=False
            )
        tpot = None
        if req.tokens > 1:
            tpot = (end_v - req.first_token_v) / (req.tokens - 1)
        self.metrics.observe_finished(
            req.labels,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=req.tokens,
            e2e_s=max(end_v - req.arrival_v, 0.0),
            tpot_s=tpot,
            spec_verify_ct=int(fin.verify_ct) if self.spec.speculative else 0,
            stream=req.stream,
        )
        req.changed.set()

    # report_prefill_stats refreshes the basic gauges (not the spec ones) after a prefill
    # batch, with gen_throughput decayed if decode went quiet.
    PREFILL_GAUGES = (
        "num_running_reqs",
        "num_queue_reqs",
        "gen_throughput",
        "cache_hit_rate",
        "token_usage",
        "full_token_usage",
        "num_used_tokens",
        "kv_available_tokens",
        "kv_used_tokens",
    )

    def _flush_tick(self) -> None:
        now_v = self.vnow()
        for rank in self.ranks:
            if rank.prefill_logged:
                rank.prefill_logged = False
                stats = self._stats(rank, now_v, 0.0, 0.0, 0, 0)
                self.metrics.log_stats(rank.dp_rank, stats, only=self.PREFILL_GAUGES)
            self.metrics.add_decode_passes(
                rank.dp_rank, rank.tick_passes, rank.tick_decode_tokens, rank.tick_phase_s
            )
            self.metrics.add_prefill_tokens(rank.dp_rank, rank.tick_prefill_tokens)
            self.metrics.add_idle_seconds(rank.dp_rank, rank.tick_idle_s)
            rank.tick_passes = rank.tick_decode_tokens = rank.tick_prefill_tokens = 0
            rank.tick_phase_s = {}
            rank.tick_idle_s = 0.0
        self.metrics.flush_itl()

    # ---- views --------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """/flush_cache: refused while requests run or wait; resets the lifetime accept
        counters (SchedulerMetricsReporter.reset_metrics)."""
        if any(r.engine.num_running or r.engine.num_queued for r in self.ranks):
            return False
        for rank in self.ranks:
            rank.forward_ct_decode = rank.interval_tokens = 0
            rank.spec_accept_tokens = rank.spec_correct = 0
            rank.spec_forward_ct = rank.spec_proposed = 0
            rank.spec_total_accept_tokens = rank.spec_total_forward_ct = 0
        return True

    def load_snapshot(self, rank: RankState, include: set[str] | None) -> dict[str, Any]:
        """LoadSnapshot.to_dict for one DP rank."""
        now_v = self.vnow()
        used = max(rank.used_tokens, 0)
        queued = rank.engine.num_queued
        waiting_tokens = sum(
            r.prompt_tokens
            for r in self.requests.values()
            if r.dp_rank == rank.dp_rank and r.first_token_v is None
        )
        load: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": rank.dp_rank,
            "num_running_reqs": rank.engine.num_running,
            "num_waiting_reqs": queued,
            "num_waiting_uncached_tokens": waiting_tokens,
            "num_used_tokens": used,
            "num_total_tokens": used + waiting_tokens,
            "num_active_tokens": used + waiting_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.kv_capacity,
            "max_running_requests": self.max_running_requests,
            "token_usage": round(used / self.kv_capacity, 4) if self.kv_capacity else 0.0,
            "gen_throughput": round(rank.gen_throughput(now_v), 2),
            "cache_hit_rate": 0.0,
            "utilization": round(min(rank.engine.num_running / self.max_running_requests, 1), 4),
            "total_prefill_uncached_tokens": rank.prefill_tokens,
            "total_prefill_busy_us": int(rank.prefill_busy_us),
            "decode_moments": list(rank.moments) if rank.moments[0] > 0 else None,
        }
        if include is not None and "all" not in include and include == {"core"}:
            return load
        everything = include is None or "all" in include

        def wanted(name: str) -> bool:
            return everything or (include is not None and name in include)

        avg = rank.avg_accept_length()
        if wanted("spec") and self.spec.speculative and avg is not None:
            load["speculative"] = {"accept_length": avg, "accept_rate": rank.last_accept_rate}
        if wanted("disagg"):
            load["disaggregation"] = {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if wanted("queues"):
            load["queues"] = {
                "waiting": queued,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            }
        return load

    def internal_state(self, rank: RankState) -> dict[str, Any]:
        state = self.args.server_info()
        state.pop("launch_command", None)
        state.update(
            {
                "world_size": self.args.tp_size * self.args.dp_size,
                "startup_time": self.startup_phases,
                "effective_max_running_requests_per_dp": self.max_running_requests,
                "last_gen_throughput": rank.gen_throughput(self.vnow()),
            }
        )
        if self.spec.speculative:
            state["speculative_num_steps"] = (
                rank.steps_now if self.spec.adaptive else (self.spec.num_steps)
            )
            avg = rank.avg_accept_length()
            if avg is not None:
                state["avg_spec_accept_length"] = avg
        return state


# ---- HTTP --------------------------------------------------------------------------------------


def _filler(rid: str, start: int, end: int) -> tuple[str, list[int]]:
    offset = sum(map(ord, rid)) % len(FILLER_WORDS)
    idx = [(offset + i) % len(FILLER_WORDS) for i in range(start, end)]
    return "".join(FILLER_WORDS[i] for i in idx), [FILLER_TOKEN_ID_BASE + i for i in idx]


def _prompt_tokens(text: Any, input_ids: Any) -> int:
    """Prompt length: len(input_ids), else ~4 characters per token of the text."""
    if isinstance(input_ids, list) and input_ids:
        return len(input_ids)
    if isinstance(text, str) and text:
        return max(1, round(len(text) / 4))
    raise ValueError("Either text or input_ids should be provided.")


def _finish_reason(req: SimRequest) -> dict[str, Any] | None:
    if req.aborted:
        return {"type": "abort", "message": "Abort before/while serving the request."}
    if req.result is None:
        return None
    if req.max_new_tokens is not None and req.tokens >= req.max_new_tokens:
        return {"type": "length", "length": req.tokens}
    return {"type": "stop", "matched": EOS_TOKEN_ID}


def spec_meta(sim: Simulation, req: SimRequest) -> dict[str, Any]:
    """_calculate_spec_decoding_metrics: proposed = verify_ct x (draft tokens - 1) with the
    launch's draft tokens; accept length = completion tokens / verify_ct (bonus included)."""
    fin = req.result
    if fin is None or not sim.spec.speculative or fin.verify_ct <= 0:
        return {}
    proposed = fin.verify_ct * (sim.spec.draft_tokens - 1)
    out: dict[str, Any] = {}
    if proposed > 0:
        out = {
            "spec_accept_rate": fin.num_correct_drafts / proposed,
            "spec_accept_length": req.tokens / fin.verify_ct,
            "spec_num_correct_drafts": fin.num_correct_drafts,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": fin.verify_ct,
        }
    if any(fin.correct_drafts_histogram):
        out["spec_correct_drafts_histogram"] = list(fin.correct_drafts_histogram)
    return out


def meta_info(sim: Simulation, req: SimRequest) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": _finish_reason(req),
        "prompt_tokens": req.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": req.tokens,
        "cached_tokens": 0,
    }
    if req.done:
        meta["e2e_latency"] = (req.finish_v or sim.vnow()) - req.arrival_v
        meta.update(spec_meta(sim, req))
    return meta


def _workload_of(custom_labels: Mapping[str, Any] | None) -> str:
    value = (custom_labels or {}).get("workload")
    return str(value) if value else "default"


def _header_labels(sim: Simulation, request: Request) -> dict[str, str] | None:
    """extract_custom_labels: the JSON object in the custom-labels header, allowed keys only."""
    header = sim.args.tokenizer_metrics_custom_labels_header
    allowed = set(sim.args.tokenizer_metrics_allowed_custom_labels or ())
    raw = request.headers.get(header) if header else None
    if not raw or not allowed:
        return None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    return {k: str(v) for k, v in parsed.items() if k in allowed}


# tokenizer_manager._wait_one_response wakes every 4 s to check whether the client left (here 4
# simulated seconds, but not more often than every 0.25 wall seconds per waiting request).
DISCONNECT_CHECK_S = 4.0


async def _wait_done(sim: Simulation, req: SimRequest, request: Request) -> None:
    """Wait for a non-streaming request to finish; abort it if the client goes away."""
    while not req.done:
        req.changed.clear()
        if req.done:
            break
        try:
            await asyncio.wait_for(req.changed.wait(), max(DISCONNECT_CHECK_S / sim.speed, 0.25))
        except TimeoutError:
            if await request.is_disconnected():
                sim.abort(req.rid)
                return


async def _updates(req: SimRequest) -> AsyncIterator[int]:
    """Yield the token count each time new tokens (or the end) arrive."""
    sent = -1
    while True:
        if req.tokens != sent or req.done:
            sent = req.tokens
            yield sent
            if req.done:
                return
        req.changed.clear()
        if req.tokens == sent and not req.done:
            await req.changed.wait()


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def create_app(sim: Simulation) -> FastAPI:
    """SGLang 0.5.23's HTTP API over a Simulation."""
    app = FastAPI(title="SGLang 0.5.23 simulator", docs_url=None, redoc_url=None)
    args = sim.args
    model_name = args.served_model_name

    def not_ready_response() -> Response | None:
        if sim.closing:
            return JSONResponse({"error": "server is shutting down"}, status_code=503)
        if sim.status != "up":
            return JSONResponse({"error": "server is starting"}, status_code=503)
        return None

    def submit_from(
        body: Mapping[str, Any],
        *,
        prompt_tokens: int,
        max_new_tokens: Any,
        stream: bool,
        labels: Mapping[str, Any] | None,
    ) -> SimRequest:
        if max_new_tokens is not None and (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or max_new_tokens < 0
        ):
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens}")
        rid = body.get("rid")
        return sim.submit(
            workload=_workload_of(labels),
            custom_labels=labels,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens,
            stream=stream,
            rid=str(rid) if rid is not None else None,
        )

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse(
            {
                "object": "error",
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": status,
            },
            status_code=status,
        )

    async def read_json(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"invalid JSON body: {e}") from e
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        return body

    # ---- native API ---------------------------------------------------------------------------
    @app.post("/generate")
    @app.put("/generate")
    async def generate(request: Request) -> Response:
        if (r := not_ready_response()) is not None:
            return r
        try:
            body = await read_json(request)
            if (r := not_ready_response()) is not None:
                return r  # began to close while the body was read
            sp = body.get("sampling_params") or {}
            labels = body.get("custom_labels")
            req = submit_from(
                body,
                prompt_tokens=_prompt_tokens(body.get("text"), body.get("input_ids")),
                max_new_tokens=sp.get("max_new_tokens"),
                stream=bool(body.get("stream", False)),
                labels=labels if isinstance(labels, dict) else None,
            )
        except ValueError as e:
            return error(str(e))

        def out(r: SimRequest) -> dict[str, Any]:
            text, ids = _filler(r.rid, 0, r.tokens)
            return {"text": text, "output_ids": ids, "meta_info": meta_info(sim, r)}

        if req.stream:

            async def stream_gen() -> AsyncIterator[bytes]:
                try:
                    async for _ in _updates(req):
                        yield _sse(out(req))
                    yield b"data: [DONE]\n\n"
                finally:
                    sim.abort(req.rid)  # client went away mid-stream (no-op when done)

            return StreamingResponse(stream_gen(), media_type="text/event-stream")
        try:
            await _wait_done(sim, req, request)
        except asyncio.CancelledError:
            sim.abort(req.rid)
            raise
        return JSONResponse(out(req))

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        if sim.draining or sim.status != "up":
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        ok = sim.status == "up" and not sim.paused and not sim.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": args.model_path,
            "served_model_name": model_name,
            "tokenizer_path": args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "simulated",
            "architectures": ["SimulatedForCausalLM"],
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        info = args.server_info()
        info["max_running_requests"] = sim.max_running_requests
        info.update(
            {
                "startup_time": sim.startup_phases,
                "internal_states": [sim.internal_state(r) for r in sim.ranks],
                "version": SGLANG_VERSION,
                "frontend": "python",
            }
        )
        return info

    @app.get("/v1/loads")
    async def loads(
        dp_rank: int | None = None, include: str | None = None, format: str | None = None
    ) -> Response:
        t = time.perf_counter()
        include_set = {s.strip() for s in include.split(",")} if include else None
        if include_set is not None and not include_set <= VALID_LOAD_SECTIONS:
            return JSONResponse(
                {
                    "detail": f"Invalid include sections: {include_set - VALID_LOAD_SECTIONS}. "
                    f"Valid options: {sorted(VALID_LOAD_SECTIONS)}"
                },
                status_code=400,
            )
        ranks = [r for r in sim.ranks if dp_rank is None or r.dp_rank == dp_rank]
        if dp_rank is not None and not ranks:
            return JSONResponse({"detail": f"dp_rank {dp_rank} out of range"}, status_code=400)
        payload = [sim.load_snapshot(r, include_set) for r in ranks]
        sim.metrics.observe_get_loads(time.perf_counter() - t)
        if format == "prometheus":
            lines: dict[str, list[str]] = {}
            prefixes = {"speculative": "spec", "disaggregation": "disagg"}
            for load in payload:
                rank = load.pop("dp_rank")
                for key, value in load.items():
                    items = (
                        [(f"sglang_{prefixes.get(key, key)}_{k}", v) for k, v in value.items()]
                        if isinstance(value, dict)
                        else [(f"sglang_{key}", value)]
                    )
                    for name, v in items:
                        if isinstance(v, int | float) and not isinstance(v, bool):
                            lines.setdefault(name, []).append(f'{name}{{dp_rank="{rank}"}} {v}')
            text = "".join(
                f"# TYPE {name} gauge\n" + "\n".join(samples) + "\n"
                for name, samples in lines.items()
            )
            return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
        return JSONResponse(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                "version": SGLANG_VERSION,
                "accelerator": None,
                "num_accelerators": args.tp_size,
                "loads": payload,
            }
        )

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if sim.flush_cache():
            return Response(
                "Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n"
            )
        return Response("Flush cache failed.\n", status_code=400)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body: dict[str, Any] = {}
        if await request.body():
            try:
                body = await read_json(request)
            except ValueError as e:
                return error(str(e))
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return error(f"mode must be one of abort, retract, in_place (got {mode!r})", 422)
        sim.paused = True
        if mode == "abort":
            sim.abort_all()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        sim.paused = False
        sim._wake.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        if not args.enable_metrics:
            return Response("Not Found", status_code=404)
        if sim.faults.metrics is not None:
            return metrics_fault_response(sim.faults.metrics)
        return Response(
            sim.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    # ---- OpenAI-compatible API ----------------------------------------------------------------
    def usage(req: SimRequest) -> dict[str, Any]:
        return {
            "prompt_tokens": req.prompt_tokens,
            "total_tokens": req.prompt_tokens + req.tokens,
            "completion_tokens": req.tokens,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        }

    def openai_finish(req: SimRequest) -> tuple[str | None, int | None]:
        fr = _finish_reason(req)
        if fr is None:
            return None, None
        return fr["type"], fr.get("matched")

    def spec_details(req: SimRequest) -> dict[str, Any] | None:
        meta = spec_meta(sim, req)
        if not meta:
            return None
        return {
            "spec_accept_rate": meta.get("spec_accept_rate", 0.0),
            "spec_accept_length": meta.get("spec_accept_length", 0.0),
            "spec_cap_length": 0.0,
            "spec_block_accept_length": 0.0,
            "spec_num_correct_drafts": meta.get("spec_num_correct_drafts", 0),
            "spec_num_proposed_drafts": meta.get("spec_num_proposed_drafts", 0),
            "spec_verify_ct": meta.get("spec_verify_ct", 0),
            "spec_correct_drafts_histogram": meta.get("spec_correct_drafts_histogram", []),
            "spec_cap_lens_histogram": [],
        }

    async def openai_route(request: Request, chat: bool) -> Response:
        if (r := not_ready_response()) is not None:
            return r
        try:
            body = await read_json(request)
            if (r := not_ready_response()) is not None:
                return r  # began to close while the body was read
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ValueError("messages must be a non-empty list")
                text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
                prompt = max(1, round(len(text) / 4)) + 4 * len(messages)  # chat template
            else:
                p = body.get("prompt")
                if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
                    prompt = _prompt_tokens(None, p)
                else:
                    prompt = _prompt_tokens(p if isinstance(p, str) else None, None)
            max_tokens = body.get("max_completion_tokens") if chat else None
            if max_tokens is None:
                max_tokens = body.get("max_tokens")
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
                raise ValueError("max_tokens must be positive")
            labels = _header_labels(sim, request)
            if labels is None and isinstance(body.get("custom_labels"), dict):
                labels = body["custom_labels"]
            stream = bool(body.get("stream", False))
            req = submit_from(
                body, prompt_tokens=prompt, max_new_tokens=max_tokens, stream=stream, labels=labels
            )
        except ValueError as e:
            return error(str(e))
        want_spec = bool(body.get("return_spec_tokens_details", False))
        created = int(time.time())
        rid = req.rid
        obj = "chat.completion" if chat else "text_completion"

        if not stream:
            try:
                await _wait_done(sim, req, request)
            except asyncio.CancelledError:
                sim.abort(rid)
                raise
            text, _ = _filler(rid, 0, req.tokens)
            reason, matched = openai_finish(req)
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
            if chat:
                choice["message"] = {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": None,
                }
            else:
                choice["text"] = text
            resp: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": body.get("model") or model_name,
                "choices": [choice],
                "usage": usage(req),
                "metadata": None,
            }
            details = spec_details(req) if want_spec else None
            if details is not None:
                resp["sglext"] = {"spec_tokens_details": details}
            return JSONResponse(resp)

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        model = body.get("model") or model_name

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return _sse(
                {
                    "id": rid,
                    "object": chunk_obj,
                    "created": created,
                    "model": model,
                    "choices": choices,
                    **extra,
                }
            )

        async def stream_gen() -> AsyncIterator[bytes]:
            sent = 0
            first = True
            try:
                async for n in _updates(req):
                    if n > sent or (first and chat):
                        piece, _ = _filler(rid, sent, n)
                        sent = n
                        if chat:
                            delta: dict[str, Any] = {"content": piece}
                            if first:
                                delta = {"role": "assistant", "content": piece}
                            c = {
                                "index": 0,
                                "delta": delta,
                                "logprobs": None,
                                "finish_reason": None,
                                "matched_stop": None,
                            }
                        else:
                            c = {
                                "index": 0,
                                "text": piece,
                                "logprobs": None,
                                "finish_reason": None,
                                "matched_stop": None,
                            }
                        first = False
                        yield chunk([c])
                    if req.done:
                        reason, matched = openai_finish(req)
                        end = {
                            "index": 0,
                            "logprobs": None,
                            "finish_reason": reason,
                            "matched_stop": matched,
                        }
                        end.update({"delta": {}} if chat else {"text": ""})
                        yield chunk([end])
                        details = spec_details(req) if want_spec else None
                        if details is not None:
                            yield chunk([], sglext={"spec_tokens_details": details})
                        if include_usage:
                            yield chunk([], usage=usage(req))
                yield b"data: [DONE]\n\n"
            finally:
                sim.abort(rid)

        return StreamingResponse(stream_gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_route(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_route(request, chat=True)

    # ---- simulator-only ------------------------------------------------------------------------
    @app.get("/sim/load")
    async def get_sim_load() -> dict[str, Any]:
        return {**sim.internal.to_dict(), "speed": sim.speed, "lost_s": sim.lost_v}

    @app.post("/sim/load")
    async def set_sim_load(request: Request) -> Response:
        """Closed-loop clients inside the server: {"concurrency": C, "mix": {"chat": 0.7},
        "prompt_tokens": 256, "max_new_tokens": null}."""
        try:
            body = await read_json(request)
            sim.set_internal_load(
                int(body.get("concurrency", 0)),
                body.get("mix") or {"default": 1.0},
                int(body.get("prompt_tokens", 256)),
                body.get("max_new_tokens"),
            )
        except (ValueError, TypeError) as e:
            return error(str(e))
        return JSONResponse(sim.internal.to_dict())

    @app.get("/sim/cost_scale")
    async def get_cost_scale() -> dict[str, float]:
        scale = sim.ranks[0].engine.scale
        return {"verify": scale.verify, "base": scale.base, "draft": scale.draft}

    @app.post("/sim/cost_scale")
    async def set_cost_scale(request: Request) -> Response:
        """Change the system state while running (FIELD.md's drift between boots, applied
        live): {"verify": 1.6, "base": 1.08, "draft": 1.0}; omitted keys are 1."""
        try:
            body = await read_json(request)
            unknown = set(body) - {"verify", "base", "draft"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)} (verify, base, draft)")
            scale = CostScale(**{k: float(v) for k, v in body.items()})
        except (ValueError, TypeError) as e:
            return error(str(e))
        for rank in sim.ranks:
            rank.engine.scale = scale
        return JSONResponse({"verify": scale.verify, "base": scale.base, "draft": scale.draft})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "sglang",
                    "root": model_name,
                    "max_model_len": args.context_length,
                }
            ],
        }

    if sim.faults.slow_s > 0:
        app.add_middleware(SlowResponses, delay_s=sim.faults.slow_s)
    return app
