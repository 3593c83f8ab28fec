"""Change detection on per-window signals, regime-duration expectation, and findings.

Owns: a two-sided CUSUM on standardised residuals per stream (accept length, concurrency, cycle
cost, baseline step time), the bookkeeping of regime means per stream (history), the expected
remaining duration of the current regime (a conjugate exponential/Gamma model of regime lengths,
i.e. a Lomax predictive, with a conservative prior), and Findings: drift against history and
acceptance far below history, as data.

CUSUM calibration (Siegmund's approximation, unit-variance Gaussian residuals): with drift
allowance k = 1 and threshold h = 6 the in-control run length of one side is ~8e5 windows, so
four streams x two sides stay well under one false alarm per 8640-window day; a step of 4 sigma
is detected in ~2.5 windows on average. Residuals are clipped to +-z_clip so one outlier window
cannot alarm on its own. Sigma comes from the larger of (a) mean absolute successive differences
(robust to level shifts) and (b) the regime's own spread (captures slow wander that (a) misses),
floored at a relative resolution, and inflated by sqrt(1 + 1/n) for the uncertainty of a young
regime's mean. A stream whose points have all repeated the one before (a closed-loop load's
concurrency, a single workload's share) has no noise scale yet: its moves are levels, found
against the resolution floor, and the scale is learnt from the differences after its first move.

Must not: decide, read clocks, or know profiles beyond the stream names it is given.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# sqrt(pi) / 2: E|x_t - x_{t-1}| = 2 sigma / sqrt(pi) for independent Gaussian windows.
_ABSDIFF_TO_SIGMA = math.sqrt(math.pi) / 2.0

# Memory (windows) of the running means behind sigma and the regime level: long enough for a
# stable noise scale (~7% error), short enough to follow slow drift within a regime.
SIGMA_MEMORY_WINDOWS = 200
LEVEL_MEMORY_WINDOWS = 100

# A difference scale below this is no stream's noise (accept lengths, step-time ratios,
# concurrencies and shares are all of order 1e-3 and up): only the capped move out of a
# constant run, in states saved before `_diff` handled one, left a scale down there.
_DEGENERATE_ABSDIFF = 1e-100

# Regime means kept per stream for history comparisons (bounded state).
HISTORY_LEN = 20

# Autocorrelation correction: the regime spread needs this many windows before it is trusted,
# and rho is capped (rho -> 1 would make sigma infinite and the detector blind).
LR_MIN_WINDOWS = 20
MAX_RHO = 0.9


# Every kind of finding (a closed set: the API's ?kind= filter takes only these).
FindingKind = Literal["drift", "acceptance_low", "change"]


@dataclass(frozen=True)
class Finding:
    """Something an operator should know, as data: `kind` is "drift" (a level moved against its
    history, e.g. verify 20 -> 30 ms, baseline 89 -> 82 tok/s), "acceptance_low" (accept rate far
    below history, e.g. 47% -> 19%) or "change" (a detected change point)."""

    kind: FindingKind
    subject: str
    before: float
    after: float
    t_s: float
    unit: str = ""

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "subject": self.subject,
            "before": self.before,
            "after": self.after,
            "t_s": self.t_s,
            "unit": self.unit,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        return cls(
            str(d["kind"]),
            str(d["subject"]),
            float(d["before"]),
            float(d["after"]),
            float(d["t_s"]),
            str(d.get("unit", "")),
        )


@dataclass(frozen=True)
class CusumEvent:
    """`kind` "change": a change point (before = old regime level, after = the level of the
    windows since the CUSUM left zero; `since_s`: the time of the last point before those, so
    the change began after it, whatever span each point covers); "established": a regime's level
    is now based on `n` windows (after = that level; before = the previous regime's level, nan
    if none)."""

    kind: str
    t_s: float
    before: float
    after: float
    n: int
    since_s: float | None = None


@dataclass
class CusumDetector:
    """Two-sided CUSUM with self-estimated level and noise (see the module docstring)."""

    k: float = 1.0
    h: float = 6.0
    warmup: int = 6
    z_clip: float = 5.0
    rel_sigma_floor: float = 0.005
    # state
    n: int = 0  # windows in the current regime
    mean: float = 0.0
    var: float = 0.0  # running variance of the regime around its mean
    absdiff: float = 0.0
    n_diff: int = 0
    skip_diffs: int = 0  # differences still to pass over after a move out of a constant run
    last_x: float | None = None
    s_hi: float = 0.0
    s_lo: float = 0.0
    hi_sum: float = 0.0
    hi_n: int = 0
    lo_sum: float = 0.0
    lo_n: int = 0
    prev_mean: float | None = None
    established: bool = False
    lr_factor: float = 1.0  # long-run / difference-based sigma, kept across regimes
    lr_n: int = 0  # updates behind lr_factor
    last_t: float | None = None  # time of the last point
    hi_since: float | None = None  # time of the point before the upper run began
    lo_since: float | None = None
    # The level held when the noise scale was last re-learnt (`relearn`), its long-run sigma,
    # the windows behind it and the time of its last point; compared with the new level once
    # the new scale rests on LR_MIN_WINDOWS windows.
    ref_mean: float | None = None
    ref_sigma: float = 0.0
    ref_n: int = 0
    ref_t: float | None = None

    def sigma(self) -> float:
        """Long-run noise scale of the window sum the CUSUM accumulates."""
        s_diff = self.absdiff * _ABSDIFF_TO_SIGMA if self.n_diff >= 2 else 0.0
        if self.n >= LR_MIN_WINDOWS and s_diff > 0:
            # Successive differences see sigma^2 (1 - rho); the regime spread sees sigma^2. Their
            # ratio gives the lag-1 autocorrelation rho, and a CUSUM over autocorrelated windows
            # needs the long-run scale sigma sqrt((1 + rho) / (1 - rho)) or it alarms on wander.
            s_reg = math.sqrt(self.var)
            # Differences at least as wide as the spread: no positive autocorrelation (and a
            # spread of 0, a regime of identical windows, must not overflow the ratio).
            rho = 0.0 if s_reg <= s_diff else min(1.0 - (s_diff / s_reg) ** 2, MAX_RHO)
            factor = max(1.0, s_reg / s_diff) * math.sqrt((1.0 + rho) / (1.0 - rho))
            self.lr_n += 1
            self.lr_factor += (factor - self.lr_factor) / min(self.lr_n, SIGMA_MEMORY_WINDOWS)
        s = max(s_diff * self.lr_factor, self.rel_sigma_floor * abs(self.mean), 1e-12)
        return s * math.sqrt(1.0 + 1.0 / max(self.n, 1))

    def _absorb(self, x: float) -> None:
        self.n += 1
        w = 1.0 / min(self.n, LEVEL_MEMORY_WINDOWS)
        d = x - self.mean
        self.mean += w * d
        self.var = (1.0 - w) * (self.var + w * d * d)

    def _diff(self, x: float) -> None:
        if self.last_x is not None:
            d = abs(x - self.last_x)
            if self.skip_diffs > 0:
                self.skip_diffs -= 1
            elif self.absdiff == 0.0 and d > 0.0 and self.n_diff > 0:
                # Every point so far repeated the one before (one stream exactly, a workload's
                # whole share of the mix): the stream has taught no noise scale, and a move is
                # a level, not noise. A window straddling the move holds part of each level, so
                # the point after it is the level's too: the scale is learnt afresh from the
                # difference after that. (Capped at a multiple of the zero scale, the move left
                # the scale near zero for good, its long-run factor near 1e300, and the
                # detector blind after its first change.)
                self.n_diff = 0
                self.skip_diffs = 1
            else:
                if self.n_diff >= 10:
                    # A level shift is one huge difference: cap it so it barely moves the scale.
                    d = min(d, 6.0 * self.absdiff)
                self.n_diff += 1
                self.absdiff += (d - self.absdiff) / min(self.n_diff, SIGMA_MEMORY_WINDOWS)
        self.last_x = x

    def _start_regime(self, level: float, n: int) -> None:
        self.prev_mean = self.mean
        self.mean = level
        self.n = n
        self.var = 0.0
        self.s_hi = self.s_lo = 0.0
        self.hi_sum = self.lo_sum = 0.0
        self.hi_n = self.lo_n = 0
        self.established = False

    def relearn(self) -> None:
        """The noise of the points changes from here (a point's spread is set by what stands
        behind it: a window at 64 streams holds fifty times the verify steps of one at a single
        stream): the scale and the regime start over, and the level held so far is kept as a
        reference. Once the new scale rests on LR_MIN_WINDOWS windows, a new level that the
        CUSUM would have alarmed on over those windows (reference noise included) is a change
        dated from the last point before this call. A level moving at the same time as the
        noise would otherwise go unseen: the old scale raises false alarms, and a detector
        started afresh takes the new level as its first. A detector re-learnt again before
        that comparison keeps its first reference."""
        if self.ref_mean is None and self.n > 0 and self.established:
            self.ref_mean = self.mean
            self.ref_sigma = self.sigma()
            self.ref_n = min(self.n, LEVEL_MEMORY_WINDOWS)
            self.ref_t = self.last_t
        self.absdiff, self.n_diff, self.skip_diffs, self.last_x = 0.0, 0, 0, None
        self._start_regime(0.0, 0)

    def _moved_from_reference(self, t_s: float) -> CusumEvent | None:
        """The comparison `relearn` set up, once the new scale rests on LR_MIN_WINDOWS
        windows: the n windows' sum of standardised residuals against the reference level,
        less the drift allowance, past the threshold (the CUSUM's own test over those windows;
        the reference level's own error widens the scale)."""
        if self.ref_mean is None or self.n < LR_MIN_WINDOWS:
            return None
        ref, ref_sigma, ref_n, ref_t = self.ref_mean, self.ref_sigma, self.ref_n, self.ref_t
        self.ref_mean, self.ref_sigma, self.ref_n, self.ref_t = None, 0.0, 0, None
        n = self.n
        # The n windows' sum around the reference varies as n sigma^2 + n^2 ref_sigma^2 / ref_n.
        sigma = math.hypot(self.sigma(), ref_sigma * math.sqrt(n / max(ref_n, 1)))
        if not math.isfinite(sigma) or n * (abs(self.mean - ref) / sigma - self.k) <= self.h:
            return None
        self.prev_mean = ref
        return CusumEvent("change", t_s, ref, self.mean, n, ref_t)

    @property
    def armed(self) -> bool:
        """Whether the regime's warm-up is over, so that a point may raise an alarm. The first
        regime in which a detector's points vary also has to learn the noise's autocorrelation
        before it may alarm; later regimes inherit it. Points that have not varied yet (a
        stream constant in every regime so far) have none to learn."""
        learnt = self.lr_n > 0 or self.absdiff == 0.0
        return self.n >= (self.warmup if learnt else max(self.warmup, LR_MIN_WINDOWS))

    def update(self, x: float, t_s: float) -> CusumEvent | None:
        """Feed one window's value. Non-finite values are ignored."""
        if not math.isfinite(x):
            return None
        prev_t, self.last_t = self.last_t, float(t_s)
        self._diff(x)
        if not self.armed:
            self._absorb(x)
            if self.n >= self.warmup and not self.established:
                self.established = True
                before = math.nan if self.prev_mean is None else self.prev_mean
                return CusumEvent("established", t_s, before, self.mean, self.n)
            if self.n >= LR_MIN_WINDOWS:
                self.sigma()  # learn the long-run factor while still warming up
            return self._moved_from_reference(t_s)
        z = (x - self.mean) / self.sigma()
        z = max(-self.z_clip, min(self.z_clip, z))
        self.s_hi = max(0.0, self.s_hi + z - self.k)
        self.s_lo = max(0.0, self.s_lo - z - self.k)
        if self.s_hi > 0:
            if self.hi_n == 0:
                self.hi_since = prev_t
            self.hi_sum += x
            self.hi_n += 1
        else:
            self.hi_sum, self.hi_n = 0.0, 0
        if self.s_lo > 0:
            if self.lo_n == 0:
                self.lo_since = prev_t
            self.lo_sum += x
            self.lo_n += 1
        else:
            self.lo_sum, self.lo_n = 0.0, 0
        if self.s_hi > self.h or self.s_lo > self.h:
            up = self.s_hi > self.h
            total, count = (self.hi_sum, self.hi_n) if up else (self.lo_sum, self.lo_n)
            since = self.hi_since if up else self.lo_since
            before = self.mean
            after = total / count
            # The new level is re-learnt from the windows after the alarm: the windows that
            # raised it may include the last pre-change ones (the CUSUM left zero on noise).
            self._start_regime(after, 0)
            return CusumEvent("change", t_s, before, after, count, since)
        self._absorb(x)
        return self._moved_from_reference(t_s)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CusumDetector:
        det = cls(**dict(d))
        if "skip_diffs" not in d and 0.0 < det.absdiff < _DEGENERATE_ABSDIFF:
            # Saved before constant streams were handled (`_diff`): a scale learnt from a move
            # out of a constant run capped at a multiple of zero, near 1e-300, with its
            # long-run factor near 1e300. Restored as it is, the detector (a warm start's
            # `batch` stream, never reset) would stay blind: its scale starts afresh.
            det.absdiff, det.n_diff, det.lr_factor, det.lr_n = 0.0, 0, 1.0, 0
        return det


@dataclass
class ChangeMonitor:
    """One CusumDetector per stream name, plus each stream's history of established levels."""

    k: float = 1.0
    h: float = 6.0
    warmup: int = 6
    z_clip: float = 5.0
    rel_sigma_floor: float = 0.005
    detectors: dict[str, CusumDetector] = field(default_factory=dict)
    history: dict[str, list[float]] = field(default_factory=dict)

    def update(self, key: str, x: float | None, t_s: float) -> CusumEvent | None:
        if x is None or not math.isfinite(x):
            return None
        det = self.detectors.get(key)
        if det is None:
            det = CusumDetector(self.k, self.h, self.warmup, self.z_clip, self.rel_sigma_floor)
            self.detectors[key] = det
        ev = det.update(x, t_s)
        if ev is not None and ev.kind == "established":
            hist = self.history.setdefault(key, [])
            hist.append(ev.after)
            del hist[:-HISTORY_LEN]
        return ev

    def level(self, key: str) -> float | None:
        det = self.detectors.get(key)
        return det.mean if det is not None and det.n > 0 else None

    def reset(self, prefix: str = "") -> None:
        """Forget the detectors whose key starts with `prefix` (a restart begins new regimes for
        them); histories stay, so a new boot is compared with the previous ones."""
        for key in [k for k in self.detectors if k.startswith(prefix)]:
            del self.detectors[key]

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "h": self.h,
            "warmup": self.warmup,
            "z_clip": self.z_clip,
            "rel_sigma_floor": self.rel_sigma_floor,
            "detectors": {k: d.to_dict() for k, d in self.detectors.items()},
            "history": {k: list(v) for k, v in self.history.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChangeMonitor:
        return cls(
            k=float(d["k"]),
            h=float(d["h"]),
            warmup=int(d["warmup"]),
            z_clip=float(d["z_clip"]),
            rel_sigma_floor=float(d["rel_sigma_floor"]),
            detectors={k: CusumDetector.from_dict(v) for k, v in d["detectors"].items()},
            history={k: [float(x) for x in v] for k, v in d["history"].items()},
        )


@dataclass
class RegimeDurations:
    """Expected remaining duration of the current regime.

    Regime lengths are modelled as exponential with an unknown rate under a Gamma prior whose
    mean length is `prior_mean_s`, worth `prior_strength` pseudo-regimes. After k completed
    regimes of total length D, and the current one having lasted `age_s` (censored), the
    predictive remaining duration has mean (prior_strength x prior_mean_s + D + age_s) /
    (prior_strength + k - 0): a long-lived regime is expected to last longer (Lindy), a history
    of short regimes (bursts) pulls the expectation down."""

    prior_mean_s: float = 1800.0
    prior_strength: float = 1.0
    completed: list[float] = field(default_factory=list)

    def record(self, duration_s: float) -> None:
        if math.isfinite(duration_s) and duration_s > 0:
            self.completed.append(float(duration_s))
            del self.completed[: -HISTORY_LEN * 5]

    def expected_remaining_s(self, age_s: float) -> float:
        age = max(float(age_s), 0.0)
        k = len(self.completed)
        a = self.prior_strength + k
        b = self.prior_strength * self.prior_mean_s + sum(self.completed) + age
        return b / a

    def _outlived(self, age_s: float, min_regimes: int) -> list[float] | None:
        """What is left of each completed regime that outlived `age_s` (what the current one
        may still last), or None with fewer than `min_regimes` of them."""
        age = max(float(age_s), 0.0)
        rests = [d - age for d in self.completed if d >= age]
        return rests if len(rests) >= min_regimes else None

    def remaining_s(self, age_s: float, min_regimes: int) -> float:
        """Expected remaining duration at `age_s`: the completed regimes that outlived that age
        (their rest, with the prior's memoryless mean as one more, weighted as in
        `expected_remaining_s`) once there are `min_regimes` of them; before that, or when
        none outlived it, `expected_remaining_s` (the exponential model cannot tell regular
        hour-long regimes 50 minutes in from new ones)."""
        rests = self._outlived(age_s, min_regimes)
        if rests is None:
            return self.expected_remaining_s(age_s)
        k = self.prior_strength
        return (k * self.prior_mean_s + sum(rests)) / (k + len(rests))

    def switch_beats_waiting(
        self,
        age_s: float,
        wait_s: float,
        restart_s: float,
        gain_tok_s: float,
        cost_tok_s: float,
        min_regimes: int,
    ) -> bool:
        """Whether the regimes seen say a switch now beats waiting `wait_s` more (the burst
        rule's ski-rental wait), for a switch that gains `gain_tok_s` once its restart of
        `restart_s` is over and costs `cost_tok_s` for every second of it.

        The burst rule waits because a young regime of unknown length may be a burst; ski
        rental with a known distribution of lengths needs no such guard. The distribution is
        the completed regimes that outlived `age_s` (what the current one may still be) plus
        the prior's exponential, weighted as in `expected_remaining_s`; switching now yields
        gain x (rest - restart)+ - cost x restart, waiting yields the same from `wait_s` later
        if the regime lasts that long, and nothing if it ends first. False with fewer than
        `min_regimes` such regimes: the guard stays until history speaks."""
        w, r = max(wait_s, 0.0), max(restart_s, 0.0)
        rests = self._outlived(age_s, min_regimes)
        if rests is None:
            return False
        g, c = gain_tok_s, cost_tok_s

        def now(rest: float) -> float:
            return g * max(rest - r, 0.0) - c * r

        def later(rest: float) -> float:
            return now(rest - w) if rest >= w else 0.0

        mu, k = self.prior_mean_s, self.prior_strength
        # The prior's memoryless rest: E[(R - r)+] = mu e^(-r/mu), P(R >= w) = e^(-w/mu).
        prior_now = g * mu * math.exp(-r / mu) - c * r
        prior_later = math.exp(-w / mu) * prior_now
        v_now = (k * prior_now + sum(now(x) for x in rests)) / (k + len(rests))
        v_later = (k * prior_later + sum(later(x) for x in rests)) / (k + len(rests))
        return v_now > 0.0 and v_now >= v_later

    def to_dict(self) -> dict[str, Any]:
        return {
            "prior_mean_s": self.prior_mean_s,
            "prior_strength": self.prior_strength,
            "completed": list(self.completed),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RegimeDurations:
        return cls(
            float(d["prior_mean_s"]),
            float(d["prior_strength"]),
            [float(x) for x in d["completed"]],
        )


def drift_finding(
    subject: str, before: float, after: float, t_s: float, min_rel: float, unit: str = ""
) -> Finding | None:
    """A drift Finding when a level moved by at least `min_rel` relative to its history."""
    if not (math.isfinite(before) and math.isfinite(after)) or before == 0:
        return None
    if abs(after / before - 1.0) < min_rel:
        return None
    return Finding("drift", subject, before, after, t_s, unit)


def acceptance_finding(
    subject: str,
    history_accept_length: Sequence[float],
    now_accept_length: float,
    steps: int,
    low_ratio: float,
    t_s: float,
) -> Finding | None:
    """An "acceptance_low" Finding when the accept rate ((L - 1) / steps, SGLang's
    spec_accept_rate) is below `low_ratio` x the median of its history."""
    if steps < 1 or not history_accept_length or not math.isfinite(now_accept_length):
        return None
    hist_rate = (statistics.median(history_accept_length) - 1.0) / steps
    now_rate = (now_accept_length - 1.0) / steps
    if hist_rate <= 0 or now_rate >= low_ratio * hist_rate:
        return None
    return Finding("acceptance_low", subject, hist_rate, now_rate, t_s, "accept_rate")
