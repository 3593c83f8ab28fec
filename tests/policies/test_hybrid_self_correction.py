"""An adaptive profile's own windows correct its table-based prediction
(hybrid_decide.observe_self): it follows drift of its true cost while it runs, survives a
to_dict/from_dict round trip, and moves nothing when the model was right.

The synth runs the adaptive profile as its one tier (a table with the single candidate 2:
SGLang's rule then never leaves it), so its truth is the 2-step chain's at the synth's costs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from policies import hybrid_decide
from policies.decide import PolicyState, decide, initial_state, on_switch_done, predictions
from policies.settings import PolicySettings
from policies.types import Overrides, ProfilePrediction, ProfileSpec, Reason
from tests.policies.synth import PROFILES, Cost, Synth

S = PolicySettings()
ALPHAS = {"chat": 0.7}
CHAT = {"chat": 1.0}
BATCH = 4.0
HYB = ProfileSpec(
    "hybrid", num_steps=2, draft_tokens=3, algorithm="EAGLE3", adaptive=True, candidate_steps=(2,)
)
TABLE = {"1": {"candidate_steps": [2]}}
PAUSE = Overrides(paused_until_s=math.inf)


def _trained(
    seed: int = 5, fixed: tuple[str, ...] = ("baseline", "eagle2", "eagle5")
) -> tuple[PolicyState, Synth, float]:
    """The `fixed` profiles (default: every one) run 40 windows each at BATCH, then the adaptive
    one launched (decisions paused: the test drives which profile runs)."""
    st = initial_state(
        (*PROFILES, HYB), "baseline", 0.0, S, adaptive_tables={"hybrid": {"table": TABLE}}
    )
    syn = Synth(cost=Cost(), seed=seed)
    t = 0.0
    for name in (*fixed, "hybrid"):
        if name != st.running:
            t += 120.0
            st = on_switch_done(st, name, True, 120.0, t)
        if name == "hybrid":
            break
        for _ in range(40):
            t += 10.0
            st, d = decide(st, syn.window(st.specs[name], t, BATCH, ALPHAS, CHAT), t, S, PAUSE)
            assert d.reason is Reason.HOLD_PAUSED
    return st, syn, t


def _run_hybrid(st: PolicyState, syn: Synth, t: float, n: int) -> tuple[PolicyState, float]:
    for _ in range(n):
        t += 10.0
        st, _d = decide(st, syn.window(HYB, t, BATCH, ALPHAS, CHAT), t, S, PAUSE)
    return st, t


def _pred(st: PolicyState) -> float:
    pr = hybrid_decide.predict(st, HYB, BATCH, S)
    assert pr is not None and pr.tok_s is not None
    return pr.tok_s.mean


def _truth(syn: Synth) -> float:
    return syn.true_tok_s(HYB, BATCH, ALPHAS, CHAT)


def test_prediction_follows_a_step_in_its_own_cost_within_a_few_windows() -> None:
    st, syn, t = _trained()
    st, t = _run_hybrid(st, syn, t, 30)
    before = _pred(st)
    assert abs(before / _truth(syn) - 1.0) < 0.03
    # The verify forward gets 60% dearer while the adaptive profile runs; the fixed profiles'
    # data (what the table-based prediction rests on) still says the old cost.
    syn.cost = dataclasses.replace(syn.cost, verify_fixed_s=syn.cost.verify_fixed_s * 1.6)
    truth = _truth(syn)
    assert truth < 0.85 * before
    st, t = _run_hybrid(st, syn, t, 12)
    after = _pred(st)
    assert abs(after / truth - 1.0) < 0.04, (before, after, truth)
    # ... and so does the tier cost the table generation reads.
    ins = hybrid_decide.inputs(st, HYB)
    stale = hybrid_decide.inputs(st, HYB, corrected=False)
    assert ins is not None and stale is not None
    c_new, c_old = ins[1](BATCH, 2), stale[1](BATCH, 2)
    assert c_new is not None and c_old is not None
    true_ratio = float(syn.cost.step_s(BATCH, 3)) / float(
        dataclasses.replace(syn.cost, verify_fixed_s=syn.cost.verify_fixed_s / 1.6).step_s(BATCH, 3)
    )
    assert abs(c_new.mean / c_old.mean / true_ratio - 1.0) < 0.04


def test_prediction_follows_a_slow_drift() -> None:
    st, syn, t = _trained(seed=9)
    st, t = _run_hybrid(st, syn, t, 30)
    v0 = syn.cost.verify_fixed_s
    # Verify cost ramps 1.0x -> 1.6x over four hours of the adaptive profile running (no step a
    # change detector would call one): the correction tracks it with the cycle half-life's lag.
    steps = 1440
    for i in range(steps):
        syn.cost = dataclasses.replace(syn.cost, verify_fixed_s=v0 * (1.0 + 0.6 * i / steps))
        st, t = _run_hybrid(st, syn, t, 1)
    truth = _truth(syn)
    stale = hybrid_decide.inputs(st, HYB, corrected=False)
    assert stale is not None
    assert abs(_pred(st) / truth - 1.0) < 0.04


def test_no_drift_changes_nothing() -> None:
    st, syn, t = _trained(seed=11)
    # Before its own windows: the prediction from the fixed profiles alone.
    st, t = _run_hybrid(st, syn, t, 1)
    base = _pred(st)
    st, t = _run_hybrid(st, syn, t, 120)
    corr = hybrid_decide.self_correction(st, "hybrid", BATCH)
    assert corr["T:2"] is not None and corr["L"] is not None
    assert abs(corr["T:2"][0]) < 0.02 and abs(corr["L"][0]) < 0.02
    assert abs(_pred(st) / base - 1.0) < 0.02
    assert abs(_pred(st) / _truth(syn) - 1.0) < 0.03


def test_self_correction_round_trips() -> None:
    st, syn, t = _trained(seed=13)
    syn.cost = dataclasses.replace(syn.cost, verify_fixed_s=syn.cost.verify_fixed_s * 1.3)
    st, t = _run_hybrid(st, syn, t, 40)
    back = PolicyState.from_dict(st.to_dict())
    assert st.hybrid is not None and back.hybrid is not None
    assert {p: {k: r.to_json() for k, r in c.items()} for p, c in back.hybrid.corr.items()} == {
        p: {k: r.to_json() for k, r in c.items()} for p, c in st.hybrid.corr.items()
    }
    assert _pred(back) == _pred(st)
    assert hybrid_decide.self_correction(back, "hybrid", BATCH) == hybrid_decide.self_correction(
        st, "hybrid", BATCH
    )
    # A state saved before self-correction existed loads without one.
    d = st.to_dict()
    del d["hybrid"]["corr"]
    assert PolicyState.from_dict(d).hybrid.corr == {}  # type: ignore[union-attr]


def test_a_new_boot_keeps_only_a_carryover_of_the_correction() -> None:
    """Like a profile's step times at a new boot, its cycle ratios keep at most
    boot_carryover_max_windows windows' worth per batch bucket (the tier cells scaled as their
    bucket's window count, so the tiers keep their shares), and its accept ratios, like accept
    lengths, boot_carryover of theirs. A quarter of 40 windows would outweigh the first 9 of a
    boot whose verify moved (r20-17: 31 windows of an hour at one stream against a trial's 4,
    which then priced the table at 116 tok/s against the 60 it served, and it was tried again)."""
    st, syn, t = _trained(seed=17)
    syn.cost = dataclasses.replace(syn.cost, verify_fixed_s=syn.cost.verify_fixed_s * 1.3)
    st, t = _run_hybrid(st, syn, t, 40)
    assert st.hybrid is not None
    before = {k: r.w for k, r in st.hybrid.corr["hybrid"].items()}
    st = on_switch_done(st, "hybrid", True, 120.0, t + 120.0)
    corr = st.hybrid.corr["hybrid"]
    n = corr["N:4"]
    assert n.w == pytest.approx(S.boot_carryover_max_windows) and n.count == 0.0
    scale = n.w / before["N:4"]
    assert corr["T:4:2"].w == pytest.approx(scale * before["T:4:2"])
    assert corr["R:4:2"].w == pytest.approx(scale * before["R:4:2"])
    assert corr["L:4"].w == pytest.approx(S.boot_carryover * before["L:4"])
    assert all(r.count == 0.0 for r in corr.values())


def _at_32(st: PolicyState, syn: Synth, t: float, names: tuple[str, ...]) -> PolicyState:
    """Run each of `names` 20 windows at 32 streams (verify 1.3x dearer than at training)."""
    syn.cost = dataclasses.replace(syn.cost, verify_fixed_s=Cost().verify_fixed_s * 1.3)
    for name in names:
        if name != st.running:
            t += 120.0
            st = on_switch_done(st, name, True, 120.0, t)
        spec = HYB if name == "hybrid" else st.specs[name]
        for _ in range(20):
            t += 10.0
            st, _d = decide(st, syn.window(spec, t, 32.0, ALPHAS, CHAT), t, S, PAUSE)
    return st


def test_a_correction_against_a_continued_line_stays_at_its_bucket() -> None:
    # The adaptive profile runs at 32 streams, where 2-step's cost is its line from 4 streams
    # continued: the ratio there is the line's error, and says nothing of 4 streams, where
    # 2-step's cost is its own data.
    st, syn, t = _trained(seed=19)
    st = _at_32(st, syn, t, ("hybrid",))
    assert hybrid_decide.self_correction(st, "hybrid", 32.0)["T:2"] is not None
    assert hybrid_decide.self_correction(st, "hybrid", BATCH)["T:2"] is None
    # ... nor of 5 steps at 32 streams (a tier the adaptive profile did not run there).
    ins, stale = hybrid_decide.inputs(st, HYB), hybrid_decide.inputs(st, HYB, corrected=False)
    assert ins is not None and stale is not None
    assert ins[1](32.0, 5) == stale[1](32.0, 5)
    assert ins[1](32.0, 2) != stale[1](32.0, 2)
    # Where 2-step served 32 streams too, the ratio there is the model's error, and transfers.
    st, syn, t = _trained(seed=19)
    st = _at_32(st, syn, t, ("eagle2", "hybrid"))
    assert hybrid_decide.self_correction(st, "hybrid", BATCH)["T:2"] is not None


def _chain_pred(st: PolicyState, name: str) -> ProfilePrediction:
    return {p.profile: p for p in predictions(st)}[name]


def test_a_chain_never_run_is_priced_by_the_tier_an_adaptive_profile_ran() -> None:
    """baseline and 5-step ran; 2-step never did, so its step time is read off theirs (the
    surface). The verify forward then gets 40% dearer and the adaptive profile runs its one
    tier, 2 steps: the very forward of the 2-step chain. 2-step is priced by what that tier
    measured (within a few percent of its truth), where the surface alone is far off; the
    cell counts only where the tier carried the bucket's windows."""
    st, syn, t = _trained(9, ("baseline", "eagle5"))
    before = _chain_pred(st, "eagle2")
    assert before.source.split("+")[-1] == "surface" and not st.model.cycle.has_data("eagle2")
    syn.cost = dataclasses.replace(syn.cost, verify_fixed_s=syn.cost.verify_fixed_s * 1.4)
    truth = syn.true_tok_s(st.specs["eagle2"], BATCH, ALPHAS, CHAT)
    assert before.tok_s is not None and before.tok_s.mean > 1.1 * truth
    st, t = _run_hybrid(st, syn, t, 30)
    after = _chain_pred(st, "eagle2")
    assert "tier" in after.source.split("+") and after.tok_s is not None
    assert abs(after.tok_s.mean / truth - 1.0) < 0.03, (before.tok_s, after.tok_s, truth)
    assert after.tok_s.low <= truth <= after.tok_s.high
    # Windows spread over several tiers at the bucket are an attribution, not a measurement.
    hs = st.hybrid
    assert hs is not None
    corr = hs.corr["hybrid"]
    for key in [k for k in corr if k.startswith("N:")]:
        n = corr[key]
        corr[key] = dataclasses.replace(n, w=n.w / hybrid_decide.TIER_MEASURED_MIN_SHARE * 1.5)
    spread = _chain_pred(st, "eagle2")
    assert "tier" not in spread.source.split("+")
    assert spread.tok_s is not None and spread.tok_s.mean > 1.1 * truth


