"""reconcile_profiles: a restored policy state against the profiles configured now. A removed
profile is forgotten (and a pending switch, trial, rollback or running profile naming it
cleared), a new one joins untried, a changed one (its digest moved) is reset and untried, an
unchanged one keeps everything (its spec refreshed); a state saved without digests changes
nothing and records them."""

from __future__ import annotations

import dataclasses

import pytest

from policies.decide import PolicyState, decide
from policies.reconcile import ProfileChanges, drop_unknown_pin, reconcile_profiles
from policies.types import Action, Overrides, ProfileSpec
from tests.policies.driver import Driver
from tests.policies.synth import BASE, E2, E5, PROFILES

ALPHAS = {"chat": 0.8}
MIX = {"chat": 1.0}
DIGESTS = {"baseline": "b0", "eagle2": "e2", "eagle5": "e5"}
E3 = ProfileSpec("eagle3", num_steps=3, draft_tokens=4, algorithm="EAGLE3")


def _learned() -> tuple[PolicyState, float]:
    """A state that measured all three profiles (each pinned in turn), through a JSON round
    trip as the store keeps it, with the digests of a first reconcile recorded."""
    d = Driver("baseline")
    for name in ("baseline", "eagle2", "eagle5"):
        d.run(40, 8.0, ALPHAS, MIX, Overrides(pin_profile=name))
    st = PolicyState.from_dict(d.state.to_dict())
    assert not reconcile_profiles(st, PROFILES, DIGESTS)
    assert st.digests == DIGESTS
    for name in ("baseline", "eagle2", "eagle5"):
        assert st.model.cycle.has_data(name), name
        assert name in st.tried and name in st.served_top
    return st, d.t


def _stats(st: PolicyState, name: str) -> tuple[object, ...]:
    m = st.model
    return (
        m.cycle.stats[name].to_dict(),
        {k: v.to_dict() for k, v in m.cycle.buckets[name].items()},
        {w: s.to_dict() for w, s in m.accept.ratios[name].items()},
        m.accept.hists[name].to_dict(),
        m.observed.get(name),
    )


def test_unchanged_profiles_keep_everything() -> None:
    st, _ = _learned()
    before = st.to_dict()
    changes = reconcile_profiles(st, PROFILES, dict(DIGESTS))
    assert changes == ProfileChanges() and not changes and changes.describe() == ""
    assert st.to_dict() == before


def test_a_state_saved_without_digests_loads_unchanged_and_records_them() -> None:
    st, _ = _learned()
    old = st.to_dict()
    del old["digests"]  # as an older version saved it
    restored = PolicyState.from_dict(old)
    assert restored.digests == {}
    # Every digest differs from anything the state could have known: not a change.
    new = {"baseline": "x0", "eagle2": "x2", "eagle5": "x5"}
    assert not reconcile_profiles(restored, PROFILES, new)
    assert restored.digests == new
    for name in ("baseline", "eagle2", "eagle5"):
        assert _stats(restored, name) == _stats(st, name)
    assert restored.tried == st.tried
    # From now on the digests tell: the next edit of eagle5 is a change.
    changes = reconcile_profiles(restored, PROFILES, {**new, "eagle5": "x5'"})
    assert changes.changed == ("eagle5",)


def test_a_changed_profile_is_reset_and_untried_the_others_keep_theirs() -> None:
    st, t = _learned()
    st.restart_s["eagle5"] = 200.0
    st.failed["eagle5"] = t
    st.explore_declined["eagle5"] = "info"
    kept = {n: _stats(st, n) for n in ("baseline", "eagle2")}
    changes = reconcile_profiles(st, PROFILES, {**DIGESTS, "eagle5": "e5-other-draft"})
    assert changes == ProfileChanges(changed=("eagle5",))
    assert changes.describe() == "changed=eagle5"
    assert st.digests["eagle5"] == "e5-other-draft"
    m = st.model
    assert not m.cycle.has_data("eagle5") and not m.accept.has_data("eagle5")
    assert m.observed_tok_s("eagle5") is None and m.accept.histogram("eagle5") is None
    assert "eagle5" not in st.tried
    for per in (st.restart_s, st.failed, st.explore_declined, st.served_top, st.served_low):
        assert "eagle5" not in per
    assert not [k for k in st.monitor.detectors if k.split(":")[1:2] == ["eagle5"]]
    assert not [k for k in st.stream_acc if k.startswith("accept:eagle5:")]
    for n, s in kept.items():
        assert _stats(st, n) == s
    assert {"baseline", "eagle2"} <= st.tried
    # The reset survives the store's round trip, and the policy goes on deciding.
    st = PolicyState.from_dict(st.to_dict())
    assert not st.model.cycle.has_data("eagle5")
    d = Driver("baseline")
    d.state, d.t, d.running = st, t, st.running
    d.run(60, 8.0, ALPHAS, MIX)
    assert d.state.model.cycle.has_data(d.state.running)


def test_a_spec_that_moved_under_the_same_digest_is_refreshed_not_reset() -> None:
    st, _ = _learned()
    kept = _stats(st, "eagle5")
    capped = dataclasses.replace(E5, max_running_requests=48)  # what a newer version derives
    for digests in (DIGESTS, {}):
        st.digests = dict(digests)
        assert not reconcile_profiles(st, (BASE, E2, capped), DIGESTS)
        assert st.specs["eagle5"] == capped and st.model.specs["eagle5"] == capped
        assert st.model.cycle.specs["eagle5"] == capped
        assert st.model.accept.specs["eagle5"] == capped
        assert _stats(st, "eagle5") == kept and "eagle5" in st.tried


