import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.changepoint import LR_MIN_WINDOWS
from policies.decide import (
    PolicySettings,
    PolicyState,
    begin_manual_switch,
    budget_exhausted,
    decide,
    explore_cap_s,
    found_serving,
    initial_state,
    on_start_up,
    on_switch_done,
    predictions,
)
from policies.state import restart_time
from policies.types import Action, DecodeMoments, Observation, Overrides, Reason
from tests.policies.driver import Driver
from tests.policies.synth import E5, PROFILES, Synth

HI = {"chat": 0.85}
LO = {"chat": 0.3}
MIX = {"chat": 1.0}
S = PolicySettings()


def warmed(start: str = "eagle5", n: int = 60, seed: int = 0) -> Driver:
    dr = Driver(start, seed=seed)
    dr.run(n, 8, HI, MIX)
    return dr


@pytest.fixture(scope="module")
def warm_state() -> dict:  # type: ignore[type-arg]
    """A state past its dwell with estimates of eagle5 and baseline (JSON, copied per test)."""
    dr = Driver("baseline", seed=1)
    dr.run(120, 8, HI, MIX)
    assert dr.state.running == "eagle5"
    return dr.state.to_dict()


def obs_for(state: PolicyState, t: float, seed: int = 0) -> Observation:
    spec = state.specs[state.running]
    return Synth(seed=seed).window(spec, t, 8, HI, MIX)


T = 5000.0


@pytest.mark.parametrize(
    ("overrides", "obs_kind", "reason", "action", "target"),
    [
        (Overrides(paused_until_s=T + 60), "ok", Reason.HOLD_PAUSED, Action.HOLD, "eagle5"),
        (Overrides(paused_until_s=T + 60), "none", Reason.HOLD_PAUSED, Action.HOLD, "eagle5"),
        (
            Overrides(paused_until_s=T + 60, pin_profile="baseline"),
            "ok",
            Reason.HOLD_PAUSED,
            Action.HOLD,
            "eagle5",
        ),
        (Overrides(pin_profile="baseline"), "ok", Reason.SWITCH_PINNED, Action.SWITCH, "baseline"),
        (
            Overrides(pin_profile="baseline"),
            "none",
            Reason.SWITCH_PINNED,
            Action.SWITCH,
            "baseline",
        ),
        (Overrides(pin_profile="eagle5"), "ok", Reason.HOLD_PINNED, Action.HOLD, "eagle5"),
        (
            Overrides(pin_profile="baseline", pin_until_s=T - 1),
            "ok",
            Reason.HOLD_BEST,
            Action.HOLD,
            "eagle5",
        ),
        (Overrides(pin_profile="nope"), "ok", Reason.HOLD_PINNED, Action.HOLD, "eagle5"),
        (
            Overrides(blocked_reason="unknown outcome"),
            "ok",
            Reason.HOLD_BLOCKED,
            Action.HOLD,
            "eagle5",
        ),
        # Blocked: nothing acts (the shell refuses a pin's switch too) until a person clears it.
        (
            Overrides(pin_profile="baseline", blocked_reason="x"),
            "ok",
            Reason.HOLD_BLOCKED,
            Action.HOLD,
            "eagle5",
        ),
        (
            Overrides(paused_until_s=T + 60, blocked_reason="x"),
            "ok",
            Reason.HOLD_BLOCKED,
            Action.HOLD,
            "eagle5",
        ),
        (Overrides(), "none", Reason.HOLD_SCRAPE_FAILED, Action.HOLD, "eagle5"),
        (Overrides(), "idle", Reason.HOLD_NO_TRAFFIC, Action.HOLD, "eagle5"),
        (Overrides(), "unknown", Reason.HOLD_INSUFFICIENT_DATA, Action.HOLD, "eagle5"),
        (Overrides(), "ok", Reason.HOLD_BEST, Action.HOLD, "eagle5"),
    ],
)
def test_decision_table(warm_state, overrides, obs_kind, reason, action, target) -> None:  # type: ignore[no-untyped-def]
    state = PolicyState.from_dict(warm_state)
    obs: Observation | None = obs_for(state, T)
    if obs_kind == "none":
        obs = None
    elif obs_kind == "idle":
        obs = Observation(
            t_s=T, window_s=10, profile="eagle5", moments=DecodeMoments(0, 0, 0, 0, 0, 0)
        )
    elif obs_kind == "unknown":
        obs = Observation(t_s=T, window_s=10, profile="mystery")
    state, d = decide(state, obs, T, S, overrides)
    assert (d.reason, d.action, d.profile) == (reason, action, target), d.summary()
    assert isinstance(d.reason, Reason)
    json.dumps(dict(d.diagnostics))


