"""The long-run rule (policies/hybrid_decide.py) for plain and hybrid profile sets: traffic that
flips faster than a restart pays is served by the profile best over the recent batch-size
distribution (fixed and adaptive profiles valued over it), exploration under flipping traffic
happens and ends, a burst shorter than a restart in a stable regime moves nothing, and a table
rewrite of the running adaptive profile happens only when rewrite_pays says so."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import pytest

from policies import hybrid_decide
from policies.decide import (
    PolicySettings,
    PolicyState,
    decide,
    initial_state,
    on_switch_done,
)
from policies.hybrid import rewrite_pays, seed_table
from policies.overhead import wall_estimate
from policies.settings import settings_from_dict, settings_to_dict
from policies.types import Action, Decision, Observation, Overrides, ProfileSpec, Reason
from tests.policies.driver import SPECS, Driver
from tests.policies.synth import HYB, PROFILES, Cost, Synth

S = PolicySettings()
# A compute-heavier target than the synth's default: per-token cost makes a deep chain win at
# two streams and a short one at 64 (the hybrid-flip scenarios' shape).
COST = Cost(per_tok_s=0.0003)
ALPHAS = {"chat": 0.8}
CHAT = {"chat": 1.0}
RESTART_S = 300.0  # longer than the flips' regimes pay for
LOW, HIGH = 2, 64
LOW_WINDOWS, HIGH_WINDOWS = 36, 54  # 6 and 9 minutes of 10 s windows


def _flip(dr: Driver, hours: float) -> None:
    for _ in range(round(hours * 4)):
        dr.run(LOW_WINDOWS, LOW, ALPHAS, CHAT)
        dr.run(HIGH_WINDOWS, HIGH, ALPHAS, CHAT)


def _true_long_run(syn: Synth, name: str) -> float:
    """The true tok/s of `name` averaged over the flips' time shares."""
    lo, hi = LOW_WINDOWS / (LOW_WINDOWS + HIGH_WINDOWS), HIGH_WINDOWS / (LOW_WINDOWS + HIGH_WINDOWS)
    spec = SPECS[name]
    return lo * syn.true_tok_s(spec, LOW, ALPHAS, CHAT) + hi * syn.true_tok_s(
        spec, HIGH, ALPHAS, CHAT
    )


@pytest.fixture(scope="module")
def flipped() -> Driver:
    """Plain specpilot (no adaptive profile) started on baseline, 8 hours of 2 <-> 64."""
    dr = Driver("baseline", restart_s=RESTART_S, seed=31)
    dr.syn = Synth(cost=COST, seed=31)
    _flip(dr, 8.0)
    return dr


def test_the_scenario_has_no_profile_best_everywhere(flipped: Driver) -> None:
    """The premise: the best profile at two streams is not the best at 64, and neither regime
    repays a restart, so the long-run best is what a restart-based controller can get."""
    syn = flipped.syn

    def best_at(b: int) -> str:
        return max(SPECS, key=lambda n: syn.true_tok_s(SPECS[n], b, ALPHAS, CHAT))

    at = {b: best_at(b) for b in (LOW, HIGH)}
    assert at[LOW] == "eagle5" and at[HIGH] == "eagle2"
    assert max(SPECS, key=lambda n: _true_long_run(syn, n)) == "eagle2"


def test_flipping_traffic_explores_and_the_exploration_ends(flipped: Driver) -> None:
    """No regime lasts long enough for a restart to pay, so decide's own rule holds them all
    (HOLD_BURST, a horizon too short to explore) but the first, whose age the controller does
    not know (an untried chain may triple a baseline: it is tried there); the long-run rule
    explores over the long-run horizon, once per profile, and ends on the profile best over
    the distribution, holding it for the rest of the day."""
    explores = [d for d in flipped.decisions if d.reason is Reason.EXPLORE]
    assert explores, "no exploration under flipping traffic"
    first_regime_s = LOW_WINDOWS * flipped.window_s
    assert all(d.diagnostics.get("long_run") or d.t_s < first_regime_s for d in explores)
    assert any(d.diagnostics.get("long_run") for d in explores)
    assert len({d.profile for d in explores}) == len(explores)  # each profile at most once
    assert flipped.state.tried == {p.name for p in PROFILES}
    # Exploration ends: nothing at all switches in the last six hours.
    late = [d for d in flipped.switches() if d.t_s > 2 * 3600.0]
    assert late == [], [d.summary() for d in late]
    assert flipped.running == max(SPECS, key=lambda n: _true_long_run(flipped.syn, n))
    # What it served is within a few restarts of the best static profile's tokens.
    best_static = _true_long_run(flipped.syn, "eagle2") * flipped.t
    assert flipped.served > 0.93 * best_static
    assert flipped.served > 1.05 * _true_long_run(flipped.syn, "baseline") * flipped.t


