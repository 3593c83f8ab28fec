import itertools
import json
import math
import os

import numpy as np
import pytest

from policies.changepoint import (
    LR_MIN_WINDOWS,
    ChangeMonitor,
    CusumDetector,
    CusumEvent,
    RegimeDurations,
    acceptance_finding,
    drift_finding,
)
from policies.decide import decide, initial_state
from policies.settings import PolicySettings
from policies.types import Overrides
from tests.policies.synth import E2, HYB, PROFILES, Synth

LONG = os.environ.get("SPECPILOT_LONG") == "1"


def stream(
    rng: np.random.Generator, n: int, level: float, sd: float, ar: float = 0.0
) -> np.ndarray:
    e = np.zeros(n)
    x = 0.0
    for i in range(n):
        x = ar * x + rng.standard_normal() * np.sqrt(1 - ar * ar)
        e[i] = x
    return level + sd * e


def first_change(det: CusumDetector, xs: np.ndarray, start: int = 0) -> int | None:
    for i, x in enumerate(xs):
        ev = det.update(float(x), float(i))
        if ev is not None and ev.kind == "change" and i >= start:
            return i
    return None


@pytest.mark.parametrize("moved", [False, True])
def test_a_level_that_moves_when_the_noise_is_relearnt_is_a_change(moved: bool) -> None:
    """A stream's noise shrinks tenfold at window 200 (a concurrency change: fifty times the
    verify steps behind each point), and there `relearn` is called. If the level moved there
    too (-10%, four sigmas of the old noise), the detector reports one change once the new
    scale rests on 20 windows, before = the old level, after = the new, dated after the last
    point before the relearn. If only the noise moved, nothing is reported: not in those 20
    windows, nor in the 300 after (the new, tighter scale raises no false alarm either)."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        before = stream(rng, 200, 2.0, 0.05)
        after = stream(rng, 320, 1.8 if moved else 2.0, 0.005)
        det = CusumDetector()
        assert first_change(det, before) is None
        det.relearn()
        events = []
        for i, x in enumerate(after):
            ev = det.update(float(x), 200.0 + i)
            if ev is not None and ev.kind == "change":
                events.append((i, ev))
        if not moved:
            assert events == [], seed
            continue
        assert len(events) == 1, seed
        i, ev = events[0]
        assert i == 19  # the 20th window after the relearn
        assert ev.before == pytest.approx(2.0, abs=0.03)
        assert ev.after == pytest.approx(1.8, abs=0.01)
        assert ev.since_s == 199.0
        # A change that dates back to the relearn, as _on_event dates it.
        assert ev.t_s - (ev.n - 1) == 200.0
        assert det.ref_mean is None  # compared once


def test_a_detector_relearnt_twice_keeps_its_first_reference() -> None:
    """Two concurrency changes ten windows apart: the reference is the level held before the
    first (the ten windows between are no regime of their own), and it survives a save."""
    rng = np.random.default_rng(5)
    det = CusumDetector()
    for i, x in enumerate(stream(rng, 100, 2.0, 0.05)):
        det.update(float(x), float(i))
    det.relearn()
    for i, x in enumerate(stream(rng, 10, 1.5, 0.01)):
        det.update(float(x), 100.0 + i)
    det.relearn()
    assert det.ref_mean == pytest.approx(2.0, abs=0.03) and det.ref_t == 99.0
    det = CusumDetector.from_dict(json.loads(json.dumps(det.to_dict())))
    found = [
        ev
        for i, x in enumerate(stream(rng, 30, 1.5, 0.01))
        if (ev := det.update(float(x), 110.0 + i)) is not None and ev.kind == "change"
    ]
    assert len(found) == 1 and found[0].before == pytest.approx(2.0, abs=0.03)
    # A detector saved before references were kept loads without one.
    old = {k: v for k, v in det.to_dict().items() if not k.startswith("ref_")}
    assert CusumDetector.from_dict(old).ref_mean is None


def test_a_reference_with_an_enormous_noise_scale_is_compared_without_overflow() -> None:
    """An accept-length stream of identical windows and then varying ones (hybrid-flip-tuned:
    a table's 0-step tier serving 1.0) leaves a long-run factor near 1e300 and a scale near
    9e299.
    Re-learnt, its comparison must neither raise (the square of the scales' ratio overflowed)
    nor report a change: a reference that noisy says nothing."""
    det = CusumDetector(
        n=30, mean=4.59, established=True, absdiff=0.11, n_diff=30, lr_factor=8.0e300, lr_n=30
    )
    assert det.sigma() > 1e299
    det.relearn()
    events = [det.update(1.0, 100.0 + i) for i in range(40)]
    assert [e.kind for e in events if e is not None] == ["established"]
    assert det.ref_mean is None


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_concurrency_change_relearns_a_fixed_chains_acceptance_and_restarts_an_adaptive_ones(
    adaptive: bool,
) -> None:
    """At a concurrency change, a fixed chain's per-workload accept-length detector keeps its
    level as a reference (the comparison that finds new traffic under the same label); an
    adaptive profile's is started afresh, as before: its accept length moves with the batch
    by design (its table picks another tier), which is no change of acceptance."""
    from policies.intake import _on_event

    spec = HYB if adaptive else E2
    s = PolicySettings()
    state = initial_state((*PROFILES, HYB), spec.name, 0.0, s)
    key = f"accept:{spec.name}:chat"
    for i in range(30):
        state.monitor.update(key, 2.4 + 0.01 * (i % 3), 10.0 * i)
    obs = Synth(seed=1).window(spec, 300.0, 8, {"chat": 0.7}, {"chat": 1.0})
    _on_event(state, "batch", CusumEvent("change", 300.0, 2.0, 8.0, 3), obs, s)
    det = state.monitor.detectors.get(key)
    if adaptive:
        assert det is None
    else:
        assert det is not None and det.ref_mean == pytest.approx(2.41, abs=0.01)


@pytest.mark.parametrize("step_sigmas", [5.0, 8.0, -5.0, 20.0, -40.0])
def test_step_change_detected_within_three_windows(step_sigmas: float) -> None:
    delays = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        xs = stream(rng, 300, 2.0, 0.05)
        xs[200:] += step_sigmas * 0.05
        i = first_change(CusumDetector(), xs)
        assert i is not None and i >= 200, (seed, i)
        delays.append(i - 200 + 1)
    assert max(delays) <= 3, delays


def test_a_change_is_dated_after_the_last_point_before_it_whatever_the_points_span() -> None:
    """Points that gather several windows each (a mix point waits for 8 finished requests): a
    change is dated after the last point before the ones that raised it, not n windows before
    the alarm (which, with 40-second points, would date it minutes late); decide's regime
    boundary starts at the first window after that point."""
    from policies.decide import initial_state
    from policies.intake import _on_event
    from policies.settings import PolicySettings
    from tests.policies.synth import Synth

    rng = np.random.default_rng(3)
    xs = stream(rng, 80, 0.5, 0.02)
    xs[60:] = 0.1 + 0.02 * rng.standard_normal(20)
    det = CusumDetector()
    ev = None
    for i, x in enumerate(xs):
        ev = det.update(float(x), 40.0 * i)
        if ev is not None and ev.kind == "change":
            break
    assert ev is not None and ev.kind == "change" and ev.n >= 1
    assert ev.since_s == pytest.approx(40.0 * 59)
    assert ev.t_s - (ev.n - 1) * 10.0 > ev.since_s + 40.0  # what 10 s windows would say
    state = initial_state(PROFILES, "eagle2", 0.0, PolicySettings())
    obs = Synth(seed=1).window(E2, ev.t_s, 8, {"chat": 0.7}, {"chat": 1.0})
    _on_event(state, "mix:chat", ev, obs, PolicySettings())
    assert state.regime_start_s == pytest.approx(40.0 * 59 + 10.0)


def test_field_size_changes_are_detected_fast() -> None:
    # Verify 20 -> 30 ms and acceptance 47% -> 19% with 2% window noise.
    for before, after in ((0.020, 0.030), (1.94, 1.38)):
        rng = np.random.default_rng(1)
        xs = stream(rng, 120, before, 0.02 * before)
        xs[100:] = stream(rng, 20, after, 0.02 * after)
        i = first_change(CusumDetector(), xs)
        assert i is not None and 100 <= i <= 102


def false_alarms(days: int, ar: float, seed0: int) -> float:
    total = 0
    for d in range(days):
        rng = np.random.default_rng(seed0 + d)
        mon = ChangeMonitor()
        streams = {
            "batch": stream(rng, 8640, 16.0, 0.4, ar),
            "accept:eagle2": stream(rng, 8640, 2.1, 0.03),
            "cycle:eagle2": stream(rng, 8640, 1.0, 0.02),
            "cycle:baseline": stream(rng, 8640, 1.0, 0.02),
        }
        for i in range(8640):
            for k, xs in streams.items():
                ev = mon.update(k, float(xs[i]), 10.0 * i)
                total += ev is not None and ev.kind == "change"
    return total / days


def test_false_alarms_below_one_per_simulated_day() -> None:
    days = 8 if LONG else 2
    assert false_alarms(days, 0.0, 100) < 1.0
    # Autocorrelated concurrency (closed-loop clients) must not alarm either.
    assert false_alarms(days, 0.3, 200) < 1.0


def test_false_alarms_through_decide_on_stationary_traffic() -> None:
    # The whole pipeline (synthetic windows -> estimators -> change detectors) for one day of
    # 10 s windows on one profile with stationary traffic: no change findings.
    syn = Synth(seed=42)
    s = PolicySettings(explore=False)
    state = initial_state(PROFILES, "eagle2", 0.0, s)
    n = 8640 if LONG else 2000
    changes = 0
    for i in range(1, n + 1):
        obs = syn.window(E2, 10.0 * i, 16, {"chat": 0.7, "code": 0.8}, {"chat": 0.6, "code": 0.4})
        state, _ = decide(state, obs, 10.0 * i, s, Overrides())
        changes += sum(f.kind == "change" for f in state.new_findings)
    assert changes * 8640 / n < 1.0


def test_monitor_history_and_reset_round_trip() -> None:
    mon = ChangeMonitor(warmup=3)
    rng = np.random.default_rng(0)
    for i, x in enumerate(stream(rng, 50, 2.0, 0.01)):
        mon.update("accept:x", float(x), float(i))
    assert mon.history["accept:x"] and abs(mon.history["accept:x"][0] - 2.0) < 0.05
    mon2 = ChangeMonitor.from_dict(json.loads(json.dumps(mon.to_dict())))
    assert mon2.to_dict() == mon.to_dict()
    mon.reset("accept:")
    assert "accept:x" not in mon.detectors and mon.history["accept:x"]


def test_expected_remaining_duration() -> None:
    r = RegimeDurations(prior_mean_s=1800.0, prior_strength=1.0)
    assert r.expected_remaining_s(0.0) == pytest.approx(1800.0)
    # A regime that has lasted longer is expected to last longer (censored observation).
    assert r.expected_remaining_s(3600.0) > r.expected_remaining_s(60.0)
    # A history of short bursts pulls the expectation down towards their length.
    for _ in range(10):
        r.record(120.0)
    assert r.expected_remaining_s(0.0) < 300.0
    assert RegimeDurations.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_a_history_of_long_regimes_lifts_the_burst_wait_and_one_of_bursts_keeps_it() -> None:
    """Ski rental with a learned distribution: at 40 s into a regime, with a restart of 170 s
    and 130 s of burst wait left, switching now beats waiting when every regime seen lasted an
    hour, not when half of them were 2-minute bursts, and not on too little history."""
    args = dict(age_s=40.0, wait_s=130.0, restart_s=170.0, gain_tok_s=45.0, cost_tok_s=150.0)
    long = RegimeDurations(prior_mean_s=1800.0, prior_strength=1.0)
    for _ in range(5):
        long.record(3600.0)
    assert long.switch_beats_waiting(**args, min_regimes=3)
    assert not long.switch_beats_waiting(**args, min_regimes=6)  # too little history
    bursty = RegimeDurations(prior_mean_s=1800.0, prior_strength=1.0)
    for _ in range(5):
        bursty.record(3600.0)
        bursty.record(120.0)
    assert not bursty.switch_beats_waiting(**args, min_regimes=3)
    # Bursts younger than the regime's age are not what it may still be: past 2 minutes the
    # same history clears a switch.
    assert bursty.switch_beats_waiting(**{**args, "age_s": 130.0, "wait_s": 40.0}, min_regimes=3)
    # A switch that does not repay its restart within any regime seen never beats waiting.
    assert not long.switch_beats_waiting(**{**args, "gain_tok_s": 1.0}, min_regimes=3)


def test_remaining_duration_follows_the_regimes_seen_once_there_are_enough() -> None:
    """Hour-long regimes, one after another: 50 minutes into the next one, about 10 minutes
    remain (the exponential model, memoryless, says an hour or more); before three regimes
    outlived the age, or past every one seen, the exponential model answers."""
    r = RegimeDurations(prior_mean_s=1800.0, prior_strength=1.0)
    for _ in range(5):
        r.record(3600.0)
    assert r.expected_remaining_s(3000.0) > 3000.0
    assert r.remaining_s(3000.0, 3) == pytest.approx((1800.0 + 5 * 600.0) / 6)
    assert r.remaining_s(3000.0, 6) == r.expected_remaining_s(3000.0)
    assert r.remaining_s(4000.0, 3) == r.expected_remaining_s(4000.0)


def test_findings_as_data() -> None:
    f = drift_finding("cycle:eagle2", 0.020, 0.030, 5.0, 0.05, "s")
    assert f is not None and f.kind == "drift" and f.ratio == pytest.approx(1.5)
    assert drift_finding("baseline_tok_s", 89.0, 82.0, 5.0, 0.05) is not None
    assert drift_finding("x", 1.0, 1.01, 5.0, 0.05) is None
    # The field's wrong config: accept rate 47% -> 19% on a 2-step chain.
    a = acceptance_finding("eagle2", [1.94, 1.95, 1.93], 1.38, 2, 0.6, 9.0)
    assert a is not None and a.kind == "acceptance_low"
    assert a.before == pytest.approx(0.47, abs=0.01) and a.after == pytest.approx(0.19)
    assert acceptance_finding("eagle2", [1.94], 1.80, 2, 0.6, 9.0) is None


def test_identical_windows_after_noisy_ones_do_not_overflow() -> None:
    """A regime of identical windows (spread 0) while the differences remember earlier noise: the
    autocorrelation estimate must not divide by the zero spread (a bench scenario hit this)."""
    det = CusumDetector()
    rng = np.random.default_rng(0)
    for i in range(30):
        det.update(100.0 + float(rng.normal(0, 1)), 10.0 * i)
    det.var = 0.0
    assert det.n >= 20 and det.n_diff >= 2 and det.absdiff > 0
    s = det.sigma()
    assert math.isfinite(s) and s > 0
    for i in range(30, 80):
        det.update(100.0, 10.0 * i)
    assert math.isfinite(det.sigma())


@pytest.mark.parametrize("constant_windows", [30, 100])
def test_a_stream_that_was_constant_learns_its_noise_when_it_starts_to_vary(
    constant_windows: int,
) -> None:
    """Identical windows first (one stream exactly: the concurrency of a single client, a
    workload's whole share of the mix), then traffic that varies around 5; 200 windows later
    its level steps to 4 (3.3 sigma). The jump out of the constant run is a change, the noise
    scale is learnt from the varying windows, and the step is the next change, found within a
    few windows. The first move out of the constant run used to be capped at a multiple of the
    zero scale: the scale stayed near zero, its long-run factor grew to 1e300, and the
    detector never alarmed again."""
    delays = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        det = CusumDetector()
        for i in range(constant_windows):
            det.update(1.0, float(i))
        xs = stream(rng, 210, 5.0, 0.3)
        xs[200:] -= 1.0
        changes = []
        for i, x in enumerate(xs):
            ev = det.update(float(x), float(constant_windows + i))
            if ev is not None and ev.kind == "change":
                changes.append(i)
            if i == 199:
                assert det.lr_factor < 3.0 and det.sigma() == pytest.approx(0.3, rel=0.3)
        assert len(changes) == 2 and changes[0] <= 2 and changes[1] >= 200, (seed, changes)
        delays.append(changes[1] - 200 + 1)
    assert max(delays) <= 6, delays


def test_a_piecewise_constant_stream_finds_every_move() -> None:
    """A stream that is exactly constant between its moves (the concurrency of a closed-loop
    load: 1, 8, 2, 64 and 1 streams), each move straddled by one window that holds part of
    both levels, and regimes of 8 windows (shorter than the 20 in which a stream's first
    varying regime learns the autocorrelation of its noise: this one has none to learn). Every
    move is a change, found within two windows of the straddling one."""
    levels = [1.0, 8.0, 2.0, 64.0, 1.0]
    det = CusumDetector()
    xs: list[float] = [levels[0]] * 30
    moves = []
    for a, b in itertools.pairwise(levels):
        moves.append(len(xs))
        xs.append(a + 0.3 * (b - a))  # the window that straddles the move
        xs += [b] * 8
    changes = []
    for i, x in enumerate(xs):
        ev = det.update(x, 30.0 * i)
        if ev is not None and ev.kind == "change":
            changes.append(i)
    assert len(changes) == len(moves), (changes, moves)
    for i, m in zip(changes, moves, strict=True):
        assert m <= i <= m + 2, (changes, moves)
    assert det.absdiff == 0.0 and det.mean == 1.0


def test_a_blind_detector_saved_before_constant_streams_were_handled_starts_its_scale_afresh() -> (
    None
):
    """A warm start's state from before the fix: the `batch` detector, never reset, saved with
    the scale a capped move out of a constant run left (1e-301, its long-run factor 1e301).
    Loaded, its scale starts afresh and the next move of the concurrency is a change; a state
    saved with a real scale, and one saved after the fix, load as they were."""
    det = CusumDetector()
    for i in range(30):
        det.update(2.0, 30.0 * i)
    saved = det.to_dict()
    del saved["skip_diffs"]
    saved.update(absdiff=5e-302, n_diff=40, lr_factor=3e301, lr_n=50)
    restored = CusumDetector.from_dict(json.loads(json.dumps(saved)))
    assert (restored.absdiff, restored.n_diff, restored.lr_factor, restored.lr_n) == (0, 0, 1, 0)
    events = [restored.update(x, 900.0 + 30.0 * i) for i, x in enumerate([2.0, 20.0, 32.0, 32.0])]
    assert any(ev is not None and ev.kind == "change" for ev in events)

    real = dict(saved, absdiff=0.05, lr_factor=1.3)
    assert CusumDetector.from_dict(real).to_dict() == {**real, "skip_diffs": 0}
    after_fix = dict(saved, skip_diffs=0)
    assert CusumDetector.from_dict(after_fix).to_dict() == after_fix


def test_armed_says_when_a_point_may_alarm() -> None:
    """A regime's warm-up absorbs its points, a move among them too: `armed` says when it is
    over. A stream that varies learns its noise's autocorrelation in its first regime
    (LR_MIN_WINDOWS points); one that has not varied needs only the warm-up."""
    rng = np.random.default_rng(3)
    noisy = CusumDetector(warmup=6)
    for i in range(LR_MIN_WINDOWS):
        assert not noisy.armed
        assert noisy.update(10.0 + float(rng.normal(0.0, 0.1)), 10.0 * i) is None or i == 5
    assert noisy.armed
    flat = CusumDetector(warmup=6)
    for i in range(6):
        assert not flat.armed
        flat.update(4.0, 10.0 * i)
    assert flat.armed
    # Armed, a move alarms within a few points; unarmed, the same move is absorbed.
    for det, t0 in ((noisy, 10.0 * LR_MIN_WINDOWS), (flat, 60.0)):
        ev = [det.update(20.0, t0 + 10.0 * i) for i in range(4)]
        assert any(e is not None and e.kind == "change" for e in ev)
    early = CusumDetector(warmup=6)
    for i in range(8):
        early.update(10.0 + float(rng.normal(0.0, 0.1)), 10.0 * i)
    assert not early.armed
    ev = [early.update(20.0, 80.0 + 10.0 * i) for i in range(4)]
    assert all(e is None or e.kind != "change" for e in ev)
