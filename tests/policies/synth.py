"""Synthetic poll windows for the policy tests: a small chain + roofline stand-in, not the
simulator (tests/policies must not import simulator/). Each window draws per-step batch sizes,
noisy step times from a linear cost model, and accepted drafts per sequence-step from the
topk-1 chain with a per-workload alpha, and reports them as an Observation (or as cumulative
Snapshots, for observation.diff)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from policies.chain import expected_accept_length
from policies.types import DecodeMoments, Observation, ProfileSpec, Snapshot, WorkloadWindow

BASE = ProfileSpec("baseline")
E2 = ProfileSpec("eagle2", num_steps=2, draft_tokens=3, algorithm="EAGLE3")
E5 = ProfileSpec("eagle5", num_steps=5, draft_tokens=6, algorithm="EAGLE3")
PROFILES = (BASE, E2, E5)
# An adaptive profile of the same drafter (SGLang's adaptive mode over steps 0, 2 and 5).
HYB = ProfileSpec(
    "hybrid",
    num_steps=2,
    draft_tokens=3,
    algorithm="EAGLE3",
    adaptive=True,
    candidate_steps=(0, 2, 5),
)


@dataclass
class Cost:
    """step_s(B, n) = fixed + verify_fixed*[n>1] + per_tok*B*n + per_seq*B + draft*(n-1)."""

    fixed_s: float = 0.0100
    verify_fixed_s: float = 0.0070
    per_tok_s: float = 0.00005
    per_seq_s: float = 0.0002
    draft_step_s: float = 0.0004

    def step_s(self, batch: np.ndarray | float, n: int) -> np.ndarray:
        b = np.asarray(batch, dtype=float)
        return (
            self.fixed_s
            + (self.verify_fixed_s if n > 1 else 0.0)
            + self.per_tok_s * b * n
            + self.per_seq_s * b
            + self.draft_step_s * (n - 1)
        )


@dataclass
class Synth:
    cost: Cost = field(default_factory=Cost)
    seed: int = 0
    noise: float = 0.03  # relative sd of one step's time
    batch_jitter: int = 1  # per-step batch size varies uniformly by +- this
    with_hist: bool = True

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def true_tok_s(
        self,
        spec: ProfileSpec,
        batch: float,
        alphas: Mapping[str, float],
        shares: Mapping[str, float],
    ) -> float:
        n = max(spec.draft_tokens, 1)
        t = float(self.cost.step_s(batch, n))
        if spec.num_steps == 0:
            return batch / t
        tot = sum(shares.values())
        L = tot / sum(
            s / float(expected_accept_length(alphas[w], spec.num_steps)) for w, s in shares.items()
        )
        return batch * L / t

    def window(
        self,
        spec: ProfileSpec,
        t_s: float,
        batch: float,
        alphas: Mapping[str, float],
        shares: Mapping[str, float] | None = None,
        window_s: float = 10.0,
        out_len: float = 300.0,
    ) -> Observation:
        shares = dict(shares or {"chat": 1.0})
        n = max(spec.draft_tokens, 1)
        g = spec.num_steps
        rng = self.rng
        mean_t = float(self.cost.step_s(batch, n))
        n_steps = max(int(window_s / mean_t), 1)
        bs = np.clip(
            np.round(batch + rng.integers(-self.batch_jitter, self.batch_jitter + 1, n_steps)),
            1,
            None,
        )
        ts = self.cost.step_s(bs, n) * (1.0 + self.noise * rng.standard_normal(n_steps))
        ts = np.clip(ts, 1e-5, None)
        seq_steps = float(bs.sum())
        wl: list[WorkloadWindow] = []
        hist = np.zeros(g + 1)
        tot_gen = 0.0
        if g == 0:
            for w, sh in shares.items():
                gen = seq_steps * sh / sum(shares.values())
                req = rng.poisson(gen / out_len)
                tot_gen += gen
                wl.append(WorkloadWindow(w, float(round(gen)), None, float(req)))
        else:
            Ls = {w: float(expected_accept_length(alphas[w], g)) for w in shares}
            pis = np.array([shares[w] / Ls[w] for w in shares])
            pis /= pis.sum()
            counts = rng.multinomial(int(seq_steps), pis)
            for (w, _), v in zip(shares.items(), counts, strict=True):
                a = alphas[w]
                k = np.arange(g + 1)
                p = a**k * (1 - a)
                p[g] = a**g
                h = rng.multinomial(int(v), p / p.sum())
                hist += h
                acc = float((h * k).sum()) + float(v)
                req = float(rng.poisson(max(acc, 1.0) / out_len))
                tot_gen += acc
                wl.append(WorkloadWindow(w, acc + req, float(v), req))
        moments = DecodeMoments(
            n_steps=float(n_steps),
            sum_bs=float(bs.sum()),
            sum_step_s=float(ts.sum()),
            sum_bs2=float((bs**2).sum()),
            sum_bs_step_s=float((bs * ts).sum()),
            sum_generated=tot_gen,
        )
        return Observation(
            t_s=t_s,
            window_s=window_s,
            profile=spec.name,
            running_reqs=float(batch),
            generation_tokens=sum(w.generation_tokens or 0.0 for w in wl),
            verify_calls=sum(w.verify_calls or 0.0 for w in wl) if g else None,
            decode_tokens=tot_gen,
            moments=moments,
            workloads=tuple(wl),
            accepted_drafts_hist=tuple(float(x) for x in hist) if (g and self.with_hist) else None,
        )


def to_snapshot(prev: Snapshot | None, obs: Observation) -> Snapshot:
    """Accumulate an Observation onto a cumulative Snapshot (for diff tests)."""

    def acc(m: Mapping[str, float], key: str, v: float | None) -> dict[str, float]:
        out = dict(m)
        if v is not None:
            out[key] = out.get(key, 0.0) + v
        return out

    gen = dict(prev.generation_tokens) if prev else {}
    ver = dict(prev.verify_calls) if prev else {}
    req = dict(prev.requests) if prev else {}
    for w in obs.workloads:
        gen = acc(gen, w.workload, w.generation_tokens)
        ver = acc(ver, w.workload, w.verify_calls)
        req = acc(req, w.workload, w.requests)
    m = obs.moments
    assert m is not None
    vec = (m.n_steps, m.sum_bs, m.sum_step_s, m.sum_bs2, m.sum_bs_step_s, m.sum_generated)
    mom = (
        tuple(a + b for a, b in zip(prev.moments, vec, strict=True))
        if prev and prev.moments
        else vec
    )
    hist = obs.accepted_drafts_hist
    if hist is not None and prev is not None and prev.accepted_drafts_hist is not None:
        hist = tuple(a + b for a, b in zip(prev.accepted_drafts_hist, hist, strict=True))
    return Snapshot(
        t_s=obs.t_s,
        profile=obs.profile,
        running_reqs=obs.running_reqs,
        generation_tokens=gen,
        verify_calls=ver,
        requests=req,
        decode_tokens=(prev.decode_tokens if prev and prev.decode_tokens else 0.0)
        + (obs.decode_tokens or 0.0),
        moments=mom,
        accepted_drafts_hist=hist,
    )
