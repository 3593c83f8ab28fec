"""store: open/migrate, typed writes and reads, bad input, crash safety, readers."""

from __future__ import annotations

import math
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.types import (
    Action,
    Decision,
    DecodeMoments,
    Estimate,
    Mode,
    Observation,
    Overrides,
    ProfilePrediction,
    Reason,
    WorkloadWindow,
)
from store import (
    ALL_WORKLOADS,
    OverrideKind,
    Reader,
    Store,
    StoreError,
    SwitchOutcome,
    TrialState,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "sp.db")
    yield s
    s.close()


def _obs(t_s: float = 100.0, **kw) -> Observation:
    base = dict(
        t_s=t_s,
        window_s=5.0,
        profile="eagle3-2",
        running_reqs=12.0,
        queue_reqs=0.0,
        spec_accept_length=2.1,
        decode_tokens=500.0,
        generation_tokens=480.0,
        verify_calls=230.0,
    )
    base.update(kw)
    return Observation(**base)  # type: ignore[arg-type]


def _integrity_ok(s: Store) -> bool:
    return s.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_open_creates_wal_and_migrations(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "sp.db"
    with Store(path) as s:
        assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s.db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
        names = [r[0] for r in s.db.execute("SELECT name FROM _sqlite_migrations")]
        assert names == ["m001_initial", "m002_adaptive_tables"]
        assert set(s.counts()) >= {"observations", "decisions", "switches", "state"}
    with Store(path) as s:  # reopening applies nothing twice
        assert s.db.execute("SELECT COUNT(*) FROM _sqlite_migrations").fetchone()[0] == 2


def test_newer_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "sp.db"
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.execute(
        "INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
        "VALUES ('specpilot', 'm999_future', 'x')"
    )
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer specpilot"):
        Store(path)


def test_another_applications_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "grafana.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE dashboard (id INTEGER PRIMARY KEY, title TEXT)")
    conn.execute("INSERT INTO dashboard (title) VALUES ('tok/s')")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match=r"grafana.db is not specpilot's: it holds other tables"):
        Store(path)
    assert path.read_bytes() == before  # no WAL switch, no table of ours
    assert not (tmp_path / "grafana.db-wal").exists()
    Store(tmp_path / "empty.db").close()  # an empty file or a new one is ours to fill
    Store(tmp_path / "empty.db").close()  # and ours once it is


def test_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="cannot open database"):
        Store(path)
    with pytest.raises(StoreError, match="does not exist"):
        Reader(tmp_path / "missing.db")


def test_observation_roundtrip(store: Store) -> None:
    obs = _obs(
        spec_accept_rate=float("nan"),
        gen_throughput_tok_s=float("inf"),
        moments=DecodeMoments(10, 40, 0.2, 200, 0.8, 25),
        workloads=(WorkloadWindow("code", 300.0, 100.0, 3.0), WorkloadWindow("chat", None)),
        accepted_drafts_hist=(5.0, 3.0, 2.0),
        counter_reset=True,
    )
    store.record_observation(obs)
    [row] = store.observations(since_s=0)
    assert row["profile"] == "eagle3-2"
    assert row["output_tok_s"] == pytest.approx(100.0)  # decode_tokens / window_s
    assert row["running"] == 12.0 and row["queue"] == 0.0  # a real 0 stays 0
    assert row["accept_rate"] is None and row["gen_throughput_tok_s"] is None  # non-finite
    assert row["counter_reset"] is True
    assert row["moments"]["sum_step_s"] == 0.2
    assert row["workloads"][0] == {
        "workload": "code",
        "generation_tokens": 300.0,
        "verify_calls": 100.0,
        "requests": 3.0,
    }
    assert row["workloads"][1]["generation_tokens"] is None
    assert row["accepted_drafts_hist"] == [5.0, 3.0, 2.0]
    assert store.observations(since_s=101) == []
    assert store.observations(since_s=0, profile="other") == []


