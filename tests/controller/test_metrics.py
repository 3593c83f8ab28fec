"""specpilot's own metrics: names and units, values after real ticks, switches, rollbacks and
scrape failures, the dedicated registry, `promtool check metrics` on the exposition, and the
bound on the series the client-chosen workload label can make."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from controller.api import create_app
from controller.metrics import (
    MAX_TRACKED_WORKLOADS,
    MAX_WORKLOAD_SERIES,
    OTHER_WORKLOAD,
    ControllerMetrics,
)
from policies.types import Observation, WorkloadWindow
from tests.controller.ops_support import TOKEN, ProfileModel, Rig, make_rig, tick_until_trial

AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXPECTED = {
    # family (as the parser reports it) -> type
    "specpilot_current_profile": "gauge",
    "specpilot_predicted_output_tokens_per_second": "gauge",
    "specpilot_observed_output_tokens_per_second": "gauge",
    "specpilot_accept_length": "gauge",
    "specpilot_predicted_accept_length": "gauge",
    "specpilot_breakeven_accept_length": "gauge",
    "specpilot_cycle_seconds": "gauge",
    "specpilot_batch_size": "gauge",
    "specpilot_decisions": "counter",
    "specpilot_switches": "counter",
    "specpilot_rollbacks": "counter",
    "specpilot_restart_downtime_seconds": "histogram",
    "specpilot_mode": "gauge",
    "specpilot_override_pin": "gauge",
    "specpilot_override_pin_expiry_timestamp_seconds": "gauge",
    "specpilot_override_paused": "gauge",
    "specpilot_override_pause_expiry_timestamp_seconds": "gauge",
    "specpilot_blocked": "gauge",
    "specpilot_switch_in_flight": "gauge",
    "specpilot_trial_running": "gauge",
    "specpilot_scrape_errors": "counter",
    "specpilot_store_write_errors": "counter",
    "specpilot_target_up": "gauge",
    "specpilot_tick_duration_seconds": "histogram",
    "specpilot_findings": "counter",
}


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = await make_rig(tmp_path)
    yield r
    await r.close()


async def scrape(rig: Rig) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics through the API and index the samples by (name, sorted labels)."""
    app = create_app(rig.controller, TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_own_registry() -> None:
    a = ControllerMetrics(["baseline"])
    b = ControllerMetrics(["baseline", "eagle3-2step"])  # a second instance does not clash
    a.scrape_errors.inc()
    assert b"specpilot_scrape_errors_total 0.0" in b.exposition()
    assert not [m for m in REGISTRY.collect() if m.name.startswith("specpilot")]
    # Known label values exist at zero from the first scrape (rate() and alerts see 0, not
    # no data): every rollback reason, every finding kind.
    text = b.exposition().decode()
    for series in (
        'specpilot_rollbacks_total{reason="rollback_start_failed"} 0.0',
        'specpilot_rollbacks_total{reason="rollback_trial_failed"} 0.0',
        'specpilot_findings_total{kind="drift"} 0.0',
        'specpilot_findings_total{kind="acceptance_low"} 0.0',
        'specpilot_findings_total{kind="change"} 0.0',
    ):
        assert series in text, series


def test_names_types_help_and_units() -> None:
    m = ControllerMetrics(["baseline", "eagle3-2step"])
    fams = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    assert set(EXPECTED) <= set(fams)
    for name, fam in fams.items():
        assert name.startswith("specpilot_")
        assert fam.documentation.strip(), f"{name} has no help text"
        if name in EXPECTED:
            assert fam.type == EXPECTED[name], name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), name
        # Base units: seconds, never milliseconds or minutes.
        assert not any(u in name for u in ("_ms", "millisecond", "_minutes", "_hours")), name


async def test_values_after_ticks(rig: Rig) -> None:
    await rig.ticks(12)
    s = await scrape(rig)
    assert val(s, "specpilot_current_profile", profile="baseline") == 1
    assert val(s, "specpilot_current_profile", profile="eagle3-2step") == 0
    assert val(s, "specpilot_target_up") == 1
    assert val(s, "specpilot_observed_output_tokens_per_second", profile="baseline") == (
        pytest.approx(8 / 0.030, rel=1e-6)
    )
    assert val(s, "specpilot_batch_size") == 8
    assert val(s, "specpilot_cycle_seconds", profile="baseline") == pytest.approx(0.030, rel=0.01)
    mean = val(s, "specpilot_predicted_output_tokens_per_second", profile="baseline", bound="mean")
    low = val(s, "specpilot_predicted_output_tokens_per_second", profile="baseline", bound="low")
    high = val(s, "specpilot_predicted_output_tokens_per_second", profile="baseline", bound="high")
    assert low is not None and mean is not None and high is not None
    assert low <= mean <= high
    assert mean == pytest.approx(8 / 0.030, rel=0.05)
    # Speculative profiles get a break-even accept length and a predicted accept length.
    preds = {p.profile: p for p in rig.controller.predictions}
    for p in ("eagle3-2step", "eagle3-5step"):
        be = preds[p].breakeven_accept_length
        if be is not None:
            assert val(s, "specpilot_breakeven_accept_length", profile=p) == pytest.approx(be)
        acc = preds[p].accept_length
        if acc is not None:
            assert val(s, "specpilot_predicted_accept_length", profile=p) == pytest.approx(acc.mean)
    assert val(s, "specpilot_tick_duration_seconds_count") == 12
    decisions = sum(v for (n, _), v in s.items() if n == "specpilot_decisions_total")
    assert decisions == 13  # the start + one per tick
    assert val(s, "specpilot_mode", mode="active") == 1
    assert val(s, "specpilot_switch_in_flight") == 0
    assert val(s, "specpilot_override_paused") == 0