def test_cooldown_inside_dwell_and_insufficient_data_after() -> None:
    """The dwell follows a restart on record (here a start reported through on_switch_done, as
    the daemon reports its own start-up start)."""
    state = initial_state(PROFILES, "eagle5", 0.0, S)
    state = on_switch_done(state, "eagle5", True, 60.0, 0.0)
    assert not found_serving(state)
    syn = Synth(seed=2)
    state, d = decide(state, syn.window(E5, 10.0, 8, HI, MIX), 10.0, S, Overrides())
    assert d.reason is Reason.HOLD_COOLDOWN and d.diagnostics["dwell_left_s"] == pytest.approx(290)
    state, d = decide(state, syn.window(E5, 400.0, 8, HI, MIX), 400.0, S, Overrides())
    assert d.reason is Reason.HOLD_INSUFFICIENT_DATA


@pytest.mark.parametrize("start", ["found", "booted", "restarted"])
def test_explores_from_baseline_to_the_most_revealing_profile(start: str) -> None:
    """A server found serving (nothing restarted or changed since the policy began) is explored
    as soon as its traffic's change detectors are past their warm-up (a restart before then
    could hide a move of the traffic inside it): its traffic predates the controller, so
    neither the rest of the dwell nor the burst wait applies. After a boot the controller saw
    (its own start-up start, on_start_up) or a restart on record the dwell does; either way the
    policy never switches on a timer alone."""
    dr = Driver("baseline", seed=3)
    if start == "booted":
        dr.state = on_start_up(dr.state, 0.0)
        assert dr.state.boot_seen and PolicyState.from_dict(dr.state.to_dict()).boot_seen
    elif start == "restarted":
        dr.state = on_switch_done(dr.state, "baseline", True, 60.0, 0.0)
    assert not found_serving(dr.state)  # nothing learnt yet, or a boot on record
    old = dr.state.to_dict()
    del old["boot_seen"]  # a state saved before it was kept: taken as seen, the dwell holds
    assert PolicyState.from_dict(old).boot_seen
    dr.run(120, 8, HI, MIX)
    sw = dr.switches()
    assert [(d.reason, d.profile) for d in sw] == [(Reason.EXPLORE, "eagle5")]
    if start != "found":
        assert sw[0].t_s >= S.min_dwell_s
    else:
        assert sw[0].t_s < S.min_dwell_s
        # The synth's batch size varies: its detector learns its noise's autocorrelation first.
        assert sw[0].t_s >= LR_MIN_WINDOWS * dr.window_s
        held = {d.reason for d in dr.decisions if d.t_s < sw[0].t_s}
        assert held <= {Reason.HOLD_INSUFFICIENT_DATA, Reason.HOLD_COOLDOWN}
    # Once there, 2-step is known by truncation and the policy holds the best profile.
    assert dr.decisions[-1].reason is Reason.HOLD_BEST
    preds = {p.profile: p for p in predictions(dr.state)}
    assert preds["eagle2"].source.startswith("truncation")
    assert preds["eagle2"].tok_s is not None and preds["eagle5"].tok_s is not None
    assert preds["eagle5"].tok_s.mean > preds["eagle2"].tok_s.mean > preds["baseline"].tok_s.mean  # type: ignore[union-attr]


def test_acceptance_collapse_switches_to_baseline_and_flags_it() -> None:
    dr = Driver("baseline", seed=4)
    dr.run(200, 8, HI, MIX)
    assert dr.state.running == "eagle5"
    t_change = dr.t
    dr.run(200, 8, LO, MIX)
    sw = [d for d in dr.switches() if d.t_s > t_change]
    assert sw and sw[0].reason is Reason.SWITCH_PREDICTED_GAIN and sw[0].profile == "baseline"
    # Detected within 3 windows, switched once the regime outlived a restart (burst rule).
    changes = [f for f in dr.state.findings if f.kind == "change" and f.subject == "accept:eagle5"]
    assert changes and changes[0].t_s - t_change <= 30
    assert sw[0].t_s - t_change >= S.restart_prior_s * S.burst_wait_factor - 30
    assert sw[0].t_s - t_change <= 600
    low = [f for f in dr.state.findings if f.kind == "acceptance_low"]
    assert low and low[0].after < 0.6 * low[0].before
    assert len(dr.switches()) == 2  # explore in, one switch out: no flapping


