"""What an exploration is worth: the distributions a profile's price is weighed with, and the
expected value and cost arithmetic decide()'s exploration rule runs on them.

Owns `prior_dist` (a prediction as a normal, a bound or an unseen acceptance as a uniform band,
no prediction as a band around the running rate), their closed-form shortfall and the expected
excess of the best of several over the running rate, `explore_gain` (that excess less the
switch margin), `breakeven_s` (the remaining regime at which an exploration repays), and
`interval_sd` (the normal spread of an Estimate's ~90% interval) and `switch_margin` (the
switch rule's margin, which every restart decision clears).

Must not: read state, decide anything, read clocks, or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import ndtr

from policies.chain import Z90
from policies.settings import PolicySettings
from policies.types import Estimate, ProfilePrediction, ProfileSpec

# A price's distribution: ("norm", mean, sd) or ("unif", low, high).
Dist = tuple[str, float, float]


def interval_sd(e: Estimate) -> float:
    """The standard deviation of the normal whose ~90% interval is `e`'s (inf if unbounded)."""
    if not (math.isfinite(e.high) and math.isfinite(e.low)):
        return math.inf
    return (e.high - e.low) / (2.0 * Z90)


def switch_margin(current: Estimate, new: Estimate, margin_frac: float, margin_z: float) -> float:
    """The switch rule's margin for leaving `current` for `new` (tok/s): margin_frac x C (what
    the model cannot see) + margin_z x sd(N - C) (what it is unsure of)."""
    return margin_frac * current.mean + margin_z * math.hypot(
        interval_sd(new), interval_sd(current)
    )


def prior_dist(
    pred: ProfilePrediction | None,
    cur: float,
    s: PolicySettings,
    spec: ProfileSpec,
    running: ProfileSpec,
) -> Dist:
    """("norm", mean, sd) from a prediction; ("unif", low, high) over a bound or a price whose
    accept length for a workload in the mix no chain has served (`unseen`: the other
    workloads' level is its mean, anywhere from 1 to steps + 1 its interval; where in it the
    truth lies, nothing says), else around the running rate: a speculative profile `spec`
    weighed from a `running` baseline up to `explore_prior_spec_high_ratio` of it (at most
    its steps + 1), anything else up to `explore_prior_high_ratio`."""
    if pred is not None and pred.tok_s is not None and (pred.bound or pred.unseen):
        return "unif", pred.tok_s.low, max(pred.tok_s.high, pred.tok_s.low * (1 + 1e-9))
    if pred is not None and pred.tok_s is not None and math.isfinite(interval_sd(pred.tok_s)):
        return "norm", pred.tok_s.mean, max(interval_sd(pred.tok_s), 1e-9 * max(cur, 1.0))
    high = s.explore_prior_high_ratio
    if spec.speculative and not running.speculative:
        high = max(high, min(s.explore_prior_spec_high_ratio, float(spec.max_steps + 1)))
    return "unif", s.explore_prior_low_ratio * cur, high * cur


def cdf(d: Dist, x: np.ndarray) -> np.ndarray:
    """P(X <= x) for each of `x`."""
    kind, a, b = d
    if kind == "norm":
        return np.asarray(ndtr((x - a) / b))
    return np.clip((x - a) / (b - a), 0.0, 1.0)


def shortfall_below(d: Dist, c: float) -> tuple[float, float]:
    """(P(X < c), E[(c - X)+]) in closed form."""
    kind, a, b = d
    if kind == "norm":
        u = (c - a) / b
        p = float(ndtr(u))
        pdf = math.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
        return p, (c - a) * p + b * pdf
    if c <= a:
        return 0.0, 0.0
    hi = min(c, b)
    p = (hi - a) / (b - a)
    # integral over [a, hi] of (c - x) / (b - a)
    e = ((c - a) ** 2 - (c - hi) ** 2) / (2 * (b - a))
    return p, e


def expected_excess(dists: Sequence[Dist], c: float) -> float:
    """E[(max_i X_i - c)+] for independent X_i: the integral over x > c of 1 - prod F_i(x)."""
    hi = c
    for kind, a, b in dists:
        hi = max(hi, a + 6.0 * b if kind == "norm" else b)
    if hi <= c:
        return 0.0
    x = np.linspace(c, hi, 65)
    f = np.ones_like(x)
    for d in dists:
        f *= cdf(d, x)
    y = 1.0 - f
    return float(np.sum((y[1:] + y[:-1]) * 0.5 * np.diff(x)))


def explore_gain(dists: Sequence[Dist], cur: float, s: PolicySettings, spec: ProfileSpec) -> float:
    """What an exploration of `spec` is expected to add per second of the regime: the expected
    excess of the best profile it reveals over the running rate, less the switch rule's fixed
    margin (margin_frac x cur: what the model cannot see of a profile it has not run, scheduling
    and a speculative server's draft prefill). An exploration expected to clear no more than
    that is a bet on the model's blind spots (concurrency-cycle: baseline, explored from 2-step
    at 64 streams on an expected net of about zero, was 11% slower; a random MoE day explored
    baseline so at one stream, then chased a mispriced 1-step at 64: 0.541 of oracle_dp, 0.982
    without that run). An adaptive profile is not charged it: what its price cannot see is in
    its favour (it picks its tier per batch, and its price is the tier for the mean batch);
    charged it, specpilot_hybrid never explored it on stress a2, b2 and z4, where it serves
    12-14% above oracle_dp."""
    excess = expected_excess(dists, cur)
    return excess if spec.adaptive else excess - s.margin_frac * cur


def breakeven_s(gain: float, cost: float, restart_s: float, s: PolicySettings) -> float:
    """The horizon at which an exploration's value (`gain`, explore_gain, x useful seconds)
    equals its cost: restart and dwell plus cost / gain (inf without any upside)."""
    if not gain > 0:
        return math.inf
    return restart_s + s.min_dwell_s + cost / gain