async def test_switches_rollbacks_and_scrape_errors(rig: Rig) -> None:
    rig.server.models["eagle3-5step"] = ProfileModel(step_s=0.070, accept_length=1.2)
    rig.controller.pin("eagle3-2step", 600, "test", "me")
    await rig.ticks(4)
    s = await scrape(rig)
    assert rig.controller.running == "eagle3-2step"
    assert val(s, "specpilot_switches_total", reason="switch_pinned", outcome="ok") == 1
    assert val(s, "specpilot_switches_total", reason="start", outcome="ok") == 1
    assert val(s, "specpilot_restart_downtime_seconds_count") == 2  # the start was 0 s
    assert val(s, "specpilot_restart_downtime_seconds_sum") == pytest.approx(60.0)
    assert val(s, "specpilot_current_profile", profile="eagle3-2step") == 1
    assert val(s, "specpilot_current_profile", profile="baseline") == 0
    assert val(s, "specpilot_override_pin", profile="eagle3-2step") == 1
    assert val(s, "specpilot_override_pin_expiry_timestamp_seconds") == pytest.approx(
        rig.controller.overrides.pin_until_s
    )
    # Observed series are the running profile's only: no stale baseline rate.
    assert val(s, "specpilot_observed_output_tokens_per_second", profile="baseline") is None
    assert val(s, "specpilot_observed_output_tokens_per_second", profile="eagle3-2step") == (
        pytest.approx(8 * 2.2 / 0.040, rel=1e-6)
    )
    assert val(s, "specpilot_accept_length", profile="eagle3-2step", workload="chat") == (
        pytest.approx(2.2, rel=0.01)
    )

    rig.server.fail_scrapes = True
    await rig.ticks(2)
    s = await scrape(rig)
    assert val(s, "specpilot_scrape_errors_total") == 2
    assert val(s, "specpilot_target_up") == 0
    rig.server.fail_scrapes = False


async def test_trial_and_rollback_series(rig: Rig) -> None:
    trial = await tick_until_trial(rig)
    s = await scrape(rig)
    assert val(s, "specpilot_trial_running", profile=str(trial["profile"])) == 1
    assert rig.controller.abort_trial("test", "me")  # a person judges it failed: a rollback
    assert rig.controller._manual is not None
    await rig.controller._manual
    s = await scrape(rig)
    assert val(s, "specpilot_rollbacks_total", reason="rollback_trial_failed") == 1
    assert val(s, "specpilot_trial_running", profile=str(trial["profile"])) is None
    assert val(s, "specpilot_current_profile", profile=str(trial["from"])) == 1


async def test_switch_in_flight_gauge(rig: Rig) -> None:
    rig.actuator.hold = asyncio.Event()
    rig.controller.start_manual_switch("eagle3-5step", "", "me")
    for _ in range(5):
        await asyncio.sleep(0)
    assert val(await scrape(rig), "specpilot_switch_in_flight") == 1
    rig.actuator.hold.set()
    assert rig.controller._manual is not None
    await rig.controller._manual
    assert val(await scrape(rig), "specpilot_switch_in_flight") == 0


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (tools/test-deps.sh installs Debian's)"
)
async def test_promtool_check_metrics(rig: Rig) -> None:
    rig.server.models["eagle3-5step"] = ProfileModel(step_s=0.070, accept_length=1.2)
    rig.controller.pin("eagle3-2step", 600, "test", "me")
    rig.controller.pause(600, "test", "me")
    await rig.ticks(30)
    app = create_app(rig.controller, TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        text = (await c.get("/metrics")).text
    assert "specpilot_switches_total{" in text  # labelled series are present, not just HELP
    assert PROMTOOL is not None
    r = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, f"promtool:\n{r.stdout}{r.stderr}"
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


# --------------------------------------------------------------------------------- Grafana

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specpilot.json"


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's variables filled in."""
    import json

    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", "1m").replace("$job", ".*")
            out.append((p["title"], expr))
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            out.append((a["name"], a["expr"].replace("$job", ".*")))
    return out


def test_grafana_dashboard_uses_our_series() -> None:
    import json
    import re

    dash = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in dash["panels"]]
    for needed in ("Profile timeline", "predicted vs observed", "Accept length vs break-even"):
        assert any(needed in t for t in titles), titles
    assert any("Switches" in t for t in titles)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    exposed = {
        f.name + suffix
        for f in text_string_to_metric_families(
            ControllerMetrics(["baseline"]).exposition().decode()
        )
        for suffix in suffixes.get(f.type, ("",))
    }
    for title, expr in dashboard_exprs():
        for name in re.findall(r"\bspecpilot_[a-z_]+", expr):
            assert name in exposed, f"{title}: {name} is not a specpilot series"


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (tools/test-deps.sh installs Debian's)"
)
def test_grafana_dashboard_promql_is_valid(tmp_path: Path) -> None:
    import json

    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"specpilot:dashboard_{i}", "expr": expr}
                    for i, (_, expr) in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    assert PROMTOOL is not None
    r = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stdout + r.stderr