def test_burst_shorter_than_a_restart_is_ridden_out() -> None:
    dr = Driver("baseline", seed=5)
    dr.run(200, 8, HI, MIX)
    n_before = len(dr.switches())
    # Acceptance collapses for 100 s (less than a restart) and comes back.
    dr.run(10, 8, LO, MIX)
    dr.run(100, 8, HI, MIX)
    assert len(dr.switches()) == n_before
    assert Reason.HOLD_BURST in {d.reason for d in dr.decisions[-110:]}


def test_failed_start_rolls_back_to_the_last_good_profile() -> None:
    dr = Driver("baseline", seed=6)
    dr.fail_next_start = True
    dr.run(120, 8, HI, MIX)
    reasons = [d.reason for d in dr.switches()]
    assert reasons[:2] == [Reason.EXPLORE, Reason.ROLLBACK_START_FAILED]
    assert dr.switches()[1].profile == "baseline"
    assert "eagle5" in dr.state.failed
    # The failed profile is backed off: no automatic retry within the backoff.
    assert all(d.profile != "eagle5" for d in dr.switches()[2:])


@pytest.mark.parametrize(
    "overrides",
    [Overrides(paused_until_s=T + 3600), Overrides(pin_profile="baseline")],
    ids=["paused", "pinned"],
)
def test_a_failed_start_is_rolled_back_under_a_pause_or_a_pin(warm_state, overrides) -> None:  # type: ignore[no-untyped-def]
    """An operator's switch that fails to start during a pause, or a pin's, leaves nothing
    serving: the way back to the last good profile is safety, not a decision a pause or a pin
    overrides (the server stayed down for the whole pause)."""
    state = PolicyState.from_dict(warm_state)
    t = T + 10.0
    begin_manual_switch(state, "baseline", t)
    t += 60.0
    state = on_switch_done(state, "baseline", False, 60.0, t)
    t += 10.0
    state, d = decide(state, None, t, S, overrides)
    assert (d.action, d.reason, d.profile) == (
        Action.SWITCH,
        Reason.ROLLBACK_START_FAILED,
        "eagle5",
    )
    assert d.diagnostics["failed_profile"] == "baseline"


def test_a_start_the_shell_already_rolled_back_is_a_new_boot_inside_its_dwell(warm_state) -> None:  # type: ignore[no-untyped-def]
    """A switch to baseline fails to start and the shell brings eagle5 back itself: the next
    window comes from eagle5. That is a boot of eagle5 (the failed restart and this one both
    just happened), not a licence to switch again at once: the policy holds in its dwell
    (found by test_invariants: it switched to another profile on the next tick)."""
    state = PolicyState.from_dict(warm_state)
    t = T + 10.0
    state, d = decide(state, obs_for(state, t), t, S, Overrides(pin_profile="baseline"))
    assert (d.action, d.profile) == (Action.SWITCH, "baseline")
    t += 60.0
    state = on_switch_done(state, "baseline", False, 60.0, t)
    assert state.rollback_to == "eagle5"
    t += 10.0
    state, d = decide(state, obs_for(state, t), t, S, Overrides())
    assert (d.action, d.reason) == (Action.HOLD, Reason.HOLD_COOLDOWN)
    assert state.rollback_to is None and state.last_switch_s == t
    assert d.diagnostics["restored_by_shell"] == "eagle5"


def test_trial_failure_rolls_back() -> None:
    # eagle5 was measured great, then the policy moved to baseline (pinned); eagle5's
    # acceptance has since collapsed, but its old estimate says it is far better.
    dr = Driver("eagle5", seed=7)
    dr.run(60, 8, HI, MIX)
    dr.run(60, 8, HI, MIX, Overrides(pin_profile="baseline"))
    assert dr.state.running == "baseline"
    dr.run(80, 8, LO, MIX)  # the switch back is predicted from stale data; reality is LO
    reasons = [d.reason for d in dr.switches()]
    assert Reason.SWITCH_PREDICTED_GAIN in reasons
    assert reasons[reasons.index(Reason.SWITCH_PREDICTED_GAIN) + 1] is Reason.ROLLBACK_TRIAL_FAILED