def test_an_accept_length_where_nothing_was_verified_is_stored_as_none(store: Store) -> None:
    """SGLang's spec_accept_length gauge reads 0 on a server without speculation and after an
    interval without a verify step: not an accept length (one counts the bonus token, so it is
    at least 1). Stored as 0 it plotted as one in the report and pulled hourly means down."""
    store.record_observation(_obs(100.0, profile="baseline", spec_accept_length=0.0))
    store.record_observation(_obs(105.0, spec_accept_length=0.0, spec_accept_rate=0.0))
    store.record_observation(_obs(110.0, spec_accept_length=2.1, spec_accept_rate=0.0))
    rows = store.observations(since_s=0)
    assert [r["accept_length"] for r in rows] == [None, None, 2.1]
    assert [r["accept_rate"] for r in rows] == [None, None, 0.0]  # a real 0 rate stays


def test_observation_without_time_is_refused_and_nothing_written(store: Store) -> None:
    for bad in (_obs(t_s=float("nan")), _obs(window_s=None), _obs(profile=None)):  # type: ignore[arg-type]
        with pytest.raises(StoreError):
            store.record_observation(bad)
    assert store.counts()["observations"] == 0
    assert _integrity_ok(store)


def test_decisions(store: Store) -> None:
    d = Decision(
        t_s=10.0,
        action=Action.SWITCH,
        profile="eagle3-5",
        reason=Reason.SWITCH_PREDICTED_GAIN,
        diagnostics={"gain_tok_s": 12.5, "bad": float("nan"), "n": 3, "why": "x", "ok": True},
    )
    did = store.record_decision(d, Mode.ADVISORY, acted=False)
    store.record_decision(
        Decision(11.0, Action.HOLD, "eagle3-2", Reason.HOLD_BEST), "active", acted=False
    )
    rows = store.recent_decisions(limit=10)
    assert [r["t_s"] for r in rows] == [11.0, 10.0]  # newest first
    first = rows[1]
    assert first["id"] == did
    assert (first["action"], first["reason"], first["mode"]) == (
        "switch",
        "switch_predicted_gain",
        "advisory",
    )
    assert first["acted"] is False
    assert first["diagnostics"] == {"gain_tok_s": 12.5, "bad": None, "n": 3, "why": "x", "ok": True}
    assert len(store.recent_decisions(limit=10, since_s=10.5)) == 1
    with pytest.raises(StoreError, match="mode"):
        store.record_decision(d, "yolo", acted=True)
    assert store.counts()["decisions"] == 2


def test_estimates(store: Store) -> None:
    preds = [
        ProfilePrediction(
            "baseline", Estimate(88.0, 85.0, 91.0, 40), cycle_s=Estimate(0.011, 0.01, 0.012)
        ),
        ProfilePrediction(
            "eagle3-2",
            Estimate(94.0, 80.0, float("inf"), 12),
            accept_length=Estimate(2.0, 1.85, 2.12, 300),
            breakeven_accept_length=2.46,
            observed_tok_s=93.0,
            source="observed",
        ),
        ProfilePrediction("eagle3-5", None, source="tail_model"),
    ]
    assert store.record_estimates(20.0, preds) == 3
    store.record_estimates(30.0, preds[:1], workload="code")
    store.record_estimates(40.0, preds[:1])
    rows = store.estimates(since_s=0, profile="eagle3-2")
    assert len(rows) == 1
    r = rows[0]
    assert r["workload"] == ALL_WORKLOADS
    assert (r["tok_s_mean"], r["tok_s_low"], r["tok_s_high"]) == (94.0, 80.0, None)
    assert r["accept_length_n"] == 300 and r["breakeven_accept_length"] == 2.46
    assert r["cycle_s_mean"] is None
    e5 = store.estimates(profile="eagle3-5")[0]
    assert e5["tok_s_mean"] is None and e5["source"] == "tail_model"
    latest = {(r["profile"], r["workload"]): r["t_s"] for r in store.latest_estimates()}
    assert latest == {
        ("baseline", "*"): 40.0,
        ("baseline", "code"): 30.0,
        ("eagle3-2", "*"): 20.0,
        ("eagle3-5", "*"): 20.0,
    }


