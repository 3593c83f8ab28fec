"""Accept length per (profile, workload): observed, or predicted across profiles.

Owns `AcceptLength` (forgotten ratio statistics of accepted tokens per verify step, per profile,
workload and batch bucket, with the accepted-drafts histogram per profile), the cross
prediction of a chain never run on a workload from one that was (chain truncation, the tail
model, constant-alpha maps calibrated on shared workloads: policies/chain.py), and
`cross_predictable` (which profiles can be read off which).

Must not: decide anything, read clocks (times come in with the data), or do I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.chain import (
    Z90,
    alpha_from_accept_length,
    expected_accept_length,
    extrapolated_accept_length,
    fit_tail,
    hist_from_alpha,
    predict_from_mean,
    truncated_accept_estimate,
)
from policies.forgetting import (
    AGGREGATE,
    REFIT_FRACTION,
    TINY,
    Memo,
    all_finite,
    batch_bucket,
    decay,
    estimate_within,
)
from policies.traffic import Concurrency
from policies.types import Estimate, Observation, ProfileSpec, spec_from_dict, spec_to_dict

# A cross prediction is split per workload only when the workloads with their own estimates
# carry at least this share of the profile's verify steps (the rest would bias the split).
MIN_SPLIT_COVERAGE = 0.9


@functools.lru_cache(maxsize=8192)
def _chain_map(accept_length: float, g_from: int, g_to: int) -> float:
    """E[L_{g_to}] of the constant-alpha chain whose g_from-step mean is `accept_length`
    (memoised: cross predictions map the same estimates at every look)."""
    a = alpha_from_accept_length(min(max(accept_length, 1.0), g_from + 1.0), g_from)
    return float(expected_accept_length(a, g_to))


def _calibrated(
    e: Estimate, gp: int, gq: int, c: float, hist: tuple[float, float, float]
) -> Estimate:
    """One workload's cross prediction: chain map of its mean, scaled by the calibration c of
    the accepted part; the interval carries its own sampling error, the histogram's relative
    one, and half the calibration's correction (how far the chain shape was off)."""
    lq, mq, hq = hist
    m = _chain_map(e.mean, gp, gq)
    mean = 1.0 + (m - 1.0) * c
    slack = abs(c - 1.0) / 2.0 * (m - 1.0)
    rel_lo = (lq - 1.0) / (mq - 1.0) if mq > 1.0 else 1.0
    rel_hi = (hq - 1.0) / (mq - 1.0) if mq > 1.0 else 1.0
    low = 1.0 + (_chain_map(e.low, gp, gq) - 1.0) * c * rel_lo - slack
    high = 1.0 + (_chain_map(e.high, gp, gq) - 1.0) * c * rel_hi + slack
    mean = min(max(mean, 1.0), gq + 1.0)
    return Estimate(mean, max(1.0, min(low, mean)), min(gq + 1.0, max(high, mean)), e.n)


@dataclass
class _RatioStats:
    """Forgotten sums for a ratio estimate L = sum(gen - req) / sum(verify) with window scatter."""

    w: float = 0.0  # sum verify calls
    wl: float = 0.0  # sum (gen - requests)
    wll: float = 0.0  # sum (gen - requests)^2 / verify  (= sum v * L_w^2)
    v2: float = 0.0  # sum verify^2 (effective number of windows)
    windows: float = 0.0
    count: int = 0  # windows since the last discount (the minimum-data rule counts these)
    last_t_s: float | None = None
    rejected: int = 0

    def scale(self, f: float) -> None:
        self.w *= f
        self.wl *= f
        self.wll *= f
        self.v2 *= f * f
        self.windows *= f

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> _RatioStats:
        return cls(**dict(d))


@dataclass
class _HistStats:
    counts: list[float] = field(default_factory=list)
    last_t_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "last_t_s": self.last_t_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> _HistStats:
        return cls(counts=[float(x) for x in d["counts"]], last_t_s=d.get("last_t_s"))


@dataclass(frozen=True)
class AcceptPrediction:
    estimate: Estimate
    source: str  # "observed", "truncation", "tail_model", "mean_model", "baseline"
    data_t_s: float | None  # time of the newest data behind it


