"""`specpilot bench-estimators --quick`: the issue's accuracy targets measured against the
simulator's ground truth (real assertions on accuracy; the timing keys are only sanity-checked,
the machine running the tests is shared)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controller import estimator_bench as eb
from simulator.model import builtin_workloads, load_profile

KEYS = (
    "cycle_time_rel_error",
    "unseen_profile_rel_error",
    "unseen_interval_covers",
    "truncation_rel_error",
    "detection_delay_windows",
    "false_alarms_per_day",
    "parse_ms_median",
    "fetch_ms_median",
    "extrapolation_rel_error",
    "extrapolation_covers",
)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("eb") / "bench.json"
    return eb.bench_estimators(out, seed=0, quick=True), out


def test_json_has_the_issue_keys(quick: tuple[dict[str, Any], Path]) -> None:
    result, out = quick
    data = json.loads(out.read_text())
    for k in KEYS:
        assert k in data and k in result
    assert set(data["pass"]) == set(eb.TARGETS)
    assert data["config"]["sim_profiles"] == ["kimi-k2.5-pcie-tuned", "kimi-k2.5-pcie-later-boot"]


def test_cycle_time_within_5_percent_at_every_batch_size_seen(
    quick: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick
    assert result["cycle_time_rel_error"] <= 0.05
    rows = [r for c in result["cases"]["cycle"] for r in c["rows"]]
    assert {r["profile"] for r in rows} == {p.name for p in eb.PROFILES}
    assert {r["batch"] for r in rows} == set(eb.BATCHES_QUICK)


def test_truncation_within_3_percent(quick: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick
    assert result["truncation_rel_error"] <= 0.03
    workloads = {r["workload"] for c in result["cases"]["truncation"] for r in c["rows"]}
    assert workloads == {*eb.MIX, "mix", "*"}


def test_changes_detected_within_3_windows_and_no_false_alarms(
    quick: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick
    assert result["detection_delay_windows"] <= 3
    assert result["false_alarms_per_day"] < 1.0
    for d in result["cases"]["detection"]:
        assert d["findings_before_change"] == [], d  # stationary warm-up: nothing to report
        # A concurrency change is a change point, never drift.
        assert not any(f["kind"] == "drift" for f in d["findings_after_change"]), d


def test_unseen_profile_interval_covers_the_truth(quick: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick
    assert result["unseen_interval_covers"] == 1.0
    for c in result["cases"]["unseen"]:
        for r in c["rows"]:
            assert r["source"].endswith("surface")
            assert r["cycle_rel_error"] <= 0.15 and r["tok_s_rel_error"] <= 0.15, r


def test_unseen_error_split_by_whether_the_data_reached_that_size(
    quick: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick
    rows = [r for c in result["cases"]["unseen"] for r in c["rows"]]
    # Batches 1, 4, 16, 48 (quick too): 5-step at 1 (2-step at 2), 4 (at 8) and 16 (at 32) lie
    # inside the served sizes, at 48 (at 96) beyond them.
    assert {r["batch"]: r["within_data"] for r in rows} == {1: True, 4: True, 16: True, 48: False}
    parts = [result["unseen_within_data_rel_error"], result["unseen_beyond_data_rel_error"]]
    assert max(parts) == result["unseen_profile_rel_error"]


def test_unseen_profile_within_10_percent(quick: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick
    assert result["unseen_profile_rel_error"] <= 0.10


def test_unseen_moe_profile_needs_the_routing_beyond_the_data() -> None:
    """h200-moe's 5-step at 48 streams is a 288-token forward where the largest served had
    144. Told the model's routing (384 experts, top-8: what a user writes in [policy]), the
    roofline knows the experts are all read by then and predicts within 10%; without it, the
    cycle times alone fit a dense roofline badly, the donor's straight continuation stays the
    centre, and that overshoots by far more (the interval covers the truth either way)."""
    wl = builtin_workloads()
    told = eb.unseen_case("h200-moe", eb.BATCHES_FULL, 0, wl)
    assert told["max_rel_error"] <= 0.10 and told["covers_fraction"] == 1.0, told
    beyond = next(r for r in told["rows"] if not r["within_data"])
    assert beyond["cycle_rel_error"] <= 0.05, beyond

    plain = eb.unseen_case("h200-moe", eb.BATCHES_FULL, 0, wl, routing=False)
    assert plain["roofline_rel_rms"] > 0.05, plain["roofline_rel_rms"]
    assert told["roofline_rel_rms"] < 0.05
    beyond = next(r for r in plain["rows"] if not r["within_data"])
    assert beyond["cycle_rel_error"] > 0.2 and beyond["cycle_covers"], beyond


def test_a_run_profile_continues_along_the_roofline_beyond_its_served_sizes() -> None:
    """h200-moe's 2-step served up to 16 streams, 5-step up to 4: along their own end secants
    the saturating expert cost is overshot by 75-345% with intervals that miss the truth; the
    roofline through every profile's points (the routing given) continues them within 5%."""
    wl = builtin_workloads()
    told = eb.extrapolation_case("h200-moe", 0, wl)
    assert told["covers_fraction"] == 1.0 and told["max_rel_error"] <= 0.05, told
    assert {r["support"] for r in told["rows"]} == {"extrapolated"}
    plain = eb.extrapolation_case("h200-moe", 0, wl, routing=False)
    assert plain["max_rel_error"] > 0.5, plain


