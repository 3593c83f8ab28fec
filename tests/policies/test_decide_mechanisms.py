"""The mechanisms behind the benchmark's misses (issue "Decide"): a mix shift is not an
acceptance change; exploration respects the burst rule and never runs on a timer; predictions
are over wall time (prefill included) and trials compare decode rate with decode rate."""

import dataclasses
import json
import math

import numpy as np
import pytest

from policies.decide import (
    PolicySettings,
    PolicyState,
    decide,
    initial_state,
    on_switch_done,
    predictions,
)
from policies.overhead import NonDecodeTime, wall_estimate, wall_rate
from policies.types import (
    Action,
    DecodeMoments,
    Estimate,
    Observation,
    Overrides,
    ProfilePrediction,
    Reason,
)
from tests.policies.driver import SPECS, Driver
from tests.policies.synth import PROFILES, Synth

S = PolicySettings()
ALPHAS = {"code": 0.9, "chat": 0.5}
CODE = {"code": 1.0}
CHAT = {"chat": 1.0}


def test_mix_shift_keeps_each_workloads_acceptance() -> None:
    """code -> chat -> code on a pinned 5-step: the overall accept length collapses and comes
    back with the mix, the per-workload levels never move. The mix change is a regime boundary
    (found as such), and code's acceptance is still known, and right, when code returns."""
    pin = Overrides(pin_profile="eagle5")
    dr = Driver("eagle5", seed=21)
    dr.run(120, 4, ALPHAS, CODE, pin)
    code_before = dr.state.model.accept.estimate("eagle5", "code")
    assert code_before is not None
    t_shift = dr.t
    dr.run(120, 4, ALPHAS, CHAT, pin)
    code_after = dr.state.model.accept.estimate("eagle5", "code")
    # Not discounted: its level and its data survived a whole phase of chat.
    assert code_after is not None
    assert code_after.mean == pytest.approx(code_before.mean, rel=0.01)
    changes = {f.subject for f in dr.state.findings if f.kind == "change" and f.t_s > t_shift}
    assert any(s.startswith("mix:") for s in changes)
    assert not any(s.startswith("accept:eagle5:") for s in changes)
    assert dr.state.last_accept_change_s is None
    # Back to code: the prediction for the code mix is the code level at once, not chat's.
    dr.run(30, 4, ALPHAS, CODE, pin)
    pred = {p.profile: p for p in predictions(dr.state)}["eagle5"]
    assert pred.accept_length is not None
    assert pred.accept_length.mean == pytest.approx(code_before.mean, rel=0.03)


def test_acceptance_change_of_one_workload_forgets_only_that_workload() -> None:
    pin = Overrides(pin_profile="eagle5")
    mix = {"code": 0.5, "chat": 0.5}
    dr = Driver("eagle5", seed=22)
    dr.run(150, 8, ALPHAS, mix, pin)
    code_before = dr.state.model.accept.estimate("eagle5", "code")
    t_change = dr.t
    dr.run(60, 8, {"code": 0.9, "chat": 0.2}, mix, pin)
    subjects = [f.subject for f in dr.state.findings if f.kind == "change" and f.t_s > t_change]
    assert "accept:eagle5:chat" in subjects
    assert "accept:eagle5:code" not in subjects
    chat = dr.state.model.accept.estimate("eagle5", "chat")
    code = dr.state.model.accept.estimate("eagle5", "code")
    assert code is not None and code_before is not None
    assert code.n > 0.5 * code_before.n  # kept its data
    assert chat is not None and chat.mean < 1.4  # re-learnt the new level (alpha 0.2: ~1.25)
    assert dr.state.last_accept_change_s is not None


def test_first_windows_of_a_burst_explore_nothing_and_a_short_burst_is_ridden_out() -> None:
    dr = Driver("eagle5", seed=23)
    dr.run(720, 1, ALPHAS, CODE)  # two quiet hours at one stream
    n_before = len(dr.switches())
    t_burst = dr.t
    burst = dr.run(60, 48, ALPHAS, CODE)  # ten minutes of 48 streams
    dr.run(120, 1, ALPHAS, CODE)
    assert [d for d in dr.switches() if d.t_s > t_burst] == [], [
        d.summary() for d in dr.switches()[n_before:]
    ]
    # The first window: a change in progress, not yet confirmed, and nothing is weighed on it.
    assert burst[0].reason is Reason.HOLD_BURST
    assert burst[0].diagnostics.get("change_suspected") == "batch"
    assert all(d.reason is not Reason.EXPLORE for d in burst)
    assert any(f.subject == "batch" and f.t_s > t_burst for f in dr.state.findings)


def test_no_exploration_on_a_timer() -> None:
    """Eight stationary hours: whatever is explored is explored while the regime is young
    enough for its value to grow; once weighed at the full horizon and declined, nothing is
    weighed again without a change."""
    dr = Driver("eagle5", seed=24)
    dr.run(8 * 360, 8, ALPHAS, {"code": 0.5, "chat": 0.5})
    late = [d for d in dr.switches() if d.t_s > S.explore_horizon_s + 2 * S.min_dwell_s]
    assert late == [], [d.summary() for d in late]
    assert dr.state.last_change_s is None
    last = dr.decisions[-1]
    declined = [k for k in last.diagnostics if k.startswith("explore_declined.")]
    untried = {p.name for p in PROFILES} - dr.state.tried
    assert {k.split(".", 1)[1] for k in declined} >= untried