def _manual_values(state: PolicyState, s: PolicySettings) -> dict[str, float]:
    """Every profile's wall tok/s averaged over the batch-size histogram, computed here from
    the model's and hybrid_decide's predictions at each bucket's mean batch size."""
    pts = hybrid_decide._points(state.long_run)
    tot = sum(w for _, w in pts)
    per_tok = state.overhead.per_token_s()
    out: dict[str, float] = {}
    for spec in state.profiles:
        acc = 0.0
        for b, w in pts:
            if spec.adaptive:
                pr = hybrid_decide.predict(state, spec, b, s)
            else:
                pr = state.model_prediction(spec.name, s.stale_widen, batch=b)
            assert pr is not None and pr.tok_s is not None, spec.name
            acc += w * wall_estimate(pr.tok_s, per_tok).mean
        out[spec.name] = acc / tot
    return out


def _evaluate(state: PolicyState, now_s: float, s: PolicySettings) -> tuple[object, dict]:
    st = state.copy()
    st.long_run.cache = None
    diag: dict = {}
    return hybrid_decide.long_run(st, now_s, s, diag), diag


def test_fixed_profiles_are_valued_over_the_batch_distribution(flipped: Driver) -> None:
    st = flipped.state
    pts = hybrid_decide._points(st.long_run)
    tot = sum(w for _, w in pts)
    shares = {round(b): w / tot for b, w in pts if w > 0.05 * tot}
    # The forgotten histogram holds the flips' time shares (6 and 9 minutes).
    assert set(shares) == {LOW, HIGH}
    assert shares[HIGH] == pytest.approx(0.6, abs=0.1)
    assert hybrid_decide.active_horizon(st, flipped.t, S) is not None
    d, diag = _evaluate(st, flipped.t, S)
    assert diag["long_run"] is True
    manual = _manual_values(st, S)
    for name, v in manual.items():
        assert diag[f"long_run_tok_s.{name}"] == pytest.approx(v, rel=1e-9)
        # ... and they are right: within 10% of the true long-run rate.
        assert v == pytest.approx(_true_long_run(flipped.syn, name), rel=0.1)
    assert d is not None and d.reason is Reason.HOLD_BEST


def test_a_burst_shorter_than_a_restart_in_a_stable_regime_moves_nothing() -> None:
    """Two quiet hours at two streams on the best profile there, then 2 minutes of 64 (where
    another profile is better), then quiet again: no switch, and the long-run rule stays out
    (one burst is not traffic that flips)."""
    dr = Driver("eagle5", restart_s=RESTART_S, seed=32)
    dr.syn = Synth(cost=COST, seed=32)
    dr.run(720, LOW, ALPHAS, CHAT)
    n0, t_burst = len(dr.switches()), dr.t
    burst = dr.run(12, HIGH, ALPHAS, CHAT)
    after = dr.run(360, LOW, ALPHAS, CHAT)
    assert dr.switches()[n0:] == [], [d.summary() for d in dr.switches()[n0:]]
    assert dr.running == "eagle5"
    assert not any(d.diagnostics.get("long_run") for d in burst + after)
    assert hybrid_decide.active_horizon(dr.state, dr.t, S) is None
    assert any(d.reason is Reason.HOLD_BURST for d in burst)
    assert all(d.t_s > t_burst for d in burst)


# --------------------------------------------------------------------------------------------
# Hybrid profiles


def _window(syn: Synth, spec: ProfileSpec, t: float, batch: float) -> Observation:
    return syn.window(spec, t, batch, ALPHAS, CHAT, 10.0)