def test_timings_are_sane(quick: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick
    t = result["cases"]["timing"]
    for k in ("parse_ms_median", "fetch_ms_median", "parse_only_ms_median"):
        assert math.isfinite(t[k]) and 0.0 < t[k] < 1000.0
    # Fetch + parse + reduce includes the plain fetch.
    assert result["parse_ms_median"] > 0.5 * result["fetch_ms_median"]
    assert t["exposition_bytes"] > 50_000


def test_ground_truth_matches_the_engine() -> None:
    """The cost model at the closed loop's mean context is what the WindowEngine charges."""
    wl = builtin_workloads()
    sim = load_profile("kimi-k2.5-pcie-tuned")
    for prof in eb.PROFILES:
        for b in (1, 16, 48):
            srv = eb.SimServer(sim, prof, wl, seed=1)
            srv.run(120.0, b, eb.MIX)
            assert srv.last is not None
            engine_s = srv.last.sum_step_s / srv.last.cycles
            assert engine_s == pytest.approx(eb.truth_cycle_s(sim, prof, b, wl), rel=1e-4)


def test_snapshots_diff_into_observations() -> None:
    wl = builtin_workloads()
    srv = eb.SimServer(load_profile("kimi-k2.5-pcie-tuned"), eb.E2, wl, seed=2)
    obs = list(srv.windows(30.0, 8, eb.MIX))
    assert len(obs) == 3
    for o in obs:
        assert not o.counter_reset and o.window_s == eb.WINDOW_S
        assert o.moments is not None and o.moments.sum_bs / o.moments.n_steps == 8
        assert o.accepted_drafts_hist is not None and len(o.accepted_drafts_hist) == 3


def test_cli_writes_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import typer

    calls: list[tuple[Any, ...]] = []

    def fake(json_out: Path | None, seed: int, quick: bool, routing: bool) -> dict[str, Any]:
        calls.append((json_out, seed, quick, routing))
        res: dict[str, Any] = dict.fromkeys(KEYS, 0.0)
        res["unseen_interval_covers"] = 1.0
        res["pass"] = dict.fromkeys(eb.TARGETS, True)
        res["pass"]["parse_ms_median"] = False
        return res

    monkeypatch.setattr(eb, "bench_estimators", fake)
    app = typer.Typer()
    app.command()(eb.bench_estimators_cmd)
    out = tmp_path / "o.json"
    r = CliRunner().invoke(app, ["--json", str(out), "--seed", "3", "--quick"])
    assert r.exit_code == 0, r.output
    assert calls == [(out, 3, True, True)]
    assert "MISS" in r.output and "PASS" in r.output
    r = CliRunner().invoke(app, ["--quick", "--check"])
    assert r.exit_code == 1
    r = CliRunner().invoke(app, ["--no-moe-routing"])
    assert r.exit_code == 0, r.output
    assert calls[-1] == (None, 0, False, False)


def test_cli_checks_the_json_path_before_simulating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unwritable --json is one line and exit 2 before the minutes of simulation."""
    import typer

    monkeypatch.setattr(eb, "bench_estimators", lambda *a, **k: pytest.fail("simulated first"))
    app = typer.Typer()
    app.command()(eb.bench_estimators_cmd)
    (tmp_path / "file").write_text("x")
    r = CliRunner().invoke(app, ["--quick", "--json", str(tmp_path / "file" / "o.json")])
    assert r.exit_code == 2, r.output
    assert "--json: " in r.output and "is not a directory" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