def test_declined_exploration_is_weighed_again_after_a_change() -> None:
    dr = Driver("eagle5", seed=25)
    dr.run(3 * 360, 8, ALPHAS, CODE)
    declined = set(dr.state.explore_declined)
    assert declined  # something was weighed at the full horizon and declined
    late = dr.decisions[-60:]
    assert not any(k.startswith("explore_net_tokens.") for d in late for k in d.diagnostics)
    after = dr.run(150, 8, {"code": 0.3}, CODE)  # acceptance collapses: a change point
    assert dr.state.last_change_s is not None and dr.state.last_change_s > 3 * 3600 - 1
    weighed = {
        k.split(".", 1)[1] for d in after for k in d.diagnostics if k.startswith("explore_net")
    }
    assert declined & weighed, (declined, weighed)


# --------------------------------------------------------------------------------------------
# Prefill: predictions over wall time, trials in decode units

PREFILL_S_PER_REQUEST = 0.25  # seconds of prefill per finished request (prompt ~1.5k tokens)


def with_prefill(obs: Observation, t_s: float) -> Observation:
    """The window stretched by the prefill of its finished requests (no decode meanwhile)."""
    reqs = sum(w.requests or 0.0 for w in obs.workloads)
    m = obs.moments
    assert m is not None
    wall = m.sum_step_s + PREFILL_S_PER_REQUEST * reqs
    return dataclasses.replace(obs, t_s=t_s, window_s=wall)


def run_with_prefill(
    state: PolicyState, profile: str, t0: float, n: int, batch: float, seed: int
) -> tuple[PolicyState, float, float]:
    """n windows of `profile`; returns (state, end time, observed wall tok/s over them)."""
    syn = Synth(seed=seed, noise=0.02)
    t = t0
    tokens = wall = 0.0
    pin = Overrides(pin_profile=profile)
    for _ in range(n):
        raw = syn.window(SPECS[profile], t, batch, ALPHAS, CODE, window_s=10.0, out_len=400.0)
        obs = with_prefill(raw, t + 10.0)
        t = obs.t_s
        state, _ = decide(state, obs, t, S, pin)
        assert obs.decode_tokens is not None
        tokens += obs.decode_tokens
        wall += obs.window_s
    return state, t, tokens / wall


def test_prediction_over_wall_time_matches_observed_at_high_concurrency() -> None:
    state = initial_state(PROFILES, "baseline", 0.0, S)
    state, t, base_obs = run_with_prefill(state, "baseline", 0.0, 120, 64, seed=31)
    state = on_switch_done(state, "eagle5", True, 150.0, t + 150.0)
    state, t, e5_obs = run_with_prefill(state, "eagle5", t + 150.0, 120, 64, seed=32)
    preds = {p.profile: p for p in predictions(state)}
    e5, base = preds["eagle5"].tok_s, preds["baseline"].tok_s
    assert e5 is not None and base is not None
    # The running profile: what it serves over wall time, prefill included.
    assert e5.mean == pytest.approx(e5_obs, rel=0.05)
    # The other profile: its decode rate with the non-decode time per token learnt on this one.
    assert base.mean == pytest.approx(base_obs, rel=0.05)
    # Decode-only rates would be far off (prefill takes a large share at 64 streams).
    decode_only = state.model.predict("baseline").tok_s
    assert decode_only is not None and decode_only.mean > 1.2 * base_obs


def test_nondecode_time_math() -> None:
    assert wall_rate(100.0, None) == 100.0
    assert wall_rate(100.0, 0.005) == pytest.approx(1.0 / (0.01 + 0.005))
    e = wall_estimate(Estimate(100.0, 80.0, 125.0, 5.0), 0.002)
    assert e.low < e.mean < e.high and e.n == 5.0
    nd = NonDecodeTime(half_life_s=60.0, min_tokens=100.0)
    assert nd.per_token_s() is None
    obs = Observation(
        t_s=10.0,
        window_s=10.0,
        profile="baseline",
        decode_tokens=600.0,
        moments=DecodeMoments(600.0, 600.0, 6.0, 600.0, 6.0, 600.0),
    )
    assert nd.update(obs) == pytest.approx(4.0 / 600.0)
    assert nd.per_token_s() == pytest.approx(4.0 / 600.0)
    # Steps summing well over the window are not one poll window: rejected, nothing learnt.
    bad = dataclasses.replace(obs, window_s=3.0)
    assert nd.update(bad) is None and nd.rejected == 1
    assert NonDecodeTime.from_dict(nd.to_dict()) == nd