def _hybrid_state(batch: float, table: Mapping[str, object]) -> tuple[PolicyState, Synth, float]:
    """Every fixed profile run for 400 s at `batch`, then the adaptive one (launched with
    `table`) for 400 s: a trained state with the hybrid profile running, decisions paused."""
    profiles = (*PROFILES, HYB)
    st = initial_state(
        profiles, "baseline", 0.0, S, adaptive_tables={"hybrid": {"table": dict(table)}}
    )
    syn = Synth(cost=COST, seed=33)
    pause = Overrides(paused_until_s=math.inf)
    t = 0.0
    for name in ("baseline", "eagle2", "eagle5", "hybrid"):
        if name != st.running:
            t += RESTART_S
            st = on_switch_done(st, name, True, RESTART_S, t)
        spec = st.specs[name]
        for _ in range(40):
            t += 10.0
            st, d = decide(st, _window(syn, spec, t, batch), t, S, pause)
            assert d.reason is Reason.HOLD_PAUSED
    return st, syn, t


def _flipping_hybrid(table: Mapping[str, object]) -> tuple[PolicyState, float]:
    """_hybrid_state, then four hours of 2 <-> 64 on the hybrid profile (decisions paused)."""
    st, syn, t = _hybrid_state(8, table)
    pause = Overrides(paused_until_s=math.inf)
    for _ in range(16):
        for batch, n in ((LOW, LOW_WINDOWS), (HIGH, HIGH_WINDOWS)):
            for _ in range(n):
                t += 10.0
                st, _d = decide(st, _window(syn, HYB, t, batch), t, S, pause)
    assert hybrid_decide.active_horizon(st, t, S) is not None
    return st, t


def test_adaptive_profiles_are_valued_over_the_batch_distribution() -> None:
    st, t = _flipping_hybrid(seed_table((0, 2, 5)))
    _d, diag = _evaluate(st, t, S)
    manual = _manual_values(st, S)
    assert set(manual) == {"baseline", "eagle2", "eagle5", "hybrid"}
    for name, v in manual.items():
        assert diag[f"long_run_tok_s.{name}"] == pytest.approx(v, rel=1e-9)
    # The adaptive profile's value is its predictions at the two batch sizes, time-weighted:
    # between what it is predicted at two streams and at 64.
    at = {
        b: wall_estimate(
            hybrid_decide.predict(st, HYB, b, S).tok_s,  # type: ignore[union-attr]
            st.overhead.per_token_s(),
        ).mean
        for b in (LOW, HIGH)
    }
    assert at[LOW] < manual["hybrid"] < at[HIGH]


def _rewrite_expected(st: PolicyState, now_s: float) -> bool:
    """What rewrite_pays says about the candidate table at the batch size now."""
    t = st.hybrid.tables["hybrid"]  # type: ignore[union-attr]
    b = st.model.concurrency.estimate()
    cur = hybrid_decide.predict(st, HYB, b, S)
    new = hybrid_decide.predict(st, HYB, b, S, t["candidate"])
    assert cur is not None and new is not None and cur.tok_s and new.tok_s
    age = now_s - st.regime_start_s
    r = st.restart_s.get("hybrid", S.restart_prior_s)
    pays, _net = rewrite_pays(
        cur.tok_s,
        new.tok_s,
        horizon_s=st.regimes.expected_remaining_s(age),
        restart_s=r,
        margin_frac=S.margin_frac,
        margin_z=S.margin_z,
    )
    return pays and age >= S.burst_wait_factor * r


