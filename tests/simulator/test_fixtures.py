"""The recorded simulator expositions in tests/fixtures/ (see record_fixtures.py) are valid
SGLang 0.5.23-shaped text: parseable, SGLang's families and types only, the label sets and
ranks their launch flags promise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.simulator.conftest import tsv_families

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NAMES = ["sim-baseline", "sim-eagle3-2step-workloads", "sim-eagle3-2step-tp8-allsched-6workloads"]


def _families(name: str) -> dict:
    text = (FIXTURES / f"{name}.prom").read_text()
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("name", NAMES)
def test_fixture_families_are_sglangs(name: str) -> None:
    tsv = tsv_families()
    fams = _families(name)
    for fname, fam in fams.items():
        exposed = fname + "_total" if fam.type == "counter" else fname
        assert tsv.get(exposed) == fam.type, exposed
    loads = json.loads((FIXTURES / f"{name}.loads.json").read_text())
    assert len(loads["loads"][0]["decode_moments"]) == 6
    info = json.loads((FIXTURES / f"{name}.server_info.json").read_text())
    assert info["version"] == "0.5.23" and info["internal_states"]


def test_baseline_fixture_has_no_spec_series() -> None:
    fams = _families("sim-baseline")
    assert "sglang:spec_verify_calls" not in fams
    assert fams["sglang:spec_accept_length"].samples[0].value == 0


def test_eagle_fixture_accept_length_per_workload() -> None:
    fams = _families("sim-eagle3-2step-workloads")
    gen = {s.labels["workload"]: s.value for s in fams["sglang:generation_tokens"].samples
           if s.name.endswith("_total")}  # fmt: skip
    ver = {s.labels["workload"]: s.value for s in fams["sglang:spec_verify_calls"].samples
           if s.name.endswith("_total")}  # fmt: skip
    assert set(gen) == {"chat", "code", "math"}
    ratios = {w: gen[w] / ver[w] for w in gen}
    assert all(1.0 < r <= 3.0 for r in ratios.values())
    # higher per-token acceptance (math > code > chat in the built-in workloads) shows
    assert ratios["math"] > ratios["chat"]


def test_large_fixture_has_every_rank_and_six_workloads() -> None:
    fams = _families("sim-eagle3-2step-tp8-allsched-6workloads")
    ranks = {s.labels["tp_rank"] for s in fams["sglang:num_running_reqs"].samples}
    assert ranks == {str(i) for i in range(8)}
    workloads = {s.labels["workload"] for s in fams["sglang:num_requests"].samples}
    assert workloads == {"chat", "code", "math", "sql", "summarize", "translate"}
    cats = {s.labels["category"] for s in fams["sglang:forward_execution_seconds"].samples}
    assert {"target_verify", "eagle_draft", "eagle_draft_extend", "extend"} <= cats