def test_switch_lifecycle_and_trials(store: Store) -> None:
    sid = store.start_switch("eagle3-2", "baseline", "switch_predicted_gain", 100.0)
    assert store.open_switch()["id"] == sid
    with pytest.raises(StoreError, match="still open"):
        store.start_switch("eagle3-2", "eagle3-5", "explore", 101.0)
    store.record_trial(sid, TrialState.PENDING, 100.0, predicted_tok_s=95.0)
    store.record_trial(sid, "running", 300.0, predicted_tok_s=95.0, observed_tok_s=float("nan"))
    store.finish_switch(sid, ended_s=290.0, outcome=SwitchOutcome.OK, downtime_s=190.0)
    store.record_trial(sid, "successful", 600.0, observed_tok_s=97.0, detail={"windows": 12})
    assert store.open_switch() is None
    [sw] = store.switches()
    assert (sw["from_profile"], sw["to_profile"], sw["outcome"], sw["downtime_s"]) == (
        "eagle3-2",
        "baseline",
        "ok",
        190.0,
    )
    states = [t["state"] for t in store.trials(sid)]
    assert states == ["successful", "running", "pending"]
    assert store.trials(sid)[0]["detail"] == {"windows": 12}
    assert store.trials(sid)[1]["observed_tok_s"] is None
    with pytest.raises(StoreError, match="already finished"):
        store.finish_switch(sid, ended_s=300.0, outcome="unknown")
    with pytest.raises(StoreError, match="no switch"):
        store.finish_switch(999, ended_s=300.0, outcome="ok")
    with pytest.raises(StoreError, match="no switch"):
        store.record_trial(999, "pending", 1.0)
    sid2 = store.start_switch(None, "eagle3-5", "explore", 700.0, decision_id=7)
    with pytest.raises(StoreError, match="outcome"):
        store.finish_switch(sid2, ended_s=800.0, outcome="fine")
    with pytest.raises(StoreError, match="trial state"):
        store.record_trial(sid2, "maybe", 800.0)
    store.finish_switch(sid2, ended_s=800.0, outcome="start_failed", error="exit 1: OOM" * 5000)
    sw2 = store.switches(limit=1)[0]
    assert sw2["outcome"] == "start_failed" and len(sw2["error"]) <= 16_384
    assert sw2["decision_id"] == 7


def test_overrides_findings_state(store: Store) -> None:
    oid = store.record_override(
        OverrideKind.PIN, 50.0, "alice", profile="baseline", ttl_s=3600, reason="load test"
    )
    store.record_override("mode", 60.0, "api", mode=Mode.ADVISORY)
    hist = store.overrides_history()
    assert [h["kind"] for h in hist] == ["mode", "pin"]
    assert hist[1]["id"] == oid and hist[1]["until_s"] == 3650.0
    assert hist[0]["mode"] == "advisory"
    with pytest.raises(StoreError, match="override kind"):
        store.record_override("unpinn", 1.0, "x")
    with pytest.raises(StoreError, match="ttl_s"):
        store.record_override("pause", 1.0, "x", ttl_s=-5)
    with pytest.raises(StoreError, match="actor"):
        store.record_override("pause", 1.0, "")

    store.record_finding(
        "acceptance_low",
        70.0,
        "accept length 0.9 far below history 2.0",
        subject="eagle3-2",
        numbers={"now": 0.9, "history": 2.0, "z": float("-inf")},
    )
    [f] = store.findings(kind="acceptance_low")
    assert f["numbers"] == {"now": 0.9, "history": 2.0, "z": None}
    assert store.findings(kind="other") == []

    assert store.load_state("policy") is None
    store.save_state("policy", {"a": [1, 2.5, float("nan")], "nested": {"k": (1, 2)}}, t_s=1.0)
    store.save_state("policy", {"a": 2})
    assert store.load_state("policy") == {"a": 2}
    with pytest.raises(StoreError):
        store.save_state("policy", ["not", "a", "mapping"])  # type: ignore[arg-type]
    assert store.load_overrides() is None
    ov = Overrides(pin_profile="baseline", pin_until_s=99.0, mode=Mode.ADVISORY)
    store.save_overrides(ov, t_s=5.0)
    assert store.load_overrides() == ov
    store.delete_state("overrides")
    assert store.load_overrides() is None