def test_a_table_rewrite_happens_only_when_rewrite_pays() -> None:
    # Launched with every bucket at 2 steps: at 8 streams 5 steps are ~15% better here.
    st, _syn, t = _hybrid_state(8, seed_table((2,)))
    hs = st.hybrid
    assert hs is not None
    hybrid_decide.refresh_tables(st, t, S)
    old = hs.tables["hybrid"]["running_table"]
    cand = hs.tables["hybrid"]["candidate"]
    assert cand is not None and cand != old

    # A normal restart: the rewrite pays and is made (a restart of the running profile).
    assert _rewrite_expected(st, t)
    st_pays = st.copy()
    d = hybrid_decide.long_run(st_pays, t, S, {})
    assert d is not None and d.action is Action.SWITCH and d.profile == "hybrid"
    assert d.reason is Reason.SWITCH_PREDICTED_GAIN
    assert d.diagnostics["adaptive_table_rewrite"] is True
    t_after = st_pays.hybrid.tables["hybrid"]  # type: ignore[union-attr]
    assert t_after["table"] == cand and t_after["candidate"] is None
    assert [e["reason"] for e in st_pays.hybrid.events][-1] == "rewrite"  # type: ignore[union-attr]

    # A restart far too long for the regime to repay: rewrite_pays says no, nothing restarts.
    st_no = st.copy()
    st_no.restart_s["hybrid"] = 1e6
    assert not _rewrite_expected(st_no, t)
    assert hybrid_decide.long_run(st_no, t, S, {}) is None
    assert st_no.hybrid.tables["hybrid"]["candidate"] == cand  # type: ignore[union-attr]

    # A regime younger than the restart: the burst wait holds the rewrite too.
    st_young = st.copy()
    st_young.regime_start_s = t - 0.5 * st_young.restart_s["hybrid"]
    assert not _rewrite_expected(st_young, t)
    assert hybrid_decide.long_run(st_young, t, S, {}) is None

    # No candidate (the launch table is what the estimates give): nothing to weigh.
    st_same = st.copy()
    st_same.hybrid.tables["hybrid"]["candidate"] = None  # type: ignore[union-attr]
    assert hybrid_decide.long_run(st_same, t, S, {}) is None


def _rewritten() -> tuple[PolicyState, hybrid_decide.HybridState, float, dict[str, object]]:
    """_hybrid_state at 8 streams on a 2-step-everywhere table, its table rewritten: the state,
    its hybrid state, the time and the table the rewrite replaced."""
    st, _syn, t = _hybrid_state(8, seed_table((2,)))
    hs = st.hybrid
    assert hs is not None
    hybrid_decide.refresh_tables(st, t, S)
    old = hs.tables["hybrid"]["table"]
    d = hybrid_decide.long_run(st, t, S, {})
    assert d is not None and hybrid_decide.rewrites_table(d)
    return st, hs, t, old


def test_a_rewrite_back_to_the_table_just_replaced_is_a_flap() -> None:
    """A -> B -> A for tables (the stress scenario u1: each table's tiers look worse while it
    runs, priced by its own windows, so the other looked better every half hour, 10 rewrites
    on MoE): inside the amortisation horizon and without a change point since the rewrite, a
    candidate equal to the table the rewrite replaced is refused (HOLD_NO_FLAP); after the
    horizon, or after a change point, it is weighed as any rewrite."""
    st, hs, t, old = _rewritten()
    run = hs.tables["hybrid"]
    assert run["previous"] == old and run["rewritten_s"] == t
    run["candidate"] = old  # the estimates now say the old table again
    later = t + 0.5 * S.amortisation_horizon_s
    assert hybrid_decide._rewrite_flaps(st, run, later, S)
    assert not hybrid_decide._rewrite_flaps(st, run, t + S.amortisation_horizon_s, S)
    st.last_change_s = t + 60.0
    assert not hybrid_decide._rewrite_flaps(st, run, later, S)
    st.last_change_s = None
    run["candidate"] = seed_table((5,))  # a third table is no flap
    assert not hybrid_decide._rewrite_flaps(st, run, later, S)


def test_an_adaptive_profile_serving_beyond_a_fixed_ones_data_makes_it_worth_exploring() -> None:
    """The stress scenario w8 (MoE, 1 -> 32 streams): the adaptive profile served 32 streams,
    where 5-step, tried only at smaller batches, is an extrapolation (on MoE's saturating cost
    a pessimistic one) that nothing would ever test: a profile tried, but never at a batch
    size like this one, is weighed for exploration (whatever runs). Once it has served that
    batch size, it is not weighed again for it."""
    from policies.decide import _choose
    from policies.forgetting import batch_bucket

    st, syn, t = _hybrid_state(2, seed_table((0, 2, 5)))
    pause = Overrides(paused_until_s=math.inf)
    for _ in range(60):
        t += 10.0
        st, _d = decide(st, _window(syn, HYB, t, 32), t, S, pause)
    assert st.running == "hybrid"
    assert st.model.cycle.support("eagle5", 32.0) == "extrapolated"
    st.regime_start_s = t - 3600.0
    diag: dict = {}
    _choose(st, t, S, diag)
    assert "explore_net_tokens.eagle5" in diag or "explore_declined.eagle5" in diag
    # The same state with 5-step having served 32 streams once (its data since faded).
    st2 = st.copy()
    st2.served_top["eagle5"] = batch_bucket(32.0)
    diag2: dict = {}
    _choose(st2, t, S, diag2)
    assert not any(k.endswith(".eagle5") and k.startswith("explore_") for k in diag2), diag2


