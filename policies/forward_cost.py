"""The forward-cost curve: what one target forward of B sequences x n tokens each costs, as a
roofline fitted over every fixed profile's served batch sizes at once.

Owns `ForwardCurve` and `fit_forward_curve`, and `line_pair`: which two known chain lengths a
cost is read across at one batch size (the surface for a never-run chain, the hybrid tables for
a tier no fixed profile has). `policies.cycle_time.CycleTimeSurface` centres on
this curve its prediction of a profile never run (off the donor's served sizes), and of a run
profile past its own largest served batch size, where a straight continuation of one profile's
points would cross a bend it cannot see (issue 4: a 5-step at 48 streams is a 288-token forward
when the largest one served had 144).

The model, per forward (seconds):

    T(B, n) = a + c [speculative] + max(m0 + m1 cov(B n), k B n) + kv B

- a: launch, scheduling and sampling that do not depend on the forward's size;
- c: what a speculative cycle adds at any size (the verify's own fixed costs, the draft steps'
  launches);
- max(memory, compute): the roofline. Memory is the weights streamed once per forward (m0) plus
  the routed experts the forward's tokens touch, m1 cov(t) with cov(t) = 1 - (1 - k_e/E)^t the
  expected share of E experts that t tokens routing to k_e each reach (uniform routing; a dense
  model has cov = 0). Compute (or, on PCIe tensor parallelism, the all-reduce) grows with the
  tokens from the origin: k t;
- kv: what each sequence adds (its KV cache read, per-sequence sampling and draft work).

The tokens at which the memory term gives way to the compute line are found, not assumed:
memory minus compute is concave in t, so the compute-bound forwards are those above one token
count; each split of the served token counts is a linear non-negative least squares, and the
split whose max-model fits best is kept. Relative residuals: a cycle of 600 ms and one of 20 ms
weigh alike.

Without the expert count (moe share 0) an MoE's saturating curve is not in the model's family;
the fit then shows it (`rel_rms`), and the caller keeps its donor-based centre.

Must not: do I/O, read a clock, or know profiles by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
from scipy.optimize import nnls

# A size a cost is read across: chain lengths (int) or tokens per forward (float).
_Size = TypeVar("_Size", int, float)

# Parameters of the model: a, c, m0, m1, k, kv.
N_PARAMS = 6
# Served points beyond the parameters the fit must have before its residual says anything about
# the model: with as many points as parameters any curve of the family passes through them all.
MIN_EXTRA_POINTS = 2
# Weight (relative to a residual of the whole mean cycle) of the penalty that settles the
# size-independent term where the served points leave it free (see fit_forward_curve).
TIE_BREAK = 1e-4


class ForwardPoint(NamedTuple):
    """One served batch size of one fixed profile: mean batch, tokens per sequence in its
    forward (1 for the baseline, draft tokens for a chain), whether it is speculative, and its
    mean cycle seconds."""

    batch: float
    tokens: int
    speculative: bool
    cycle_s: float


def expert_coverage(tokens: float | np.ndarray, share: float) -> np.ndarray:
    """Expected fraction of routed experts that `tokens` tokens reach when each picks a share
    `share` (top-k / experts) of them uniformly; 0 everywhere for a dense model (share 0)."""
    t = np.asarray(tokens, dtype=float)
    if share <= 0.0:
        return np.zeros_like(t)
    return 1.0 - np.power(1.0 - min(share, 1.0), t)


@dataclass(frozen=True)
class ForwardCurve:
    """A fitted forward-cost roofline (see the module docstring); `rel_rms` is its RMS relative
    residual over the `n_points` served points it was fitted to, `kink_tokens` the token count
    above which the served forwards were compute-bound (inf: none was)."""

    coef: tuple[float, float, float, float, float, float]
    expert_share: float
    rel_rms: float
    n_points: int
    kink_tokens: float

    def at(self, batch: float, tokens: int, speculative: bool) -> float:
        """Cycle seconds of a forward of `batch` sequences x `tokens` tokens each."""
        a, c, m0, m1, k, kv = self.coef
        t = batch * tokens
        mem = m0 + m1 * float(expert_coverage(t, self.expert_share))
        return a + (c if speculative else 0.0) + max(mem, k * t) + kv * batch


def line_pair(known: Iterable[_Size], x: _Size) -> tuple[_Size, _Size] | None:
    """The two known chain lengths (a < b, neither x) whose line reads the cost at length x
    (or any other size a cost is read across, such as tokens per forward):
    the nearest on each side of x (interpolation), else the two nearest on x's one side (the
    end secant continued); None with fewer than two."""
    ks = sorted(set(known) - {x})
    below = [k for k in ks if k < x]
    above = [k for k in ks if k > x]
    if below and above:
        return below[-1], above[0]
    if len(above) >= 2:
        return above[0], above[1]
    if len(below) >= 2:
        return below[-2], below[-1]
    return None


def _design(points: Sequence[ForwardPoint], share: float) -> tuple[np.ndarray, np.ndarray]:
    """Per point: the memory-bound and the compute-bound rows of the linear model."""
    b = np.array([p.batch for p in points], dtype=float)
    t = b * np.array([p.tokens for p in points], dtype=float)
    s = np.array([1.0 if p.speculative else 0.0 for p in points])
    one = np.ones_like(b)
    zero = np.zeros_like(b)
    mem = np.column_stack([one, s, one, expert_coverage(t, share), zero, b])
    comp = np.column_stack([one, s, zero, zero, t, b])
    return mem, comp


def fit_forward_curve(
    points: Sequence[ForwardPoint], expert_share: float = 0.0
) -> ForwardCurve | None:
    """The roofline through `points` (several profiles' served batch sizes), or None when they
    cannot identify it: no baseline or no speculative point, too few points for the residual to
    mean anything, a cycle that is not a positive finite number, or a batch under one."""
    pts = [p for p in points if math.isfinite(p.cycle_s) and p.batch >= 1.0]
    if len(pts) != len(points) or any(p.cycle_s <= 0 for p in pts):
        return None
    n_params = N_PARAMS if expert_share > 0 else N_PARAMS - 1
    if (
        len(pts) < n_params + MIN_EXTRA_POINTS
        or all(p.speculative for p in pts)
        or not any(p.speculative for p in pts)
    ):
        return None
    y = np.array([p.cycle_s for p in pts])
    w = 1.0 / y  # relative residuals
    mem, comp = _design(pts, expert_share)
    tokens = np.array([p.batch * p.tokens for p in pts])
    # a and m0 appear only as their sum in memory-bound forwards; one compute-bound token count
    # cannot split them, and then the compute line's slope is anywhere in a range. A penalty on
    # a, too small to move an identified fit, settles it at a = 0: the size-independent time
    # counts as memory, the compute line is its steepest, the extrapolation its costliest.
    tie = np.zeros((1, N_PARAMS))
    tie[0, 0] = TIE_BREAK / float(np.mean(y))
    best: tuple[float, np.ndarray, float] | None = None
    # Thresholds: every served token count (the forwards above it compute-bound), and none.
    for tau in [math.inf, *sorted(set(tokens.tolist()))]:
        above = tokens > tau
        x = np.where(above[:, None], comp, mem)
        coef, _ = nnls(np.vstack([x * w[:, None], tie]), np.append(y * w, 0.0))
        pred = _max_model(coef, mem, comp)
        err = float(np.sqrt(np.mean(((pred - y) * w) ** 2)))
        if best is None or err < best[0] - 1e-12:
            best = (err, coef, tau)
    assert best is not None
    err, coef, tau = best
    c = tuple(float(v) for v in coef)
    return ForwardCurve(
        coef=(c[0], c[1], c[2], c[3], c[4], c[5]),
        expert_share=float(expert_share),
        rel_rms=err,
        n_points=len(pts),
        kink_tokens=tau,
    )


def _max_model(coef: np.ndarray, mem: np.ndarray, comp: np.ndarray) -> np.ndarray:
    """The roofline at the design's points: shared terms plus the larger of memory and compute."""
    a, c, m0, m1, k, kv = coef
    shared = a * mem[:, 0] + c * mem[:, 1] + kv * mem[:, 5]
    return shared + np.maximum(m0 + m1 * mem[:, 3], k * comp[:, 4])
