"""The cycle-time surface: how long one decode cycle of each profile takes at batch size B.

Owns `CycleTimeSurface` (per profile, forgotten line statistics per half-octave batch bucket and
over all batch sizes; one shared surface in (B, n) fitted over every profile, and the
forward-cost roofline of policies/forward_cost.py, for profiles never run and batch sizes never
served; the bounds one profile's served forwards put on another's), and `comparable_step_s`
(the like-for-like step time a snapshot of a profile's statistics says at a batch size, for
drift checks). Every prediction carries its ~90% interval and the physical band around it.

Must not: decide anything, read clocks (times come in with the data), or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np
from scipy.interpolate import PchipInterpolator
from scipy.optimize import nnls
from scipy.special import ndtr

from policies.chain import Z90
from policies.forgetting import (
    REFIT_FRACTION,
    TINY,
    Memo,
    all_finite,
    batch_bucket,
    carryover,
    decay,
    estimate_within,
)
from policies.forward_cost import ForwardCurve, ForwardPoint, fit_forward_curve, line_pair
from policies.types import DecodeMoments, Estimate, ProfileSpec, spec_from_dict, spec_to_dict

# The shared surface T = c0 + c1*[n>1] + c2*B*n + c3*B is a four-term stand-in for a roofline
# with kinks: predictions of profiles never run carry at least this relative error (~90% half
# width). FIELD.md: halving draft tokens moved verify time only 14%, and verify moved 20 -> 30 ms
# across boots, so a 10% floor is the honest resolution of such a model.
SURFACE_REL_ERR_FLOOR = 0.10

# Beyond the batch sizes served, the step time's slope in B may be anything from flat (experts
# all loaded, a saturated forward) to this multiple of the end secant (a roofline turning
# compute-bound: the simulator's tuned Kimi goes from 0.41 to 0.5 ms per token past ~96 tokens,
# FIELD.md's vLLM sweep saw speculation lose at high concurrency): the shape band of an
# extrapolation, not a sampling error.
EXTRAPOLATION_SLOPE_MAX = 2.0

# An own per-profile slope is only trusted when the batch sizes seen vary by at least this
# standard deviation (sequences): below it the slope is noise over a single point.
MIN_BATCH_SD_FOR_SLOPE = 0.5

# FIELD.md: the draft model is under 5% of the cycle (profiled); the upper end of one never-run
# profile's draft steps when cycle times cannot separate them from the verify forward.
DRAFT_SHARE_MAX = 0.05

# Relative ~90% error of reading one profile's cycle off another's at equal tokens per forward:
# per-token costs (weights, experts, compute) carry over, launch and attention overheads do not
# exactly; the simulator's MoE and dense profiles stay within ~2% after the per-sequence term.
TOKEN_EQUIVALENCE_REL_ERR = 0.05

# How far (relative) beyond the physical band another batch bucket's data put it, after both
# buckets' sampling error, a bucket's step time must lie before the two are taken for forwards
# of different states of the system (`contradiction`): the band holds a forward's cost at one
# context length, and a mix of other prompt lengths moves a dense model's per-sequence cost by
# up to about this much at the batch sizes served (the simulator's Llama 8B, 64 streams).
CONTRADICTION_REL_TOL = SURFACE_REL_ERR_FLOOR


def _shaped(
    pts: Sequence[tuple[float, float, float, int]], batch: float, lin: float, lo: float, hi: float
) -> float:
    """The centre of an interpolation between served batch sizes: the shape-preserving cubic
    (PCHIP) through the served points, which follows a bending cost curve (a MoE forward's
    experts saturating) where the chord of the two nearest points cuts the bend, and
    reproduces a straight one exactly; held to the physical band [lo, hi].

    Only in an interior gap (two served sizes on each side): PCHIP pins the slope at each end
    of the gap by the secants on both sides of it, so the two points beyond each end are all it
    reads (fitted on those four alone, the same cubic). Next to the last served size there is
    one side only, and the bend it would draw is a continuation of the trend, which a roofline
    turning compute-bound past the data contradicts (bench-estimators: the tuned Kimi's 5-step
    at 16 streams, 7.6% off with the chord, 12.4% with that bend). There, and where batch
    sizes repeat, the chord `lin`."""
    xs = [p[0] for p in pts]
    i = next((j for j, x in enumerate(xs) if x > batch), 0)
    if i < 2 or i > len(xs) - 2:
        return lin
    near = pts[i - 2 : i + 2]
    bs = [p[0] for p in near]
    if any(b <= a for a, b in pairwise(bs)):
        return lin
    centre = float(PchipInterpolator(bs, [p[1] for p in near])(batch))
    return min(max(centre, lo), hi) if math.isfinite(centre) else lin


@dataclass
class LineStats:
    """Forgotten per-step moments of one profile plus prequential window residuals."""

    s0: float = 0.0  # steps
    s1: float = 0.0  # sum B
    sy: float = 0.0  # sum step_s
    s2: float = 0.0  # sum B^2
    sxy: float = 0.0  # sum B * step_s
    windows: float = 0.0  # forgotten window count
    windows2: float = 0.0  # forgotten sum of squared window weights (effective n)
    res_w: float = 0.0  # forgotten count of prequential residuals
    res_ss: float = 0.0  # forgotten sum of squared prequential residuals (seconds^2)
    count: int = 0  # windows since the last discount (the minimum-data rule counts these)
    last_t_s: float | None = None
    rejected: int = 0
    first_t_s: float | None = None  # the first window's time (a bucket's data begin there)

    def scale(self, f: float) -> None:
        self.s0 *= f
        self.s1 *= f
        self.sy *= f
        self.s2 *= f
        self.sxy *= f
        self.windows *= f
        self.windows2 *= f * f
        self.res_w *= f
        self.res_ss *= f

    @property
    def bbar(self) -> float:
        return self.s1 / self.s0

    @property
    def level(self) -> float:
        return self.sy / self.s0

    @property
    def var_b(self) -> float:
        return max(self.s2 / self.s0 - self.bbar**2, 0.0)

    def own_slope(self) -> float | None:
        """Least-squares slope of step_s on B, or None if unidentified or impossible (< 0)."""
        if self.s0 <= 0:
            return None
        vb = self.var_b
        if vb < MIN_BATCH_SD_FOR_SLOPE**2:
            return None
        b = (self.sxy / self.s0 - self.bbar * self.level) / vb
        return b if b >= 0.0 else None

    def window_var(self) -> float | None:
        """Variance of one window's mean step time around the fit (prequential)."""
        if self.res_w < 2.0:
            return None
        return self.res_ss / self.res_w

    def n_eff(self) -> float:
        return self.windows**2 / self.windows2 if self.windows2 > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LineStats:
        return cls(**dict(d))


# The additive fields of LineStats: a line over several buckets' windows is their sum.
MOMENT_FIELDS = ("s0", "s1", "sy", "s2", "sxy", "windows", "windows2", "res_w", "res_ss")


