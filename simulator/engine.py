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

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from simulator.adaptive import AdaptiveRule, spec_cuda_graph_batch_sizes
from simulator.model import (
    NO_SCALE,
    CostScale,
    SimProfile,
    SpecConfig,
    Workload,
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
        self.max_running_requests = (
            profile.max_running_requests(spec)
            if max_running_requests is None
            else int(max_running_requests)
        )
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        self.now_s = 0.0
        self._rng = np.random.default_rng(seed)
        self.adaptive: AdaptiveRule | None = None
        if spec.adaptive:
            self.adaptive = AdaptiveRule(
                spec.num_steps,
                spec.adaptive_config,
                spec_cuda_graph_batch_sizes(self.max_running_requests),
            )
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
        ctx = float(np.mean(self._prompt + self._generated))
        phases = self.profile.cycle_phases_s(
            b,
            self.spec,
            steps=g if self.spec.speculative else None,
            context_tokens=ctx,
            scale=self.scale,
        )
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