@pytest.mark.parametrize("spent", [1, 2])
def test_an_exploration_needs_room_in_the_budget_for_the_way_back(spent: int) -> None:
    """The exploration from baseline (test above) with restarts already spent this hour: with
    one, two are left (there and back) and it goes; with two, only one is left: going would
    leave no restart to return from a disappointing run, so it waits (HOLD_BUDGET) while a
    switch on a prediction would still be allowed that one."""
    dr = Driver("baseline", seed=3)
    dr.state.switches += [
        {"t_s": -10.0 * i, "from": "x", "to": "y", "reason": "explore"} for i in range(spent)
    ]
    dr.run(120, 8, HI, MIX)  # 20 minutes: nothing spent ages out of the hour
    sw = [(d.reason, d.profile) for d in dr.switches()]
    if spent == 1:
        assert sw == [(Reason.EXPLORE, "eagle5")]
    else:
        assert sw == []
        assert dr.decisions[-1].reason is Reason.HOLD_BUDGET
        assert not budget_exhausted(dr.state, dr.t, S)
        assert budget_exhausted(dr.state, dr.t, S, round_trip=True)


def test_budget_and_no_flap(warm_state) -> None:  # type: ignore[no-untyped-def]
    # A state where baseline is predicted far better (eagle5's acceptance collapsed).
    dr = Driver("baseline", seed=8)
    dr.run(200, 8, HI, MIX)
    dr.run(12, 8, LO, MIX)
    base = dr.state.to_dict()
    t = dr.t + 300.0
    obs_syn = Synth(seed=9)

    def go(mutate) -> Reason:  # type: ignore[no-untyped-def]
        state = PolicyState.from_dict(base)
        mutate(state)
        for i in range(1, 40):
            state, d = decide(
                state, obs_syn.window(E5, t + 10 * i, 8, LO, MIX), t + 10 * i, S, Overrides()
            )
            if d.action is Action.SWITCH or d.reason in (Reason.HOLD_BUDGET, Reason.HOLD_NO_FLAP):
                return d.reason
        return d.reason

    assert go(lambda s: None) is Reason.SWITCH_PREDICTED_GAIN

    def spend(s: PolicyState) -> None:
        s.switches += [
            {"t_s": t - 100.0 * i, "from": "x", "to": "y", "reason": "explore"} for i in range(1, 4)
        ]

    assert go(spend) is Reason.HOLD_BUDGET

    def flap(s: PolicyState) -> None:
        s.switches.append(
            {
                "t_s": t - 400.0,
                "from": "baseline",
                "to": "eagle5",
                "reason": "switch_predicted_gain",
            }
        )
        s.last_change_s = t - 1000.0  # no change point since that switch

    assert go(flap) is Reason.HOLD_NO_FLAP

    def failed_trial(s: PolicyState) -> None:
        # baseline's trial failed and was rolled back: switching into it again on the same
        # estimates is A -> B -> A too.
        s.switches.append(
            {
                "t_s": t - 400.0,
                "from": "baseline",
                "to": "eagle5",
                "reason": "rollback_trial_failed",
            }
        )
        s.last_change_s = t - 1000.0

    assert go(failed_trial) is Reason.HOLD_NO_FLAP


def test_decide_is_deterministic_and_state_round_trips(warm_state) -> None:  # type: ignore[no-untyped-def]
    a = PolicyState.from_dict(warm_state)
    b = PolicyState.from_dict(json.loads(json.dumps(warm_state)))
    syn_a, syn_b = Synth(seed=11), Synth(seed=11)
    for i in range(1, 80):
        t = T + 10 * i
        alphas = HI if i < 40 else LO
        a, da = decide(
            a,
            syn_a.window(E5 if a.running == "eagle5" else a.specs[a.running], t, 8, alphas, MIX),
            t,
            S,
            Overrides(),
        )
        b, db = decide(
            b,
            syn_b.window(E5 if b.running == "eagle5" else b.specs[b.running], t, 8, alphas, MIX),
            t,
            S,
            Overrides(),
        )
        assert da == db
        if da.action is Action.SWITCH:
            a = on_switch_done(a, da.profile, True, 120.0, t)
            b = on_switch_done(b, db.profile, True, 120.0, t)
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)


def test_restart_time_is_learned() -> None:
    dr = Driver("baseline", seed=12, restart_s=90.0)
    dr.run(120, 8, HI, MIX)
    assert dr.state.restart_s["eagle5"] == pytest.approx(0.5 * S.restart_prior_s + 0.5 * 90.0)
    # A profile never restarted is priced at the longest restart learned so far, not the prior.
    assert "eagle2" not in dr.state.restart_s
    assert restart_time(dr.state, "eagle2", S) == pytest.approx(dr.state.restart_s["eagle5"])
    dr.state.restart_s["baseline"] = 400.0
    assert restart_time(dr.state, "eagle2", S) == 400.0
    fresh = initial_state(PROFILES, "baseline", 0.0, S)
    assert restart_time(fresh, "eagle2", S) == S.restart_prior_s