def test_a_removed_profile_is_forgotten_and_never_chosen() -> None:
    st, t = _learned()
    st.restart_s["eagle5"] = 200.0
    changes = reconcile_profiles(
        st, (BASE, E2), {"baseline": "b0", "eagle2": "e2"}, running="baseline"
    )
    # The learned state ran eagle5 last: the profile the caller has serving takes its place.
    assert changes == ProfileChanges(removed=("eagle5",), cleared=("running",))
    assert st.running == "baseline"
    assert list(st.specs) == ["baseline", "eagle2"]
    assert "eagle5" not in st.model.specs
    assert "eagle5" not in st.model.cycle.stats and "eagle5" not in st.model.accept.ratios
    assert "eagle5" not in st.tried and "eagle5" not in st.restart_s
    assert "eagle5" not in st.digests
    assert all("eagle5" not in p.profile for p in _predictions(st))
    st = PolicyState.from_dict(st.to_dict())
    assert "eagle5" not in st.model.specs
    # eagle5 was the best profile measured; no decision may name it now.
    d = Driver("baseline")
    d.state, d.t, d.running = st, t, st.running
    decisions = d.run(60, 8.0, ALPHAS, MIX)
    assert all(x.profile != "eagle5" for x in decisions)


def _predictions(st: PolicyState) -> list:
    from policies.decide import predictions

    return predictions(st)


def test_a_new_profile_joins_untried_and_can_be_pinned() -> None:
    st, t = _learned()
    changes = reconcile_profiles(st, (*PROFILES, E3), {**DIGESTS, "eagle3": "e3"})
    assert changes == ProfileChanges(added=("eagle3",))
    assert changes.describe() == "added=eagle3"
    assert st.specs["eagle3"] == E3 and "eagle3" not in st.tried
    assert not st.model.cycle.has_data("eagle3")
    assert any(p.profile == "eagle3" for p in _predictions(st))
    st, dec = decide(st, None, t + 10, st.settings, Overrides(pin_profile="eagle3"))
    assert dec.action is Action.SWITCH and dec.profile == "eagle3"


def test_pending_references_to_a_removed_profile_are_cleared() -> None:
    st, t = _learned()
    st.running = "eagle5"
    st.pending = {"target": "eagle2", "from": "eagle5", "reason": "explore"}
    st.trial = {"profile": "eagle5", "from": "baseline", "windows": []}
    st.rollback_to = "eagle5"
    st.boot_ref = {"profile": "eagle5", "n": 0.0}
    st.failed["eagle5"] = t
    changes = reconcile_profiles(
        st, (BASE, E2), {"baseline": "b0", "eagle2": "e2"}, running="eagle2"
    )
    assert changes.removed == ("eagle5",)
    assert set(changes.cleared) == {"pending", "trial", "rollback_to", "running"}
    assert "cleared=" in changes.describe()
    assert st.pending is None and st.trial is None and st.rollback_to is None
    assert st.boot_ref is None and "eagle5" not in st.failed
    assert st.running == "eagle2"
    # Without a profile named, the first configured one runs in the state.
    st2, _ = _learned()
    st2.running = "eagle5"
    reconcile_profiles(st2, (E2, BASE), {"baseline": "b0", "eagle2": "e2"})
    assert st2.running == "eagle2"


def test_references_to_unaffected_profiles_stay() -> None:
    st, _ = _learned()
    st.pending = {"target": "eagle2", "from": "baseline", "reason": "explore"}
    st.rollback_to = "baseline"
    reconcile_profiles(st, (BASE, E2), {"baseline": "b0", "eagle2": "e2"})
    assert st.pending is not None and st.rollback_to == "baseline"


def test_adaptive_profiles_get_and_lose_their_tables() -> None:
    st, _ = _learned()
    assert st.hybrid is None
    ada = ProfileSpec(
        "ada",
        num_steps=3,
        draft_tokens=4,
        algorithm="EAGLE3",
        adaptive=True,
        candidate_steps=(0, 1, 3),
    )
    reconcile_profiles(st, (*PROFILES, ada), {**DIGESTS, "ada": "a"}, now_s=5.0)
    assert st.hybrid is not None and list(st.hybrid.tables) == ["ada"]
    table = st.hybrid.tables["ada"]
    assert table["t_s"] == 5.0 and table["reason"] == "seed"
    st.hybrid.corr["ada"] = {}
    # A changed adaptive profile is reseeded, its own corrections dropped.
    mine = {"ada": {"table": {"mine": True}, "managed": True}}
    reconcile_profiles(st, (*PROFILES, ada), {**DIGESTS, "ada": "b"}, adaptive_tables=mine)
    assert st.hybrid.tables["ada"]["reason"] == "seed" and "ada" not in st.hybrid.corr
    reconcile_profiles(st, PROFILES, DIGESTS)
    assert st.hybrid is None


def test_bad_arguments_are_refused() -> None:
    st, _ = _learned()
    with pytest.raises(ValueError, match="no digest"):
        reconcile_profiles(st, PROFILES, {"baseline": "b0"})
    with pytest.raises(ValueError, match="unique"):
        reconcile_profiles(st, (BASE, BASE), DIGESTS)
    with pytest.raises(ValueError, match="running"):
        reconcile_profiles(st, PROFILES, DIGESTS, running="eagle9")


def test_drop_unknown_pin() -> None:
    o = Overrides(pin_profile="eagle5", pin_until_s=100.0, paused_until_s=50.0)
    assert drop_unknown_pin(o, {"baseline", "eagle5"}) is o
    dropped = drop_unknown_pin(o, {"baseline"})
    assert dropped == Overrides(paused_until_s=50.0)
    assert drop_unknown_pin(Overrides(), {"baseline"}) == Overrides()
