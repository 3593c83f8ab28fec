"""store retention: downsampling conserves totals, audit rows are kept, a month stays bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from policies.types import Action, Decision, Estimate, Observation, ProfilePrediction, Reason
from store import RetentionPolicy, Store

DAY = 86400.0


def _obs(t: float, profile: str = "eagle3-2", window_s: float = 10.0) -> Observation:
    # decode tokens vary with time so that sums catch a lost or doubled row
    return Observation(
        t_s=t,
        window_s=window_s,
        profile=profile,
        running_reqs=8.0 + (t % 7),
        queue_reqs=None if int(t // 60) % 3 == 0 else 1.0,
        spec_accept_length=2.0,
        generation_tokens=100.0,
        verify_calls=50.0,
        decode_tokens=1000.0 + (t % 13),
    )


def _output_total(s: Store) -> tuple[float, float]:
    raw = s.db.execute("SELECT TOTAL(output_tok_s * window_s), TOTAL(window_s) FROM observations")
    r_tok, r_w = raw.fetchone()
    hourly = s.db.execute("SELECT TOTAL(output_tokens), TOTAL(window_s) FROM observations_hourly")
    h_tok, h_w = hourly.fetchone()
    return r_tok + h_tok, r_w + h_w


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        RetentionPolicy(raw_s=0)
    with pytest.raises(ValueError):
        RetentionPolicy(raw_s=10 * DAY, hourly_s=DAY)


def test_downsampling_conserves_totals_across_partial_hours(tmp_path: Path) -> None:
    s = Store(tmp_path / "r.db", retention=RetentionPolicy(raw_s=DAY, hourly_s=30 * DAY))
    ticks = [float(t) for t in range(0, int(3 * DAY), 60)]
    s.record_observations([_obs(t, "eagle3-2" if t < 1.5 * DAY else "baseline") for t in ticks])
    before = _output_total(s)
    # two runs whose cutoffs fall mid-hour: hours split between runs must merge additively
    out1 = s.apply_retention(now_s=2 * DAY + 1234.0)
    out2 = s.apply_retention(now_s=2.5 * DAY + 2345.0)
    assert out1["observations_deleted"] > 0 and out2["observations_deleted"] > 0
    after = _output_total(s)
    assert after[0] == pytest.approx(before[0], rel=1e-12)
    assert after[1] == pytest.approx(before[1], rel=1e-12)
    cutoff = 2.5 * DAY + 2345.0 - DAY
    assert s.observations(until_s=cutoff) == []
    assert len(s.observations(since_s=cutoff)) == len([t for t in ticks if t >= cutoff])
    hourly = s.observations_hourly()
    assert sum(h["n"] for h in hourly) == len([t for t in ticks if t < cutoff])
    assert {h["profile"] for h in hourly} == {"eagle3-2", "baseline"}
    h0 = hourly[0]
    assert h0["hour_s"] == 0 and h0["n"] == 60
    assert h0["output_tok_s"] == pytest.approx(
        sum((1000.0 + (t % 13)) for t in ticks if t < 3600) / (60 * 10.0)
    )
    assert h0["running"] == pytest.approx(sum(8.0 + (t % 7) for t in ticks if t < 3600) / 60)
    assert h0["queue"] == pytest.approx(1.0)  # NULL queues do not dilute the mean
    assert h0["tokenizer_accept_length"] == pytest.approx(2.0)
    s.close()


def test_audit_rows_are_kept_bulk_rows_dropped(tmp_path: Path) -> None:
    s = Store(tmp_path / "r.db", retention=RetentionPolicy(raw_s=DAY, hourly_s=2 * DAY))
    pred = [ProfilePrediction("baseline", Estimate(80, 70, 90))]
    for t in (10.0, 20.0, 5 * DAY):
        s.record_decision(Decision(t, Action.HOLD, "p", Reason.HOLD_BEST), "active", False)
        s.record_estimates(t, pred)
    s.record_decision(Decision(30.0, Action.SWITCH, "q", Reason.EXPLORE), "active", True)
    s.record_decision(Decision(31.0, Action.SWITCH, "q", Reason.EXPLORE), "advisory", False)
    sid = s.start_switch("p", "q", "explore", 30.0)
    s.finish_switch(sid, ended_s=200.0, outcome="ok", downtime_s=170.0)
    s.record_trial(sid, "successful", 400.0)
    s.record_override("pause", 40.0, "bob", ttl_s=60)
    s.record_finding("drift", 50.0, "verify time up 40%")
    s.record_observation(_obs(60.0))
    out = s.apply_retention(now_s=5 * DAY + 1)
    assert out["decisions_deleted"] == 2 and out["estimates_deleted"] == 2
    assert [d["reason"] for d in s.recent_decisions()] == ["hold_best", "explore", "explore"]
    c = s.counts()
    assert (c["switches"], c["trials"], c["overrides"], c["findings"]) == (1, 1, 1, 1)
    assert c["observations"] == 0 and c["observations_hourly"] == 0  # past hourly_s as well
    assert out["hourly_deleted"] == 1
    s.close()


def _simulate_month(path: Path, tick_s: float, days: int = 30) -> list[int]:
    """Write `days` of per-tick observations, decisions and estimates (one transaction per
    simulated hour, as fast as the store allows), apply retention daily, return the file size
    (db + WAL) after each day."""
    s = Store(path)  # default policy: 7 days raw, 400 days hourly
    preds = [
        ProfilePrediction("baseline", Estimate(88, 85, 91, 10)),
        ProfilePrediction("eagle3-2", Estimate(94, 80, 100, 10), Estimate(2.0, 1.9, 2.1)),
    ]
    sizes: list[int] = []
    t = 472_222 * 3600.0  # an hour boundary near 2023-11, so days are whole hours
    per_hour = int(3600 / tick_s)
    for _day in range(days):
        for _hour in range(24):
            ts = [t + i * tick_s for i in range(per_hour)]
            with s.batch():
                s.record_observations([_obs(x, window_s=tick_s) for x in ts])
                for x in ts:
                    s.record_decision(
                        Decision(x, Action.HOLD, "eagle3-2", Reason.HOLD_BEST, {"margin": 0.01}),
                        "active",
                        False,
                    )
                for x in ts[:: max(1, per_hour // 12)]:  # estimates every ~5 minutes
                    s.record_estimates(x, preds)
            t += 3600
        s.apply_retention(now_s=t)
        sizes.append(_db_bytes(path))
    raw = s.counts()["observations"]
    assert raw <= 7 * 86400 / tick_s + 1
    assert s.counts()["observations_hourly"] == (days - 7) * 24
    s.close()
    return sizes


def _db_bytes(path: Path) -> int:
    wal = Path(str(path) + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def _assert_bounded(sizes: list[int]) -> None:
    # after the first week the raw window is full: the file must stop growing (freed pages are
    # reused and handed back), apart from the small hourly table.
    plateau = max(sizes[7:10])
    print(f"\ndb size: day 7 {sizes[6] / 1e6:.2f} MB, day 10 {sizes[9] / 1e6:.2f} MB, "
          f"day 30 {sizes[-1] / 1e6:.2f} MB")  # fmt: skip
    assert max(sizes[10:]) <= plateau * 1.15
    assert sizes[-1] < sizes[6] * 1.3


def test_month_is_bounded_short(tmp_path: Path) -> None:
    """A month at one tick per 5 minutes: same retention logic as the long run, 8640 ticks."""
    _assert_bounded(_simulate_month(tmp_path / "m.db", tick_s=300.0))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SPECPILOT_LONG"), reason="set SPECPILOT_LONG=1")
def test_month_is_bounded_full(tmp_path: Path) -> None:
    """A month at one tick per 10 s: ~260k observations and as many decisions."""
    _assert_bounded(_simulate_month(tmp_path / "m.db", tick_s=10.0))