def test_a_reported_boot_prices_restarts_before_one_is_measured() -> None:
    # The same day twice: the exploration of eagle5 that a 3-minute prior pays for is declined
    # when the server reports that it took almost an hour to boot.
    quick = Driver("baseline", seed=12)
    quick.run(120, 8, HI, MIX)
    assert quick.switches()
    slow = Driver("baseline", seed=12, restart_s=3000.0, startup_s=2990.0)
    slow.run(120, 8, HI, MIX)
    assert not slow.switches()
    st = slow.state
    assert st.startup_s == {"baseline": 2990.0}
    assert restart_time(st, "eagle5", S) == pytest.approx(2990.0 + S.restart_overhead_s)
    # The first measured restart moves the estimate from the reported boot, not from the prior.
    on_switch_done(st, "eagle5", True, 3010.0, slow.t + 10.0)
    assert st.restart_s["eagle5"] == pytest.approx(0.5 * (3000.0) + 0.5 * 3010.0)


def test_a_reported_boot_raises_the_restart_prior_and_never_lowers_it() -> None:
    st = initial_state(PROFILES, "baseline", 0.0, S)
    # A boot shorter than the prior is a lower bound below it: the prior stands.
    st.startup_s["baseline"] = 100.0
    assert restart_time(st, "baseline", S) == S.restart_prior_s
    assert restart_time(st, "eagle2", S) == S.restart_prior_s
    # A longer one raises it, for every profile never restarted (the others' boots count too).
    st.startup_s["baseline"] = 400.0
    assert restart_time(st, "eagle2", S) == pytest.approx(400.0 + S.restart_overhead_s)
    st.startup_s["eagle2"] = 300.0
    assert restart_time(st, "eagle2", S) == pytest.approx(300.0 + S.restart_overhead_s)
    # A measured restart is the estimate, whatever was reported.
    st.restart_s["eagle5"] = 500.0
    assert restart_time(st, "eagle5", S) == 500.0
    assert restart_time(st, "eagle2", S) == 500.0  # the longest learned of another, above the boot
    assert PolicyState.from_dict(json.loads(json.dumps(st.to_dict()))).startup_s == st.startup_s


def test_an_untried_chain_is_explored_behind_a_slow_restart() -> None:
    # Baseline, nothing speculative ever run, a server that reports a 15-minute boot. A chain
    # may multiply baseline's rate (FIELD.md: up to 3.2x): it is tried within the hour. Priced
    # as the Kimi deployment's 0.6-1.4x alone, it is not worth two 15-minute restarts.
    def first_hour(settings: PolicySettings) -> list[str]:
        dr = Driver("baseline", settings=settings, seed=3, restart_s=900.0, startup_s=890.0)
        dr.run(360, 8, HI, MIX)
        return [d.profile for d in dr.switches() if d.reason is Reason.EXPLORE]

    assert first_hour(S)[:1] in (["eagle2"], ["eagle5"])
    assert first_hour(PolicySettings(explore_prior_spec_high_ratio=1.4)) == []


def test_information_is_valued_over_twenty_restarts_when_they_outlast_the_hour() -> None:
    st = initial_state(PROFILES, "baseline", 0.0, S)
    assert explore_cap_s(st, S) == S.explore_horizon_s  # the 3-minute prior: the hour
    st.startup_s["baseline"] = 890.0
    assert explore_cap_s(st, S) == pytest.approx(S.explore_horizon_restarts * 900.0)


def test_same_decisions_in_advisory_mode(warm_state) -> None:  # type: ignore[no-untyped-def]
    from policies.types import Mode

    for ov in (Overrides(), Overrides(pin_profile="baseline")):
        a = PolicyState.from_dict(warm_state)
        b = PolicyState.from_dict(warm_state)
        _, da = decide(a, obs_for(a, T), T, S, ov)
        _, db = decide(
            b, obs_for(b, T), T, S, Overrides(ov.pin_profile, ov.pin_until_s, mode=Mode.ADVISORY)
        )
        assert da == db


# ---- Hypothesis invariants ------------------------------------------------------------------