@dataclass(frozen=True)
class SurfaceFit:
    """Coefficients of T(B, n) = c0 + c1*[n>1] + c2*B*n + c3*B (seconds), all >= 0 (nnls)."""

    coef: tuple[float, float, float, float]
    varied_ns: tuple[int, ...]  # tokens per sequence of the profiles that varied B
    spec_ns: tuple[int, ...] = ()  # draft tokens of the speculative profiles with data
    has_baseline: bool = False
    rel_resid_rms: float = 0.0  # RMS relative residual of the profiles' levels against it
    draft_resid_per_step_s: float = 0.0  # mean per draft step residual of speculative profiles

    @property
    def slope_identified(self) -> bool:
        """Some profile varied B enough to identify the B terms."""
        return bool(self.varied_ns)

    def at(self, batch: float, n: int) -> float:
        c0, c1, c2, c3 = self.coef
        return c0 + c1 * (1.0 if n > 1 else 0.0) + c2 * batch * n + c3 * batch

    def slope(self, n: int) -> float:
        _, _, c2, c3 = self.coef
        return c2 * n + c3

    def slope_range(self, n: int) -> tuple[float, float]:
        """The slopes in B at `n` tokens per sequence that the data allow. Profiles of two
        token counts that varied B identify the split between the per-token and the
        per-sequence term, and one of `n`'s own its slope. Where only one count n* did, its
        slope S is known but not the split (c2, c3 >= 0 with c2 n* + c3 = S): above n* the slope
        lies between S (all per sequence: KV reads, experts saturated) and S n / n* (all per
        token: compute), and the fit's own split is the ridge's choice, not data. At or below
        n* the fit's slope stands: there the varied profile's own forwards, as many sequences
        with as many tokens each or more, bound the prediction (CycleTimeSurface.token_bounds),
        while above it no forward served carries as many tokens per sequence."""
        if len(self.varied_ns) != 1 or n <= self.varied_ns[0]:
            return self.slope(n), self.slope(n)
        s = self.slope(self.varied_ns[0])
        return s, s * n / self.varied_ns[0]


def _slope_with_split(fit: SurfaceFit, n: int) -> tuple[float, float]:
    """(slope, variance) in B at `n` tokens per sequence from the shared surface: its slope
    with the model floor where the data identify it, else the middle of the range the data
    allow (`SurfaceFit.slope_range`), that range its ~90% interval."""
    lo, hi = fit.slope_range(n)
    if hi <= lo:
        return lo, (SURFACE_REL_ERR_FLOOR * lo / Z90) ** 2
    mid = (lo + hi) / 2.0
    return mid, max((hi - lo) / 2.0, SURFACE_REL_ERR_FLOOR * mid) ** 2 / Z90**2


# `_Pred.how` of a prediction within a profile's own served batch sizes.
WITHIN_SERVED = frozenset({"bucket", "interpolated"})


class _Pred(NamedTuple):
    """One profile's step time at a batch size from its own data: `mean` with sampling variance
    `var`, and the band [lo, hi] the curve's unknown shape allows (None: a point, no shape
    uncertainty); the ~90% interval is the band widened by the sampling error, and never
    leaves `limits` (where set: the curves the physics allows, widened by the sampling error of
    the point they hang from)."""

    mean: float
    var: float
    how: str
    lo: float | None = None
    hi: float | None = None
    limits: tuple[float, float] | None = None

    def interval(self, extra_var: float = 0.0) -> tuple[float, float]:
        half = Z90 * math.sqrt(self.var + extra_var)
        lo = self.mean if self.lo is None else min(self.lo, self.mean)
        hi = self.mean if self.hi is None else max(self.hi, self.mean)
        lo, hi = lo - half, hi + half
        if self.limits is not None:
            lo, hi = max(lo, self.limits[0]), min(hi, self.limits[1])
        return lo, hi


def _truncated_mean(mean: float, var: float, lo: float, hi: float) -> float:
    """The mean of N(mean, var) given that it lies in [lo, hi]: a line's guess, with its
    spread, held to the band the physics allow (clamping it instead would put the centre on the
    band's edge whenever the line leaves it, however wide its spread: a step time at the very
    least the physics allow, and the profile priced at the most)."""
    sd = math.sqrt(var)
    if not sd > 0 or not hi > lo:
        return min(max(mean, lo), hi)
    a, b = (lo - mean) / sd, (hi - mean) / sd
    mass = float(ndtr(b) - ndtr(a))
    if mass < 1e-12:
        return lo if b < 0 else hi
    pdf = (math.exp(-0.5 * a * a) - math.exp(-0.5 * b * b)) / math.sqrt(2.0 * math.pi)
    return min(max(mean + sd * pdf / mass, lo), hi)


class Contradiction(NamedTuple):
    """A batch bucket's step time outside the band another bucket's older data allow
    (CycleTimeSurface.contradiction)."""

    ratio: float  # the new level over the band's nearer edge (> 1: dearer), for the furthest
    buckets: tuple[int, ...]  # the buckets whose data it contradicts
    since_s: float  # the first window of the contradicting bucket


