import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import observation
from policies.observation import diff
from policies.types import Snapshot
from tests.policies.synth import BASE, E2, Synth, to_snapshot


def snap(t: float, profile: str = "eagle2", **kw: object) -> Snapshot:
    return Snapshot(t_s=t, profile=profile, **kw)  # type: ignore[arg-type]


def test_plain_deltas_per_workload_and_totals() -> None:
    a = snap(
        0,
        generation_tokens={"chat": 100.0, "code": 50.0},
        verify_calls={"chat": 40.0, "code": 20.0},
        requests={"chat": 2.0, "code": 1.0},
        decode_tokens=1000.0,
        moments=(10.0, 40.0, 0.2, 170.0, 0.8, 100.0),
        accepted_drafts_hist=(5.0, 5.0, 10.0),
        running_reqs=3.0,
    )
    b = snap(
        10,
        generation_tokens={"chat": 160.0, "code": 80.0},
        verify_calls={"chat": 70.0, "code": 32.0},
        requests={"chat": 3.0, "code": 2.0},
        decode_tokens=1300.0,
        moments=(20.0, 80.0, 0.4, 340.0, 1.6, 200.0),
        accepted_drafts_hist=(6.0, 9.0, 20.0),
        running_reqs=4.0,
        queue_reqs=2.0,
        max_running_reqs=48.0,
    )
    o = diff(a, b)
    assert o.window_s == 10 and o.profile == "eagle2" and not o.counter_reset
    ws = {w.workload: w for w in o.workloads}
    assert ws["chat"].generation_tokens == 60 and ws["chat"].verify_calls == 30
    assert ws["code"].requests == 1
    assert o.generation_tokens == 90 and o.verify_calls == 42
    assert o.decode_tokens == 300 and o.output_tok_s == 30
    assert (
        o.moments is not None
        and o.moments.n_steps == 10
        and o.moments.sum_step_s == pytest.approx(0.2)
    )
    assert o.accepted_drafts_hist == (1.0, 4.0, 10.0)
    assert o.running_reqs == 4.0  # gauges from cur
    assert (o.queue_reqs, o.max_running_reqs) == (2.0, 48.0)


def test_counter_reset_makes_every_delta_the_current_value() -> None:
    a = snap(0, generation_tokens={"chat": 1000.0}, verify_calls={"chat": 500.0}, decode_tokens=5e4)
    b = snap(10, generation_tokens={"chat": 30.0}, verify_calls={"chat": 900.0}, decode_tokens=40.0)
    o = diff(a, b)
    assert o.counter_reset
    assert o.generation_tokens == 30 and o.verify_calls == 900 and o.decode_tokens == 40


def test_missing_is_none_never_zero() -> None:
    a = snap(0, generation_tokens={"chat": 10.0})
    b = snap(10, generation_tokens={"chat": 20.0})
    o = diff(a, b)
    assert o.verify_calls is None and o.decode_tokens is None and o.moments is None
    assert o.accepted_drafts_hist is None and o.running_reqs is None
    ws = {w.workload: w for w in o.workloads}
    assert ws["chat"].requests is None


def test_new_workload_series_started_at_zero_but_unreported_counter_is_unknown() -> None:
    a = snap(0, generation_tokens={"chat": 10.0}, verify_calls={})
    b = snap(10, generation_tokens={"chat": 20.0, "code": 7.0}, verify_calls={"chat": 5.0})
    o = diff(a, b)
    ws = {w.workload: w for w in o.workloads}
    assert ws["code"].generation_tokens == 7.0  # labelled series born inside the window
    assert ws["chat"].verify_calls is None  # the source reported no verify series before


def test_vanished_series_is_missing() -> None:
    o = diff(
        snap(0, generation_tokens={"chat": 10.0, "x": 3.0}),
        snap(10, generation_tokens={"chat": 20.0}),
    )
    ws = {w.workload: w for w in o.workloads}
    assert ws["x"].generation_tokens is None and o.generation_tokens == 10.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0])
def test_non_finite_or_negative_values_are_missing(bad: float) -> None:
    a = snap(0, decode_tokens=10.0, generation_tokens={"chat": 1.0}, running_reqs=1.0)
    b = snap(
        10, decode_tokens=bad, generation_tokens={"chat": bad}, running_reqs=bad, startup_s=bad
    )
    o = diff(a, b)
    assert o.decode_tokens is None and o.generation_tokens is None and o.running_reqs is None
    assert o.startup_s is None
    assert not o.counter_reset


