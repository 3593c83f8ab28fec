"""Trial assessment: did a switch deliver what was predicted?

Owns the verdict on one switch's observed tok/s windows against the prediction made when the
switch was decided (pending -> running -> successful | failed | inconclusive; Argo Rollouts /
Flagger analysis are the model). The thresholds are named fields of TrialSettings.

Verdict: with m the mean and se the standard error of the observed windows, the bar is
predicted.low x (1 - tolerance). Failed: m + z se is below the bar (confidently worse than the
pessimistic end of the prediction). Successful: m - z se is at or above it. Otherwise running,
until max_windows, then inconclusive. Where a window ran a smaller batch than the prediction's,
its rate says only that the rate at the prediction's batch lies between it and it scaled up by
the ratio of the batch sizes (a step takes no less time for more sequences): the caller passes
those upper ends as `upper`, and the trial fails only when they fail too.

Must not: decide a rollback (decide.py does), read clocks, or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from policies.types import Estimate


class TrialOutcome(StrEnum):
    PENDING = "pending"  # no usable window yet
    RUNNING = "running"  # some windows, no verdict yet
    SUCCESSFUL = "successful"
    FAILED = "failed"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class TrialSettings:
    """Named thresholds of a trial (PolicySettings carries one)."""

    # Windows needed before any verdict: one 10 s window after a restart is dominated by
    # clients reconnecting and prefill; three give a mean and a spread.
    min_windows: int = 3
    # Windows after which an undecided trial is called inconclusive (3 minutes of 10 s polls:
    # longer holds the policy still for no more information than its estimators already get).
    max_windows: int = 18
    # Relative slack below the prediction's low end before a trial can fail: tok/s observed
    # includes prefill and scheduling the cycle model leaves out.
    tolerance: float = 0.10
    # Standard errors of the observed mean a verdict must clear (~97.5% one-sided).
    z: float = 2.0


def _mean_se(windows: Sequence[float]) -> tuple[int, float, float]:
    xs = [float(x) for x in windows if math.isfinite(x) and x >= 0]
    n = len(xs)
    if n == 0:
        return 0, math.nan, math.nan
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return n, m, math.sqrt(var / n)


def assess_trial(
    predicted: Estimate,
    observed_tok_s_windows: Sequence[float],
    settings: TrialSettings,
    upper: Sequence[float] | None = None,
) -> TrialOutcome:
    """Verdict on a trial so far (see the module docstring). Non-finite or negative windows are
    ignored (a failed scrape is not evidence). `upper`: the windows' upper ends at the
    prediction's batch, one per window (default: the windows themselves)."""
    n, m, se = _mean_se(observed_tok_s_windows)
    if n == 0:
        return TrialOutcome.PENDING
    if n < settings.min_windows:
        return TrialOutcome.RUNNING
    bar = predicted.low * (1.0 - settings.tolerance)
    n_up, m_up, se_up = _mean_se(upper) if upper is not None else (n, m, se)
    if n_up > 0 and m_up + settings.z * se_up < bar:
        return TrialOutcome.FAILED
    if m - settings.z * se >= bar:
        return TrialOutcome.SUCCESSFUL
    if n >= settings.max_windows:
        return TrialOutcome.INCONCLUSIVE
    return TrialOutcome.RUNNING


def beats(observed_tok_s_windows: Sequence[float], rate: float, settings: TrialSettings) -> bool:
    """Whether the windows' mean, `settings.z` standard errors down, is at or above `rate`
    (at least `min_windows` of them): confidently serving more than it."""
    n, m, se = _mean_se(observed_tok_s_windows)
    return n >= settings.min_windows and m - settings.z * se >= rate