events = st.lists(
    st.tuples(
        st.sampled_from(["ok", "ok", "ok", "none", "idle", "lo"]),
        st.sampled_from(
            ["none", "none", "none", "pin_base", "pin_e2", "pause", "block", "pin_expired"]
        ),
        st.sampled_from([True, True, False]),  # switch succeeds
    ),
    min_size=5,
    max_size=40,
)


def overrides_for(kind: str, t: float) -> Overrides:
    return {
        "none": Overrides(),
        "pin_base": Overrides(pin_profile="baseline", pin_until_s=t + 100),
        "pin_e2": Overrides(pin_profile="eagle2"),
        "pause": Overrides(paused_until_s=t + 5),
        "block": Overrides(blocked_reason="unknown outcome"),
        "pin_expired": Overrides(pin_profile="eagle2", pin_until_s=t - 1),
    }[kind]


@given(events, st.integers(0, 3))
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_invariants(warm_state, evs, seed) -> None:  # type: ignore[no-untyped-def]
    state = PolicyState.from_dict(warm_state)
    twin = PolicyState.from_dict(warm_state)
    syn = Synth(seed=seed)
    t = T
    for kind, ov_kind, ok in evs:
        t += 10.0
        ov = overrides_for(ov_kind, t)
        spec = state.specs[state.running]
        if kind == "none":
            obs = None
        elif kind == "idle":
            obs = Observation(
                t_s=t, window_s=10, profile=spec.name, moments=DecodeMoments(0, 0, 0, 0, 0, 0)
            )
        else:
            obs = syn.window(spec, t, 8, LO if kind == "lo" else HI, MIX)
        last_switch = state.last_switch_s
        rollback_due = state.rollback_to is not None
        state, d = decide(state, obs, t, S, ov)
        twin, d_twin = decide(twin, obs, t, S, ov)
        # decide is deterministic
        assert d == d_twin
        # a live pin wins unless a pause does, after the two safety rules (a block holds; a
        # failed start is rolled back, or held once where the shell already brought it back)
        safety = ov.blocked_reason is not None or rollback_due
        if ov.pin_active(t) and not ov.pause_active(t) and not safety:
            assert d.reason in (Reason.HOLD_PINNED, Reason.SWITCH_PINNED)
            assert d.profile == ov.pin_profile or d.reason is Reason.HOLD_PINNED
        if ov.pause_active(t):
            assert d.action is Action.HOLD or d.reason is Reason.ROLLBACK_START_FAILED
        if ov.blocked_reason is not None:
            assert d.reason is Reason.HOLD_BLOCKED
        # never an automatic switch inside the dwell
        if d.reason in (Reason.SWITCH_PREDICTED_GAIN, Reason.EXPLORE):
            assert t - last_switch >= S.min_dwell_s
            assert not rollback_due
        # every decision is data
        assert isinstance(d.reason, Reason)
        json.dumps(dict(d.diagnostics))
        if d.action is Action.SWITCH:
            t += 60.0
            state = on_switch_done(state, d.profile, ok, 60.0, t)
            twin = on_switch_done(twin, d.profile, ok, 60.0, t)
    assert json.dumps(state.to_dict(), sort_keys=True) == json.dumps(twin.to_dict(), sort_keys=True)
    assert PolicyState.from_dict(json.loads(json.dumps(state.to_dict()))).to_dict() == json.loads(
        json.dumps(state.to_dict())
    )


def test_drift_findings_within_a_boot_and_across_boots() -> None:
    from tests.policies.synth import Cost

    dr = Driver("eagle5", seed=15)
    dr.run(60, 8, HI, MIX)
    # Verify cost rises by 10 ms inside the boot (the field's 20 -> 30 ms).
    dr.syn.cost = Cost(verify_fixed_s=0.017)
    dr.run(10, 8, HI, MIX)
    drift = [f for f in dr.state.findings if f.kind == "drift" and f.subject == "cycle:eagle5"]
    assert drift and drift[0].after > 1.3 * drift[0].before and drift[0].unit == "s"
    # Baseline slower on its next boot (the field's 89 -> 82 tok/s): visit it, leave, return.
    dr.run(40, 8, HI, MIX, Overrides(pin_profile="baseline"))
    dr.run(40, 8, HI, MIX, Overrides(pin_profile="eagle5"))
    dr.syn.cost = Cost(verify_fixed_s=0.017, fixed_s=0.011)
    dr.run(40, 8, HI, MIX, Overrides(pin_profile="baseline"))
    tok = [f for f in dr.state.findings if f.subject == "baseline_tok_s"]
    assert tok and tok[-1].after < 0.95 * tok[-1].before and tok[-1].unit == "tok/s"