def test_a_prediction_its_own_windows_measured_is_as_narrow_as_the_measurement() -> None:
    """Before it runs, the adaptive profile's price carries the emulation's spread (acceptance
    paired with slow cycles across the rule's tiers). Once its own windows at the batch cover
    the tier it runs and its tokens per cycle, its price is a measurement: within a few percent,
    however wide the emulation was (a random day: a running table's 44% spread set a 196 tok/s
    switch margin that kept it running at 0.92 of a chain measured beside it)."""
    st, syn, t = _trained(7, ("baseline", "eagle5"))  # its tier, 2 steps, read off the two
    pr0 = hybrid_decide.predict(st, HYB, BATCH, S)
    assert pr0 is not None and pr0.tok_s is not None and "measured" not in pr0.source
    st, t = _run_hybrid(st, syn, t, 30)
    pr = hybrid_decide.predict(st, HYB, BATCH, S)
    assert pr is not None and pr.tok_s is not None
    assert "measured" in pr.source.split("+")
    truth = _truth(syn)
    assert pr.tok_s.low <= truth <= pr.tok_s.high
    assert pr.tok_s.high / pr.tok_s.low < 1.05 < pr0.tok_s.high / pr0.tok_s.low
    # At a batch size its windows did not serve, the emulation's spread stays.
    far = hybrid_decide.predict(st, HYB, 8 * BATCH, S)
    assert far is not None and far.tok_s is not None and "measured" not in far.source