def test_long_run_state_round_trips_and_old_states_load(flipped: Driver) -> None:
    st = flipped.state
    back = PolicyState.from_dict(st.to_dict())
    assert back.long_run.to_dict() == st.long_run.to_dict()
    # A state saved when the batch history lived inside "hybrid", with the old setting names.
    old = st.to_dict()
    lr = old.pop("long_run")
    old["hybrid"] = {"tables": {}, "batch_w": lr["batch_w"], "flips": lr["flips"]}
    old["settings"] = {
        ("hybrid_horizon_s" if k == "long_run_horizon_s" else k): v
        for k, v in old["settings"].items()
    }
    loaded = PolicyState.from_dict(old)
    assert loaded.long_run.batch_w == st.long_run.batch_w
    assert loaded.long_run.flips == st.long_run.flips
    assert loaded.settings.long_run_horizon_s == S.long_run_horizon_s
    assert settings_from_dict(settings_to_dict(S)) == S


def test_tables_are_regenerated_only_when_their_inputs_move() -> None:
    base: dict[str, float | None] = {"alpha:0": 0.80, "alpha:1": 0.70, "alpha:mix": 0.77}
    base |= {"cycle:1:2": math.log(0.020), "cycle:64:2": None}
    assert hybrid_decide._moved(None, base)
    assert not hybrid_decide._moved(base, dict(base))
    # A mix move of 5% between two workloads 0.1 apart moves the weighted alpha by 0.005.
    assert not hybrid_decide._moved(base, base | {"alpha:mix": 0.775})
    assert hybrid_decide._moved(base, base | {"alpha:mix": 0.79})
    assert hybrid_decide._moved(base, base | {"alpha:1": 0.72})
    assert not hybrid_decide._moved(base, base | {"cycle:1:2": math.log(0.0202)})
    assert hybrid_decide._moved(base, base | {"cycle:1:2": math.log(0.0206)})
    assert hybrid_decide._moved(base, base | {"cycle:64:2": math.log(0.05)})  # newly priced

    st, _syn, t = _hybrid_state(8, seed_table((2,)))
    hs = st.hybrid
    assert hs is not None
    hybrid_decide.refresh_tables(st, t, S)
    assert hs.last_look_s == t
    looked = hs.tables["hybrid"]["inputs"]
    # Within the regen interval and without a model change, the inputs are not even priced.
    hybrid_decide.refresh_tables(st, t + 0.5 * S.hybrid_regen_interval_s, S)
    assert hs.last_look_s == t
    # A change in acceptance or cycle time is looked at at once.
    st.last_model_change_s = t + 1.0
    hybrid_decide.refresh_tables(st, t + 10.0, S)
    assert hs.last_look_s == t + 10.0
    assert hs.tables["hybrid"]["inputs"] is not None and looked is not None


@pytest.mark.parametrize("restart_s", [RESTART_S, 1e5])
def test_under_flipping_traffic_a_rewrite_is_valued_over_the_distribution(
    restart_s: float,
) -> None:
    """The running adaptive profile's candidate table is valued over the batch distribution,
    and the table is rewritten only when rewrite_pays says so over the long-run horizon."""
    st, t = _flipping_hybrid(seed_table((2,)))
    st.restart_s = {p.name: restart_s for p in st.profiles}
    hybrid_decide.refresh_tables(st, t, S)
    cand = st.hybrid.tables["hybrid"]["candidate"]  # type: ignore[union-attr]
    assert cand is not None, "a table launched with 2 steps everywhere has a better candidate"
    work = st.copy()
    work.long_run.cache = None
    d = hybrid_decide.long_run(work, t, S, {})
    rewrote = d is not None and bool(d.diagnostics.get("adaptive_table_rewrite"))
    if rewrote:
        assert d is not None and d.action is Action.SWITCH and d.profile == "hybrid"
        assert work.hybrid.tables["hybrid"]["table"] == cand  # type: ignore[union-attr]
    pts = hybrid_decide._points(st.long_run)
    cur = hybrid_decide._value(st, "hybrid", pts, S)
    new = hybrid_decide._value(st, "hybrid", pts, S, cand)
    lr_h = hybrid_decide.active_horizon(st, t, S)
    assert cur is not None and new is not None and lr_h is not None
    assert new[0].mean > cur[0].mean
    pays, _net = rewrite_pays(
        cur[0],
        new[0],
        horizon_s=lr_h,
        restart_s=restart_s,
        margin_frac=S.margin_frac,
        margin_z=S.margin_z,
    )
    # A rewrite is made only when it pays (switching to another profile may pay more).
    assert not rewrote or pays
    if not pays:
        assert not rewrote and (d is None or d.profile != "hybrid" or d.action is Action.HOLD)
    if restart_s > lr_h:
        assert not pays