class CycleTimeSurface:
    """T(B, n) per profile from DecodeMoments, plus one shared surface over all profiles.

    `update` feeds one window of a profile's moments; `estimate(profile, batch)` predicts that
    profile's cycle seconds at `batch`: from its own line where it has data (slope from the
    shared surface when its own batch sizes did not vary), from the shared surface plus the
    learned draft residual where it has none (wider, and wider still when extrapolating in n
    or B). Forgetting: each profile's statistics decay with `half_life_s` of its observed time.
    """

    def __init__(
        self,
        profiles: Sequence[ProfileSpec],
        half_life_s: float = 1800.0,
        min_windows: int = 3,
        min_steps: float = 20.0,
        expert_share: float = 0.0,
    ) -> None:
        self.specs = {p.name: p for p in profiles}
        self.half_life_s = float(half_life_s)
        self.min_windows = int(min_windows)
        self.min_steps = float(min_steps)
        self.stats: dict[str, LineStats] = {p.name: LineStats() for p in profiles}
        # Per profile, per batch bucket: the same forgotten moments, local to that bucket.
        self.buckets: dict[str, dict[int, LineStats]] = {p.name: {} for p in profiles}
        self.expert_share = 0.0
        self._fit: SurfaceFit | None = None
        self._curve: ForwardCurve | None = None
        self._fit_dirty = True
        # Derived, not persisted: estimates asked for since the statistics they read last
        # changed (one decision asks for the same profile at the same batch size many times,
        # and a profile not running answers the same until something it reads moves).
        self._memo = Memo()
        self.set_expert_share(expert_share)
        self._steps_since_fit = 0.0
        self._fit_members: tuple[tuple[str, int | None], ...] = ()

    # -- data in
    def update(
        self, profile: str, moments: DecodeMoments, t_s: float, window_s: float
    ) -> float | None:
        """Feed one window. Returns the window's mean step time divided by the prediction made
        before it at the window's batch size (prequential ratio, ~1 when nothing changed) or
        None when there was no prediction yet or the window was empty/rejected."""
        st = self.stats.get(profile)
        if st is None:
            raise KeyError(f"unknown profile {profile!r}")
        m = moments
        n = m.n_steps
        vals = (n, m.sum_bs, m.sum_step_s, m.sum_bs2, m.sum_bs_step_s)
        if not all_finite(*vals) or any(v < 0 for v in vals):
            st.rejected += 1
            return None
        if n <= 0:
            return None
        mean_b = m.sum_bs / n
        mean_t = m.sum_step_s / n
        # A decode step serves at least one sequence and takes time; sum B^2 >= (sum B)^2 / n.
        if mean_b < 1.0 - 1e-9 or mean_t <= 0 or m.sum_bs2 < m.sum_bs**2 / n * (1 - 1e-9):
            st.rejected += 1
            return None
        # Prequential: predictions made before this window is added. The ratio for change
        # detection compares like with like, so it is only given when the window's own batch
        # bucket already had data (a new batch size is not a change in step time).
        own = self._own_predict(profile, mean_b)
        ratio = None
        if own is not None and own.how == "bucket" and own.mean > 0:
            ratio = mean_t / own.mean
        line_pred = self._line_predict(profile, mean_b)
        k = batch_bucket(mean_b)
        bucket = self.buckets[profile].get(k)
        bucket_pred = own.mean if own is not None and own.how == "bucket" else None
        lam = decay(window_s, self.half_life_s)
        # Old data fades with the profile's observed time in every bucket alike.
        for bst in self.buckets[profile].values():
            bst.scale(lam)
        if bucket is None:
            bucket = self.buckets[profile][k] = LineStats()
        for line, pred in ((st, line_pred[0] if line_pred else None), (bucket, bucket_pred)):
            if line is st:
                line.scale(lam)
            if pred is not None:
                r = mean_t - pred
            elif line.s0 > 0:
                r = mean_t - line.level
            else:
                r = None
            if r is not None:
                line.res_ss += r * r
                line.res_w += 1.0
            line.s0 += n
            line.s1 += m.sum_bs
            line.sy += m.sum_step_s
            line.s2 += m.sum_bs2
            line.sxy += m.sum_bs_step_s
            line.windows += 1.0
            line.windows2 += 1.0
            line.count += 1
            line.last_t_s = t_s
            if line.first_t_s is None:
                line.first_t_s = t_s
        self._steps_since_fit += n
        total = sum(x.s0 for x in self.stats.values())
        if self._steps_since_fit > REFIT_FRACTION * total or self._members() != self._fit_members:
            self._fit_dirty = True
        self._forget(profile)
        return ratio

    def _forget(self, profile: str) -> None:
        """Drop the memoised estimates that `profile`'s statistics, just changed, can move. A
        fixed profile's are read by every other's estimate (the shared fit, the roofline, token
        bounds and equivalents, sibling lines), and a refit due reads every fixed profile's as
        they are now: all go. An adaptive profile's are read by its own estimates, and by
        another's only through _served_by_any, which reads which batch buckets hold data: a
        change there is a change of _members, so the refit is due and all go."""
        own = self.specs[profile].adaptive and not self._fit_dirty
        self._memo.forget(profile, only_its_own=own)

    def _members(self) -> tuple[tuple[str, int | None], ...]:
        """The profiles with enough data (bucket None), and their batch buckets with enough: a
        new member or a newly served batch size is new shape, whatever its share of the steps."""
        return tuple((p, None) for p in self.stats if self.has_data(p)) + tuple(
            (p, k)
            for p, bs in self.buckets.items()
            for k, st in sorted(bs.items())
            if self._enough(st)
        )

    def discount(self, profile: str, factor: float, max_windows: float | None = None) -> None:
        """Keep only `factor` of a profile's evidence (a new boot, a detected drift), and of each
        line (the profile's, each batch bucket's) at most `max_windows` windows' worth: old data
        becomes a weak prior that fresh windows outweigh within a few polls."""
        f = min(max(factor, 0.0), 1.0)
        self._memo.clear()
        for st in (self.stats[profile], *self.buckets[profile].values()):
            st.scale(carryover(f, st.windows, max_windows))
            st.count = 0
        self._fit_dirty = True

    def contradiction(self, profile: str, batch: float) -> Contradiction | None:
        """Whether the step time `profile` serves at `batch` (its batch bucket, with enough
        data) cannot be the same forward as that of its buckets whose data all predate the
        bucket's first window (`since_s`), or None.

        A forward's step time never falls as the batch grows, and its time per sequence never
        rises (`_own_predict`), so a bucket's level lies in [y0, y0 B/B0] (growing) or
        [y0 B/B0, y0] (shrinking) of another's (B0, y0). A level beyond that band, by more than
        both levels' sampling error and CONTRADICTION_REL_TOL, says the system moved between the
        two (a change of system state that came with a change of concurrency, which the
        step-time stream cannot see: it compares like batch sizes only; a random day's 7-step
        served 16 streams in 83 ms, then 32 in 206 ms, 1.24x the most 16 allow, the verify 1.41x
        dearer since, and 2-step, read off the old 16-stream data, was switched to at 1.4x the
        rate it served). `ratio` is the new level over the band's nearer edge for the bucket
        furthest out: a lower bound on how far the step time moved. Adaptive profiles are not
        judged (their tokens per sequence move with the batch)."""
        if self.specs[profile].adaptive or batch <= 0 or not math.isfinite(batch):
            return None
        pts = self._points(profile)
        k = batch_bucket(batch)
        new = next((p for p in pts if p[3] == k), None)
        since = self.buckets[profile][k].first_t_s if new is not None else None
        if new is None or since is None:
            return None
        b1, y1, v1, _ = new
        h1 = Z90 * math.sqrt(v1)
        tol = CONTRADICTION_REL_TOL
        worst, keys = 1.0, []
        for b0, y0, v0, j in pts:
            last = self.buckets[profile][j].last_t_s
            if j == k or last is None or last >= since:
                continue
            h0 = Z90 * math.sqrt(v0)
            grow = b1 / b0
            if y1 - h1 > (y0 + h0) * max(grow, 1.0) * (1.0 + tol):
                r = y1 / (y0 * max(grow, 1.0))
            elif y1 + h1 < (y0 - h0) * min(grow, 1.0) * (1.0 - tol):
                r = y1 / (y0 * min(grow, 1.0))
            else:
                continue
            keys.append(j)
            if abs(math.log(r)) > abs(math.log(worst)):
                worst = r
        return Contradiction(worst, tuple(keys), since) if keys else None

    def drop_buckets(self, profile: str, keys: Collection[int]) -> None:
        """Forget `profile`'s data in the batch buckets `keys` (a forward of another state of
        the system, `contradiction`), in the buckets and in the profile's line over all its
        windows, which becomes the sum of the buckets kept (the same windows' moments, each
        bucket's consistent on its own, so their sum is too)."""
        buckets = self.buckets[profile]
        for k in keys:
            buckets.pop(k, None)
        old = self.stats[profile]
        line = LineStats(rejected=old.rejected)
        for b in buckets.values():
            for f in MOMENT_FIELDS:
                setattr(line, f, getattr(line, f) + getattr(b, f))
            line.count += b.count
        line.last_t_s = max(
            (b.last_t_s for b in buckets.values() if b.last_t_s is not None), default=None
        )
        line.first_t_s = min(
            (b.first_t_s for b in buckets.values() if b.first_t_s is not None), default=None
        )
        self.stats[profile] = line
        self._memo.clear()
        self._fit_dirty = True

    def reprofile(self, profiles: Sequence[ProfileSpec], reset: Collection[str] = ()) -> None:
        """The profile set becomes `profiles` (their specs and order): a profile no longer in it
        loses its statistics, and one new to it, or named in `reset` (its definition changed
        under the same name), starts without any; every other keeps its own. The shared fit is
        refitted on the next query (a profile's data left or went)."""
        fresh = set(reset) | {p.name for p in profiles if p.name not in self.specs}
        self.specs = {p.name: p for p in profiles}
        self.stats = {
            n: LineStats() if n in fresh else self.stats.get(n, LineStats()) for n in self.specs
        }
        self.buckets = {n: {} if n in fresh else self.buckets.get(n, {}) for n in self.specs}
        self._memo.clear()
        self._fit_dirty = True

    def set_expert_share(self, share: float) -> None:
        """The served model's routing (top-k / experts; 0: dense or unknown): a setting, not
        data, so the settings in force win over the share a restored state was saved with."""
        if not (0.0 <= share <= 1.0):
            raise ValueError(f"expert_share must be in [0, 1], got {share!r}")
        if share != self.expert_share:
            self.expert_share = float(share)
            self._fit_dirty = True
            self._memo.clear()

    # -- queries
    def has_data(self, profile: str) -> bool:
        return self._enough(self.stats[profile])

    def last_t_s(self, profile: str) -> float | None:
        return self.stats[profile].last_t_s

    def mean_batch(self, profile: str) -> float | None:
        st = self.stats[profile]
        return st.bbar if st.s0 > 0 else None

    def surface(self) -> SurfaceFit | None:
        """The shared surface fitted with nnls over every profile's moments (lazily refitted
        when any profile's statistics changed); None without data from two profiles."""
        self._refit()
        return self._fit

    def forward_curve(self) -> ForwardCurve | None:
        """The forward-cost roofline over every fixed profile's served batch sizes
        (policies.forward_cost; refitted with the surface), or None where it is unidentified."""
        self._refit()
        return self._curve

    def usable_curve(self) -> ForwardCurve | None:
        """The roofline where it fits its points within TOKEN_EQUIVALENCE_REL_ERR (RMS): only
        then may it centre a prediction off the served data."""
        curve = self.forward_curve()
        return curve if curve is not None and curve.rel_rms <= TOKEN_EQUIVALENCE_REL_ERR else None

    def _refit(self) -> None:
        if self._fit_dirty:
            self._fit = self._fit_surface()
            self._curve = fit_forward_curve(
                [
                    ForwardPoint(b, sp.forward_tokens, sp.speculative, y)
                    for name, sp in self.specs.items()
                    if not sp.adaptive
                    for b, y, _, _ in self._points(name)
                ],
                self.expert_share,
            )
            self._fit_dirty = False
            self._steps_since_fit = 0.0
            self._fit_members = self._members()

    def _fit_surface(self) -> SurfaceFit | None:
        xtx = np.zeros((4, 4))
        xty = np.zeros(4)
        used: list[tuple[ProfileSpec, LineStats]] = []
        varied: set[int] = set()
        for name, st in self.stats.items():
            spec = self.specs[name]
            if spec.adaptive or not self.has_data(name):
                continue
            n = spec.forward_tokens
            s = 1.0 if n > 1 else 0.0
            s0, s1, s2, sy, sxy = st.s0, st.s1, st.s2, st.sy, st.sxy
            # sum over steps of f f' with f = [1, s, n B, B]
            xtx += np.array(
                [
                    [s0, s * s0, n * s1, s1],
                    [s * s0, s * s0, s * n * s1, s * s1],
                    [n * s1, s * n * s1, n * n * s2, n * s2],
                    [s1, s * s1, n * s2, s2],
                ]
            )
            xty += np.array([sy, s * sy, n * sxy, sxy])
            used.append((spec, st))
            if st.var_b >= MIN_BATCH_SD_FOR_SLOPE**2:
                varied.add(n)
        if len(used) < 2:
            return None
        # Scale-aware ridge keeps the Cholesky defined when columns are collinear (one n seen).
        ridge = 1e-9 * float(np.trace(xtx)) + TINY
        r = np.linalg.cholesky(xtx + ridge * np.eye(4)).T
        z = np.linalg.solve(r.T, xty)
        coef, _ = nnls(r, z)
        c = (float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]))
        varied_ns = tuple(sorted(varied))
        fit = SurfaceFit(c, varied_ns)
        rel2: list[float] = []
        draft: list[float] = []
        spec_ns: list[int] = []
        has_base = False
        for spec, st in used:
            n = spec.forward_tokens
            at = fit.at(st.bbar, n)
            resid = st.level - at
            rel2.append((resid / st.level) ** 2)
            if n > 1:
                spec_ns.append(n)
                draft.append(resid / (n - 1))
            else:
                has_base = True
        return SurfaceFit(
            coef=c,
            varied_ns=varied_ns,
            spec_ns=tuple(sorted(set(spec_ns))),
            has_baseline=has_base,
            rel_resid_rms=math.sqrt(sum(rel2) / len(rel2)),
            draft_resid_per_step_s=sum(draft) / len(draft) if draft else 0.0,
        )

    def _enough(self, st: LineStats) -> bool:
        """Whether `st` (a profile's line or one batch bucket's) holds the minimum of data."""
        return st.count >= self.min_windows and st.s0 >= self.min_steps

    def _points(self, profile: str) -> list[tuple[float, float, float, int]]:
        """(mean batch, level, variance of the level, bucket) of every bucket of `profile` with
        enough data, by batch size."""
        out = []
        for k, st in self.buckets[profile].items():
            if not self._enough(st):
                continue
            wv = st.window_var()
            var = (wv if wv is not None else (0.05 * st.level) ** 2) / max(st.n_eff(), 1.0)
            out.append((st.bbar, st.level, var, k))
        out.sort()
        return out

    def _slope_elsewhere(self, profile: str) -> tuple[float, float] | None:
        """(slope, variance) of step time in B when the buckets cannot give one: the profile's
        own line over all its batch sizes, else the shared surface's, else None."""
        b = self.stats[profile].own_slope()
        if b is not None:
            return b, (0.5 * b / Z90) ** 2
        fit = self.surface()
        spec = self.specs[profile]
        if fit is not None and fit.slope_identified and not spec.adaptive:
            return _slope_with_split(fit, spec.forward_tokens)
        return None

    def _own_predict(self, profile: str, batch: float) -> _Pred | None:
        """What the profile's own data says at `batch`; None below the minimum of data.

        `how`: "bucket" (the batch bucket of `batch` has data: local level plus a local slope),
        "interpolated" (between the nearest buckets with data), "extrapolated" (beyond the
        buckets, along the end secant), or "line" (no bucket has enough data yet: the
        profile's line over all its windows).

        Between and beyond the batch sizes served the curve's shape is unknown; the prediction's
        band [lo, hi] holds every curve the physics allows there: step time never falls as the
        batch grows, and the time per sequence never rises (fixed costs amortise; at worst a
        forward is compute-bound, linear in B). Between two points that is
        [max(y0, y1 B/B1), min(y1, y0 B/B0)] (a roofline turning compute-bound lies low in it,
        saturating experts high), capped by the neighbouring secants extended into the gap
        (the most a concave stretch can rise); beyond the largest batch, from flat (saturated)
        to EXTRAPOLATION_SLOPE_MAX x the end secant, within [y0, y0 B/B0]; below the smallest,
        the mirror image within [y0 B/B0, y0] (where another profile served that batch size the
        system's curve there is data: the continuation is a line, half its growth uncertain,
        centred on the line's mean within the band and never leaving it). The centre is the
        chord or the end secant, beyond the data the roofline's rise where it is fitted, else a
        chain's chord in tokens to other chains' forwards (`_token_chord_rise`), else a
        baseline's rise over the same sequences (`_decode_rise`); with no slope
        anywhere, the band's geometric middle (an
        elasticity of step time in B uniform on [0, 1]: the middle in tokens per second too)."""
        pts = self._points(profile)
        if not pts:
            line = self._line_predict(profile, batch)
            return None if line is None else _Pred(line[0], line[1], "line")
        k = batch_bucket(batch)
        idx = next((i for i, p in enumerate(pts) if p[3] == k), None)
        if idx is not None:
            b0, y0, v0, _ = pts[idx]
            st = self.buckets[profile][k]
            d = batch - b0
            own = st.own_slope()
            if own is not None:
                return _Pred(y0 + own * d, v0 * (1.0 + d * d / st.var_b), "bucket")
            secants = []
            for j in (idx - 1, idx + 1):
                if 0 <= j < len(pts):
                    b1, y1, v1, _ = pts[j]
                    secants.append(((y1 - y0) / (b1 - b0), (v0 + v1) / (b1 - b0) ** 2))
            if secants:
                slope = sum(x for x, _ in secants) / len(secants)
                svar = sum(v for _, v in secants) / len(secants) ** 2
                # Two secants that disagree say how curved the cost is here.
                if len(secants) == 2:
                    svar += ((secants[0][0] - secants[1][0]) / 2.0 / Z90) ** 2
                slope = max(slope, 0.0)
            else:
                other = self._slope_elsewhere(profile)
                if other is not None:
                    slope, svar = other
                else:  # non-decreasing in B and at most proportional to it
                    slope = y0 / b0 / 2.0
                    svar = (slope / Z90) ** 2
            return _Pred(y0 + slope * d, v0 + svar * d * d, "bucket")
        lower = [p for p in pts if p[0] < batch]
        upper = [p for p in pts if p[0] > batch]
        if lower and upper:
            b0, y0, v0, _ = lower[-1]
            b1, y1, v1, _ = upper[0]
            w = (batch - b0) / (b1 - b0)
            lin = y0 + w * (y1 - y0)
            lo = max(y0, y1 * batch / b1)
            hi = min(y1, y0 * batch / b0)
            # A concave stretch lies under its neighbours' secants extended into the gap (a
            # convex one under the chord): the lower of those lines caps the band.
            ext = []
            if len(lower) >= 2:
                bm, ym, _, _ = lower[-2]
                ext.append(y0 + (y0 - ym) / (b0 - bm) * (batch - b0))
            if len(upper) >= 2:
                b2, y2, _, _ = upper[1]
                ext.append(y1 - (y2 - y1) / (b2 - b1) * (b1 - batch))
            if ext:
                hi = min(hi, max(lin, min(ext)))
            lo, hi = min(lo, lin), max(hi, lin)
            var = (1 - w) ** 2 * v0 + w * w * v1
            return _Pred(_shaped(pts, batch, lin, lo, hi), var, "interpolated", lo, hi)
        side = lower if lower else upper
        end = side[-1] if lower else side[0]
        b0, y0, v0, _ = end
        d = batch - b0
        slope_var: tuple[float, float] | None = None
        if len(side) >= 2:
            nxt = side[-2] if lower else side[1]
            b1, y1, v1, _ = nxt
            slope_var = (max((y0 - y1) / (b0 - b1), 0.0), (v0 + v1) / (b0 - b1) ** 2)
        else:
            slope_var = self._slope_elsewhere(profile)
        # The physically possible band beyond the data (see above).
        lo, hi = sorted((y0, y0 * batch / b0))
        if slope_var is None:
            return _Pred(math.sqrt(lo * hi), v0, "extrapolated", lo, hi)
        slope, svar = slope_var
        mean = min(max(y0 + slope * d, lo), hi)
        # Where a line's spread is the uncertainty, the physical band still bounds it (a line
        # continued from 96 sequences down to 32 at another profile's slope, half its growth
        # uncertain, put the step time anywhere from 0 up: on a random fleet day baseline was
        # priced at 137 tok/s in [45, 3304] where it would serve about 93).
        limits: tuple[float, float] | None = None
        if y0 > 0:
            rel = Z90 * math.sqrt(v0) / y0
            limits = (lo * (1.0 - rel), hi * (1.0 + rel))
        st = self.stats[profile]
        covered = (
            len(side) < 2
            and st.own_slope() is not None
            and abs(batch - st.bbar) <= 2.0 * math.sqrt(st.var_b)
        )
        if covered:
            # The profile's own steps (within its windows) spanned this batch size: its line
            # holds here, up to the model floor.
            extra = SURFACE_REL_ERR_FLOOR * slope * abs(d) / Z90
            return _Pred(mean, v0 + svar * d * d + extra * extra, "extrapolated", limits=limits)
        rise = self._curve_rise(profile, b0, batch)
        chord = None
        if rise is None:
            chord = self._token_chord_rise(profile, b0, y0, batch)
            if chord is None:
                chord = self._decode_rise(profile, b0, batch)
        if rise is not None:
            # The roofline through every profile's served sizes knows where the cost saturates
            # or turns compute-bound: anchored at the profile's own end point it centres the
            # continuation (the uncertainty stays what the end secant allows).
            mean = min(max(y0 + rise, lo), hi)
        if self._served_by_any(profile, batch):
            # Another profile served this batch size: the system's cost curve there is data
            # (the shared surface's slope saw it), so the profile's own continuation is a line
            # with half its growth as shape uncertainty, on top of the sampling error and floor.
            extra = SURFACE_REL_ERR_FLOOR * slope * abs(d) / Z90
            shape = slope * abs(d) / 2.0 / Z90
            var = v0 + svar * d * d + extra * extra + shape * shape
            if rise is None:
                mean = _truncated_mean(y0 + slope * d, var, lo, hi)
                if chord is not None:
                    # Two readings of the shape, the shared surface's one slope and the chord
                    # in tokens to a longer (or shorter) chain's forward: the chord centres it,
                    # their disagreement is shape uncertainty too.
                    var += ((y0 + chord - mean) / Z90) ** 2
                    mean = min(max(y0 + chord, lo), hi)
            return _Pred(mean, var, "extrapolated", limits=limits)
        # Beyond every batch size any profile served, the slope may be anything from flat
        # (saturated) to EXTRAPOLATION_SLOPE_MAX times the end secant (turning compute-bound),
        # within the physical band. The sampling error of the slope counts only for the data's
        # own end secant: a slope borrowed from elsewhere carries a shape allowance that this
        # band replaces.
        reach = EXTRAPOLATION_SLOPE_MAX * slope * abs(d)
        if d > 0:
            lo, hi = y0, min(hi, y0 + reach)
        else:
            lo, hi = max(lo, y0 - reach), y0
        sampling = v0 + (svar * d * d if len(side) >= 2 else 0.0)
        line = y0 + slope * d
        if chord is not None:
            mean = y0 + chord
        elif rise is None and not lo <= line <= hi:
            # The line left the band: its guess, with half its growth as spread, held to the
            # band, not clamped onto its edge (a random MoE day: 5-step, served at 48 streams
            # only, read down to 1.5 at a slope borrowed from baseline, sat on the band's
            # proportional edge, 20 ms against the 46 ms baseline's decode took at 2 streams,
            # and 1-step, read off it, was switched to at 389 tok/s predicted; it served 37).
            shape = slope * abs(d) / 2.0 / Z90
            mean = _truncated_mean(line, sampling + shape * shape, lo, hi)
        return _Pred(min(max(mean, lo), hi), sampling, "extrapolated", lo, hi)

    def _curve_rise(self, profile: str, b0: float, batch: float) -> float | None:
        """How much the forward-cost roofline says `profile`'s cycle grows from b0 to `batch`
        sequences; None where the roofline is not fitted, fits its points worse than
        TOKEN_EQUIVALENCE_REL_ERR, or the profile is adaptive (its tokens move)."""
        spec = self.specs[profile]
        curve = self.usable_curve()
        if spec.adaptive or curve is None:
            return None
        n = spec.forward_tokens
        return curve.at(batch, n, spec.speculative) - curve.at(b0, n, spec.speculative)

    def _token_chord_rise(self, profile: str, b0: float, y0: float, batch: float) -> float | None:
        """How much a fixed chain's cycle grows from its own end point (b0 sequences, y0) to
        `batch`, read piecewise linearly in tokens per forward through the forwards other fixed
        chains served: from the nearest of its own point and theirs short of the tokens its
        forward would carry at `batch`, to the nearest of theirs at or past them. A verify's
        cost is mostly a function of its tokens (`_token_equivalent`), and a chord lies between
        a saturating curve (above it) and one turning compute-bound (below it). The stand-in
        for the roofline's rise where too few sizes were served to fit it (r26-11: 4-step,
        served at 4 streams, read up to 16 at the shared surface's slope per token, 80 ms where
        it took 69, and 7-step, 90 ms at 128 tokens a forward, was held over it for ten hours).
        None for a baseline (another kernel path), an adaptive profile, or with no chain's
        forward at or past those tokens."""
        q = self.specs[profile]
        if not q.speculative or q.adaptive:
            return None
        nq = q.forward_tokens
        t0, t = b0 * nq, batch * nq
        # Cycle by tokens per forward: its own end point, and the other chains' forwards on
        # the far side of it (the first one served at a token count stands for it).
        by_tokens = {t0: y0}
        for name, sp in self.specs.items():
            if name == profile or not sp.speculative or sp.adaptive:
                continue
            n_p = sp.forward_tokens
            for b, y, _, _ in self._points(name):
                if (b * n_p > t0) if t > t0 else (b * n_p < t0):
                    by_tokens.setdefault(b * n_p, y)
        if t in by_tokens:
            return by_tokens[t] - y0
        pair = line_pair(by_tokens, t)
        if pair is None or not pair[0] < t < pair[1]:
            return None  # nothing served at or past t: no chord reaches it
        (ta, ya), (tb, yb) = ((k, by_tokens[k]) for k in pair)
        return ya + (yb - ya) * (t - ta) / (tb - ta) - y0

    def _decode_rise(self, profile: str, b0: float, batch: float) -> float | None:
        """How much a fixed chain's cycle grows from its largest served batch size b0 up to
        `batch` sequences, read off a baseline that served both sizes, where no chain's forward
        reaches the tokens a chord would need (`_token_chord_rise`). Going from b0 to `batch`
        sequences, what a forward pays per sequence (its KV reads, sampling, the draft per
        sequence) grows alike in a decode and in a verify, and what it pays per token (compute,
        the experts its tokens reach) n times faster in a verify of n tokens a sequence: the
        chain's rise lies between the decode's and n times it, and nothing in the two cycles
        says where; its geometric middle, sqrt(n) times the decode's rise, is the centre (r26-13:
        3-step, served at 1 and 2 streams, was read up to 32 along its own secant, 327 ms a
        cycle where it takes 94, and the baseline held for 110 minutes at 628 tok/s against the
        810 it serves; the baseline's rise from 2 to 32 streams, 27 ms, puts it at 95).
        Only upwards: from a large batch, where a verify of n times the tokens may have turned
        compute-bound while the decode has not, the decode's fall read this way missed by
        more than the chain's own line down (the forward shapes of
        tests/policies/test_estimators.py). None for a baseline, an adaptive profile, going
        down, or where no baseline's own points span b0 and `batch`."""
        q = self.specs[profile]
        if not q.speculative or q.adaptive or batch <= b0:
            return None
        for name, sp in self.specs.items():
            if sp.speculative:
                continue
            # Both sizes within the baseline's own served ones (a bucket of it, or between two).
            at_b0, at_batch = self._own_predict(name, b0), self._own_predict(name, batch)
            if at_b0 is None or at_batch is None or {at_b0.how, at_batch.how} - WITHIN_SERVED:
                continue
            return math.sqrt(q.forward_tokens) * max(at_batch.mean - at_b0.mean, 0.0)
        return None

    def _served_by_any(self, profile: str, batch: float) -> bool:
        """Whether some profile's batch buckets with data reach `batch` (its bucket, or between
        two served sizes of one profile), and, for a fixed profile, some fixed profile served a
        forward carrying as many tokens as `profile`'s at `batch` or more. A forward's cost is
        mostly a function of its tokens: beyond the most any forward carried the curve may
        saturate (MoE experts all loaded) whatever batch sizes were served: a 6-step chain
        served at 16 streams, 112 tokens a forward, is not read up to 48, 336 tokens, along its
        secant because the baseline served 64 sequences of one token."""
        # Reads only which buckets hold data, as _members does (_forget relies on it).
        k = batch_bucket(batch)
        q = self.specs[profile]
        nq = q.forward_tokens
        batch_seen, tokens_seen = False, q.adaptive  # an adaptive profile's tokens move
        for name in self.buckets:
            pts = self._points(name)
            if not pts:
                continue
            if pts[0][0] <= batch <= pts[-1][0] or any(p[3] == k for p in pts):
                batch_seen = True
            sp = self.specs[name]
            if not sp.adaptive and not tokens_seen:
                b = batch * nq / sp.forward_tokens
                tokens_seen = b <= pts[-1][0] or batch_bucket(b) == pts[-1][3]
            if batch_seen and tokens_seen:
                return True
        return False

    def _line_predict(self, profile: str, batch: float) -> tuple[float, float] | None:
        """(mean, variance) from the profile's line over all its windows; None below the
        minimum of data."""
        if not self.has_data(profile):
            return None
        st = self.stats[profile]
        wv = st.window_var()
        n_eff = max(st.n_eff(), 1.0)
        level_var = (wv if wv is not None else (0.05 * st.level) ** 2) / n_eff
        d = batch - st.bbar
        b = st.own_slope()
        if b is not None:
            return st.level + b * d, level_var * (1.0 + d * d / st.var_b)
        if abs(d) <= MIN_BATCH_SD_FOR_SLOPE:
            return st.level, level_var
        fit = self.surface()
        spec = self.specs[profile]
        n = spec.forward_tokens
        if fit is not None and fit.slope_identified and not spec.adaptive:
            bs, svar = _slope_with_split(fit, n)
            return st.level + bs * d, level_var + svar * d * d
        # No slope anywhere: step time is non-decreasing in B and at most proportional to it.
        lo, hi = sorted((st.level, st.level * batch / st.bbar))
        half = (hi - lo) / 2.0
        return (lo + hi) / 2.0, level_var + (half / Z90) ** 2

    def profile_snapshot(self, profile: str) -> dict[str, Any]:
        """A profile's statistics (its line and batch buckets) as JSON, to compare a later boot
        with (`comparable_step_s`)."""
        return {
            "spec": spec_to_dict(self.specs[profile]),
            "min_windows": self.min_windows,
            "min_steps": self.min_steps,
            "stats": self.stats[profile].to_dict(),
            "buckets": {str(k): v.to_dict() for k, v in self.buckets[profile].items()},
        }

    def restore_buckets(self, profile: str, snapshot: Mapping[str, Any]) -> int:
        """After a new boot matched the previous one where both served (no drift), give back
        the previous boot's batch buckets (`profile_snapshot`, taken before the boot's
        discount) that this boot has not served yet: their step times are as valid as they
        were, and a boot that served one batch size should not forget every other. Returns how
        many buckets came back."""
        restored = 0
        for k, d in snapshot.get("buckets", {}).items():
            old = LineStats.from_dict(d)
            cur = self.buckets[profile].get(int(k))
            if (cur is None or cur.count == 0) and self._enough(old):
                self.buckets[profile][int(k)] = old
                restored += 1
        if restored:
            self._fit_dirty = True
            self._memo.clear()
        return restored

    def support(self, profile: str, batch: float) -> str | None:
        """How the profile's own data covers `batch`: "bucket", "interpolated", "extrapolated"
        (beyond every batch size it was served at: its shape there is a band, not data),
        "line", or None (too little data of its own)."""
        own = self._own_predict(profile, batch)
        return None if own is None else own.how

    def estimate(self, profile: str, batch: float) -> Estimate | None:
        """Cycle seconds of `profile` at `batch` with a ~90% interval, or None."""
        if batch <= 0 or not math.isfinite(batch):
            raise ValueError(f"batch must be a positive number, got {batch!r}")
        e: Estimate | None = self._memo.answer(
            (profile, float(batch)), lambda: self._estimate(profile, batch)
        )
        return e

    def _estimate(self, profile: str, batch: float) -> Estimate | None:
        own = self._own_predict(profile, batch)
        if own is not None:
            if own.mean <= 0:
                return None
            lo, hi = own.interval()
            e = Estimate(own.mean, max(own.mean * 1e-3, lo), hi, self.stats[profile].s0)
            return e if own.how == "bucket" else self._token_bounded(profile, batch, e)
        e = self._surface_predict(profile, batch)
        return None if e is None else self._token_bounded(profile, batch, e)

    def token_bounds(self, profile: str, batch: float) -> tuple[float, float]:
        """(low, high) that other profiles' served forwards put on `profile`'s cycle at `batch`
        (0 and inf where none speaks). A forward's cost never falls when it carries more
        sequences or more tokens: a cycle of p with b >= B sequences and n_p >= n_q tokens each
        (as many draft steps or more) costs at least q's, T_q(B) <= T_p(b) (a verify forward
        costs at least a decode forward of as many sequences); with b < B, since the time per
        sequence never rises with B, T_q(B) <= T_p(b) B / b (a chain whose windows average just
        under the cap, where every profile is priced, bounded nothing there). Among verify
        forwards (both speculative: one kernel path), the cost per token never rises with more
        tokens (fixed costs amortise; at worst compute-bound, linear), so p's verify at b <= B
        sequences x n_p tokens with b n_p >= B n_q bounds q's from below: T_q(B) >=
        verify_p(b) B n_q / (b n_p), the verify being at least 1 - DRAFT_SHARE_MAX of p's
        cycle. A decode forward gets no such bound from a verify: the verify carries fixed
        costs of its own (FIELD.md: verify cost is mostly fixed per cycle, ~30 ms at the later
        boot against a 12 ms decode step at 82 tok/s), so a decode of a few streams may cost
        less per token than it.
        Each served point is taken at the far end of its ~90% sampling interval. Adaptive
        profiles neither give nor get bounds (their tokens per sequence move)."""
        q = self.specs[profile]
        low, high = 0.0, math.inf
        if q.adaptive:
            return low, high
        nq = q.forward_tokens
        for name, p in self.specs.items():
            if name == profile or p.adaptive:
                continue
            n_p = p.forward_tokens
            for b, y, v, _ in self._points(name):
                half = Z90 * math.sqrt(v)
                if q.speculative and p.speculative and b <= batch and b * n_p >= batch * nq:
                    low = max(low, (1.0 - DRAFT_SHARE_MAX) * (y - half) * batch * nq / (b * n_p))
                if n_p >= nq:
                    high = min(high, (y + half) * max(batch / b, 1.0))
        return low, high

    def _token_bounded(self, profile: str, batch: float, e: Estimate) -> Estimate:
        """`e` (a prediction away from `profile`'s own served batch sizes) held to the bounds
        other profiles' forwards put on it (token_bounds). Where its whole interval lies outside
        them, the curve it followed (a line, a shared surface's average slope) is disproved
        there, and the estimate becomes the band between the bound and what the profile's own
        nearest points allow (step time never falls with B, time per sequence never rises),
        centred (nothing measured says where in it); without own points on that side, the bound
        widened by twice the shared model's resolution. Bounds that contradict each other (a
        donor's data from before a change) are not used."""
        low, high = self.token_bounds(profile, batch)
        if (low <= 0.0 and math.isinf(high)) or low > high:
            return e
        lo, hi = max(e.low, low), min(e.high, high)
        if lo <= hi:
            return Estimate(min(max(e.mean, lo), hi), lo, hi, e.n)
        pts = self._points(profile)
        below = [(b, y) for b, y, _, _ in pts if b < batch]
        above = [(b, y) for b, y, _, _ in pts if b > batch]
        own_lo = below[-1][1] if below else (above[0][1] * batch / above[0][0] if above else 0.0)
        own_hi = (
            above[0][1] if above else (below[-1][1] * batch / below[-1][0] if below else math.inf)
        )
        lo, hi = max(low, own_lo), min(high, own_hi)
        f = SURFACE_REL_ERR_FLOOR
        if math.isinf(hi):
            hi = lo * (1.0 + 2.0 * f)
        elif lo <= 0.0:
            # Only an upper bound and no own point below: the bound, as the lower one above
            # (a step takes time: [0, hi] would price the profile at any speed at all).
            lo = hi / (1.0 + 2.0 * f)
        if lo > hi:
            return e
        return Estimate((lo + hi) / 2.0, lo, hi, e.n)

    def _token_equivalent(self, profile: str, batch: float) -> Estimate | None:
        """A never-run speculative profile q read off a run one p at the same tokens per
        forward: a forward's cost is mostly a function of the tokens it processes (weights and
        routed experts streamed, compute per token), so T_q(B) ~ T_p(r B) with r = n_q / n_p,
        corrected for what scales per sequence or per draft step:

            T_q(B) = T_p(r B) + (n_q - n_p) d0 + (r - 1) B beta / (n_p - 1)

        beta is the slope in B of T_p(B) - T_base(n_p B) (per-sequence costs: KV reads, draft
        per sequence), fitted where the baseline served n_p B; d0 (one draft step's fixed cost)
        is not identified by cycle times and is taken uniform on [0, DRAFT_SHARE_MAX x T_p / g_p]
        (FIELD.md: the draft model is under 5% of the cycle). Without the baseline's decode beta
        is unidentified: the band reaches down to the donor's cycle at B sequences (a longer
        verify of as many sequences costs at least its verify). None without a run speculative
        profile."""
        q = self.specs[profile]
        nq = int(q.draft_tokens)
        donors = [
            sp
            for name, sp in self.specs.items()
            if name != profile
            and sp.speculative
            and not sp.adaptive
            and sp.draft_tokens > 1
            and self._points(name)
        ]
        if nq <= 1 or not donors:
            return None
        p = min(donors, key=lambda sp: (abs(sp.draft_tokens - nq), -sp.draft_tokens))
        np_ = int(p.draft_tokens)
        r = nq / np_
        own = self._own_predict(p.name, r * batch)
        if own is None:
            return None
        t_p = own.mean
        base = next(
            (n for n, sp in self.specs.items() if not sp.speculative and self._points(n)), None
        )
        if base is None and self.stats[profile].s0 > 0:
            # A profile that ran, its data set aside at a change, waits for its own windows:
            # read off the donor's cycles, which may predate that change, it would be priced
            # at the old level.
            return None
        donor_pts = self._points(p.name)
        # Per-sequence costs are read against the baseline's decode; without it they are
        # unidentified, and the band below reaches down to what they could save.
        fit = None if base is None else self._per_sequence_slope(donor_pts, base, np_)
        g_p = max(p.num_steps, 1)
        # d0 is the batch-independent part of a draft step (what grows with B is in beta): the
        # draft share bounds it where the donor's cycle is shortest, at its smallest batch.
        t_min = min(y for _, y, _, _ in donor_pts)
        d0_max = DRAFT_SHARE_MAX * min(t_min, t_p) / g_p
        shift = (nq - np_) * d0_max / 2.0
        var = ((nq - np_) * d0_max) ** 2 / 12.0
        corr_scale = (r - 1.0) * batch / (np_ - 1)
        if fit is not None:
            beta, beta_var = fit
            shift += corr_scale * beta
            var += corr_scale**2 * beta_var
        else:
            # Per-sequence costs unknown: as large as the draft share again, either sign.
            var += (DRAFT_SHARE_MAX * t_p / Z90) ** 2
        mean = t_p + shift
        if mean <= 0:
            return None
        # The equivalence itself is a model: attention and launch costs do not scale with tokens.
        floor = TOKEN_EQUIVALENCE_REL_ERR * mean / Z90
        # The donor's shape band (where r B lies between or beyond its data) moves with it.
        lo, hi = own.interval(var + floor * floor)
        lo, hi = max(mean * 1e-3, lo + shift), hi + shift
        if base is None and r > 1.0:
            # q's B sequences read (r - 1) B fewer caches and sample fewer than p's r B: by as
            # much as all of p's per-sequence cost, which only the baseline's decode would
            # identify. Its cycle is still at least p's at B sequences (q's verify carries
            # more tokens each) less p's draft share.
            at_b = self._own_predict(p.name, batch)
            if at_b is not None:
                lo = min(lo, max(at_b.interval()[0], 0.0) * (1.0 - DRAFT_SHARE_MAX))
        # Better centres than the donor's, where there is one (the band the donor's data and
        # the physics allow stays: a model of the shape, however well it fits, is not data
        # where none was). Two other chains that served this very batch size are data at it;
        # and between or beyond the donor's served sizes, where its own points give only a
        # chord or a straight continuation, the roofline through every profile's points.
        sib = self._sibling_line(q, batch)
        curve = self.usable_curve()
        if sib is not None:
            mean = min(max(sib, lo), hi)
        elif own.how != "bucket" and curve is not None:
            # The roofline through every profile's points knows where the forward saturates
            # (experts all loaded) or turns compute-bound.
            mean = min(max(curve.at(batch, nq, True) + (nq - np_) * d0_max / 2.0, lo), hi)
        return Estimate(mean, lo, hi, 0.0)

    def _sibling_line(self, q: ProfileSpec, batch: float) -> float | None:
        """A never-run chain's cycle at `batch` read across two other fixed chains that
        served this batch size (its bucket), along their line in draft tokens per sequence:
        each draft step adds one step of the drafter and one token of the verify, so at a
        fixed batch size the cycle grows with the chain about linearly, and the speculative
        overheads a baseline lacks are in both points. The nearest chain on each side of q
        (interpolation), else the two nearest on one side; the slope is never negative (a
        longer chain never costs less). None without two such chains."""
        nq = int(q.draft_tokens)
        pts: dict[int, float] = {}
        for name, sp in self.specs.items():
            n = int(sp.draft_tokens)
            if name == q.name or not sp.speculative or sp.adaptive or n <= 1 or n == nq:
                continue
            own = self._own_predict(name, batch)
            if own is not None and own.how == "bucket":
                pts[n] = min(pts.get(n, own.mean), own.mean)
        pair = line_pair(pts, nq)
        if pair is None:
            return None
        n0, n1 = pair
        slope = max((pts[n1] - pts[n0]) / (n1 - n0), 0.0)
        return pts[n0] + slope * (nq - n0)

    def _per_sequence_slope(
        self, donor_pts: Sequence[tuple[float, float, float, int]], base: str, n_p: int
    ) -> tuple[float, float] | None:
        """(beta, variance): the slope in B of T_p(B) - T_base(n_p B) over the donor's batch
        buckets where the baseline served n_p B (its bucket or between two of its own), i.e.
        what a verify of n_p tokens per sequence costs per sequence beyond n_p B decode tokens;
        None without two such batch sizes far enough apart."""
        xs, ys, ws = [], [], []
        for b, y, v, _ in donor_pts:
            ob = self._own_predict(base, n_p * b)
            if ob is None or ob.how not in ("bucket", "interpolated"):
                continue
            xs.append(b)
            ys.append(y - ob.mean)
            ws.append(1.0 / max(v + ob.var, TINY))
        if len(xs) < 2 or max(xs) - min(xs) <= MIN_BATCH_SD_FOR_SLOPE:
            return None
        x, yv, w = np.asarray(xs), np.asarray(ys), np.asarray(ws)
        xm = float(np.average(x, weights=w))
        sxx = float(np.sum(w * (x - xm) ** 2))
        beta = float(np.sum(w * (x - xm) * (yv - np.average(yv, weights=w)))) / sxx
        resid = yv - (np.average(yv, weights=w) + beta * (x - xm))
        # The scatter around the line says how well one slope describes it.
        s2 = float(np.sum(w * resid**2)) / max(len(xs) - 2, 1) if len(xs) > 2 else 1.0
        return beta, max(s2, 1.0) / sxx

    def _surface_predict(self, profile: str, batch: float) -> Estimate | None:
        spec = self.specs[profile]
        if spec.adaptive:
            return None  # its tier moves with B: no single n to put on the surface
        if spec.draft_tokens > 1 and (te := self._token_equivalent(profile, batch)) is not None:
            return te
        fit = self.surface()
        if fit is None:
            return None
        n = spec.forward_tokens
        if n > 1:
            if not fit.spec_ns or not fit.has_baseline:
                return None  # the speculative terms are unidentified
            near = min(fit.spec_ns, key=lambda k: (abs(k - n), k))
            mean = fit.at(batch, n) + fit.draft_resid_per_step_s * (n - 1)
            rel = math.hypot(SURFACE_REL_ERR_FLOOR, fit.rel_resid_rms)
            rel *= 1.0 + abs(n - near) / near
        else:
            return None  # a baseline with no own data cannot be read off speculative cycles
        if not fit.slope_identified:
            bs = [
                self.stats[p].bbar
                for p, sp in self.specs.items()
                if self.has_data(p) and not sp.adaptive
            ]
            near_b = min(bs, key=lambda x: abs(x - batch))
            rel += abs(batch - near_b) / max(batch, near_b)
        if mean <= 0:
            return None
        return estimate_within(mean, rel * mean, mean * 1e-3, math.inf, 0.0)

    def baseline_bound(self, batch: float, verify_rise: float = 1.0) -> Estimate | None:
        """A baseline never run, bounded by a speculative profile that was: its decode forward
        carries one token per sequence where the verify carries n and no draft runs, so it
        costs at most the speculative cycle, and at least 1/n of the verify forward (the cost
        per token never rises with tokens; the verify is at least 1 - DRAFT_SHARE_MAX of the
        cycle). Nothing in cycle times says where in between: the interval is that whole band
        and the mean its geometric middle, the middle in tokens per second too (the arithmetic
        one put the decode 1.07x (a 1-step donor) to 1.46x (5-step) above it, and a baseline
        never run looked slower than its own band says). The donor with the fewest draft
        tokens gives the tightest band. None without such a profile. `verify_rise`: how far
        detected changes of system state have moved the verify since it was first seen; a rise
        may have been the verify's alone (FIELD.md's reboot: verify 1.5x, decode 1.08x), so the
        lower end is that of the verify before it."""
        donors = sorted(
            (sp for sp in self.specs.values() if sp.speculative and not sp.adaptive),
            key=lambda sp: sp.draft_tokens,
        )
        for sp in donors:
            own = self._own_predict(sp.name, batch)
            if own is None or own.mean <= 0:
                continue
            lo_p, hi_p = own.interval()
            n = sp.forward_tokens
            lo = max(lo_p, own.mean * 1e-3) * (1.0 - DRAFT_SHARE_MAX) / n / max(verify_rise, 1.0)
            return Estimate(math.sqrt(lo * hi_p), lo, hi_p, 0.0)
        return None

    # -- persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "half_life_s": self.half_life_s,
            "min_windows": self.min_windows,
            "min_steps": self.min_steps,
            "expert_share": self.expert_share,
            "profiles": [spec_to_dict(s) for s in self.specs.values()],
            "stats": {k: v.to_dict() for k, v in self.stats.items()},
            "buckets": {
                p: {str(k): v.to_dict() for k, v in bs.items()} for p, bs in self.buckets.items()
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CycleTimeSurface:
        obj = cls(
            [spec_from_dict(s) for s in d["profiles"]],
            half_life_s=d["half_life_s"],
            min_windows=d["min_windows"],
            min_steps=d["min_steps"],
            expert_share=float(d.get("expert_share", 0.0)),
        )
        for k, v in d["stats"].items():
            obj.stats[k] = LineStats.from_dict(v)
        for p, bs in d.get("buckets", {}).items():
            obj.buckets[p] = {int(k): LineStats.from_dict(v) for k, v in bs.items()}
        return obj


def comparable_step_s(snapshot: Mapping[str, Any], batch: float) -> float | None:
    """The step time a `profile_snapshot` says at `batch`, only where it holds data in the
    batch bucket of `batch` (like with like); None when that batch size was not served then: a
    batch-size change is not drift."""
    spec = spec_from_dict(snapshot["spec"])
    surf = CycleTimeSurface(
        [spec], min_windows=snapshot["min_windows"], min_steps=snapshot["min_steps"]
    )
    surf.stats[spec.name] = LineStats.from_dict(snapshot["stats"])
    surf.buckets[spec.name] = {
        int(k): LineStats.from_dict(v) for k, v in snapshot["buckets"].items()
    }
    if batch <= 0 or not math.isfinite(batch):
        return None
    own = surf._own_predict(spec.name, batch)
    if own is None or own.how != "bucket" or own.mean <= 0:
        return None
    return own.mean