def test_trial_judges_decode_rate_not_reconnect_prefill() -> None:
    """After a switch, clients reconnect and prefill: wall tok/s is low for a while. The trial
    compares the decode rate with the decode rate predicted, so a profile that decodes as
    predicted is not rolled back for the prefill."""
    syn = Synth(seed=33, noise=0.02)
    true_decode = syn.true_tok_s(SPECS["eagle5"], 8, ALPHAS, CODE)
    state = initial_state(PROFILES, "baseline", 0.0, S)
    state.pending = {
        "target": "eagle5",
        "t_s": 0.0,
        "reason": Reason.SWITCH_PREDICTED_GAIN.value,
        "from": "baseline",
        "predicted": Estimate(true_decode, 0.97 * true_decode, 1.03 * true_decode).to_dict(),
        "predicted_wall": Estimate(true_decode, 0.97 * true_decode, 1.03 * true_decode).to_dict(),
    }
    state = on_switch_done(state, "eagle5", True, 150.0, 150.0)
    assert state.trial is not None and state.trial["kind"] == "decode"
    t = 150.0
    reasons = []
    for _ in range(12):
        raw = syn.window(SPECS["eagle5"], t, 8, ALPHAS, CODE)
        obs = dataclasses.replace(raw, t_s=t + 16.0, window_s=16.0)  # 6 s of prefill each
        t = obs.t_s
        assert obs.output_tok_s is not None and obs.output_tok_s < 0.7 * true_decode
        state, d = decide(state, obs, t, S, Overrides())
        reasons.append(d.reason)
    assert Reason.ROLLBACK_TRIAL_FAILED not in reasons
    assert state.trial is None  # judged (successful), not left hanging


@pytest.mark.parametrize(("left_ratio", "rolls_back"), [(None, True), (0.6, False), (1.1, True)])
def test_trial_fails_on_a_decode_shortfall_and_goes_back_only_to_a_profile_that_serves_more(
    left_ratio: float | None, rolls_back: bool
) -> None:
    """A trial decoding well below its prediction failed; a rollback pays a restart, so it
    goes back only where the profile it left was predicted to serve more than the trial does
    (its high end against the trial's mean, z standard errors down), or where that price is
    unknown (a switch recorded before it was kept). Otherwise the trial ends without a switch,
    and the estimates, holding its windows now, decide."""
    syn = Synth(seed=34, noise=0.02)
    true_decode = syn.true_tok_s(SPECS["eagle5"], 8, ALPHAS, CODE)
    state = initial_state(PROFILES, "baseline", 0.0, S)
    high = 1.4 * true_decode
    left = None if left_ratio is None else left_ratio * true_decode
    state.pending = {
        "target": "eagle5",
        "t_s": 0.0,
        "reason": Reason.SWITCH_PREDICTED_GAIN.value,
        "from": "baseline",
        "predicted": Estimate(high, 0.95 * high, 1.05 * high).to_dict(),
        "left": None if left is None else Estimate(left, 0.95 * left, left).to_dict(),
    }
    state = on_switch_done(state, "eagle5", True, 150.0, 150.0)
    t = 150.0
    ended = None
    for _ in range(12):
        t += 10.0
        state, d = decide(state, syn.window(SPECS["eagle5"], t, 8, ALPHAS, CODE), t, S, Overrides())
        if d.diagnostics.get("trial_outcome") == "failed":
            ended = d
            break
    assert ended is not None and state.trial is None
    if rolls_back:
        assert ended.reason is Reason.ROLLBACK_TRIAL_FAILED and ended.profile == "baseline"
    else:
        assert ended.action is Action.HOLD and state.running == "eagle5"
        assert ended.diagnostics["trial_kept_over"] == "baseline"
        assert ended.diagnostics["trial_kept_over_tok_s"] == pytest.approx(left)


def test_a_switch_records_what_the_profile_it_leaves_was_predicted_to_serve() -> None:
    """The rollback rule above needs the left profile's price at the switch: a predicted-gain
    switch records it (decode and wall), and the trial carries it."""
    hi, mix = {"chat": 0.85}, {"chat": 1.0}
    dr = Driver("eagle5", seed=7)
    dr.run(60, 8, hi, mix)
    dr.run(60, 8, hi, mix, Overrides(pin_profile="baseline"))
    assert dr.state.running == "baseline"
    pending = None
    for _ in range(80):
        d = dr.step(8, hi, mix)
        if d.reason is Reason.SWITCH_PREDICTED_GAIN:
            pending = dict(dr.state.pending or {})
            break
    assert pending is not None and pending["from"] == "baseline"
    left, wall = Estimate.from_dict(pending["left"]), Estimate.from_dict(pending["left_wall"])
    assert left.low <= left.mean <= left.high and 0 < wall.mean <= left.mean
    assert float(d.diagnostics["pred_tok_s.baseline"]) == pytest.approx(wall.mean)
    dr.run(20, 8, hi, mix)
    assert dr.state.running == "eagle5"