# -- bounded cardinality: the workload label comes from clients


def _window(profile: str, loads: dict[str, float], t_s: float = 0.0) -> Observation:
    """One window where each workload made `tokens` generation tokens in 10 requests, at an
    accept length of 2 (tokens - requests over verify steps)."""
    return Observation(
        t_s=t_s,
        window_s=5.0,
        profile=profile,
        workloads=tuple(
            WorkloadWindow(w, generation_tokens=tok, verify_calls=(tok - 10) / 2, requests=10)
            for w, tok in loads.items()
        ),
    )


def _accept_series(m: ControllerMetrics) -> dict[tuple[str, str], float]:
    fams = text_string_to_metric_families(m.exposition().decode())
    fam = next(f for f in fams if f.name == "specpilot_accept_length")
    return {(s.labels["profile"], s.labels["workload"]): s.value for s in fam.samples}


def test_client_workloads_cannot_mint_unbounded_series() -> None:
    m = ControllerMetrics(["baseline", "eagle3-2step"])
    # 300 distinct client labels in one window (the audit made 301 series); w000 is busiest.
    loads = {f"w{i:03d}": 10_000.0 - i for i in range(300)}
    m.observe_window(_window("eagle3-2step", loads))
    series = _accept_series(m)
    assert len(series) == MAX_WORKLOAD_SERIES + 1
    top = {f"w{i:03d}" for i in range(MAX_WORKLOAD_SERIES)}
    assert {w for _, w in series} == top | {OTHER_WORKLOAD}
    assert all(p == "eagle3-2step" for p, _ in series)
    assert series[("eagle3-2step", "w000")] == pytest.approx(2.0)
    assert series[("eagle3-2step", OTHER_WORKLOAD)] == pytest.approx(2.0)  # pooled, same rate
    # Window after window of new names: the bound holds, and so does the memory behind it.
    for t in range(1, 60):
        fresh = {f"t{t}-{i}": 50_000.0 for i in range(300)}
        m.observe_window(_window("eagle3-2step", fresh, t_s=5.0 * t))
        assert len(_accept_series(m)) <= MAX_WORKLOAD_SERIES + 1
        assert len(m._workload_scores) <= MAX_TRACKED_WORKLOADS


def test_the_busiest_recent_workloads_keep_their_series() -> None:
    m = ControllerMetrics(["eagle3-2step"])
    steady = {f"steady{i}": 1000.0 for i in range(MAX_WORKLOAD_SERIES)}
    for t in range(20):
        m.observe_window(_window("eagle3-2step", {**steady, f"burst{t}": 500.0}, t_s=5.0 * t))
    kept = {w for _, w in _accept_series(m)}
    assert kept == set(steady) | {OTHER_WORKLOAD}  # one-off bursts are pooled
    # The traffic moves on: new workloads take over and the old ones' series go at once.
    new = {f"new{i}": 5000.0 for i in range(MAX_WORKLOAD_SERIES)}
    for t in range(20, 40):
        m.observe_window(_window("eagle3-2step", new, t_s=5.0 * t))
    kept = {w for _, w in _accept_series(m)}
    assert set(new) <= kept and not kept & set(steady)
    assert len(kept) <= MAX_WORKLOAD_SERIES + 1


def test_a_client_workload_named_other_is_pooled_and_the_pool_is_weighted() -> None:
    m = ControllerMetrics(["eagle3-2step"])
    loads = {f"w{i}": 10_000.0 for i in range(MAX_WORKLOAD_SERIES)}
    obs = _window("eagle3-2step", loads)
    tail = (
        WorkloadWindow(OTHER_WORKLOAD, generation_tokens=110.0, verify_calls=100.0, requests=10),
        WorkloadWindow("tiny", generation_tokens=310.0, verify_calls=100.0, requests=10),
    )
    m.observe_window(replace(obs, workloads=obs.workloads + tail))
    series = _accept_series(m)
    assert len(series) == MAX_WORKLOAD_SERIES + 1
    # (100 + 300) tokens past the bonus over 200 verify steps
    assert series[("eagle3-2step", OTHER_WORKLOAD)] == pytest.approx(2.0)
    assert ("eagle3-2step", "tiny") not in series


def test_accept_length_series_follow_the_profile_running() -> None:
    m = ControllerMetrics(["baseline", "eagle3-2step"])
    loads = {f"w{i}": 1000.0 - i for i in range(40)}
    m.observe_window(_window("eagle3-2step", loads))
    m.observe_window(_window("baseline", {"w0": 1000.0}))
    assert set(_accept_series(m)) == {("baseline", "w0")}
