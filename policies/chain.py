"""Chain-drafting acceptance math for topk 1 (docs/FIELD.md, "Theory to build on").

Owns: the expected accept length of a g-step chain under a per-token acceptance alpha, its
inverse (alpha from a mean accept length), exact truncation of a histogram of accepted drafts to
fewer steps, and the censored extrapolation to more steps (per-position conditional rates plus a
geometric tail with a deliberately wider interval).

Conventions: `A` is the number of accepted drafts in one verify step (bonus excluded), 0..g; the
accept length L = A + 1 counts the bonus token, as SGLang's `spec_accept_length` does. A
histogram `hist[k]` counts verify steps (per sequence) that accepted exactly k drafts, k = 0..g.

Must not: know about profiles, workloads, time, or decisions (accept_length.py and decide.py do).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import brentq

# Two-sided ~90% normal quantile: every interval in policies/ is a ~90% central interval.
Z90 = 1.6448536269514722

# Low end of the censored tail: EAGLE heads drift further from the target's features the deeper
# the chain, so the conditional acceptance of positions never observed is assumed to fall by this
# factor per extra position at the pessimistic end (the mean keeps the observed tail rate).
TAIL_LOW_DECAY_PER_POSITION = 0.9

# Means-only predictions assume a constant per-token alpha (a model, not a measurement): their
# interval is widened by this relative amount of the accepted-draft part on top of sampling error.
MEANS_ONLY_REL_WIDEN = 0.10


def expected_accept_length(alpha: ArrayLike, g: int) -> NDArray[np.float64]:
    """E[L_g] = (1 - alpha^(g+1)) / (1 - alpha), bonus included, for a g-step chain (g >= 0).
    alpha 0.6: g=2 -> 1.96, g=5 -> 2.38; alpha 1 -> g + 1. Vectorised over alpha."""
    if g < 0:
        raise ValueError(f"steps g must be >= 0, got {g}")
    a = np.asarray(alpha, dtype=np.float64)
    if np.any(~np.isfinite(a)) or np.any(a < 0.0) or np.any(a > 1.0):
        raise ValueError("alpha must lie in [0, 1]")
    powers = a[..., None] ** np.arange(g + 1)
    return np.asarray(powers.sum(axis=-1), dtype=np.float64)


@functools.lru_cache(maxsize=4096)
def alpha_from_accept_length(accept_length: float, g: int) -> float:
    """Per-token alpha of a g-step chain whose mean accept length (bonus included) is given.
    Clamped: L <= 1 -> 0, L >= g + 1 -> 1. Memoised: one decision reads the same estimates
    several times (a root find per read was a tenth of a hybrid replay)."""
    if g < 1:
        raise ValueError(f"alpha needs at least one draft step, got g={g}")
    L = float(accept_length)
    if not math.isfinite(L):
        raise ValueError(f"accept length must be finite, got {accept_length!r}")
    if L <= 1.0:
        return 0.0
    if g + 1.0 <= L:
        return 1.0

    def f(a: float) -> float:
        return sum(a**i for i in range(g + 1)) - L

    return float(brentq(f, 0.0, 1.0, xtol=1e-12))


def _hist(hist: ArrayLike) -> NDArray[np.float64]:
    h = np.asarray(hist, dtype=np.float64)
    if h.ndim != 1 or h.size < 1:
        raise ValueError("a histogram of accepted drafts is a 1-D sequence with entries k = 0..g")
    if np.any(~np.isfinite(h)) or np.any(h < 0.0):
        raise ValueError("histogram counts must be finite and non-negative")
    if h.sum() <= 0.0:
        raise ValueError("histogram is empty")
    return h


def survival(hist: ArrayLike) -> NDArray[np.float64]:
    """S[i] = P(A >= i) for i = 0..g (S[0] = 1) from a histogram of accepted drafts."""
    h = _hist(hist)
    tail = np.cumsum(h[::-1])[::-1]
    return np.asarray(tail / tail[0], dtype=np.float64)


def truncate_histogram(hist: ArrayLike, g_prime: int) -> NDArray[np.float64]:
    """Histogram of min(A, g') : what a g'-step chain would have accepted on the same steps."""
    h = _hist(hist)
    g = h.size - 1
    if not 0 <= g_prime <= g:
        raise ValueError(f"truncation needs 0 <= g' <= g = {g}, got {g_prime}")
    out = h[: g_prime + 1].copy()
    out[g_prime] += h[g_prime + 1 :].sum()
    return out


def truncated_accept_length(hist: ArrayLike, g_prime: int) -> float:
    """Exact E[L_g'] = 1 + sum_{i=1..g'} P(A_g >= i) for g' <= g (topk 1: the first g' drafts of
    a g-step chain are the g'-step chain)."""
    s = survival(hist)
    g = s.size - 1
    if not 0 <= g_prime <= g:
        raise ValueError(f"truncation needs 0 <= g' <= g = {g}, got {g_prime}")
    return float(1.0 + s[1 : g_prime + 1].sum())


def truncated_accept_estimate(hist: ArrayLike, g_prime: int) -> tuple[float, float, float]:
    """(mean, low, high) of E[L_g'] with the sampling error of the histogram (the steps are the
    sample: se = sd(min(A, g')) / sqrt(steps))."""
    h = _hist(hist)
    g = h.size - 1
    if not 0 <= g_prime <= g:
        raise ValueError(f"truncation needs 0 <= g' <= g = {g}, got {g_prime}")
    th = truncate_histogram(h, g_prime)
    k = np.arange(g_prime + 1, dtype=np.float64)
    n = th.sum()
    mean_a = float((th * k).sum() / n)
    var_a = float((th * (k - mean_a) ** 2).sum() / n)
    se = math.sqrt(var_a / n) if n > 1 else float(g_prime)
    mean = 1.0 + mean_a
    return mean, max(1.0, mean - Z90 * se), min(g_prime + 1.0, mean + Z90 * se)


def conditional_rates(hist: ArrayLike) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per-position conditional acceptance r_i = P(A >= i | A >= i - 1), i = 1..g, and the number
    of trials behind each (steps that reached position i). A position nobody reached has rate
    nan and 0 trials."""
    h = _hist(hist)
    reach = np.cumsum(h[::-1])[::-1]  # reach[i] = count(A >= i)
    trials = reach[:-1]
    succ = reach[1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = np.where(trials > 0, succ / np.where(trials > 0, trials, 1.0), np.nan)
    return np.asarray(rates, dtype=np.float64), np.asarray(trials, dtype=np.float64)


@dataclass(frozen=True)
class TailFit:
    """Observed survival of a g-step histogram plus a geometric tail for positions beyond g."""

    g: int
    survival: tuple[float, ...]  # P(A >= i), i = 0..g
    rates: tuple[float, ...]  # conditional rates, i = 1..g (nan if unreached)
    tail_rate: float  # pooled conditional rate of the last positions: the geometric tail
    tail_rate_low: float
    tail_rate_high: float
    steps: float  # verify steps behind the histogram
    mean_se: float  # sampling se of the observed part of E[L]


def fit_tail(hist: ArrayLike) -> TailFit:
    """Fit the tail model to a histogram of accepted drafts of a g >= 1 step chain.

    The tail rate pools the conditional rates of the last ceil(g/2) positions (the ones closest
    to what is extrapolated); its interval is the normal approximation of a binomial rate
    (Jeffreys-smoothed so 0/n and n/n still get a width)."""
    h = _hist(hist)
    g = h.size - 1
    if g < 1:
        raise ValueError("a tail needs a histogram of at least one draft step")
    s = survival(h)
    rates, trials = conditional_rates(h)
    reach = np.cumsum(h[::-1])[::-1]
    first = g - max(1, math.ceil(g / 2))
    n_t = float(trials[first:].sum())
    k_t = float(reach[first + 1 :].sum())
    # Jeffreys prior Beta(1/2, 1/2): a rate with no observed failures still has uncertainty.
    r = (k_t + 0.5) / (n_t + 1.0)
    se_r = math.sqrt(r * (1.0 - r) / (n_t + 1.0))
    k = np.arange(g + 1, dtype=np.float64)
    n = float(h.sum())
    mean_a = float((h * k).sum() / n)
    var_a = float((h * (k - mean_a) ** 2).sum() / n)
    return TailFit(
        g=g,
        survival=tuple(float(x) for x in s),
        rates=tuple(float(x) for x in rates),
        tail_rate=r,
        tail_rate_low=max(0.0, r - Z90 * se_r),
        tail_rate_high=min(1.0, r + Z90 * se_r),
        steps=n,
        mean_se=math.sqrt(var_a / n) if n > 1 else float(g),
    )


def extrapolated_accept_length(fit: TailFit, g_prime: int) -> tuple[float, float, float]:
    """(mean, low, high) of E[L_g'] for any g' >= 0: exact truncation for g' <= g, and for
    g' > g the observed part plus P(A >= g) x sum_j prod_{m<=j} r_tail (censored: the low end
    also lets the tail rate decay per position, the high end uses the rate's upper bound)."""
    if g_prime < 0:
        raise ValueError(f"g' must be >= 0, got {g_prime}")
    s = np.asarray(fit.survival)
    if g_prime <= fit.g:
        mean = float(1.0 + s[1 : g_prime + 1].sum())
        half = Z90 * fit.mean_se
        return mean, max(1.0, mean - half), min(g_prime + 1.0, mean + half)
    base = float(1.0 + s[1:].sum())
    s_g = float(s[fit.g])
    j = np.arange(1, g_prime - fit.g + 1, dtype=np.float64)
    tail_mean = float((fit.tail_rate**j).sum())
    tail_low = float(((fit.tail_rate_low * TAIL_LOW_DECAY_PER_POSITION) ** j).sum())
    tail_high = float((fit.tail_rate_high**j).sum())
    half = Z90 * fit.mean_se
    mean = base + s_g * tail_mean
    low = max(1.0, base - half + s_g * tail_low)
    high = min(g_prime + 1.0, base + half + s_g * tail_high)
    return mean, min(low, mean), max(high, mean)


def predict_from_mean(
    mean_accept_length: float, g_from: int, g_to: int, se: float = 0.0
) -> tuple[float, float, float]:
    """(mean, low, high) of E[L_{g_to}] when only a mean accept length of a g_from-step chain is
    known: invert to a constant alpha, then apply the chain formula. Interval: the sampling se
    of the mean mapped through the (monotone) model, plus MEANS_ONLY_REL_WIDEN of the accepted
    part; wider again in the censored direction (g_to > g_from) by the extra positions."""
    if g_to == 0:
        return 1.0, 1.0, 1.0
    lo_in = max(1.0, mean_accept_length - Z90 * se)
    hi_in = min(g_from + 1.0, mean_accept_length + Z90 * se)
    vals = []
    for L in (mean_accept_length, lo_in, hi_in):
        a = alpha_from_accept_length(L, g_from)
        vals.append(float(expected_accept_length(a, g_to)))
    mean, low, high = vals
    widen = MEANS_ONLY_REL_WIDEN * (mean - 1.0)
    if g_to > g_from:
        widen *= 1.0 + (g_to - g_from) / g_from
    return mean, max(1.0, low - widen), min(g_to + 1.0, high + widen)


def hist_from_alpha(alpha: float, g: int, steps: float) -> NDArray[np.float64]:
    """Expected histogram of accepted drafts for a constant-alpha g-step chain (for tests and
    priors): P(A = k) = alpha^k (1 - alpha) for k < g, alpha^g for k = g."""
    k = np.arange(g + 1, dtype=np.float64)
    p = alpha**k * (1.0 - alpha)
    p[g] = alpha**g
    return np.asarray(p * steps, dtype=np.float64)


def accept_rate_from_length(accept_length: float, g: int) -> float:
    """SGLang's `spec_accept_rate` (correct drafts / proposed drafts) for a mean accept length
    (bonus included) of a g-step chain: (L - 1) / g."""
    if g < 1:
        raise ValueError("accept rate needs at least one draft step")
    return (accept_length - 1.0) / g


def mixture_accept_length(lengths: Sequence[float], token_shares: Sequence[float]) -> float:
    """Accept length of a batch serving several workloads, weighted by generated-token share:
    a slot spends share_w / L_w cycles per token of workload w, so E[L] is the token-weighted
    harmonic mean 1 / sum_w (share_w / L_w)."""
    if len(lengths) != len(token_shares) or not lengths:
        raise ValueError("lengths and shares must be non-empty and of equal length")
    tot = float(sum(token_shares))
    if tot <= 0:
        raise ValueError("token shares must sum to a positive number")
    return tot / sum(s / L for s, L in zip(token_shares, lengths, strict=True))