def test_new_state_fields_round_trip_and_old_states_load() -> None:
    dr = Driver("eagle5", seed=26)
    dr.run(100, 8, ALPHAS, {"code": 0.5, "chat": 0.5})
    d = dr.state.to_dict()
    again = PolicyState.from_dict(d)
    assert again.to_dict() == d
    old = {
        k: v
        for k, v in d.items()
        if k
        not in (
            "overhead",
            "last_model_change_s",
            "last_accept_change_s",
            "last_cycle_change_s",
            "stream_acc",
            "explore_declined",
            "boot_windows",
        )
    }
    st = PolicyState.from_dict(old)
    assert st.overhead.per_token_s() is None and st.explore_declined == {}
    # Saved before served_low: the highest bucket served stands in for the lowest.
    assert d["served_top"] and d["served_low"]
    before_low = {k: v for k, v in d.items() if k != "served_low"}
    assert PolicyState.from_dict(before_low).served_low == d["served_top"]
    assert math.isfinite(np.float64(st.start_s))


def test_a_move_of_system_state_leaves_profiles_not_running_to_exploration() -> None:
    """2-step ran, then 5-step (pinned, then free). The verify forward's per-token cost grows
    ten-fold (a change of system state): 5-step's step time moves ~1.9x and is detected.
    2-step's estimate predates that move: it is centred where the move would take it and its
    interval reaches back to its old level (its source says "moved"), so the policy does not
    switch on the old level (it would be ~50% too fast); the uncertainty is weighed by
    exploration (of 2-step, or of the baseline, whose data is as old), and after the run the
    explored profile's own new boot dominates its estimate (old step times weigh at most
    boot_carryover_max_windows windows), so the policy returns within its dwell and a few
    windows."""
    from tests.policies.synth import Cost

    hi, mix = {"chat": 0.85}, {"chat": 1.0}
    dr = Driver("eagle2", seed=5)
    dr.run(60, 8, hi, mix)
    dr.run(100, 8, hi, mix, Overrides(pin_profile="eagle5"))
    dr.run(30, 8, hi, mix)
    assert dr.state.running == "eagle5"
    n0 = len(dr.decisions)
    dr.syn.cost = Cost(per_tok_s=0.0005)
    dr.run(400, 8, hi, mix)
    assert any(m[1] > 1.5 for m in dr.state.cycle_moves)
    after = [(d.reason, d.profile, d.t_s) for d in dr.decisions[n0:] if d.action is Action.SWITCH]
    assert [r for r, _, _ in after] == [Reason.EXPLORE, Reason.SWITCH_PREDICTED_GAIN]
    assert after[0][1] in ("eagle2", "baseline") and after[1][1] == "eagle5"
    (_, _, t_go), (_, _, t_back) = after
    assert t_back - t_go <= dr.restart_s + S.min_dwell_s + 30 * dr.window_s
    # A profile whose data predates a move is predicted where the move takes it, tagged as
    # such, its interval reaching back to its old level.
    state = initial_state(PROFILES, "eagle5", 0.0, S)
    state.model = dr.state.model
    t2 = dr.state.model.cycle.last_t_s("eagle2")
    assert t2 is not None
    # A move of a verify forward after 2-step's last window (before 5-step's): only verify
    # forwards get it; a decode forward moves apart (FIELD.md's reboot: +50% against +8%).
    state.cycle_moves = [[t2 + 1.0, 2.0, 1.0]]
    moved = {p.profile: p for p in predictions(state)}
    assert moved["eagle2"].moved and not moved["eagle5"].moved
    assert not moved["baseline"].moved
    cyc = moved["eagle2"].cycle_s
    state.cycle_moves = []
    old = {p.profile: p for p in predictions(state)}["eagle2"].cycle_s
    assert cyc is not None and old is not None
    assert cyc.mean == pytest.approx(2.0 * old.mean)
    assert cyc.low <= old.mean and cyc.high >= cyc.mean
    state.cycle_moves = [[t2 + 1.0, 2.0, 0.0]]  # a decode forward's move
    assert not any(p.moved for p in predictions(state) if p.profile != "baseline")
    assert json.loads(json.dumps(state.to_dict()))["cycle_moves"] == state.cycle_moves
    assert PolicyState.from_dict(state.to_dict()).cycle_moves == state.cycle_moves


def test_a_rise_of_the_verify_alone_keeps_a_never_run_baseline_inside_its_bound() -> None:
    """2-step runs (pinned) at 64 streams and the baseline never does: it is only bounded,
    below by a third of 2-step's verify. Then the verify forward alone grows (a change of
    system state: FIELD.md's reboot moved the verify 1.5x and the decode 1.08x), here
    ~3.6x, past where a third of it is still below the decode. The rise is detected, and the
    bound reaches down to the verify before it, so the baseline's true step time stays inside
    it; without the move it would lie below (a random day: baseline priced at 454 tok/s in
    [240, 793] while it served 820). A fall of the verify, or a move of a decode forward,
    leaves the bound as the verify now sets it."""
    hi, mix = {"chat": 0.85}, {"chat": 1.0}
    pin = Overrides(pin_profile="eagle2")
    dr = Driver("eagle2", seed=7)
    dr.run(60, 64, hi, mix, pin)
    dr.syn.cost = dataclasses.replace(dr.syn.cost, verify_fixed_s=0.1)
    dr.run(120, 64, hi, mix, pin)
    assert "baseline" not in dr.state.tried
    rises = [m for m in dr.state.cycle_moves if m[2] and m[1] > 1.0]
    assert rises and math.prod(m[1] for m in rises) > 2.0
    truth = float(dr.syn.cost.step_s(64, 1))

    def bound(moves: list[list[float]]) -> ProfilePrediction:
        state = dr.state.copy()
        state.cycle_moves = moves
        return {p.profile: p for p in predictions(state)}["baseline"]

    now = bound(dr.state.cycle_moves)
    assert now.source == "bound" and now.cycle_s is not None
    assert now.cycle_s.low <= truth <= now.cycle_s.high
    alone = bound([])
    assert alone.cycle_s is not None and alone.cycle_s.low > truth
    assert alone.cycle_s.high == pytest.approx(now.cycle_s.high)
    for unmoved in ([[dr.t, 0.5, 1.0]], [[dr.t, 3.0, 0.0]]):
        c = bound(unmoved).cycle_s
        assert c is not None and c.low == pytest.approx(alone.cycle_s.low)


