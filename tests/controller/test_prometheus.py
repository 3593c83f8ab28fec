"""A real Prometheus (Debian's package) scrapes a running daemon's /metrics on loopback and its
query API returns the specpilot_ series with the values the daemon exposes."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.actuators.endpoint import free_port
from tests.controller.ops_support import LiveDaemon
from tests.controller.test_metrics import dashboard_exprs

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus not installed (tools/test-deps.sh installs Debian's package)",
)


def _query(client: httpx.Client, base: str, q: str) -> list[dict[str, Any]]:
    r = client.get(f"{base}/api/v1/query", params={"query": q}, timeout=5)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_prometheus_scrapes_the_daemon(tmp_path: Path) -> None:
    with LiveDaemon(tmp_path / "daemon") as live:
        port = free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: specpilot\n"
            "    scrape_timeout: 1s\n"
            "    static_configs:\n"
            f"      - targets: ['127.0.0.1:{live.daemon.api_port}']\n"
        )
        log = (tmp_path / "prometheus.log").open("wb")
        assert PROMETHEUS is not None
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            found: dict[str, list[dict[str, Any]]] = {}
            wanted = {
                "current": "specpilot_current_profile == 1",
                "predicted": 'specpilot_predicted_output_tokens_per_second{bound="mean"}',
                "ticks": "specpilot_tick_duration_seconds_count",
                "up": 'up{job="specpilot"}',
                "target_up": "specpilot_target_up",
            }
            deadline = time.monotonic() + 25
            with httpx.Client(trust_env=False) as client:
                while time.monotonic() < deadline and len(found) < len(wanted):
                    assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
                    with contextlib.suppress(httpx.HTTPError):
                        for key, q in wanted.items():
                            if key not in found:
                                res = _query(client, base, q)
                                if res:
                                    found[key] = res
                    time.sleep(0.25)
                r = client.get(f"{base}/api/v1/label/__name__/values", timeout=5)
                names = set(r.json()["data"])
                # Every query of the Grafana dashboard runs; the main panels have data.
                panels: dict[str, int] = {}
                for title, expr in dashboard_exprs():
                    panels[title] = panels.get(title, 0) + len(_query(client, base, expr))
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            log.close()
        assert set(found) == set(wanted), (
            f"Prometheus did not return {set(wanted) - set(found)} within 25 s; log:\n"
            + (tmp_path / "prometheus.log").read_text()[-3000:]
        )
        assert found["up"][0]["value"][1] == "1"
        current = found["current"]
        assert [r["metric"]["profile"] for r in current] == [live.controller.running]
        assert current[0]["metric"]["job"] == "specpilot"
        predicted = {r["metric"]["profile"]: float(r["value"][1]) for r in found["predicted"]}
        assert predicted["baseline"] == pytest.approx(8 / 0.030, rel=0.05)
        assert float(found["ticks"][0]["value"][1]) >= 1
        assert float(found["target_up"][0]["value"][1]) == 1
        for title in ("Profile timeline", "Output tok/s: predicted vs observed"):
            assert panels[title] > 0, panels
        spec = {n for n in names if n.startswith("specpilot_")}
        for n in (
            "specpilot_switches_total",
            "specpilot_restart_downtime_seconds_bucket",
            "specpilot_scrape_errors_total",
            "specpilot_mode",
        ):
            assert n in spec, sorted(spec)