def test_profile_change_is_not_a_same_profile_window() -> None:
    a = snap(0, profile="baseline", generation_tokens={"chat": 100.0}, decode_tokens=50.0)
    b = snap(
        10,
        profile="eagle2",
        generation_tokens={"chat": 5.0},
        decode_tokens=9.0,
        running_reqs=2.0,
        startup_s=95.0,
    )
    o = diff(a, b)
    assert o.counter_reset and o.profile == "eagle2"
    assert o.startup_s == 95.0  # the new server's boot, a gauge: read in its first window
    assert o.generation_tokens is None and o.decode_tokens is None and o.workloads == ()
    assert o.moments is None and o.accepted_drafts_hist is None
    assert o.running_reqs == 2.0


def test_histogram_of_another_shape_is_not_a_delta() -> None:
    o = diff(
        snap(0, accepted_drafts_hist=(1.0, 2.0, 3.0)),
        snap(10, accepted_drafts_hist=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)),
    )
    assert o.accepted_drafts_hist is None


def test_out_of_order_snapshots_raise() -> None:
    with pytest.raises(ValueError, match="out of order"):
        diff(snap(10), snap(10))


def test_round_trip_through_snapshots() -> None:
    syn = Synth(seed=5)
    o1 = syn.window(E2, 10.0, 4, {"chat": 0.7, "code": 0.8}, {"chat": 0.5, "code": 0.5})
    o2 = syn.window(E2, 20.0, 4, {"chat": 0.7, "code": 0.8}, {"chat": 0.5, "code": 0.5})
    s1 = to_snapshot(None, o1)
    s2 = to_snapshot(s1, o2)
    d = diff(s1, s2)
    assert d.generation_tokens == pytest.approx(o2.generation_tokens)
    assert d.verify_calls == pytest.approx(o2.verify_calls)
    assert d.moments is not None and o2.moments is not None
    assert d.moments.n_steps == pytest.approx(o2.moments.n_steps)
    assert d.accepted_drafts_hist == pytest.approx(o2.accepted_drafts_hist)


counter = st.one_of(st.none(), st.floats(0, 1e9), st.just(math.nan), st.floats(-10, -1e-3))


@given(
    st.dictionaries(st.sampled_from(["chat", "code", "_unlabelled"]), counter, max_size=3),
    st.dictionaries(st.sampled_from(["chat", "code", "_unlabelled"]), counter, max_size=3),
    counter,
    counter,
    st.one_of(st.none(), st.tuples(*[st.floats(0, 1e6)] * 6)),
    st.one_of(st.none(), st.tuples(*[st.floats(0, 1e6)] * 6)),
    st.sampled_from([BASE.name, E2.name]),
)
@settings(max_examples=150, deadline=None)
def test_deltas_never_negative(ga, gb, da, db, ma, mb, prof_b) -> None:  # type: ignore[no-untyped-def]
    a = Snapshot(
        t_s=0.0,
        profile=BASE.name,
        generation_tokens={k: v for k, v in ga.items() if v is not None},
        decode_tokens=da,
        moments=ma,
    )
    b = Snapshot(
        t_s=10.0,
        profile=prof_b,
        generation_tokens={k: v for k, v in gb.items() if v is not None},
        decode_tokens=db,
        moments=mb,
    )
    o = diff(a, b)
    vals = [o.generation_tokens, o.decode_tokens, o.verify_calls]
    vals += [w.generation_tokens for w in o.workloads]
    if o.moments is not None:
        vals += [o.moments.n_steps, o.moments.sum_bs, o.moments.sum_step_s]
    for v in vals:
        assert v is None or (math.isfinite(v) and v >= 0)


_ODD = [
    0.0,
    -0.0,
    1.0,
    2.0,
    -1.0,
    1e300,
    5e-324,
    math.inf,
    -math.inf,
    math.nan,
    3,
    True,
    None,
    "2.5",
    "x",
]


@pytest.mark.parametrize("prev", _ODD)
@pytest.mark.parametrize("cur", _ODD)
def test_a_counter_went_back_only_when_both_are_counters_and_cur_is_lower(prev, cur) -> None:  # type: ignore[no-untyped-def]
    """The float fast path of _went_back says what the general rule says: both values read as
    counters (finite, >= 0) and the current one is lower."""
    p, c = observation._counter(prev), observation._counter(cur)
    assert observation._went_back(prev, cur) == (p is not None and c is not None and c < p)