def test_a_canarys_windows_are_evidence_for_the_candidate_only() -> None:
    """observe_canary feeds a canary replica's window to the candidate's estimates, leaving
    the running profile, the switch history and the traffic alone; the running profile's own
    windows, unknown profiles and counter resets are refused. on_canary_started makes a new
    boot of the candidate (its old step times keep a few windows' weight)."""
    from policies.decide import observe_canary, on_canary_started

    dr = Driver("eagle5", seed=31)
    dr.run(60, 8, ALPHAS, CODE)
    state = dr.state
    before = (state.running, list(state.switches), state.model.concurrency.estimate())
    syn = Synth(seed=32)
    assert not state.model.cycle.has_data("eagle2")
    on_canary_started(state, "eagle2")
    for i in range(5):
        assert observe_canary(state, syn.window(SPECS["eagle2"], dr.t + 10 * i, 8, ALPHAS, CODE))
    assert state.model.cycle.has_data("eagle2")
    assert (state.running, state.switches, state.model.concurrency.estimate()) == before
    assert not observe_canary(state, syn.window(SPECS["eagle5"], dr.t + 60, 8, ALPHAS, CODE))
    reset = dataclasses.replace(
        syn.window(SPECS["eagle2"], dr.t + 70, 8, ALPHAS, CODE), counter_reset=True
    )
    assert not observe_canary(state, reset)
    with pytest.raises(ValueError, match="unknown profile"):
        on_canary_started(state, "nope")


@pytest.mark.parametrize(("chat_alpha", "chases"), [(0.4, False), (0.2, True)])
def test_alternating_traffic_makes_a_switch_pay_for_its_way_back(
    chat_alpha: float, chases: bool
) -> None:
    """Code and chat alternate every 30 minutes at 2 streams: 5-step wins code by far, baseline
    wins chat. Each chat regime alone would repay one restart into baseline; but over the
    traffic of the last hour baseline is worth less than 5-step, so the next code regime takes
    it back, and the chat regime's gain has to pay for both restarts. At a drafter of alpha 0.4
    on chat (baseline +14%) it does not: after the first cycle the policy stays on 5-step. At
    0.2 it does, and the policy follows every regime. (At 0.3, baseline +33%, following them
    and staying serve within 0.1% of each other: once past regimes say how long each lasts, the
    policy follows only some.)"""
    alphas = {"code": 0.9, "chat": chat_alpha}
    dr = Driver("eagle5", seed=41)
    for _ in range(6):
        dr.run(180, 2, alphas, {"code": 1.0})
        dr.run(180, 2, alphas, {"chat": 1.0})
    # The long-run window holds the mix too (both workloads), and survives a restart.
    assert set(dr.state.long_run.mix_w) == {"code", "chat"}
    assert PolicyState.from_dict(dr.state.to_dict()).long_run.mix_w == dr.state.long_run.mix_w
    priced = [d for d in dr.decisions if "return_cost_tokens" in d.diagnostics]
    assert priced and all(d.diagnostics["return_cost_tokens"] > 0 for d in priced)
    chased = [d for d in dr.switches() if d.reason is Reason.SWITCH_PREDICTED_GAIN and d.t_s > 5400]
    if chases:
        assert len(chased) >= 6
        assert any("return_cost_tokens" in d.diagnostics for d in chased)
    else:
        assert chased == []
        assert {d.reason for d in priced} == {Reason.HOLD_WITHIN_MARGIN}
        assert dr.state.running == "eagle5"


# Traffic alternating 2 <-> 8 streams every 25 minutes (fewer flips than the long-run rule's,
# and each regime too short to repay a 10-minute restart), one label: its acceptance is 0.7
# for the first four regimes (5-step best; explored in the first), then 0.4 from a flip
# on (new traffic under the same label, as when a batch job starts: baseline best at both
# concurrencies, by ~15%).
NEW_TRAFFIC_AT_S = 6000.0  # the fifth regime


