"""Canary statistics: is the candidate profile better than the current one, on the same traffic?

Owns the pure side of a fleet canary: the traffic-normalised measure of one replica-window
(output tokens per request-second in the server), the pooling of the control replicas of one window
into one traffic-weighted value, and the verdict (continue, promote, roll back) from a proper
test in scipy. Pure: numpy/scipy only; time comes in with the windows. Must not fetch, sleep or
decide which profile is a candidate (the policy does; this only judges a running canary).

Why not raw tok/s: behind a router each replica serves whatever share of the traffic the router
sends it. A replica that gets twice the requests shows about twice the tok/s whatever its
profile, and with round-robin and closed-loop clients every replica shows the same tok/s even
when one is much faster (throughput = arrival rate x tokens per request). What the profile
changes is how fast a request in the server is served: tokens per request-second in the server
(by Little's law the inverse of a request's time per output token). A better profile serves the
same arrivals with fewer requests in the server and more tokens per request-second.

In the server = decoding or waiting in its queue. A profile whose --max-running-requests caps
its batch below the load (SGLang forces 48 with speculation) keeps the rest waiting, and their
wait is time per output token as much as a decode step is: counting only the running requests
would credit the capped profile with the speed of the few it lets run (a baseline canary that
ran all 96 requests of its replica at 1.43x the control's tok/s was rolled back as 0.82x per
running request, while the control held 48 of its 96 in the queue).

The test (``method``):
- ``paired`` (default): per window, log(canary) - log(control), where control pools the control
  replicas of that same window weighted by their traffic (sum tokens / sum request-seconds
  in the server); one-sample t-test of the differences (scipy.stats.ttest_1samp). Pairing in time
  removes what moves every replica at once (the traffic mix, the load level).
- ``welch``: Welch's t-test on the log values of canary windows vs control replica-windows
  (scipy.stats.ttest_ind, equal_var=False).
- ``mannwhitney``: Mann-Whitney U on the same values (scipy.stats.mannwhitneyu); ratio from the
  medians.
The effect is the ratio canary / control (geometric means) with its confidence interval.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import numpy as np
from scipy import stats

ARM_CANARY = "canary"
ARM_CONTROL = "control"
METHODS = ("paired", "welch", "mannwhitney")


class Verdict(StrEnum):
    CONTINUE = "continue"  # not enough evidence yet
    PROMOTE = "promote"  # the candidate is better by at least min_gain: roll it out
    ROLLBACK = "rollback"  # worse, not worth it, or not shown better within max_windows


@dataclass(frozen=True)
class ArmWindow:
    """One replica over one poll window of a canary. `request_seconds`: the integral of requests
    in flight over the time they were being decoded (SGLang's decode moments give it exactly:
    the sum over decode steps of batch size x step time); `running_reqs`: their mean number
    while decoding; `requests`: requests finished in the window (None when not reported);
    `queued_seconds`: the integral of requests waiting in the server's queue over the same
    seconds (num_queue_reqs at the scrape x the decode time `request_seconds` covers)."""

    arm: str  # ARM_CANARY | ARM_CONTROL
    replica: str
    t_s: float  # end of the window (the same for every replica scraped in one tick)
    window_s: float
    output_tokens: float
    request_seconds: float
    running_reqs: float
    requests: float | None = None
    queued_seconds: float = 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.window_s if self.window_s > 0 else 0.0

    @property
    def server_seconds(self) -> float:
        """Request-seconds in the server: decoding, plus waiting in the queue."""
        return self.request_seconds + max(self.queued_seconds, 0.0)


def per_request_tok_s(w: ArmWindow) -> float | None:
    """Output tokens per request-second in the server (decoding or queued); None when the
    window carried no traffic."""
    rs = w.server_seconds
    if not (rs > 0 and w.output_tokens > 0) or not math.isfinite(rs + w.output_tokens):
        return None
    return w.output_tokens / rs


@dataclass(frozen=True)
class CanaryTestSettings:
    """How a canary is judged. Defaults: 6 windows per arm (a minute of 10 s polls) before any
    verdict, at most 30 (five minutes: a candidate that cannot show a gain by then is rolled
    back, the fleet keeps what it knows), 5% two-sided level, and a gain must reach 2% to be
    worth a restart of every replica."""

    min_windows: int = 6
    max_windows: int = 30  # paired windows, and poll windows in all (see out_of_time)
    alpha: float = 0.05
    min_gain: float = 0.02
    method: Literal["paired", "welch", "mannwhitney"] = "paired"
    # A replica-window with fewer requests in flight on average says nothing about speed.
    min_running_reqs: float = 0.5

    def __post_init__(self) -> None:
        if self.min_windows < 2:
            raise ValueError(
                f"min_windows must be >= 2 (a test needs spread), got {self.min_windows}"
            )
        if self.max_windows < self.min_windows:
            raise ValueError(
                f"max_windows ({self.max_windows}) must be >= min_windows ({self.min_windows})"
            )
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not self.min_gain >= 0:
            raise ValueError(f"min_gain must be >= 0, got {self.min_gain}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")


@dataclass(frozen=True)
class CanaryVerdict:
    verdict: Verdict
    why: str  # insufficient_windows | better | worse | no_gain | inconclusive
    ratio: float | None  # canary / control, tokens per request-second in the server
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    n_canary: int
    n_control: int
    method: str
    raw_tok_s_ratio: float | None  # canary / mean control replica, raw tok/s (for the record)
    running_ratio: float | None  # canary / mean control replica, requests in flight

    @property
    def unjudged(self) -> bool:
        """Rolled back without a judgement: fewer than min_windows windows could be paired
        (the canary's replica, or every other, carried no usable traffic) before its time ran
        out. Not evidence that the candidate is worse."""
        return self.why == "insufficient_windows"

    def to_dict(self) -> dict[str, float | int | str | None]:
        return {
            "verdict": self.verdict.value,
            "why": self.why,
            "ratio": self.ratio,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "p_value": self.p_value,
            "n_canary": self.n_canary,
            "n_control": self.n_control,
            "method": self.method,
            "raw_tok_s_ratio": self.raw_tok_s_ratio,
            "running_ratio": self.running_ratio,
        }

    def summary(self) -> str:
        def f(v: float | None, fmt: str = ".3f") -> str:
            return "-" if v is None else format(v, fmt)

        return (
            f"{self.verdict.value} ({self.why}): canary/control per-request tok/s "
            f"{f(self.ratio)} [{f(self.ci_low)}, {f(self.ci_high)}] p={f(self.p_value, '.3g')} "
            f"n={self.n_canary}/{self.n_control} ({self.method}); raw tok/s ratio "
            f"{f(self.raw_tok_s_ratio)}, in-flight ratio {f(self.running_ratio)}"
        )


def _usable(w: ArmWindow, s: CanaryTestSettings) -> bool:
    return w.running_reqs >= s.min_running_reqs and per_request_tok_s(w) is not None


def judgeable(
    canary: ArmWindow | None, control: Sequence[ArmWindow], s: CanaryTestSettings
) -> bool:
    """Whether one tick's windows could be paired by the test: the canary replica and at least
    one control replica carried usable traffic."""
    return canary is not None and _usable(canary, s) and any(_usable(w, s) for w in control)


def pooled_control(windows: Sequence[ArmWindow]) -> float | None:
    """Traffic-weighted per-request rate of several control replicas over one window: total
    tokens over total request-seconds in the server (a replica with more traffic weighs more)."""
    rs = sum(w.server_seconds for w in windows)
    tok = sum(w.output_tokens for w in windows)
    return tok / rs if rs > 0 and tok > 0 else None


def _ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    a, b = float(np.mean(num)) if num else 0.0, float(np.mean(den)) if den else 0.0
    return a / b if b > 0 else None


def assess(windows: Sequence[ArmWindow], s: CanaryTestSettings) -> CanaryVerdict:
    """The verdict on a canary from every replica-window seen since it started serving."""
    canary = [w for w in windows if w.arm == ARM_CANARY and _usable(w, s)]
    control = [w for w in windows if w.arm == ARM_CONTROL and _usable(w, s)]
    raw = _ratio([w.output_tok_s for w in canary], [w.output_tok_s for w in control])
    running = _ratio([w.running_reqs for w in canary], [w.running_reqs for w in control])

    def judged(
        log_ratio: float, log_lo: float, log_hi: float, p: float, n_c: int, n_k: int
    ) -> CanaryVerdict:
        ratio, lo, hi = math.exp(log_ratio), math.exp(log_lo), math.exp(log_hi)
        v, why = _rule(s, ratio, hi, p, min(n_c, n_k))
        return CanaryVerdict(v, why, ratio, lo, hi, p, n_c, n_k, s.method, raw, running)

    def waiting(n_c: int, n_k: int) -> CanaryVerdict:
        return CanaryVerdict(
            Verdict.CONTINUE,
            "insufficient_windows",
            None,
            None,
            None,
            None,
            n_c,
            n_k,
            s.method,
            raw,
            running,
        )

    if s.method == "paired":
        by_t: dict[float, list[ArmWindow]] = {}
        for w in control:
            by_t.setdefault(w.t_s, []).append(w)
        diffs: list[float] = []
        for w in canary:
            ctl = pooled_control(by_t.get(w.t_s, []))
            rate = per_request_tok_s(w)
            if ctl is not None and rate is not None:
                diffs.append(math.log(rate) - math.log(ctl))
        n = len(diffs)
        if n < s.min_windows:
            return waiting(n, n)
        d = np.asarray(diffs)
        m = float(np.mean(d))
        if float(np.ptp(d)) == 0.0:  # no spread at all: the difference is exact
            return judged(m, m, m, 0.0 if m != 0.0 else 1.0, n, n)
        res = stats.ttest_1samp(d, 0.0)
        ci = res.confidence_interval(1 - s.alpha)
        return judged(m, float(ci.low), float(ci.high), float(res.pvalue), n, n)

    if len(canary) < s.min_windows or len(control) < s.min_windows:
        return waiting(len(canary), len(control))
    a = np.log([per_request_tok_s(w) or 0.0 for w in canary])
    b = np.log([per_request_tok_s(w) or 0.0 for w in control])
    if s.method == "welch":
        m = float(np.mean(a) - np.mean(b))
        if float(np.ptp(a)) == 0.0 and float(np.ptp(b)) == 0.0:
            return judged(m, m, m, 0.0 if m != 0.0 else 1.0, len(a), len(b))
        res = stats.ttest_ind(a, b, equal_var=False)
        ci = res.confidence_interval(1 - s.alpha)
        return judged(m, float(ci.low), float(ci.high), float(res.pvalue), len(a), len(b))
    # Mann-Whitney: the Hodges-Lehmann shift (median of pairwise differences, the U test's own
    # estimator) and the matching quantiles of the pairwise differences as its interval.
    mw = stats.mannwhitneyu(a, b, alternative="two-sided")
    pair = np.subtract.outer(a, b).ravel()
    lo, hi = np.quantile(pair, [s.alpha / 2, 1 - s.alpha / 2])
    return judged(float(np.median(pair)), float(lo), float(hi), float(mw.pvalue), len(a), len(b))


def _rule(s: CanaryTestSettings, ratio: float, hi: float, p: float, n: int) -> tuple[Verdict, str]:
    """Promote only a significant gain of at least min_gain; roll back a significant loss, a gain
    whose interval cannot reach min_gain, or no answer within max_windows."""
    gain = 1.0 + s.min_gain
    if p < s.alpha and ratio < 1.0:
        return Verdict.ROLLBACK, "worse"
    if p < s.alpha and ratio >= gain:
        return Verdict.PROMOTE, "better"
    if hi < gain:
        # Whatever the truth, it is below what a restart of every replica needs.
        return Verdict.ROLLBACK, "no_gain"
    if n >= s.max_windows:
        return Verdict.ROLLBACK, "inconclusive"
    return Verdict.CONTINUE, "inconclusive"


def out_of_time(v: CanaryVerdict) -> CanaryVerdict:
    """The verdict once a canary's time is up: `max_windows` poll windows since it could first
    be judged, whether or not they carried usable traffic. A canary the router sends (almost)
    nothing, an idle fleet, or failing scrapes would otherwise keep one replica on the candidate
    and the deployment's decisions on hold for as long as that lasts. Undecided is rolled back
    (the fleet keeps what it knows), with its reason: `insufficient_windows` when fewer than
    `min_windows` could be paired, else `inconclusive`."""
    if v.verdict is not Verdict.CONTINUE:
        return v
    return dataclasses.replace(v, verdict=Verdict.ROLLBACK)