def test_batch_is_all_or_nothing(store: Store) -> None:
    with store.batch():
        store.record_observation(_obs(1.0))
        store.record_decision(Decision(1.0, Action.HOLD, "p", Reason.HOLD_BEST), "active", False)
    with pytest.raises(RuntimeError), store.batch():
        store.record_observation(_obs(2.0))
        raise RuntimeError("tick failed half way")
    with pytest.raises(StoreError), store.batch():
        store.record_observation(_obs(3.0))
        store.record_observation(_obs(float("nan")))
    assert [r["t_s"] for r in store.observations()] == [1.0]
    assert store.counts()["decisions"] == 1
    assert _integrity_ok(store)


def test_reader_sees_commits_and_cannot_write(store: Store) -> None:
    with store.reader() as r:
        assert r.observations() == []
        store.record_observation(_obs(5.0))
        assert [o["t_s"] for o in r.observations()] == [5.0]
        with pytest.raises(sqlite3.OperationalError):
            r.db.execute("INSERT INTO findings (t_s, kind, message) VALUES (1, 'k', 'm')")


def test_export_rows(store: Store) -> None:
    for t in (1.0, 2.0, 3.0):
        store.record_observation(_obs(t))
    assert [r["t_s"] for r in store.export_rows("observations", since_s=2.0)] == [2.0, 3.0]
    assert list(store.export_rows("switches")) == []
    with pytest.raises(StoreError, match="unknown table"):
        list(store.export_rows("sqlite_master"))


def test_committed_rows_survive_a_killed_process(tmp_path: Path) -> None:
    """The writer process dies without closing (os._exit): every committed tick is there."""
    path = tmp_path / "crash.db"
    code = textwrap.dedent(
        f"""
        import os
        from policies.types import Observation, Decision, Action, Reason
        from store import Store
        s = Store({str(path)!r})
        for i in range(50):
            with s.batch():
                s.record_observation(Observation(t_s=float(i), window_s=1.0, profile="p"))
                s.record_decision(Decision(float(i), Action.HOLD, "p", Reason.HOLD_BEST),
                                  "active", False)
        s.save_state("policy", {{"ticks": 50}})
        os._exit(9)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60)
    assert proc.returncode == 9
    with Store(path) as s:
        assert s.counts()["observations"] == 50
        assert s.counts()["decisions"] == 50
        assert s.load_state("policy") == {"ticks": 50}
        assert _integrity_ok(s)


_weird = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**30), 10**30),
    st.text(max_size=20),
    st.booleans(),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    t=_weird,
    window=_weird,
    profile=_weird,
    running=_weird,
    diag=st.dictionaries(st.text(max_size=5), _weird, max_size=5),
)
def test_bad_input_never_corrupts(store: Store, t, window, profile, running, diag) -> None:
    before = store.counts()
    try:
        store.record_observation(
            Observation(t_s=t, window_s=window, profile=profile, running_reqs=running)
        )
    except StoreError:
        assert store.counts()["observations"] == before["observations"]
    try:
        store.record_decision(
            Decision(t, Action.HOLD, profile, Reason.HOLD_BEST, diag), "active", False
        )
    except StoreError:
        assert store.counts()["decisions"] == before["decisions"]
    for r in store.recent_decisions(limit=1):
        assert all(
            not (isinstance(v, float) and not math.isfinite(v)) for v in r["diagnostics"].values()
        )
    assert _integrity_ok(store)