@pytest.fixture(scope="module")
def new_traffic_same_label() -> Driver:
    dr = Driver("baseline", restart_s=600.0, seed=51)
    n = 0
    while dr.t < NEW_TRAFFIC_AT_S + 3600.0:
        alpha = 0.7 if dr.t < NEW_TRAFFIC_AT_S else 0.4
        dr.run(150, 2 if n % 2 == 0 else 8, {"chat": alpha}, CHAT)
        n += 1
    return dr


def test_an_acceptance_change_that_comes_with_a_concurrency_change_is_found(
    new_traffic_same_label: Driver,
) -> None:
    """The concurrency change makes the label's accept-length detector re-learn its noise; the
    level it held is compared with the new one, so the acceptance change is found and dated at
    the flip (before, the detector started over at the new level and 5-step's prediction
    stayed 70% above what it served for hours)."""
    dr = new_traffic_same_label
    assert dr.switches()[0].profile == "eagle5" and dr.switches()[0].t_s < NEW_TRAFFIC_AT_S
    assert dr.state.last_accept_change_s == pytest.approx(NEW_TRAFFIC_AT_S, abs=60.0)


def test_a_gain_that_outlasts_its_regime_pays_over_the_traffic_seen(
    new_traffic_same_label: Driver,
) -> None:
    """Baseline beats 5-step at both concurrencies, but no 25-minute regime repays the
    restart on its own. Over the traffic of the long-run window the gain holds in every
    regime: counted past the regime (`carry_tokens`), the switch pays, and the policy makes it
    within the first regime of the new traffic and stays."""
    dr = new_traffic_same_label
    later = [d for d in dr.switches() if d.t_s > NEW_TRAFFIC_AT_S]
    assert [d.profile for d in later] == ["baseline"]
    d = later[0]
    assert d.reason is Reason.SWITCH_PREDICTED_GAIN and d.t_s < NEW_TRAFFIC_AT_S + 1500.0
    carry = d.diagnostics["carry_tokens"]
    assert carry > 0 and d.diagnostics["net_tokens"] - carry < 0


@pytest.mark.parametrize("drift", [False, True])
def test_a_boot_that_matches_the_last_one_keeps_its_other_batch_sizes(drift: bool) -> None:
    """5-step served 2 streams, then 12; baseline ran; 5-step boots again at 12 streams. Its
    first windows at 12 match the previous boot's there, so the previous boot's 2-stream step
    times come back (a boot that served one batch size does not forget the others). If the
    new boot's step times drifted, they stay forgotten."""
    from tests.policies.synth import Cost

    pin5, pinb = Overrides(pin_profile="eagle5"), Overrides(pin_profile="baseline")
    dr = Driver("eagle5", seed=61)
    dr.run(60, 2, ALPHAS, CODE, pin5)
    dr.run(30, 12, ALPHAS, CODE, pin5)
    dr.run(40, 12, ALPHAS, CODE, pinb)
    if drift:
        dr.syn.cost = Cost(verify_fixed_s=0.0140)
    dr.run(40, 12, ALPHAS, CODE, pin5)
    assert dr.state.running == "eagle5"
    assert dr.state.model.cycle.support("eagle5", 12.0) == "bucket"
    back = dr.state.model.cycle.support("eagle5", 2.0)
    assert back == ("extrapolated" if drift else "bucket"), back


def test_a_new_boot_keeps_the_acceptance_of_workloads_it_does_not_serve() -> None:
    """5-step served code, baseline ran, and 5-step boots again on chat. A boot moves the
    system's costs, not what the drafter accepts: code's accept length stays an estimate,
    down-weighted to the boot's carryover (a wider interval), not a gap that only code served
    on this boot could fill (stress z6: after an exploration on the 8-stream chat, 5-step's
    accept length on math was a shallower chain's tail-model guess for the rest of the day)."""
    pin5, pinb = Overrides(pin_profile="eagle5"), Overrides(pin_profile="baseline")
    dr = Driver("eagle5", seed=62)
    dr.run(60, 4, ALPHAS, CODE, pin5)
    code = dr.state.model.accept.estimate("eagle5", "code")
    assert code is not None
    dr.run(40, 4, ALPHAS, CHAT, pinb)
    dr.run(40, 4, ALPHAS, CHAT, pin5)
    assert dr.state.running == "eagle5"
    kept = dr.state.model.accept.estimate("eagle5", "code")
    assert kept is not None and kept.mean == pytest.approx(code.mean)
    assert kept.high - kept.low > code.high - code.low
    assert dr.state.model.accept.estimate("eagle5", "chat") is not None


