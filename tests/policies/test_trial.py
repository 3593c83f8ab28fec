import pytest

from policies.trial import TrialOutcome, TrialSettings, assess_trial, beats
from policies.types import Estimate

PRED = Estimate(100.0, 90.0, 110.0)
S = TrialSettings(min_windows=3, max_windows=6, tolerance=0.1, z=2.0)


@pytest.mark.parametrize(
    ("windows", "outcome"),
    [
        ([], TrialOutcome.PENDING),
        ([float("nan")], TrialOutcome.PENDING),
        ([100.0, 101.0], TrialOutcome.RUNNING),
        ([99.0, 101.0, 100.0], TrialOutcome.SUCCESSFUL),
        ([60.0, 62.0, 61.0], TrialOutcome.FAILED),
        ([50.0, 120.0, 80.0], TrialOutcome.RUNNING),
        ([50.0, 120.0, 80.0, 60.0, 110.0, 85.0], TrialOutcome.INCONCLUSIVE),
    ],
)
def test_trial_table(windows: list[float], outcome: TrialOutcome) -> None:
    assert assess_trial(PRED, windows, S) is outcome


def test_bar_is_the_low_end_less_tolerance() -> None:
    # Bar = 90 * 0.9 = 81: steady 82 passes, steady 80 fails.
    assert assess_trial(PRED, [82.0, 82.0, 82.0], S) is TrialOutcome.SUCCESSFUL
    assert assess_trial(PRED, [80.0, 80.0, 80.0], S) is TrialOutcome.FAILED


def test_windows_at_a_smaller_batch_fail_only_when_their_upper_ends_fail() -> None:
    # Bar 81. Steady 70 fails on its own; scaled up to the prediction's batch (x 1.25: 87.5)
    # it might have met the bar, so the trial runs on; scaled to 75 it still fails.
    raw = [70.0, 70.0, 70.0]
    assert assess_trial(PRED, raw, S) is TrialOutcome.FAILED
    assert assess_trial(PRED, raw, S, [87.5, 87.5, 87.5]) is TrialOutcome.RUNNING
    assert assess_trial(PRED, raw, S, [75.0, 75.0, 75.0]) is TrialOutcome.FAILED
    # Success still needs the windows themselves at the bar.
    assert assess_trial(PRED, [82.0] * 3, S, [90.0] * 3) is TrialOutcome.SUCCESSFUL


def test_beats_needs_enough_windows_and_a_confident_margin() -> None:
    s = TrialSettings()
    assert not beats([120.0, 121.0], 100.0, s)  # fewer than min_windows
    assert beats([120.0, 121.0, 119.0], 100.0, s)
    assert not beats([120.0, 80.0, 160.0], 100.0, s)  # mean above, but not z se above
    assert not beats([90.0, 91.0, 89.0], 100.0, s)