def cross_predictable(p: ProfileSpec, q: ProfileSpec) -> bool:
    """Chain truncation/extrapolation holds between topk-1, fixed-depth chains of one drafter."""
    return (
        p.algorithm is not None
        and p.algorithm == q.algorithm
        and p.topk == 1
        and q.topk == 1
        and not p.adaptive
        and not q.adaptive
        and p.num_steps >= 1
        and q.num_steps >= 1
    )


class AcceptLength:
    """Accept length (drafts + bonus per verify step) per (profile, workload), plus each
    profile's forgotten histogram of accepted drafts, and cross-profile prediction. An adaptive
    profile's accept length moves with the batch size (SGLang's rule picks its tier per batch
    bucket), so its evidence is also kept per half-octave batch bucket (`batched`), and what it
    says at a batch size comes from the windows served there alone.

    From counters: L = (generation_tokens - requests) / verify_calls over finished requests
    (each request's first token comes from prefill, not from a verify step). From histograms:
    exact truncation to fewer steps; tail model to more steps (wider)."""

    def __init__(
        self,
        profiles: Sequence[ProfileSpec],
        half_life_s: float = 1800.0,
        min_windows: int = 3,
        min_verify: float = 200.0,
        min_hist_steps: float = 200.0,
    ) -> None:
        self.specs = {p.name: p for p in profiles}
        self.half_life_s = float(half_life_s)
        self.min_windows = int(min_windows)
        self.min_verify = float(min_verify)
        self.min_hist_steps = float(min_hist_steps)
        self.ratios: dict[str, dict[str, _RatioStats]] = {p.name: {} for p in profiles}
        # Adaptive profiles only: profile -> batch bucket -> workload -> stats.
        self.batched: dict[str, dict[int, dict[str, _RatioStats]]] = {
            p.name: {} for p in profiles if p.adaptive
        }
        self.hists: dict[str, _HistStats] = {p.name: _HistStats() for p in profiles}
        # Derived, not persisted: per profile (steps added since, L_g of the histogram itself,
        # {g': (mean, low, high)}) so truncation/tail fits are not redone every window.
        self._shape: dict[str, tuple[float, float, dict[int, tuple[float, float, float]]]] = {}
        # Derived, not persisted: predictions asked for since the evidence last changed.
        self._memo = Memo()

    def _add_ratio(
        self, st: _RatioStats, gen: float, req: float, ver: float, g: int, t_s: float, lam: float
    ) -> float | None:
        if not all_finite(gen, req, ver) or gen < 0 or req < 0 or ver < 0:
            st.rejected += 1
            return None
        if ver <= 0:
            return None
        L = (gen - req) / ver
        # Impossible: fewer than one token per verify step, or more than steps + 1.
        if L < 1.0 - 1e-6 or g + 1.0 + 1e-6 < L:
            st.rejected += 1
            return None
        st.scale(lam)
        st.w += ver
        st.wl += gen - req
        st.wll += (gen - req) ** 2 / ver
        st.v2 += ver * ver
        st.windows += 1.0
        st.count += 1
        st.last_t_s = t_s
        return L

    def update(self, obs: Observation) -> float | None:
        """Feed one window of the running profile. Returns the window's accept length for
        change detection, or None: decode tokens per sequence-step from the decode moments when
        the window has them (every verify step of the window); else, once per-workload levels
        exist, the profile's level times (verify steps those levels expected / verify steps
        observed), so that only acceptance, not the finished requests' workload mix, moves it;
        before that, the raw all-workload ratio of finished requests."""
        spec = self.specs.get(obs.profile)
        if spec is None:
            raise KeyError(f"unknown profile {obs.profile!r}")
        if not spec.speculative or spec.num_steps < 1:
            return None
        # An adaptive profile's evidence is read by its own predictions alone (cross_predictable).
        self._memo.forget(spec.name, only_its_own=spec.adaptive)
        g = spec.max_steps
        lam = decay(obs.window_s, self.half_life_s)
        per = self.ratios[obs.profile]
        # Prequential levels (before this window): the change signal compares each workload with
        # its own level, so a window that happens to finish more requests of a high-acceptance
        # workload is not a change in acceptance (with a mix, that noise dominates the raw
        # all-workload ratio: ~15% per 10 s window at 16 streams).
        ref = self.estimate(obs.profile, AGGREGATE)
        wb = Concurrency.window_batch(obs) if spec.adaptive else None
        by_b = self.batched[obs.profile].setdefault(batch_bucket(wb), {}) if wb is not None else {}

        def add(key: str, gen: float, req: float, ver: float) -> float | None:
            # The profile's evidence, and an adaptive profile's in this window's batch bucket.
            if wb is not None:
                self._add_ratio(by_b.setdefault(key, _RatioStats()), gen, req, ver, g, obs.t_s, lam)
            return self._add_ratio(
                per.setdefault(key, _RatioStats()), gen, req, ver, g, obs.t_s, lam
            )

        tot_g = tot_r = tot_v = 0.0
        exp_v = cov_acc = cov_v = 0.0
        for w in obs.workloads:
            if w.generation_tokens is None or w.verify_calls is None or w.requests is None:
                continue
            pre = self.estimate(obs.profile, w.workload) if w.workload in per else None
            if add(w.workload, w.generation_tokens, w.requests, w.verify_calls):
                tot_g += w.generation_tokens
                tot_r += w.requests
                tot_v += w.verify_calls
                if pre is not None:
                    acc = w.generation_tokens - w.requests
                    exp_v += acc / pre.mean
                    cov_acc += acc
                    cov_v += w.verify_calls
        agg = None
        if tot_v > 0:
            agg = add(AGGREGATE, tot_g, tot_r, tot_v)
        h = obs.accepted_drafts_hist
        if h is not None and not spec.adaptive and len(h) == spec.num_steps + 1:
            arr = [float(x) for x in h]
            if all(math.isfinite(x) and x >= 0 for x in arr) and sum(arr) > 0:
                hs = self.hists[obs.profile]
                if len(hs.counts) != len(arr):
                    hs.counts = [0.0] * len(arr)
                hs.counts = [c * lam + x for c, x in zip(hs.counts, arr, strict=True)]
                hs.last_t_s = obs.t_s
                if obs.profile in self._shape:
                    added, lp, cache = self._shape[obs.profile]
                    self._shape[obs.profile] = (added + sum(arr), lp, cache)
        m = obs.moments
        if m is not None and m.n_steps > 0 and m.sum_bs > 0 and all_finite(m.sum_generated):
            # Decode tokens per sequence-step over every verify step of the window, running
            # requests included: it moves the window acceptance moves, while counters of
            # finished requests lag by a request's duration (minutes on a slow server).
            per_step = m.sum_generated / m.sum_bs
            if 1.0 - 1e-6 <= per_step <= g + 1.0 + 1e-6:
                return per_step
        if agg is not None and ref is not None and cov_v > 0 and cov_acc >= 0.5 * (tot_g - tot_r):
            # Verify steps the per-workload levels expected over those observed, in accept-length
            # units of the profile's level: ~ref while nothing changed, whatever the mix did.
            return ref.mean * exp_v / cov_v
        return agg

    def discount(
        self, profile: str, factor: float, workload: str | None = None, *, moved: bool = True
    ) -> None:
        """Keep only `factor` of a profile's accept evidence (a detected change, a new boot).
        With `workload`, only that workload's (a change detected in its own accept length)
        plus the evidence pooled over workloads (the aggregate and the histogram hold it too);
        the other workloads' levels did not move and keep their data. `moved`: the level is
        known to have moved, and the minimum-data rule waits for windows since; without it (a
        new boot: what a drafter accepts does not drift with the system's costs) the evidence
        stays an estimate, down-weighted, for workloads the new boot may never serve."""
        f = min(max(factor, 0.0), 1.0)
        self._memo.clear()
        for per in (self.ratios[profile], *self.batched.get(profile, {}).values()):
            for w, st in per.items():
                if workload is not None and w not in (workload, AGGREGATE):
                    continue
                st.scale(f)
                if moved:
                    st.count = 0
        hs = self.hists[profile]
        hs.counts = [c * f for c in hs.counts]
        self._shape.pop(profile, None)

    def reprofile(self, profiles: Sequence[ProfileSpec], reset: Collection[str] = ()) -> None:
        """The profile set becomes `profiles` (their specs and order): a profile no longer in it
        loses its evidence, and one new to it, or named in `reset` (its definition changed
        under the same name: another drafter, another depth), starts without any; every other
        keeps its own (and goes on informing the cross predictions of its drafter's chains)."""
        fresh = set(reset) | {p.name for p in profiles if p.name not in self.specs}
        self.specs = {p.name: p for p in profiles}
        self.ratios = {n: {} if n in fresh else self.ratios.get(n, {}) for n in self.specs}
        self.batched = {
            p.name: {} if p.name in fresh else self.batched.get(p.name, {})
            for p in profiles
            if p.adaptive
        }
        self.hists = {
            n: _HistStats() if n in fresh else self.hists.get(n, _HistStats()) for n in self.specs
        }
        self._shape = {n: v for n, v in self._shape.items() if n in self.specs and n not in fresh}
        self._memo.clear()

    def hist_shape(self, profile: str, g_prime: int) -> tuple[float, tuple[float, float, float]]:
        """(E[L_g] of the profile's own histogram, (mean, low, high) of E[L_g']): exact
        truncation for g' <= g, tail model beyond. Cached until REFIT_FRACTION of new steps."""
        hist = self.histogram(profile)
        if hist is None:
            raise ValueError(f"no histogram for {profile!r}")
        g = len(hist) - 1
        cached = self._shape.get(profile)
        if cached is None or cached[0] > REFIT_FRACTION * sum(hist):
            lp, _, _ = truncated_accept_estimate(hist, g)
            cached = (0.0, lp, {})
            self._shape[profile] = cached
        _, lp, cache = cached
        if g_prime not in cache:
            if g_prime <= g:
                cache[g_prime] = truncated_accept_estimate(hist, g_prime)
            else:
                cache[g_prime] = extrapolated_accept_length(fit_tail(hist), g_prime)
        return lp, cache[g_prime]

    def _stats(self, profile: str, workload: str, batch: float | None) -> _RatioStats | None:
        """The evidence for (profile, workload): for an adaptive profile with `batch`, that of
        the windows served in batch's bucket."""
        if batch is not None and profile in self.batched:
            return self.batched[profile].get(batch_bucket(batch), {}).get(workload)
        return self.ratios[profile].get(workload)

    def estimate(
        self, profile: str, workload: str = AGGREGATE, batch: float | None = None
    ) -> Estimate | None:
        """Observed accept length of `profile` for `workload` (AGGREGATE: all workloads); for an
        adaptive profile with `batch`, at that batch size's bucket."""
        spec = self.specs[profile]
        if not spec.speculative or spec.num_steps < 1:
            return Estimate(1.0, 1.0, 1.0, math.inf)
        st = self._stats(profile, workload, batch)
        if st is None or st.count < self.min_windows or st.w < self.min_verify:
            return None
        g = spec.max_steps
        L = st.wl / st.w
        var_w = max(st.wll / st.w - L * L, 0.0)
        n_eff = st.w * st.w / st.v2 if st.v2 > 0 else 1.0
        se = math.sqrt(var_w / max(n_eff, 1.0))
        # Floor: the Bhatia-Davis bound on a per-step variance of accepted drafts in [0, g].
        a = min(max(L - 1.0, 0.0), float(g))
        se = max(se, math.sqrt(a * (g - a) / st.w))
        return estimate_within(L, Z90 * se, 1.0, g + 1.0, st.w)

    def histogram(self, profile: str) -> list[float] | None:
        hs = self.hists[profile]
        if not hs.counts or sum(hs.counts) < self.min_hist_steps:
            return None
        return list(hs.counts)

    def last_t_s(
        self, profile: str, workload: str = AGGREGATE, batch: float | None = None
    ) -> float | None:
        st = self._stats(profile, workload, batch)
        return st.last_t_s if st is not None else None

    def has_data(self, profile: str) -> bool:
        spec = self.specs[profile]
        if not spec.speculative:
            return True
        return self.estimate(profile, AGGREGATE) is not None

    def predict(
        self,
        profile: str,
        workload: str = AGGREGATE,
        fresh_since_s: float | None = None,
        batch: float | None = None,
    ) -> AcceptPrediction | None:
        """Best available accept length of `profile` for `workload`: own fresh data first, then
        a fresh cross-profile prediction (truncation from a deeper chain, the tail model from a
        shallower one, the constant-alpha model when only means exist), then stale own data,
        then stale cross predictions. Fresh = newest data at or after `fresh_since_s`. An
        adaptive profile at `batch`: its own windows in that batch bucket, else None."""
        ap: AcceptPrediction | None = self._memo.answer(
            (profile, workload, fresh_since_s, batch),
            lambda: self._predict(profile, workload, fresh_since_s, batch),
        )
        return ap

    def _predict(
        self, profile: str, workload: str, fresh_since_s: float | None, batch: float | None
    ) -> AcceptPrediction | None:
        q = self.specs[profile]
        if not q.speculative or q.num_steps < 1:
            return AcceptPrediction(Estimate(1.0, 1.0, 1.0, math.inf), "baseline", None)

        def fresh(t: float | None) -> bool:
            return fresh_since_s is None or (t is not None and t >= fresh_since_s)

        own_e = self.estimate(profile, workload, batch)
        own = (
            AcceptPrediction(own_e, "observed", self.last_t_s(profile, workload, batch))
            if own_e is not None
            else None
        )
        if own is not None and fresh(own.data_t_s):
            return own
        cross = self._cross(q, workload, fresh)
        if cross is not None and fresh(cross.data_t_s):
            return cross
        return own if own is not None else cross

    def _cross(self, q: ProfileSpec, workload: str, fresh: Any) -> AcceptPrediction | None:
        cands: list[tuple[tuple[int, int, float], ProfileSpec, Estimate]] = []
        for p in self.specs.values():
            if p.name == q.name or not cross_predictable(p, q):
                continue
            e = self.estimate(p.name, workload)
            if e is None:
                continue
            t = self.last_t_s(p.name, workload)
            key = (0 if fresh(t) else 1, 0 if p.num_steps >= q.num_steps else 1, -e.n)
            cands.append((key, p, e))
        if not cands:
            return None
        cands.sort(key=lambda c: c[0])
        _, p, e = cands[0]
        t = self.last_t_s(p.name, workload)
        gp, gq = p.num_steps, q.num_steps
        hist = self.histogram(p.name)
        if hist is not None and len(hist) == gp + 1:
            lp_h, (mq, lq, hq) = self.hist_shape(p.name, gq)
            if lp_h <= 1.0 + 1e-9:
                return AcceptPrediction(
                    Estimate(1.0, 1.0, 1.0 + (e.high - 1.0), e.n), "truncation", t
                )
            src = "truncation" if gq <= gp else "tail_model"
            split = self._per_workload(p, gp, gq, lp_h, mq)
            if split is not None:
                c, per = split
                if workload == AGGREGATE:
                    # What q's counters would say for the same traffic: token-weighted harmonic
                    # mean of the workloads (a verify step of q yields L_w(q) tokens of w).
                    parts = [
                        (tok, _calibrated(ew, gp, gq, c, (lq, mq, hq))) for ew, tok in per.values()
                    ]
                    tot = sum(tok for tok, _ in parts)
                    if tot > 0:
                        vals = [
                            tot / sum(tok / getattr(x, k) for tok, x in parts)
                            for k in ("mean", "low", "high")
                        ]
                        return AcceptPrediction(Estimate(*vals, e.n), src, t)
                elif workload in per:
                    return AcceptPrediction(
                        _calibrated(per[workload][0], gp, gq, c, (lq, mq, hq)), src, t
                    )
            base = lp_h - 1.0
            mean = 1.0 + (e.mean - 1.0) * (mq - 1.0) / base
            low = 1.0 + (e.low - 1.0) * (lq - 1.0) / base
            high = 1.0 + (e.high - 1.0) * (hq - 1.0) / base
            est = Estimate(mean, max(1.0, min(low, mean)), min(gq + 1.0, max(high, mean)), e.n)
            return AcceptPrediction(est, src, t)
        se = (e.high - e.low) / (2 * Z90)
        m, lo, hi = predict_from_mean(e.mean, gp, gq, se)
        return AcceptPrediction(Estimate(m, lo, hi, e.n), "mean_model", t)

    def _per_workload(
        self, p: ProfileSpec, gp: int, gq: int, lp_h: float, mq: float
    ) -> tuple[float, dict[str, tuple[Estimate, float]]] | None:
        """Per-workload shape of a cross prediction from `p`'s histogram.

        The histogram is one mixture over workloads, so its truncation ratio is wrong for each
        of them (a high-alpha workload loses more to truncation than a low-alpha one). Each
        workload gets the constant-alpha chain map of its own mean, and one calibration factor
        c makes their verify-weighted mixture reproduce the histogram's exact truncation (or
        tail model): c = (histogram ratio) / (model ratio), 1 when the chain model is right.
        Beyond the histogram (gq > gp) the tail model is compared like with like: applied to
        the histogram the per-workload chains would produce, it shows the bias a mixture gives
        it on its own (the low-alpha workloads drop out of the later positions, so a pooled
        tail rate understates the rest), and only the observed histogram's departure from that
        counts as a shape the chains miss.
        Returns (c, {workload: (estimate, tokens)}) or None without per-workload data."""
        per: dict[str, tuple[Estimate, float]] = {}
        num_model = num_obs = 0.0
        model_hist = np.zeros(gp + 1)
        for w, st in self.ratios[p.name].items():
            if w == AGGREGATE:
                continue
            e = self.estimate(p.name, w)
            if e is None:
                continue
            num_model += st.w * (_chain_map(e.mean, gp, gq) - 1.0)
            num_obs += st.w * (e.mean - 1.0)
            a = alpha_from_accept_length(min(max(e.mean, 1.0), gp + 1.0), gp)
            model_hist += hist_from_alpha(a, gp, st.w)
            per[w] = (e, st.wl)
        if not per or num_model <= TINY or num_obs <= TINY or lp_h <= 1.0 + 1e-9:
            return None
        if gq > gp and model_hist.sum() > 0:
            lp_m, _, _ = truncated_accept_estimate(model_hist, gp)
            mq_m = extrapolated_accept_length(fit_tail(model_hist), gq)[0]
            if lp_m > 1.0 + 1e-9 and mq_m > 1.0 + 1e-9:
                # What the tail model says of the chains' own histogram, per observed token.
                num_model = num_obs * (mq_m - 1.0) / (lp_m - 1.0)
        # The calibration matches the whole histogram: the workloads with estimates must be
        # (nearly) all of its verify steps, or c would absorb the missing ones.
        agg = self.ratios[p.name].get(AGGREGATE)
        covered = sum(self.ratios[p.name][w].w for w in per)
        if agg is None or covered < MIN_SPLIT_COVERAGE * agg.w:
            return None
        c = ((mq - 1.0) / (lp_h - 1.0)) / (num_model / num_obs)
        return c, per

    def to_dict(self) -> dict[str, Any]:
        return {
            "half_life_s": self.half_life_s,
            "min_windows": self.min_windows,
            "min_verify": self.min_verify,
            "min_hist_steps": self.min_hist_steps,
            "profiles": [spec_to_dict(s) for s in self.specs.values()],
            "ratios": {p: {w: s.to_dict() for w, s in d.items()} for p, d in self.ratios.items()},
            "batched": {
                p: {str(b): {w: s.to_dict() for w, s in ws.items()} for b, ws in d.items()}
                for p, d in self.batched.items()
            },
            "hists": {p: h.to_dict() for p, h in self.hists.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AcceptLength:
        obj = cls(
            [spec_from_dict(s) for s in d["profiles"]],
            half_life_s=d["half_life_s"],
            min_windows=d["min_windows"],
            min_verify=d["min_verify"],
            min_hist_steps=d["min_hist_steps"],
        )
        for p, ws in d["ratios"].items():
            obj.ratios[p] = {w: _RatioStats.from_dict(s) for w, s in ws.items()}
        # States saved before the batched evidence have none: it fills from the next windows.
        for p, bs in d.get("batched", {}).items():
            if p in obj.batched:
                obj.batched[p] = {
                    int(b): {w: _RatioStats.from_dict(s) for w, s in ws.items()}
                    for b, ws in bs.items()
                }
        for p, h in d["hists"].items():
            obj.hists[p] = _HistStats.from_dict(h)
        return obj