def test_a_profile_tried_only_far_from_the_batch_served_now_is_weighed_for_exploration() -> None:
    """Every profile ran at 64 streams only; then the load falls to 2 (a random MoE day:
    baseline, run at 64 only, was priced at 2 at 44% of its rate, band [6.5, 3527] tok/s, and
    never run again). A profile's price below (or above) every batch size it has served is its
    own data's extrapolation: it is weighed for exploration like an untried one. Once it has
    served such a batch size, that size is not new again, even after its data fade."""
    WEIGHED = ("explore_net_tokens.", "explore_declined.")
    dr = Driver("baseline", seed=27)
    for name in ("baseline", "eagle2", "eagle5"):
        dr.run(240, 64, ALPHAS, CODE, Overrides(pin_profile=name))
    assert dr.running == "eagle5" and dr.state.tried >= {"baseline", "eagle2"}
    assert dr.state.served_low["baseline"] == dr.state.served_top["baseline"]
    quiet = dr.run(720, 2, ALPHAS, CODE)
    weighed = {k.split(".", 1)[1] for d in quiet for k in d.diagnostics if k.startswith(WEIGHED)}
    assert {"baseline", "eagle2"} <= weighed, weighed
    # Served at 2 now (the explored, at least): not weighed again at 2, whatever the data's age.
    st = dr.state.copy()
    served_both = [n for n in ("baseline", "eagle2") if st.served_low[n] < st.served_top[n]]
    assert served_both, (st.served_low, st.served_top)
    from policies.decide import _choose

    st.regime_start_s = dr.t - 3600.0
    st.explore_declined.clear()
    diag: dict = {}
    _choose(st, dr.t, S, diag)
    again = {k.split(".", 1)[1] for k in diag if k.startswith(WEIGHED)}
    assert not again & set(served_both), diag


def test_a_change_in_acceptance_leaves_step_times_fresh_and_one_in_cycle_time_acceptance() -> None:
    """concurrency-cycle: a change point in 2-step's accept length on code (2.67 -> 2.74)
    widened the baseline's step-time interval at 64 streams from [774, 1272] to [647, 1880]
    tok/s, as if the step times had moved, and that width bought an exploration of baseline
    (worse in fact). Acceptance data are stale after a change in acceptance, step times after
    one in step time, each alone."""
    from policies.intake import _model_change

    dr = Driver("baseline", seed=28)
    for name in ("baseline", "eagle2", "eagle5"):
        dr.run(120, 8, ALPHAS, CODE, Overrides(pin_profile=name))
    fresh = {p.profile: p for p in predictions(dr.state)}
    assert not any("stale" in p.source for p in fresh.values())

    def after(what: str) -> dict[str, ProfilePrediction]:
        st = dr.state.copy()
        _model_change(st, dr.t + 1.0, what)
        return {p.profile: p for p in predictions(st)}

    acc = after("accept")
    assert "stale" not in acc["baseline"].source
    assert acc["baseline"].tok_s == fresh["baseline"].tok_s
    for chain in ("eagle2", "eagle5"):
        assert "stale" in acc[chain].source
        assert acc[chain].cycle_s == fresh[chain].cycle_s  # its step time is still fresh
        a, f = acc[chain].tok_s, fresh[chain].tok_s
        assert a is not None and f is not None and a.high - a.low > f.high - f.low
    cyc = after("cycle")
    for name in ("baseline", "eagle2", "eagle5"):
        assert "stale" in cyc[name].source
        assert cyc[name].accept_length == fresh[name].accept_length