def test_the_long_run_mix_weighs_each_window_by_the_tokens_it_generated() -> None:
    """A busy phase weighs by what it produced, not by how long it lasted: ten minutes of code
    at 300 tokens a window and ten of chat at 100 give code three quarters of the mix."""
    from policies.hybrid_decide import LongRunState, _long_run_mix, observe
    from policies.settings import PolicySettings

    lr, s = LongRunState(), PolicySettings(long_run_batch_half_life_s=1e9)
    for i in range(60):
        observe(lr, 8.0, 10.0, 10.0 * i, s, {"code": 300.0})
    for i in range(60, 120):
        observe(lr, 8.0, 10.0, 10.0 * i, s, {"chat": 100.0, "code": 0.0})
    mix = _long_run_mix(lr)
    assert mix is not None
    assert mix["code"] == pytest.approx(0.75, rel=1e-6) and mix["chat"] == pytest.approx(0.25)


def test_one_chain_leaves_the_seed_table_unpriced_and_worth_exploring() -> None:
    """With one chain in the set and no baseline data, the tier costs say nothing of how the
    cycle grows with steps: a table generated from them would hold that chain's tier alone (the
    fixed profile under another name, never worth a restart). The seed table stays, unpriced,
    and decide explores it like any profile never run; a second chain's data identifies the
    tiers and a table is generated from them."""
    st = initial_state(
        (PROFILES[0], PROFILES[1], HYB), "eagle2", 0.0, S, adaptive_tables={"hybrid": {}}
    )
    seed = seed_table(HYB.candidate_steps)
    hs = st.hybrid
    assert hs is not None and hs.tables["hybrid"]["table"] == seed
    syn = Synth(cost=COST, seed=41)
    t = 0.0
    explored = None
    for _ in range(400):
        t += 10.0
        st, d = decide(st, _window(syn, PROFILES[1], t, LOW), t, S, Overrides())
        if d.action is Action.SWITCH:
            explored = d
            break
        assert hs.tables["hybrid"]["table"] == seed
        assert hybrid_decide.predict(st, HYB, LOW, S) is None
    assert explored is not None and explored.profile == "hybrid", explored
    assert explored.reason is Reason.EXPLORE

    # The same windows with 5-step's too: two tiers priced, and a table of their own.
    st = initial_state((*PROFILES, HYB), "eagle2", 0.0, S, adaptive_tables={"hybrid": {}})
    pause = Overrides(paused_until_s=math.inf)
    t = 0.0
    for name in ("eagle2", "eagle5"):
        if name != st.running:
            t += RESTART_S
            st = on_switch_done(st, name, True, RESTART_S, t)
        for _ in range(40):
            t += 10.0
            st, _d = decide(st, _window(syn, st.specs[name], t, LOW), t, S, pause)
    hybrid_decide.refresh_tables(st, t + S.hybrid_regen_interval_s, S)
    assert st.hybrid is not None and st.hybrid.tables["hybrid"]["table"] != seed
    assert hybrid_decide.predict(st, HYB, LOW, S) is not None


def test_a_rewrite_undone_at_the_batch_size_now_is_a_flap_whatever_else_differs() -> None:
    """Candidates written minutes apart differ at batch sizes other than the one served (a
    random MoE day: one stream's tier went 7 -> 5 -> 7 -> 5 within the hour, in tables that
    differed elsewhere): a candidate that runs, at the batch size now, the rule the last
    rewrite replaced there undoes it, whatever it does at other batch sizes."""
    st, hs, t, old = _rewritten()
    run = hs.tables["hybrid"]
    later = t + 0.5 * S.amortisation_horizon_s
    elsewhere = copy.deepcopy(old)
    top = max(elsewhere, key=int)
    assert int(top) > 8
    elsewhere[top]["candidate_steps"] = [5]
    run["candidate"] = elsewhere
    assert hybrid_decide._rewrite_flaps(st, run, later, S)


