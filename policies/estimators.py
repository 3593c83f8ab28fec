"""The throughput model: everything the policy believes about a profile, composed.

Owns `ThroughputModel`, which feeds each window to the estimators it composes (the cycle-time
surface of policies/cycle_time.py, the accept lengths of policies/accept_length.py, the
concurrency and workload mix of policies/traffic.py) and predicts a profile's tok/s for the
traffic now, B x E[L] / T_cycle(B) with an interval, and `WindowSignals`, what one window says
for change detection. All state is exponentially forgotten sufficient statistics updated in
O(1) per window (no refits from raw history), serialisable with to_dict/from_dict.

Honesty rules: `estimate()` returns None below a minimum of data; every estimate carries a ~90%
interval; windows that are physically impossible (negative times, batch < 1, accept length
outside [1, steps + 1], moments violating Cauchy-Schwarz) are rejected and counted; fits with an
impossible sign (step time falling with batch size) are not used.

Must not: decide anything, read clocks (times come in with the data), or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.accept_length import AcceptLength, AcceptPrediction
from policies.chain import Z90
from policies.cycle_time import CycleTimeSurface
from policies.forgetting import AGGREGATE, TINY, decay
from policies.traffic import Concurrency, WorkloadMix
from policies.types import Estimate, Observation, ProfilePrediction, ProfileSpec


@dataclass(frozen=True)
class WindowSignals:
    """What one window says, for change detection (None where unknown)."""

    batch: float | None  # the batch the running profile served
    load: float | None  # the load offered (the batch, plus requests queued behind a binding cap)
    accept_length: float | None
    cycle_ratio: float | None  # window step time / prediction before it at the window's B
    step_s: float | None  # window mean step time
    output_tok_s: float | None


class ThroughputModel:
    """Everything the policy believes, composed: `observe` feeds a window to every estimator;
    `predict(profile, batch, mix)` gives tok/s = B x E[L] / T_cycle(B) (baseline: B / T(B, 1))
    with an interval from the parts and the break-even accept length next to the observed one."""

    def __init__(
        self,
        profiles: Sequence[ProfileSpec],
        cycle_half_life_s: float = 1800.0,
        accept_half_life_s: float = 1800.0,
        concurrency_half_life_s: float = 30.0,
        mix_half_life_s: float = 120.0,
        observed_half_life_s: float = 60.0,
        min_windows: int = 3,
        min_steps: float = 20.0,
        min_verify: float = 200.0,
        min_hist_steps: float = 200.0,
        expert_share: float = 0.0,
    ) -> None:
        names = [p.name for p in profiles]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"profiles must be a non-empty list of unique names, got {names}")
        self.specs = {p.name: p for p in profiles}
        self.cycle = CycleTimeSurface(
            profiles, cycle_half_life_s, min_windows, min_steps, expert_share
        )
        self.accept = AcceptLength(
            profiles, accept_half_life_s, min_windows, min_verify, min_hist_steps
        )
        self.concurrency = Concurrency(concurrency_half_life_s)
        self.mix = WorkloadMix(mix_half_life_s)
        self.observed_half_life_s = float(observed_half_life_s)
        self.observed: dict[str, tuple[float, float]] = {}  # profile -> (w, w * tok_s)
        # Max running requests each profile's server reported (/v1/loads), the last one.
        self.caps: dict[str, float] = {}

    def reprofile(self, profiles: Sequence[ProfileSpec], reset: Collection[str] = ()) -> None:
        """The profile set becomes `profiles` (a config edited between runs): a profile no
        longer in it is forgotten, one new to it or named in `reset` (its definition changed)
        starts with no estimates of its own (cycle, acceptance, observed rate, reported cap),
        and every other keeps what it learned. The traffic (concurrency, mix) is no profile's
        and stays."""
        names = [p.name for p in profiles]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"profiles must be a non-empty list of unique names, got {names}")
        fresh = set(reset) | {n for n in names if n not in self.specs}
        self.specs = {p.name: p for p in profiles}
        self.cycle.reprofile(profiles, fresh)
        self.accept.reprofile(profiles, fresh)
        self.observed = {
            n: v for n, v in self.observed.items() if n in self.specs and n not in fresh
        }
        self.caps = {n: v for n, v in self.caps.items() if n in self.specs and n not in fresh}

    def cap(self, profile: str) -> float | None:
        """The most requests `profile`'s server runs at once: what it reported when it ran,
        else its flags' (ProfileSpec), else None (unknown: no cap assumed)."""
        c = self.caps.get(profile)
        if c is not None:
            return c
        m = self.specs[profile].max_running_requests
        return None if m is None else float(m)

    def batch_for(self, profile: str, load: float | None = None) -> float | None:
        """The batch size `profile` would serve under `load` (default: the load offered now):
        the load, or its cap where the load is above it (the rest queue)."""
        x = self.concurrency.load() if load is None else load
        c = self.cap(profile)
        return x if x is None or c is None else min(x, c)

    def observe(self, obs: Observation) -> WindowSignals:
        """Feed one same-profile window (the caller skips reset/profile-change windows)."""
        if obs.profile not in self.specs:
            raise KeyError(f"unknown profile {obs.profile!r}")
        m = obs.max_running_reqs
        if m is not None and 1.0 <= m < math.inf:
            self.caps[obs.profile] = float(m)
        batch, load = self.concurrency.update(obs, self.cap(obs.profile)) or (None, None)
        self.mix.update(obs)
        ratio = step_s = None
        if obs.moments is not None:
            ratio = self.cycle.update(obs.profile, obs.moments, obs.t_s, obs.window_s)
            if obs.moments.n_steps > 0:
                step_s = obs.moments.sum_step_s / obs.moments.n_steps
        L = self.accept.update(obs)
        tok = obs.output_tok_s
        if tok is not None and math.isfinite(tok) and tok >= 0:
            lam = decay(obs.window_s, self.observed_half_life_s)
            w, wt = self.observed.get(obs.profile, (0.0, 0.0))
            self.observed[obs.profile] = (w * lam + 1.0, wt * lam + tok)
        return WindowSignals(batch, load, L, ratio, step_s, tok)

    def observed_tok_s(self, profile: str) -> float | None:
        w, wt = self.observed.get(profile, (0.0, 0.0))
        return wt / w if w > 0 else None

    def accept_for_mix(
        self,
        profile: str,
        mix: Mapping[str, float],
        fresh_since_s: float | None,
        sample: tuple[float, Sequence[str]] | None = None,
        batch: float | None = None,
    ) -> tuple[Estimate, str, float | None] | None:
        """E[L] of `profile` under a token-share mix: token-weighted harmonic mean of the
        per-workload predictions (interval ends combined end to end: conservative). A workload
        with no prediction (no profile of this drafter served it) takes the profile's
        all-workload level with the whole possible interval, 1 to steps + 1.
        `batch`: where an adaptive profile's accept length is read (its tier moves with it).

        `sample`: (finished requests n, workloads known) when the shares are a sample (the mix
        now). 1/L = sum s_w / L_w is then uncertain as the shares are: under their Jeffreys
        posterior (Dirichlet with n s_w + 1/2 per known workload, so a workload not seen since
        a change still may be there) its sd is sqrt((E[1/L_w^2] - E[1/L_w]^2) / (a0 + 1)), and
        the interval widens by that much (a mix read off a few requests just after a change
        does not pass for the traffic)."""
        shares = {k: v for k, v in mix.items() if v > 0}
        parts: list[tuple[float, AcceptPrediction]] = []
        agg: AcceptPrediction | None = None
        top = self.specs[profile].max_steps + 1.0
        for w, s in shares.items():
            ap = self.accept.predict(profile, w, fresh_since_s, batch)
            if ap is None:
                # Nothing (own or cross) says how this drafter does on w: the other workloads'
                # level is a guess, anywhere from no draft accepted to every one.
                agg = agg or self.accept.predict(profile, AGGREGATE, fresh_since_s, batch)
                if agg is None:
                    parts = []
                    break
                e = agg.estimate
                ap = AcceptPrediction(
                    Estimate(e.mean, 1.0, max(top, e.high), e.n), "unseen", agg.data_t_s
                )
            parts.append((s, ap))
        if not parts:
            ap = self.accept.predict(profile, AGGREGATE, fresh_since_s, batch)
            if ap is None:
                return None
            return ap.estimate, ap.source, ap.data_t_s
        tot = sum(s for s, _ in parts)

        def hmean(vals: Iterable[tuple[float, float]]) -> float:
            return tot / sum(s / v for s, v in vals)

        mean = hmean((s, ap.estimate.mean) for s, ap in parts)
        low = hmean((s, ap.estimate.low) for s, ap in parts)
        high = hmean((s, ap.estimate.high) for s, ap in parts)
        if sample is not None:
            n = max(sample[0], 0.0)
            # parts follow shares' order (every workload in the mix has a prediction here).
            inv_l = {w: 1.0 / ap.estimate.mean for w, (_, ap) in zip(shares, parts, strict=True)}
            for w in sample[1]:
                if w not in inv_l and (ap := self.accept.predict(profile, w, fresh_since_s, batch)):
                    inv_l[w] = 1.0 / ap.estimate.mean
            alpha = {w: n * shares.get(w, 0.0) / tot + 0.5 for w in inv_l}
            a0 = sum(alpha.values())
            m1 = sum(a * inv_l[w] for w, a in alpha.items()) / a0
            m2 = sum(a * inv_l[w] ** 2 for w, a in alpha.items()) / a0
            sd_inv = math.sqrt(max(m2 - m1 * m1, 0.0) / (a0 + 1.0))
            inv = 1.0 / mean
            low = min(low, 1.0 / (inv + Z90 * sd_inv))
            high = max(high, 1.0 / max(inv - Z90 * sd_inv, TINY))
        sources = sorted({ap.source for _, ap in parts})
        times = [ap.data_t_s for _, ap in parts if ap.data_t_s is not None]
        n = min(ap.estimate.n for _, ap in parts)
        return Estimate(mean, low, high, n), "+".join(sources), min(times) if times else None

    def predict(
        self,
        profile: str,
        batch: float | None = None,
        mix: Mapping[str, float] | None = None,
        fresh_since_s: float | None = None,
        stale_widen: float = 2.0,
        cycle_moves: Sequence[tuple[float, float]] = (),
        cycle_fresh_since_s: float | None = None,
        verify_rise: float = 1.0,
    ) -> ProfilePrediction:
        """tok/s of `profile` at `batch` (default: the batch it would serve under the load offered
        now, `batch_for`) and `mix` (default: the mix now). Acceptance whose newest data
        predates `fresh_since_s` (the last change point in acceptance) and a cycle time whose
        own data predates `cycle_fresh_since_s` (the last one in cycle time) have their
        interval widened by `stale_widen`: a change of one says nothing of the other (a
        chain's accept length moving leaves the baseline's step time where it was).
        `cycle_moves` (time, ratio): detected changes of the step time of profiles of this one's
        kind (verify or decode forwards); a cycle estimate from own data older than some of them
        has most likely moved as far as their product (a change of system state moves every
        forward of a kind: FIELD.md's reboot moved the verify 1.5x and the decode 1.08x), so it
        is centred there; the move may also have been the other profile's alone, so its interval
        reaches back to the old level. `verify_rise`: the product of the ratios of every
        detected change of a verify forward's step time; where it is above 1, a baseline never
        run is bounded below by the verify as it was before them (they may have been the
        verify's alone), see CycleTimeSurface.baseline_bound."""
        if profile not in self.specs:
            raise KeyError(f"unknown profile {profile!r}")
        spec = self.specs[profile]
        b = batch if batch is not None else self.batch_for(profile)
        mx = dict(mix) if mix is not None else self.mix.shares()
        sample = None
        if mix is None and self.mix.counts_requests:
            sample = (self.mix.requests, tuple(self.mix.tokens))
        observed = self.observed_tok_s(profile)
        if b is None or b <= 0:
            return ProfilePrediction(profile, None, observed_tok_s=observed, source="no_traffic")
        cyc = self.cycle.estimate(profile, b)
        if cyc is None and not spec.speculative:
            cyc = self.cycle.baseline_bound(b, verify_rise)
        acc = self.accept_for_mix(profile, mx, fresh_since_s, sample, b)
        base_name = self._baseline_name()
        # The break-even accept length needs the baseline's step time, not a bound on it.
        base = self.cycle.estimate(base_name, b) if base_name is not None else None
        breakeven = None
        if cyc is not None and base is not None and spec.speculative:
            breakeven = cyc.mean / base.mean
        if cyc is None or acc is None:
            return ProfilePrediction(
                profile,
                None,
                accept_length=acc[0] if acc else None,
                cycle_s=cyc,
                breakeven_accept_length=breakeven,
                observed_tok_s=observed,
                source="insufficient",
            )
        L, src_a, t_a = acc
        # "bound": a baseline never run, only bounded by a speculative profile's cycle.
        cyc_src = (
            "observed"
            if self.cycle.has_data(profile)
            else ("surface" if spec.speculative else "bound")
        )
        t_c = self.cycle.last_t_s(profile)
        # A surface prediction's uncertainty is already the model's; staleness widens own data.
        stale_c = (
            cyc_src == "observed"
            and cycle_fresh_since_s is not None
            and (t_c is None or t_c < cycle_fresh_since_s)
        )
        stale_a = (
            spec.speculative and fresh_since_s is not None and (t_a is None or t_a < fresh_since_s)
        )
        if stale_c:
            cyc = _widen(cyc, stale_widen, floor=cyc.mean * 1e-3)
        since = [r for t, r in cycle_moves if t_c is None or t_c < t]
        moved = cyc_src == "observed" and bool(since)
        if moved:
            far = cyc.mean * math.prod(since)
            cyc = Estimate(far, min(cyc.low, far), max(cyc.high, far), cyc.n)
        if stale_a:
            L = _widen(L, stale_widen, floor=1.0)
        mean = b * L.mean / cyc.mean
        low = b * L.low / cyc.high if math.isfinite(cyc.high) else 0.0
        high = b * L.high / cyc.low if cyc.low > 0 else math.inf
        tok = Estimate(mean, min(low, mean), max(high, mean), min(L.n, cyc.n))
        src = cyc_src if src_a in ("baseline", "observed") else f"{src_a}+{cyc_src}"
        if stale_a or stale_c:
            src += "+stale"
        if moved:
            src += "+moved"
        return ProfilePrediction(
            profile,
            tok,
            accept_length=L,
            cycle_s=cyc,
            breakeven_accept_length=breakeven,
            observed_tok_s=observed,
            source=src,
        )

    def _baseline_name(self) -> str | None:
        for p in self.specs.values():
            if not p.speculative:
                return p.name
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cycle": self.cycle.to_dict(),
            "accept": self.accept.to_dict(),
            "concurrency": self.concurrency.to_dict(),
            "mix": self.mix.to_dict(),
            "observed_half_life_s": self.observed_half_life_s,
            "observed": {k: list(v) for k, v in self.observed.items()},
            "caps": dict(self.caps),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ThroughputModel:
        obj = cls.__new__(cls)
        obj.cycle = CycleTimeSurface.from_dict(d["cycle"])
        obj.specs = dict(obj.cycle.specs)
        obj.accept = AcceptLength.from_dict(d["accept"])
        obj.concurrency = Concurrency.from_dict(d["concurrency"])
        obj.mix = WorkloadMix.from_dict(d["mix"])
        obj.observed_half_life_s = float(d["observed_half_life_s"])
        obj.observed = {k: (float(v[0]), float(v[1])) for k, v in d["observed"].items()}
        obj.caps = {k: float(v) for k, v in d.get("caps", {}).items()}
        return obj


def _widen(e: Estimate, factor: float, floor: float) -> Estimate:
    return Estimate(
        e.mean,
        max(floor, e.mean - (e.mean - e.low) * factor),
        e.mean + (e.high - e.mean) * factor,
        e.n,
    )
