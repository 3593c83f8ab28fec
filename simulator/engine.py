"""The simulator's engines: StepEngine (one scheduler iteration at a time, the ground truth the
HTTP server runs) and WindowEngine (one poll window at once, vectorised, for the benchmark).

Owns: request state, admission, prefill and decode cycles, per-request chain draws, the
per-request counters SGLang reports at finish, and a window's aggregate counters.
Must not: do I/O, sleep or read a clock (engine time is the sum of step durations), import
controller/store/policies.

Scheduling model (both engines): SGLang's default prefill-first loop without chunked or mixed
prefill. When requests wait and a slot is free, the step is a prefill (extend) step that admits
them, costs `SimProfile.prefill_s` and yields each one its first token; otherwise it is one decode
cycle of the whole running batch (`SimProfile.cycle_s`). A request finishes when it has emitted
its output length (drawn from its workload, capped by max_new_tokens); accepted drafts past
that are discarded, as SGLang truncates at the stop condition.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from simulator.adaptive import AdaptiveRule, spec_cuda_graph_batch_sizes
from simulator.model import (
    NO_SCALE,
    CostScale,
    SimProfile,
    SpecConfig,
    Workload,
    accepted_drafts_pmf,
    draw_accepted_drafts,
)

DEFAULT_WORKLOAD = "default"


@dataclass
class FinishedRequest:
    rid: str
    workload: str
    prompt_tokens: int
    completion_tokens: int
    verify_ct: int
    correct_drafts_histogram: list[int]  # entry k = verify steps that accepted exactly k drafts
    num_correct_drafts: int
    num_proposed_drafts: int
    first_token_s: float  # engine time of the first token (end of its prefill step)
    finish_s: float  # engine time
    arrival_s: float = 0.0  # engine time when add_request was called


@dataclass
class StepResult:
    duration_s: float
    batch_size: int
    steps: int  # draft steps this cycle (0: baseline, adaptive tier 0 or a prefill step)
    new_tokens: dict[str, int]
    accepted_drafts: dict[str, int]  # empty for the baseline and prefill steps
    finished: list[FinishedRequest]
    phase_s: dict[str, float]  # decode|target_verify|eagle_draft|eagle_draft_extend|extend
    kind: str = "decode"  # "decode" (a decode/verify cycle) or "prefill"


@dataclass
class _Pending:
    rid: str
    workload: str
    alpha: float
    prompt: int
    length: int
    arrival_s: float


def _resolve_workload(workloads: Mapping[str, Workload], name: str) -> Workload:
    w = workloads.get(name)
    if w is not None:
        return w
    if DEFAULT_WORKLOAD not in workloads:
        raise ValueError(
            f"unknown workload {name!r} and no {DEFAULT_WORKLOAD!r} workload to fall back to"
        )
    return workloads[DEFAULT_WORKLOAD]


def _server_limits(
    profile: SimProfile, spec: SpecConfig, max_running_requests: int | None
) -> tuple[int, AdaptiveRule | None]:
    """What both engines take from the server's launch: the running-request limit (the
    profile's unless given) and, for adaptive speculation, SGLang's tier rule over the CUDA-graph
    batch sizes under that limit."""
    limit = (
        profile.max_running_requests(spec)
        if max_running_requests is None
        else int(max_running_requests)
    )
    if limit < 1:
        raise ValueError("max_running_requests must be >= 1")
    rule = None
    if spec.adaptive:
        rule = AdaptiveRule(
            spec.num_steps, spec.adaptive_config, spec_cuda_graph_batch_sizes(limit)
        )
    return limit, rule


class StepEngine:
    """Step-by-step engine: per-request chain draws, SGLang's per-request counters, adaptive
    tiers per batch. Running requests live in parallel numpy arrays for speed."""

    def __init__(
        self,
        profile: SimProfile,
        spec: SpecConfig,
        workloads: Mapping[str, Workload],
        *,
        seed: int = 0,
        max_running_requests: int | None = None,
        scale: CostScale = NO_SCALE,
    ) -> None:
        self.profile = profile
        self.spec = spec
        self.workloads = dict(workloads)
        self.scale = scale
        self.max_running_requests, self.adaptive = _server_limits(
            profile, spec, max_running_requests
        )
        self.now_s = 0.0
        self._rng = np.random.default_rng(seed)
        self._phase_cache: dict[tuple[object, ...], dict[str, float]] = {}
        self._gmax = max(spec.tiers) if spec.speculative else 0
        self._queue: deque[_Pending] = deque()
        self._known: set[str] = set()
        # Running requests: parallel arrays + per-request metadata.
        self._rids: list[str] = []
        self._meta: list[_Pending] = []
        self._first_token_s: list[float] = []
        self._alpha = np.zeros(0)
        self._remaining = np.zeros(0, dtype=np.int64)
        self._generated = np.zeros(0, dtype=np.int64)
        self._prompt = np.zeros(0, dtype=np.int64)
        self._verify = np.zeros(0, dtype=np.int64)
        self._proposed = np.zeros(0, dtype=np.int64)
        self._hist = np.zeros((0, self._gmax + 1), dtype=np.int64)

    # -- requests ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._rids)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def add_request(
        self, rid: str, workload: str, prompt_tokens: int, max_new_tokens: int | None = None
    ) -> None:
        """Queue a request. Its output length is drawn from the workload (an unknown workload
        uses "default"'s parameters but keeps its label) and capped by max_new_tokens."""
        if rid in self._known:
            raise ValueError(f"duplicate request id {rid!r}")
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1 (got {prompt_tokens})")
        w = _resolve_workload(self.workloads, workload)
        length = w.sample_output_tokens(self._rng)
        if max_new_tokens is not None:
            if max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
            length = min(length, int(max_new_tokens))
        self._known.add(rid)
        self._queue.append(
            _Pending(rid, workload, w.alpha, int(prompt_tokens), int(length), self.now_s)
        )

    def abort(self, rid: str) -> None:
        """Drop a queued or running request (no FinishedRequest is produced)."""
        if rid not in self._known:
            return
        self._known.discard(rid)
        for p in self._queue:
            if p.rid == rid:
                self._queue.remove(p)
                return
        if rid in self._rids:
            keep = np.array([r != rid for r in self._rids])
            self._compact(keep)

    def advance_idle(self, duration_s: float) -> None:
        """Let engine time pass with nothing to do (the server was idle)."""
        if duration_s < 0:
            raise ValueError("duration_s must be >= 0")
        self.now_s += duration_s

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> StepResult | None:
        """One scheduler iteration: a prefill step if queued requests can be admitted, else one
        decode cycle of the running batch. None when idle."""
        admitted = self._admit()
        if admitted:
            return self._prefill(admitted)
        if not self._rids:
            return None
        return self._decode()

    def _admit(self) -> list[_Pending]:
        free = self.max_running_requests - len(self._rids)
        if free <= 0 or not self._queue:
            return []
        # KV admission: context of running requests + new prompts must fit the KV pool
        # (no retraction is modelled; a request larger than the pool is still admitted alone).
        used = int(np.sum(self._prompt + self._generated))
        cap = self.profile.serving.kv_capacity_tokens
        out: list[_Pending] = []
        while self._queue and len(out) < free:
            p = self._queue[0]
            if used + p.prompt > cap and (self._rids or out):
                break
            used += p.prompt
            out.append(self._queue.popleft())
        return out

    def _prefill(self, admitted: list[_Pending]) -> StepResult:
        total_prompt = sum(p.prompt for p in admitted)
        dur = self.profile.prefill_s(len(admitted), total_prompt, self.spec, self.scale)
        self.now_s += dur
        n = len(admitted)
        self._rids.extend(p.rid for p in admitted)
        self._meta.extend(admitted)
        self._first_token_s.extend([self.now_s] * n)
        self._alpha = np.concatenate([self._alpha, [p.alpha for p in admitted]])
        self._remaining = np.concatenate(
            [self._remaining, np.array([p.length - 1 for p in admitted], dtype=np.int64)]
        )
        self._generated = np.concatenate([self._generated, np.ones(n, dtype=np.int64)])
        self._prompt = np.concatenate(
            [self._prompt, np.array([p.prompt for p in admitted], dtype=np.int64)]
        )
        zeros = np.zeros(n, dtype=np.int64)
        self._verify = np.concatenate([self._verify, zeros])
        self._proposed = np.concatenate([self._proposed, zeros])
        self._hist = np.concatenate([self._hist, np.zeros((n, self._gmax + 1), dtype=np.int64)])
        finished = self._collect_finished()
        return StepResult(
            duration_s=dur,
            batch_size=n,
            steps=0,
            new_tokens={p.rid: 1 for p in admitted},
            accepted_drafts={},
            finished=finished,
            phase_s={"extend": dur},
            kind="prefill",
        )

    def current_steps(self, batch_size: int | None = None) -> int:
        """Draft steps the next decode cycle would use (the live tier under adaptive)."""
        if not self.spec.speculative:
            return 0
        if self.adaptive is not None:
            return self.adaptive.steps_for_batch(batch_size or max(1, len(self._rids)))
        return self.spec.num_steps

    def _decode(self) -> StepResult:
        b = len(self._rids)
        g = self.current_steps(b)
        # Mean context, rounded to 32 tokens so the cost of a cycle can be cached (the kv
        # term moves by well under 0.1% per 32 tokens).
        ctx = 32.0 * round(float(np.mean(self._prompt + self._generated)) / 32.0)
        key = (b, g, ctx, self.scale)
        phases = self._phase_cache.get(key)
        if phases is None:
            phases = self.profile.cycle_phases_s(
                b,
                self.spec,
                steps=g if self.spec.speculative else None,
                context_tokens=ctx,
                scale=self.scale,
            )
            if len(self._phase_cache) > 8192:
                self._phase_cache.clear()
            self._phase_cache[key] = phases
        dur = float(sum(phases.values()))
        self.now_s += dur
        if self.spec.speculative:
            acc = draw_accepted_drafts(self._rng, self._alpha, g)
            self._verify += 1
            self._proposed += g
            self._hist[np.arange(b), acc] += 1
        else:
            acc = np.zeros(b, dtype=np.int64)
        emitted = np.minimum(acc + 1, self._remaining)
        self._remaining -= emitted
        self._generated += emitted
        if self.adaptive is not None:
            self.adaptive.on_verify_complete(acc, b)
        rids = self._rids
        new_tokens = dict(zip(rids, emitted.tolist(), strict=True))
        accepted = dict(zip(rids, acc.tolist(), strict=True)) if self.spec.speculative else {}
        finished = self._collect_finished()
        return StepResult(
            duration_s=dur,
            batch_size=b,
            steps=g,
            new_tokens=new_tokens,
            accepted_drafts=accepted,
            finished=finished,
            phase_s={k: float(v) for k, v in phases.items() if k != "overhead"},
        )

    def _collect_finished(self) -> list[FinishedRequest]:
        done = self._remaining <= 0
        if not done.any():
            return []
        out: list[FinishedRequest] = []
        for i in np.flatnonzero(done):
            m = self._meta[i]
            hist = self._hist[i].tolist()
            correct = int(np.dot(np.arange(len(hist)), self._hist[i]))
            out.append(
                FinishedRequest(
                    rid=m.rid,
                    workload=m.workload,
                    prompt_tokens=m.prompt,
                    completion_tokens=int(self._generated[i]),
                    verify_ct=int(self._verify[i]),
                    correct_drafts_histogram=hist if self.spec.speculative else [],
                    num_correct_drafts=correct,
                    num_proposed_drafts=int(self._proposed[i]),
                    first_token_s=self._first_token_s[i],
                    finish_s=self.now_s,
                    arrival_s=m.arrival_s,
                )
            )
            self._known.discard(m.rid)
        self._compact(~done)
        return out

    def _compact(self, keep: np.ndarray) -> None:
        idx = np.flatnonzero(keep)
        self._rids = [self._rids[i] for i in idx]
        self._meta = [self._meta[i] for i in idx]
        self._first_token_s = [self._first_token_s[i] for i in idx]
        self._alpha = self._alpha[idx]
        self._remaining = self._remaining[idx]
        self._generated = self._generated[idx]
        self._prompt = self._prompt[idx]
        self._verify = self._verify[idx]
        self._proposed = self._proposed[idx]
        self._hist = self._hist[idx]


@dataclass
class ClosedLoopTotals:
    """What a closed-loop run of a StepEngine produced (decode-only figures for tok/s)."""

    duration_s: float
    output_tokens: int  # every emitted token, first tokens included
    decode_tokens: int  # tokens emitted by decode/verify cycles
    decode_s: float  # time spent in decode/verify cycles
    cycles: int
    generation_tokens: dict[str, int]  # per workload, finished requests
    verify_calls: dict[str, int]
    requests: dict[str, int]
    accepted_drafts_hist: list[int]  # over every verify of every request
    tiers_used: dict[int, int]

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def cycle_s(self) -> float:
        return self.decode_s / self.cycles if self.cycles else 0.0

    @property
    def accept_length(self) -> float:
        """Accepted drafts + bonus per request per verify (SGLang's spec_accept_length)."""
        n = sum(self.accepted_drafts_hist)
        if n == 0:
            return 1.0
        return sum((k + 1) * c for k, c in enumerate(self.accepted_drafts_hist)) / n


def drive_closed_loop(
    engine: StepEngine,
    duration_s: float,
    concurrency: int,
    mix: Mapping[str, float],
    *,
    seed: int = 0,
    rid_prefix: str = "r",
) -> ClosedLoopTotals:
    """Run `engine` for `duration_s` of engine time with `concurrency` clients that each keep
    one request open (a new one as soon as theirs finishes), workloads drawn from `mix`."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    labels = [k for k, v in mix.items() if v > 0]
    if not labels:
        raise ValueError("mix must give a positive weight to at least one workload")
    probs = np.array([mix[k] for k in labels], dtype=float)
    probs /= probs.sum()
    rng = np.random.default_rng(seed)
    counter = 0

    def submit() -> None:
        nonlocal counter
        label = labels[int(rng.choice(len(labels), p=probs))]
        w = _resolve_workload(engine.workloads, label)
        engine.add_request(f"{rid_prefix}{counter}", label, round(w.prompt_tokens))
        counter += 1

    for _ in range(concurrency):
        submit()
    end = engine.now_s + duration_s
    start = engine.now_s
    out_tok = dec_tok = cycles = 0
    dec_s = 0.0
    gen: dict[str, int] = {}
    ver: dict[str, int] = {}
    req: dict[str, int] = {}
    hist = np.zeros((max(engine.spec.tiers) if engine.spec.speculative else 0) + 1, dtype=np.int64)
    tiers: dict[int, int] = {}
    while engine.now_s < end:
        r = engine.step()
        if r is None:  # pragma: no cover - a closed loop never idles
            break
        toks = sum(r.new_tokens.values())
        out_tok += toks
        if r.kind == "decode":
            dec_tok += toks
            dec_s += r.duration_s
            cycles += 1
            tiers[r.steps] = tiers.get(r.steps, 0) + 1
        for f in r.finished:
            gen[f.workload] = gen.get(f.workload, 0) + f.completion_tokens
            ver[f.workload] = ver.get(f.workload, 0) + f.verify_ct
            req[f.workload] = req.get(f.workload, 0) + 1
            if f.correct_drafts_histogram:
                hist[: len(f.correct_drafts_histogram)] += f.correct_drafts_histogram
            submit()
    return ClosedLoopTotals(
        duration_s=engine.now_s - start,
        output_tokens=out_tok,
        decode_tokens=dec_tok,
        decode_s=dec_s,
        cycles=cycles,
        generation_tokens=gen,
        verify_calls=ver,
        requests=req,
        accepted_drafts_hist=hist.tolist(),
        tiers_used=tiers,
    )


# ------------------------------------------------------------------------------------------------
# WindowEngine
# ------------------------------------------------------------------------------------------------


@dataclass
class WindowResult:
    duration_s: float
    cycles: int  # decode/verify cycles in the window
    output_tokens: float  # tokens emitted in the window (first tokens from prefill included)
    generation_tokens: dict[str, float]  # per workload, completion tokens of finished requests
    verify_calls: dict[str, float]  # per workload, verify steps of finished requests
    requests: dict[str, float]  # per workload, finished requests
    sum_bs: float  # decode_moments deltas over decode/verify cycles
    sum_step_s: float
    sum_bs2: float
    sum_bs_step_s: float
    accepted_drafts_hist: list[float]  # verify steps x requests that accepted exactly k drafts
    mean_running: float
    mean_queued: float
    tiers_used: dict[int, int] = field(default_factory=dict)  # draft steps -> cycles
    prefill_steps: float = 0.0


# Exact dynamic programming up to this many tokens, renewal asymptote K(m) ~ K(m0) + (m - m0)/E[L]
# beyond (the chain pmf is aperiodic, so K(m) - m/E[L] converges geometrically fast).
_DP_EXACT_TOKENS = 256

# Window models one engine keeps (emptied when full). An adaptive server's models follow its
# window's tier mix, in 1% steps: a day of one holds a few hundred to a few thousand.
MODELS_MAX = 4096


@cache
def _cycles_per_request(
    step_pmf: tuple[float, ...], length_law: tuple[float, float, float]
) -> tuple[float, float, float]:
    """Renewal maths of one request under a per-cycle token pmf (step_pmf[l - 1] = P(l tokens))
    and a length law (mean, sigma, max factor). Returns (E[n], E[K], E[n K]) where K(m) is the
    number of decode cycles needed to emit m = n - 1 tokens (the first comes from prefill):
    K(0) = 0, K(m) = 1 + sum_l p_l K(m - l)."""
    w = Workload("_", 0.0, length_law[0], 1.0, length_law[1], length_law[2])
    pn = w.output_length_pmf()
    top = len(pn) - 1
    p = np.asarray(step_pmf)
    lmax = len(p)
    mean_l = float(np.dot(np.arange(1, lmax + 1), p))
    exact = min(top, _DP_EXACT_TOKENS)
    off = lmax - 1
    k = np.zeros(exact + lmax)  # k[m + off] = K(m); K(m <= 0) = 0
    rev = p[::-1]  # dot with k[m - lmax + off .. m - 1 + off] = sum_l p_l K(m - l)
    for m in range(1, exact):
        k[m + off] = 1.0 + float(np.dot(rev, k[m - lmax + off : m + off]))
    km = np.empty(top)  # K(m) for m = 0..top-1
    km[:exact] = k[off : exact + off]
    if top > exact:
        km[exact:] = km[exact - 1] + (np.arange(exact, top) - (exact - 1)) / mean_l
    n = np.arange(top + 1)
    kn = np.zeros(top + 1)
    kn[1:] = km  # K(n - 1)
    return float(np.dot(pn, n)), float(np.dot(pn, kn)), float(np.dot(pn, n * kn))


@dataclass(frozen=True)
class _WindowModel:
    """Everything about a window that depends only on (workloads, mix, batch, tiers, scale)."""

    t_pf: float  # prefill time per decode cycle
    cyc: dict[int, float]  # decode cycle time per tier (filled on first use: WindowEngine._cyc)
    # What the cycle times are priced at: the running batch, the mean context of a decode
    # cycle, the cost scale.
    n_run: int
    ctx: float
    scale: CostScale
    finishes_per_cycle: float
    p_prefill: float
    shares: np.ndarray
    trunc: float
    hist_pmf: dict[int, np.ndarray]  # per tier, accepted-drafts pmf over the batch (sums to 1)
    # Per workload, as Python floats for the window's scalar arithmetic: (E[n], E[K], the
    # output length's sd, var(L) / E[L]^3).
    per_workload: tuple[tuple[float, float, float, float], ...]


class WindowEngine:
    """Draws one poll window's outcome from the StepEngine's model without stepping.

    Closed loop: `concurrency` clients each keep one request open; min(concurrency,
    max_running_requests) run (fewer if the KV pool is full), the rest queue. In steady state
    every decode cycle serves the full running batch; each slot is a renewal process whose
    requests pick a workload from `mix`. Per window: decode cycles = window / (cycle time +
    prefill time per cycle), with the fractional cycle carried to the next window; finished
    requests, tokens, verify steps and the accepted-drafts histogram are drawn around their
    renewal-reward means (exact expected cycles per request from the chain pmf, truncation at
    the output length included).

    Adaptive speculation keeps SGLang's rule state (`AdaptiveRule`) across windows, as a server
    does between restarts, and runs it batch by batch over the window's cycles: each batch's
    mean accepted drafts is drawn (vectorised, per tier) and the EMA is advanced in closed form
    between decision points, so tier dwell and flip-flop behave as in the StepEngine.
    """

    def __init__(
        self,
        profile: SimProfile,
        spec: SpecConfig,
        workloads: Mapping[str, Workload],
        *,
        seed: int = 0,
        max_running_requests: int | None = None,
    ) -> None:
        self.profile = profile
        self.spec = spec
        self.workloads = dict(workloads)
        self.max_running_requests, self.adaptive = _server_limits(
            profile, spec, max_running_requests
        )
        self._rng = np.random.default_rng(seed)
        self._carry = 0.0  # fraction of a cycle carried into the next window (static)
        self._debt_s = 0.0  # time of this window already spent by the last cycle (adaptive)
        self._last_tiers: tuple[tuple[int, float], ...] | None = None
        self._models: dict[tuple[object, ...], _WindowModel] = {}
        self._block_key: tuple[object, ...] | None = None
        self._blocks: dict[int, tuple[list[float], int]] = {}
        # The tiers with captured graphs (0 alone for the baseline), ascending.
        self._tiers: tuple[int, ...] = spec.tiers if spec.speculative else (0,)
        self._shares_given = b""  # the last slot shares given to _run_adaptive, and as drawn
        self._shares_drawn = np.ones(1)

    # -- helpers ----------------------------------------------------------------------------

    def _step_pmf(self, alpha: float, tiers: Mapping[int, float]) -> tuple[float, ...]:
        """P(l tokens per cycle), l = 1..gmax+1, for one request under a tier mix."""
        gmax = max(tiers)
        out = np.zeros(gmax + 1)
        for g, pi in tiers.items():
            if g == 0 or not self.spec.speculative:
                out[0] += pi
            else:
                out[: g + 1] += pi * accepted_drafts_pmf(alpha, g)
        return tuple(float(x) for x in out)

    def _renewal(self, w: Workload, tiers: Mapping[int, float]) -> tuple[float, float, float]:
        return _cycles_per_request(
            self._step_pmf(w.alpha, tiers), (w.output_tokens, w.output_sigma, w.max_output_factor)
        )

    def _pick(self, alphas: np.ndarray, shares: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Per-sequence alphas: each sequence's workload drawn by its slot share."""
        if len(alphas) == 1:
            return np.full(shape, alphas[0])
        idx = np.searchsorted(np.cumsum(shares)[:-1], self._rng.random(shape), side="right")
        return alphas[idx]

    # Above this batch size a batch's mean accepted drafts is drawn from its normal limit
    # (mean, variance / n of the per-sequence mixture) instead of n chain draws.
    CLT_BATCH = 16

    def _block_terms(
        self, g: int, n: int, every: int, ema_alpha: float, alphas: np.ndarray, shares: np.ndarray
    ) -> list[float]:
        """A chunk of EMA increments of whole update intervals at tier g: for each block of
        `every` batches of n sequences, sum_i ema_alpha (1 - ema_alpha)^(every-1-i) x_i where x_i
        is batch i's mean accepted drafts (drawn from the chain model)."""
        w = ema_alpha * (1.0 - ema_alpha) ** np.arange(every - 1, -1, -1)
        if n > self.CLT_BATCH:
            pmf = sum(
                s * accepted_drafts_pmf(float(a), g) for s, a in zip(shares, alphas, strict=True)
            )
            k = np.arange(g + 1)
            mean = float(np.dot(pmf, k))
            var = float(np.dot(pmf, k * k)) - mean * mean
            sd = math.sqrt(max(0.0, var) / n * float(np.dot(w, w)))
            return (mean * float(w.sum()) + sd * self._rng.standard_normal(256)).tolist()
        m = max(16, 4096 // (n * every))
        a = self._pick(alphas, shares, (m, every, n))
        means = draw_accepted_drafts(self._rng, a, g).mean(axis=2)  # [m, every]
        return (means @ w).tolist()

    def _run_adaptive(
        self,
        rule: AdaptiveRule,
        n: int,
        budget_s: float,
        dt: Mapping[int, float],
        alphas: np.ndarray,
        shares: np.ndarray,
    ) -> dict[int, int]:
        """Run SGLang's rule over the window's cycles; returns cycles per tier.

        After warmup the rule decides every `update_interval` batches and the tier is constant
        in between, so whole intervals are applied at once (EMA in closed form from pre-drawn
        block increments); the last interval may run past the window, and that time is carried
        into the next one."""
        slot = rule.slots[rule.bucket(n)]
        cfg = slot.cfg
        every = cfg.update_interval
        decay = (1.0 - cfg.ema_alpha) ** every
        # Slot shares move a little with the window's tier mix; 1% steps keep the draws reused.
        given = shares.tobytes()
        if given != self._shares_given:
            rounded = np.round(shares, 2)
            self._shares_given, self._shares_drawn = given, rounded / rounded.sum()
        shares = self._shares_drawn
        key = (rule.bucket(n), n, alphas.tobytes(), shares.tobytes())
        if key != self._block_key:
            self._block_key, self._blocks = key, {}
        counts: dict[int, int] = {}
        t = self._debt_s
        while t < budget_s:
            g = slot.current_steps
            if slot.batch_count < cfg.warmup_batches:
                k = cfg.warmup_batches - slot.batch_count
                means = np.zeros(k)
                if g > 0:
                    a = (
                        np.resize(alphas, (k, n))
                        if len(alphas) == 1
                        else alphas[self._rng.choice(len(alphas), size=(k, n), p=shares)]
                    )
                    means = draw_accepted_drafts(self._rng, a, g).mean(axis=1)
                slot.advance(means)
            elif g > 0 or len(cfg.candidate_steps) == 1:
                # A run of whole intervals at tier g in a tight loop (the same float operations
                # interval by interval), up to the window's end, the block's end or the first
                # interval after which the rule may move: recompute decides there. A lone tier
                # 0 never moves.
                step = every * dt[g]
                j = 0
                moved = False
                if g > 0:
                    buf, pos = self._blocks.get(g, ([], 0))
                    if pos >= len(buf):
                        buf, pos = self._block_terms(g, n, every, cfg.ema_alpha, alphas, shares), 0
                    lo, hi, ceil_c = slot.stay_bounds()
                    ema = slot.ema_accept_len
                    end = len(buf)
                    while t < budget_s and pos < end:
                        ema = decay * ema + buf[pos]
                        pos += 1
                        j += 1
                        t += step
                        if not lo < ema <= hi or (
                            ceil_c > 0 and max(1, math.ceil(ema * ceil_c)) < g
                        ):
                            moved = True
                            break
                    slot.ema_accept_len = ema
                    self._blocks[g] = (buf, pos)
                else:
                    while t < budget_s:
                        j += 1
                        t += step
                slot.batch_count += every * j
                if moved:
                    slot.recompute()
                counts[g] = counts.get(g, 0) + every * j
                continue
            else:  # tier 0 among others: one interval, then the rule probes the next one up
                k = every
                slot.batch_count += every
                slot.recompute()
            counts[g] = counts.get(g, 0) + k
            t += k * dt[g]
        self._debt_s = t - budget_s
        return counts

    # -- the window -------------------------------------------------------------------------

    def _model(
        self,
        ws: tuple[Workload, ...],
        mixw: tuple[float, ...],
        n_run: int,
        tiers: tuple[tuple[int, float], ...],
        scale: CostScale,
    ) -> _WindowModel:
        key = (ws, mixw, n_run, tiers, scale)
        hit = self._models.get(key)
        if hit is not None:
            return hit
        spec, prof = self.spec, self.profile
        tier_map = dict(tiers)
        mix = np.asarray(mixw)
        ren = np.array([self._renewal(w, tier_map) for w in ws])  # [w, (E n, E K, E nK)]
        en, ek, enk = ren[:, 0], ren[:, 1], ren[:, 2]
        ek_mix = float(np.dot(mix, ek))
        shares = mix * ek / ek_mix  # time share of decode slots per workload
        prompts = np.array([float(round(w.prompt_tokens)) for w in ws])
        # Mean context over decode cycles: prompt + (n + 1) / 2 on average over a request.
        ctx = float(np.dot(mix, prompts * ek + (enk + ek) / 2.0)) / ek_mix
        finishes = n_run / ek_mix
        # Slots finish independently, so a cycle is followed by a prefill step with
        # probability 1 - (1 - 1/E[K])^N; every admitted prompt adds its per-token cost.
        p_prefill = 1.0 - (1.0 - min(1.0, 1.0 / ek_mix)) ** n_run
        pf_fixed = prof.prefill_s(1, 0.0, spec, scale)
        pf_per_tok = (prof.prefill_s(1, 1000.0, spec, scale) - pf_fixed) / 1000.0
        t_pf = p_prefill * pf_fixed + finishes * float(np.dot(mix, prompts)) * pf_per_tok
        pmfs = [np.asarray(self._step_pmf(w.alpha, tier_map)) for w in ws]
        ls = [np.arange(1, len(pm) + 1) for pm in pmfs]
        el = np.array([float(np.dot(pm, lv)) for pm, lv in zip(pmfs, ls, strict=True)])
        var_l = (
            np.array([float(np.dot(pm, lv * lv)) for pm, lv in zip(pmfs, ls, strict=True)]) - el**2
        )
        mean_l = float(np.dot(shares, el))
        hist_pmf: dict[int, np.ndarray] = {}
        for g in tier_map:
            pmf = self._drafts_pmf(g, shares, ws)
            pmf /= pmf.sum()
            hist_pmf[g] = pmf / pmf.sum()  # normalised again, as the draws have always read it
        sd_n = np.array([w.output_length_moments()[1] for w in ws])
        ver_noise = np.maximum(0.0, var_l) / el**3
        model = _WindowModel(
            t_pf=t_pf,
            cyc={},
            n_run=n_run,
            ctx=ctx,
            scale=scale,
            finishes_per_cycle=finishes,
            p_prefill=p_prefill,
            shares=shares,
            # Truncation at the output length: emitted decode tokens per slot-cycle are
            # E[n - 1] / E[K], not E[L].
            trunc=float(np.dot(mix, en - 1.0)) / ek_mix / mean_l,
            hist_pmf=hist_pmf,
            per_workload=tuple(
                zip(en.tolist(), ek.tolist(), sd_n.tolist(), ver_noise.tolist(), strict=True)
            ),
        )
        if len(self._models) >= MODELS_MAX:  # phases change mixes: keep the cache bounded
            self._models.clear()
        self._models[key] = model
        return model

    def _drafts_pmf(self, g: int, shares: np.ndarray, ws: tuple[Workload, ...]) -> np.ndarray:
        """Accepted drafts per verify at tier g over the batch's slots (workload w's share
        shares[w]), unnormalised; tier 0 and the baseline accept none."""
        pmf = np.zeros(self._tiers[-1] + 1)
        if g == 0 or not self.spec.speculative:
            pmf[0] = 1.0
        else:
            for sh, w in zip(shares, ws, strict=True):
                pmf[: g + 1] += sh * accepted_drafts_pmf(w.alpha, g)
        return pmf

    def _cyc(self, m: _WindowModel, g: int) -> float:
        """The decode cycle time of tier g under window model m."""
        c = m.cyc.get(g)
        if c is None:
            spec = self.spec
            steps = g if spec.speculative else None
            c = m.cyc[g] = float(self.profile.cycle_s(m.n_run, spec, steps, m.ctx, m.scale))
        return c

    def run_window(
        self,
        duration_s: float,
        concurrency: int,
        mix: Mapping[str, float],
        scale: CostScale = NO_SCALE,
    ) -> WindowResult:
        """One poll window of `duration_s` with `concurrency` closed-loop clients whose
        requests pick workloads with weights `mix` (labels unknown to the engine use the
        "default" workload's parameters and keep their label)."""
        if duration_s < 0 or not math.isfinite(duration_s):
            raise ValueError(f"duration_s must be a finite number >= 0 (got {duration_s})")
        if concurrency < 0:
            raise ValueError(f"concurrency must be >= 0 (got {concurrency})")
        if any(v < 0 or not math.isfinite(v) for v in mix.values()):
            raise ValueError(f"mix weights must be finite and >= 0 (got {dict(mix)})")
        labels = [k for k, v in mix.items() if v > 0]
        if concurrency > 0 and not labels:
            raise ValueError("mix must give a positive weight to at least one workload")
        if concurrency == 0 or duration_s == 0:
            return self._idle(duration_s)
        ws = tuple(_resolve_workload(self.workloads, k) for k in labels)
        total = float(sum(mix[k] for k in labels))
        mixw = tuple(float(mix[k]) / total for k in labels)
        spec = self.spec
        n_run = min(concurrency, self.max_running_requests)
        # KV pool limit on concurrent requests (mean context per request).
        mean_ctx_req = sum(
            m * (w.prompt_tokens + w.output_tokens) for m, w in zip(mixw, ws, strict=True)
        )
        kv_cap = self.profile.serving.kv_capacity_tokens
        n_run = max(1, min(n_run, int(kv_cap // max(1.0, mean_ctx_req))))
        queued = concurrency - n_run
        rng = self._rng

        if self.adaptive is not None:
            prior = self._last_tiers or ((self.adaptive.steps_for_batch(n_run), 1.0),)
            m0 = self._model(ws, mixw, n_run, prior, scale)
            dt = {g: self._cyc(m0, g) + m0.t_pf for g in self._tiers}
            alphas = np.array([w.alpha for w in ws])
            tiers_used = self._run_adaptive(self.adaptive, n_run, duration_s, dt, alphas, m0.shares)
            cycles = sum(tiers_used.values())
        else:
            g0 = spec.num_steps if spec.speculative else 0
            m0 = self._model(ws, mixw, n_run, ((g0, 1.0),), scale)
            cycles_exact = duration_s / (self._cyc(m0, g0) + m0.t_pf) + self._carry
            cycles = int(cycles_exact)
            self._carry = cycles_exact - cycles
            tiers_used = {g0: cycles} if cycles else {}
        if cycles == 0:
            return self._idle(duration_s, n_run, queued)
        if self.adaptive is not None:
            # The renewal maths use the window's tier mix, rounded to 1% to keep the cache hot.
            tiers = tuple(sorted((g, round(c / cycles, 2)) for g, c in tiers_used.items()))
            tiers = tuple((g, p) for g, p in tiers if p > 0) or ((max(tiers_used), 1.0),)
            norm = sum(p for _, p in tiers)
            tiers = tuple((g, p / norm) for g, p in tiers)
            self._last_tiers = tiers
            m = self._model(ws, mixw, n_run, tiers, scale)
        else:
            m = m0
        step_time = float(sum(c * self._cyc(m, g) for g, c in tiers_used.items()))

        # Verify events and the accepted-drafts histogram (one event per slot per cycle).
        if spec.speculative:
            gmax = self._tiers[-1]
            hist = np.zeros(gmax + 1)
            for g, c in tiers_used.items():
                pmf = m.hist_pmf.get(g)
                if pmf is None:  # a tier rounded away from the mix
                    pmf = self._drafts_pmf(g, m.shares, ws)
                    pmf = pmf / pmf.sum()
                hist += rng.multinomial(c * n_run, pmf)
            raw_tokens = float(np.dot(np.arange(1, gmax + 2), hist))
        else:
            hist = np.zeros(0)
            raw_tokens = float(cycles * n_run)
        # One scalar draw per workload, in order: the same stream as one array draw, faster.
        finishes = cycles * m.finishes_per_cycle
        req = [float(rng.poisson(finishes * x)) for x in mixw]
        output_tokens = raw_tokens * m.trunc + sum(req)

        gen: dict[str, float] = {}
        ver: dict[str, float] = {}
        reqs: dict[str, float] = {}
        noise = rng.standard_normal((len(labels), 2)).tolist()
        for label, r, (en_i, ek_i, sd_i, vn_i), (z_len, z_acc) in zip(
            labels, req, m.per_workload, noise, strict=True
        ):
            g_tok = v = 0.0
            if r > 0:
                g_tok = max(r, r * en_i + math.sqrt(r) * sd_i * z_len)
                if spec.speculative:
                    mu = (en_i - 1.0) / ek_i if ek_i > 0 else 1.0
                    v = r * ek_i + (g_tok - r * en_i) / mu
                    # Acceptance randomness given the lengths: var(K | n) ~ n var(L) / E[L]^3.
                    v = max(0.0, v + math.sqrt(g_tok * vn_i) * z_acc)
            gen[label] = gen.get(label, 0.0) + float(round(g_tok))
            ver[label] = ver.get(label, 0.0) + float(round(v))
            reqs[label] = reqs.get(label, 0.0) + r
        return WindowResult(
            duration_s=duration_s,
            cycles=cycles,
            output_tokens=output_tokens,
            generation_tokens=gen,
            verify_calls=ver,
            requests=reqs,
            sum_bs=float(cycles * n_run),
            sum_step_s=step_time,
            sum_bs2=float(cycles * n_run * n_run),
            sum_bs_step_s=step_time * n_run,
            accepted_drafts_hist=hist.tolist(),
            mean_running=float(n_run),
            mean_queued=float(queued),
            tiers_used=tiers_used,
            prefill_steps=cycles * m.p_prefill,
        )

    def _idle(self, duration_s: float, running: int = 0, queued: int = 0) -> WindowResult:
        gmax = max(self.spec.tiers) if self.spec.speculative else 0
        return WindowResult(
            duration_s=duration_s,
            cycles=0,
            output_tokens=0.0,
            generation_tokens={},
            verify_calls={},
            requests={},
            sum_bs=0.0,
            sum_step_s=0.0,
            sum_bs2=0.0,
            sum_bs_step_s=0.0,
            accepted_drafts_hist=[0.0] * (gmax + 1) if self.spec.speculative else [],
            mean_running=float(running),
            mean_queued=float(queued),
        )