FailedRewrite = tuple[
    PolicyState, hybrid_decide.HybridState, float, dict[str, object], dict[str, object], Decision
]


def _failed_rewrite(candidate_during_trial: bool = False) -> FailedRewrite:
    """_rewritten, its rewritten table's trial failed: the state, its hybrid state, the time,
    the table the rewrite replaced, the table that failed and the decision that rolled it
    back."""
    st, hs, t, old = _rewritten()
    new = hs.tables["hybrid"]["table"]
    t += RESTART_S
    st = on_switch_done(st, "hybrid", True, RESTART_S, t)
    assert st.trial is not None
    if candidate_during_trial:
        hs.tables["hybrid"]["candidate"] = seed_table((5,))
        hs.tables["hybrid"]["reason"] = "candidate"
    # The rewritten table serves far below its prediction (a cost the model did not see).
    slow = Synth(cost=Cost(per_tok_s=0.003), seed=34)
    out = None
    for _ in range(S.trial.max_windows + S.trial_warmup_windows):
        t += 10.0
        st, out = decide(st, _window(slow, HYB, t, 8), t, S, Overrides())
        if out.action is Action.SWITCH:
            break
    assert out is not None
    return st, hs, t, old, new, out


@pytest.mark.parametrize("candidate_during_trial", [False, True])
def test_a_failed_rewrite_is_rolled_back_to_the_table_it_replaced(
    candidate_during_trial: bool,
) -> None:
    """The trial of a rewritten table fails: the rollback relaunches the running profile with
    the table the rewrite replaced (marked as a rewrite, the only restart of the running
    profile the shells make; before, the failed table went on serving and the rollback's switch
    expired), and a rewrite back to the failed table is then a flap. So also when a candidate
    was written while the trial ran (refresh_tables then sets the table's last reason to
    "candidate": the rollback must not depend on it)."""
    st, hs, t, old, new, out = _failed_rewrite(candidate_during_trial)
    assert new != old
    assert out.action is Action.SWITCH, out
    assert out.reason is Reason.ROLLBACK_TRIAL_FAILED and out.profile == "hybrid"
    assert hybrid_decide.rewrites_table(out)
    run = hs.tables["hybrid"]
    assert run["table"] == old and run["previous"] == new
    assert [e["reason"] for e in hs.events][-1] == "rollback"
    run["candidate"] = new
    assert hybrid_decide._rewrite_flaps(st, run, t + 60.0, S)


def test_a_rule_whose_trial_failed_here_is_not_tried_again_until_the_model_changes() -> None:
    """Stress a17 (MoE working days): a failed trial's few windows are too few for the
    self-correction to hold what they measured, so once the no-flap horizon passed the same
    rewrite was priced up again and failed again, by the hour. A candidate that runs, at the
    batch size now, the rule whose trial failed at this batch size is not weighed (decide's own
    rule applies) until a change in acceptance or cycle time; at another batch size it is."""
    st, hs, t, _old, new, out = _failed_rewrite()
    assert out.reason is Reason.ROLLBACK_TRIAL_FAILED
    run = hs.tables["hybrid"]
    failed = run["failed"][-1]
    assert failed["table"] == new and failed["t_s"] == t
    run["candidate"] = new
    later = t + 2.0 * S.amortisation_horizon_s
    assert not hybrid_decide._rewrite_flaps(st, run, later, S)  # past the no-flap horizon
    hs.last_look_s = later  # no new candidate: the estimates still say the failed table
    diag: dict = {}
    d = hybrid_decide.long_run(st, later, S, diag)
    assert d is None or not hybrid_decide.rewrites_table(d)
    assert diag["rewrite_failed_here"]
    # Failed at another batch size: no evidence here.
    failed["batch"] = 64.0
    assert not hybrid_decide._rewrite_failed_here(st, run, {})
    failed["batch"] = 8.0
    assert hybrid_decide._rewrite_failed_here(st, run, {})
    # The model changed since the trial: weighed again.
    st.last_model_change_s = t + 60.0
    assert not hybrid_decide._rewrite_failed_here(st, run, {})