def test_manual_switch_is_a_trial(warm_state) -> None:  # type: ignore[no-untyped-def]
    """POST /v1/switch: an operator's one-off switch is judged like the policy's own switches
    when the model predicts the target; without a prediction there is nothing to judge."""
    from policies.decide import begin_manual_switch

    state = PolicyState.from_dict(warm_state)
    assert state.running == "eagle5"
    predicted = begin_manual_switch(state, "baseline", T)
    assert predicted is not None and predicted.mean > 0
    assert state.pending is not None and state.pending["reason"] == Reason.SWITCH_MANUAL.value
    state = on_switch_done(state, "baseline", True, 150.0, T + 150.0)
    assert state.trial is not None and state.trial["profile"] == "baseline"
    assert state.trial["from"] == "eagle5"

    cold = initial_state(PROFILES, "baseline", 0.0, S)
    assert begin_manual_switch(cold, "eagle5", 10.0) is None
    cold = on_switch_done(cold, "eagle5", True, 150.0, 160.0)
    assert cold.trial is None
    with pytest.raises(ValueError, match="unknown profile"):
        begin_manual_switch(cold, "nope", 200.0)


def test_trial_waits_for_the_batch_to_come_back_after_the_restart() -> None:
    """Right after a restart clients are still reconnecting: windows at a fraction of the batch
    the prediction was made for are ramp-up, not evidence against the profile."""
    from policies.decide import _trial_step
    from policies.types import Estimate

    dr = warmed("eagle5", n=60)
    st = dr.state
    syn = Synth(seed=5)
    pred = Estimate(1000.0, 900.0, 1100.0, 10.0)
    st.trial = {
        "profile": st.running,
        "from": "baseline",
        "kind": "decode",
        "batch": 32.0,
        "predicted": pred.to_dict(),
        "windows": [],
        "skip": 0,
        "t_s": dr.t,
    }
    diag: dict = {}  # type: ignore[type-arg]
    spec = st.specs[st.running]
    for i in range(4):
        obs = syn.window(spec, dr.t + 10.0 * (i + 1), 4, HI, MIX)
        _trial_step(st, obs, "ok", S, diag)
    assert st.trial["windows"] == [] and st.trial["ramp_windows"] == 4
    obs = syn.window(spec, dr.t + 60.0, 32, HI, MIX)
    _trial_step(st, obs, "ok", S, diag)
    assert len(st.trial["windows"]) == 1


def test_a_trial_at_a_smaller_batch_than_predicted_for_does_not_fail() -> None:
    """A trial predicted at batch 5 (the load estimate still carried some of the regime before)
    whose windows serve batch 4: their decode rate is the profile's at 4, a fifth below the
    prediction and under its bar. A step takes no less time for more sequences, so at 5 the
    profile would serve at most 5/4 of it: the trial cannot say the profile failed, and it does
    not roll back (before, it failed on the batch alone)."""
    from policies.decide import _trial_step
    from policies.trial import TrialOutcome

    dr = warmed("eagle5", n=60)
    st = dr.state
    pred = st.model.predict(st.running, batch=5.0, mix=MIX)
    assert pred.tok_s is not None
    st.trial = {
        "profile": st.running,
        "from": "baseline",
        "kind": "decode",
        "batch": 5.0,
        "predicted": pred.tok_s.to_dict(),
        "windows": [],
        "skip": 0,
        "t_s": dr.t,
    }
    syn = Synth(seed=5)
    spec = st.specs[st.running]
    outcomes = []
    for i in range(8):
        obs = syn.window(spec, dr.t + 10.0 * (i + 1), 4, HI, MIX)
        outcomes.append(_trial_step(st, obs, "ok", S, {}))
    observed = sum(st.trial["windows"]) / len(st.trial["windows"])
    assert observed < (1.0 - S.trial.tolerance) * pred.tok_s.low  # below the trial's bar
    assert TrialOutcome.FAILED not in outcomes
    assert st.trial["upper"] == pytest.approx([w * 1.25 for w in st.trial["windows"]], rel=0.05)