def test_a_gain_too_small_to_repay_its_restart_leaves_exploration_to_be_weighed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stress a12: baseline runs at 100 tok/s; 5-step, run before, is predicted 4% above it,
    a gain over the switch margin that does not repay a restart in the regime expected; 2-step,
    never run, is priced 15% above with a wide band. The small sure gain holds no switch, and it
    must not end the decision before the exploration of 2-step is weighed (it ended it: 3-step
    was never tried on a12, 0.862 of oracle_dp)."""
    import policies.decide as dm

    st = initial_state(PROFILES, "baseline", 0.0, S)
    st.tried |= {"eagle5"}
    now = 7200.0
    crafted = {
        "baseline": Estimate(100.0, 99.0, 101.0, 100),
        "eagle5": Estimate(104.0, 103.0, 105.0, 100),
        "eagle2": Estimate(115.0, 90.0, 140.0, 10),
    }
    monkeypatch.setattr(
        dm,
        "_decode_predictions",
        lambda state, widen: [ProfilePrediction(n, e) for n, e in crafted.items()],
    )
    st, d = dm._choose(st, now, S, diag := {})
    assert diag["best"] == "eagle5" and diag["gain_tok_s"] > diag["margin_tok_s"]
    assert diag["net_tokens"] < 0  # the sure gain does not repay its restart
    assert d.action is Action.SWITCH and d.reason is Reason.EXPLORE and d.profile == "eagle2"
    # Without the untried profile the same gain holds, within the margin.
    st2 = initial_state(PROFILES, "baseline", 0.0, S)
    st2.tried |= {"eagle5", "eagle2"}
    crafted["eagle2"] = Estimate(95.0, 94.0, 96.0, 100)
    _, d2 = dm._choose(st2, now, S, {})
    assert d2.action is Action.HOLD and d2.reason is Reason.HOLD_WITHIN_MARGIN
    # Past a held gain an adaptive profile is not weighed: explored there and found worse, it
    # keeps its model's spread, whose margin held it for hours (reboot-midday, -4.4%).
    from tests.policies.test_hybrid_self_correction import HYB, TABLE

    st3 = initial_state(
        (*PROFILES, HYB), "baseline", 0.0, S, adaptive_tables={"hybrid": {"table": TABLE}}
    )
    st3.tried |= {"eagle5", "eagle2"}
    crafted["hybrid"] = Estimate(115.0, 90.0, 140.0, 10)
    _, d3 = dm._choose(st3, now, S, diag3 := {})
    assert d3.action is Action.HOLD and d3.reason is Reason.HOLD_WITHIN_MARGIN
    assert not any(k.endswith(".hybrid") and k.startswith("explore_") for k in diag3), diag3
    # ... while with no gain held it is (it is the one profile never run).
    crafted["eagle5"] = Estimate(95.0, 94.0, 96.0, 100)
    _, d4 = dm._choose(st3, now, S, {})
    assert d4.action is Action.SWITCH and d4.reason is Reason.EXPLORE and d4.profile == "hybrid"


def _weigh_eagle2(
    monkeypatch: pytest.MonkeyPatch,
    band: tuple[float, float],
    restart_s: float,
    candidate: str = "eagle2",
    **over: float,
) -> tuple[Action, dict]:
    """Baseline runs at 100 tok/s four hours into its regime, 5-step is known worse (90), and
    the candidate (2-step, or an adaptive profile), never run, is priced anywhere in `band`;
    every restart takes `restart_s`. What the policy does with the exploration of the
    candidate, and its diagnostics."""
    import policies.decide as dm
    from tests.policies.test_hybrid_self_correction import HYB, TABLE

    s = dataclasses.replace(S, **over)
    profiles = [p for p in PROFILES if p.name in ("baseline", "eagle5", candidate)]
    tables = {}
    if candidate == HYB.name:
        profiles.append(HYB)
        tables = {HYB.name: {"table": TABLE}}
    st = initial_state(profiles, "baseline", 0.0, s, adaptive_tables=tables)
    st.tried |= {"eagle5"}
    st.restart_s = dict.fromkeys(("baseline", "eagle5", candidate), restart_s)
    crafted = {
        "baseline": Estimate(100.0, 99.0, 101.0, 100),
        "eagle5": Estimate(90.0, 89.0, 91.0, 100),
        candidate: Estimate(sum(band) / 2, band[0], band[1], 10),
    }
    monkeypatch.setattr(
        dm,
        "_decode_predictions",
        lambda state, widen: [ProfilePrediction(n, e) for n, e in crafted.items()],
    )
    _, d = dm._choose(st, 4 * 3600.0, s, diag := {})
    assert d.action is Action.HOLD or (d.reason is Reason.EXPLORE and d.profile == candidate)
    return d.action, diag


def test_an_exploration_must_expect_to_clear_the_switch_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """concurrency-cycle: baseline, explored from 2-step at 64 streams on an expected net of
    about nothing, was 11% slower. A gain within the switch rule's fixed margin (margin_frac of
    the running rate) is one no prediction would switch for, so the information is worth the
    expected excess less that margin, over the useful part of the horizon."""
    net = "explore_net_tokens.eagle2"
    free, diag0 = _weigh_eagle2(monkeypatch, (90.0, 120.0), 120.0, margin_frac=0.0)
    held, diag = _weigh_eagle2(monkeypatch, (90.0, 120.0), 120.0)
    assert free is Action.SWITCH and held is Action.HOLD
    useful = diag["explore_horizon_s"] - 120.0 - S.min_dwell_s
    assert diag0[net] - diag[net] == pytest.approx(S.margin_frac * 100.0 * useful)
    assert diag["explore_breakeven_s.eagle2"] > diag0["explore_breakeven_s.eagle2"]
    # A wide enough band still clears it.
    assert _weigh_eagle2(monkeypatch, (70.0, 140.0), 120.0)[0] is Action.SWITCH
    # An adaptive profile is not charged it (what its price cannot see, its choice of tier per
    # batch, is in its favour): at the band 2-step was declined at, it is explored.
    hyb, diag_h = _weigh_eagle2(monkeypatch, (90.0, 120.0), 120.0, candidate="hybrid")
    assert hyb is Action.SWITCH
    assert diag_h["explore_net_tokens.hybrid"] == pytest.approx(diag0[net], rel=0.01)


def test_a_fleets_exploration_is_priced_on_its_canary(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet tries a candidate on one canary replica first (stress a7), so the
    restart, the dwell below the running rate and the way back if it is worse cost one
    replica's share; the others restart only if it wins. Priced as a whole-fleet restart, a
    15-minute restart left 2-step (85-125% of baseline) untried; on one replica of three it
    pays. On one server (share 1) the price is the whole restart, as before."""
    band = (85.0, 125.0)
    one, d1 = _weigh_eagle2(monkeypatch, band, 900.0)
    canary, d3 = _weigh_eagle2(monkeypatch, band, 900.0, explore_canary_share=1 / 3)
    assert one is Action.HOLD and canary is Action.SWITCH
    assert d3["explore_net_tokens.eagle2"] > d1["explore_net_tokens.eagle2"]
    # The others still restart if it wins: a narrow band (95-110%) does not pay on a canary
    # either.
    assert _weigh_eagle2(monkeypatch, (95.0, 110.0), 900.0, explore_canary_share=1 / 3)[0] is (
        Action.HOLD
    )