def test_regimes_that_always_lasted_hours_lift_the_burst_wait() -> None:
    """Code (eagle5 pays) and chat (baseline pays) alternate hourly. The first boundaries wait
    out the burst rule (a restart's time from the change); once three regimes have lasted an
    hour, their lengths say a switch now beats waiting, and the switch follows the change as
    soon as it is confirmed."""
    alphas = {"code": 0.85, "chat": 0.3}
    dr = Driver("baseline", seed=11)
    delays: list[float] = []
    for hour in range(7):
        mix = {"code": 1.0} if hour % 2 == 0 else {"chat": 1.0}
        t0, n0 = dr.t, len(dr.decisions)
        dr.run(360, 8, alphas, mix)
        sw = [d for d in dr.decisions[n0:] if d.reason is Reason.SWITCH_PREDICTED_GAIN]
        if hour > 0 and sw:
            delays.append(sw[0].t_s - t0)
    assert len(delays) >= 5
    wait = S.burst_wait_factor * dr.restart_s
    assert all(d >= wait for d in delays[:2])
    assert all(d < wait for d in delays[-3:])
    assert max(delays[-3:]) <= 80.0


@pytest.mark.parametrize("with_traffic", [True, False])
def test_a_step_time_change_that_comes_with_the_traffic_is_not_a_system_change(
    with_traffic: bool,
) -> None:
    """A mix change brings other context lengths and moves the step time a few percent (the
    stress scenario x4: math <-> chat on llama, -5% / +6% at every boundary). Found in the same
    window as a traffic change it marks no drift and makes no profile's data stale, and the
    running profile keeps its estimates; alone, it is a change of the system."""
    from policies.changepoint import CusumEvent
    from policies.intake import _on_event

    dr = warmed()
    st = dr.state
    p = st.running
    t = dr.t
    if with_traffic:
        st.last_traffic_change_s = t - 10.0
    before = st.model.cycle.stats[p].s0
    _on_event(st, f"cycle:{p}", CusumEvent("change", t, 1.0, 0.95, 2), obs_for(st, t), S)
    drift = [f for f in st.findings if f.kind == "drift"]
    if with_traffic:
        assert st.last_cycle_change_s is None and not drift and not st.cycle_moves
        assert st.model.cycle.stats[p].s0 == before
    else:
        assert st.last_cycle_change_s == t - 10.0 and drift and st.cycle_moves
        assert st.model.cycle.stats[p].s0 < before


def test_a_rejected_canary_backs_the_candidate_off_and_rolls_nothing_back(warm_state) -> None:  # type: ignore[no-untyped-def]
    """A fleet's canary of baseline is rolled back while the deployment keeps serving eagle5:
    baseline is backed off and the pending switch is over, but eagle5 never restarted, so its
    next window is no new boot (a failed start's rollback would adopt it as one: its estimates
    discounted and its dwell started again)."""
    from policies.decide import on_canary_rejected

    state = PolicyState.from_dict(warm_state)
    t = T + 10.0
    state, d = decide(state, obs_for(state, t), t, S, Overrides(pin_profile="baseline"))
    assert (d.action, d.profile) == (Action.SWITCH, "baseline")
    last_switch = state.last_switch_s
    t += 60.0
    state = on_canary_rejected(state, "baseline", t)
    assert state.pending is None and state.rollback_to is None and "baseline" in state.failed
    t += 10.0
    state, d = decide(state, obs_for(state, t), t, S, Overrides())
    assert "restored_by_shell" not in d.diagnostics
    assert state.last_switch_s == last_switch and state.running == "eagle5"
    with pytest.raises(ValueError, match="unknown profile"):
        on_canary_rejected(state, "nope", t)


def test_a_canary_rolled_back_unjudged_backs_nothing_off(warm_state) -> None:  # type: ignore[no-untyped-def]
    """A canary whose time ran out before its replica carried traffic to compare is no evidence
    against the candidate: the pending switch is over, but the candidate is not backed off (a
    judged rejection would hold it back for failed_profile_backoff_s)."""
    from policies.decide import on_canary_rejected

    state = PolicyState.from_dict(warm_state)
    t = T + 10.0
    state, d = decide(state, obs_for(state, t), t, S, Overrides(pin_profile="baseline"))
    assert (d.action, d.profile) == (Action.SWITCH, "baseline")
    state = on_canary_rejected(state, "baseline", t + 60.0, judged=False)
    assert state.pending is None and state.trial is None and "baseline" not in state.failed
    # The same pin asks for baseline again at once: it is not blocked.
    t += 70.0
    state, d = decide(state, obs_for(state, t), t, S, Overrides(pin_profile="baseline"))
    assert (d.action, d.profile) == (Action.SWITCH, "baseline")
