"""The measured H200 profiles: they load through simulator.model, and every measured number in
them is what tools/h200/results/h200_raw.csv says (read here independently of make_profiles)."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from simulator.model import SpecConfig, TableTarget, builtin_profiles, load_profile

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "tools" / "h200"
RAW = H200 / "results" / "h200_raw.csv"
META = H200 / "results" / "h200_meta.json"
NAMES = {"h200-llama8b": "llama8b", "h200-moe": "moe"}


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"h200_{name}", H200 / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def raw_graph() -> dict[tuple[str, str, int, int, int], float]:
    """Fastest usable CUDA-graph median per shape, straight from the CSV."""
    best: dict[tuple[str, str, int, int, int], float] = {}
    with RAW.open(newline="") as fh:
        for r in csv.DictReader(fh):
            if r["mode"] != "graph" or r["error"] or r["finite"] != "1":
                continue
            key = (r["model"], r["component"], int(r["ctx"]), int(r["batch"]), int(r["tokens"]))
            best[key] = min(best.get(key, float("inf")), float(r["median_ms"]))
    return best


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads(META.read_text())


def test_raw_results_cover_the_grid_with_finite_outputs_and_say_where_they_ran(meta) -> None:
    env = meta["environment"]
    assert "H200" in env["gpu_name"]
    assert env["torch"] and env["cuda_runtime"] and env["date_utc"]
    assert "driver_version" in env["nvidia_smi"]
    grid = meta["grid"]
    counts: dict[tuple[str, str, str], int] = defaultdict(int)
    with RAW.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert all(r["finite"] == "1" and not r["error"] for r in rows)
    for r in rows:
        counts[(r["model"], r["component"], r["mode"])] += 1
    shapes = len(grid["contexts"]) * len(grid["batches"]) * len(grid["tokens"])
    for model in ("llama8b", "moe"):
        # eager: one row per shape; graph: one per attention variant (two for n > 1)
        assert counts[(model, "target", "eager")] == shapes
        assert counts[(model, "target", "graph")] > shapes
    for drafter in ("eagle3-llama8b", "eagle3-moe"):
        steps = len(grid["contexts"]) * len(grid["batches"])
        assert counts[(drafter, "draft_step", "graph")] == steps
        assert counts[(drafter, "draft_extend", "eager")] == steps * len(grid["tokens"])


@pytest.mark.parametrize("profile", sorted(NAMES))
def test_profile_loads_as_measured_table(profile: str) -> None:
    assert profile in builtin_profiles()
    p = load_profile(profile)
    assert p.kind == "measured"
    assert isinstance(p.target, TableTarget)
    assert any("H200" in line for line in p.provenance["measured"])
    assert p.provenance["assumed"]
    # A speculative cycle costs more than the verify forward alone, and verify > decode.
    s3 = SpecConfig.eagle3(3)
    assert p.cycle_s(8, s3) > p.target_step_s(8, 4) > p.target_step_s(8, 1)


def test_dense_table_is_the_raw_graph_medians(raw_graph, meta) -> None:
    p = load_profile("h200-llama8b")
    grid = meta["grid"]
    for c in grid["contexts"]:
        for n in grid["tokens"]:
            for b in grid["batches"]:
                want = raw_graph[("llama8b", "target", c, b, n)]
                assert p.target_step_s(b, n, c) * 1000 == pytest.approx(want, abs=1e-4)


def test_moe_table_is_the_measured_layers_scaled_to_full_depth(raw_graph, meta) -> None:
    p = load_profile("h200-moe")
    m = meta["models"]["moe"]
    measured, full = m["layers_measured"], m["layers_full"]
    assert (measured, full) == (3, 61)
    grid = meta["grid"]
    for c in grid["contexts"]:
        for n in grid["tokens"]:
            for b in grid["batches"]:
                total = raw_graph[("moe", "target", c, b, n)]
                head = raw_graph[("moe", "head", 0, b, n)]
                want = head + (total - head) * full / measured
                assert p.target_step_s(b, n, c) * 1000 == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(("profile", "drafter"), [("h200-llama8b", "eagle3-llama8b"),
                                                  ("h200-moe", "eagle3-moe")])  # fmt: skip
def test_draft_lines_follow_the_measured_draft_passes(raw_graph, meta, profile, drafter) -> None:
    p = load_profile(profile)
    ctx = p.serving.context_tokens
    for b in meta["grid"]["batches"]:
        step = np.interp(ctx, [1024, 4096], [raw_graph[(drafter, "draft_step", c, b, 1)]
                                             for c in (1024, 4096)])  # fmt: skip
        ext = np.interp(ctx, [1024, 4096], [raw_graph[(drafter, "draft_extend", c, b, 4)]
                                            for c in (1024, 4096)])  # fmt: skip
        assert p.draft_step_s(b) * 1000 == pytest.approx(step, rel=0.05)
        # Linear in B is a coarse fit of the extend pass (attention grows with B * tokens).
        assert p.draft_extend_s(b) * 1000 == pytest.approx(ext, rel=0.25)


def test_profiles_on_disk_are_what_make_profiles_writes() -> None:
    mp = _module("make_profiles")
    assert mp.main(["--check"]) == 0
    built = mp.build_all()
    for name in NAMES:
        assert (ROOT / "simulator" / "profiles" / f"{name}.toml").read_text() == built[name][1]


def test_make_profiles_rejects_bad_input(tmp_path: Path) -> None:
    mp = _module("make_profiles")
    bad = tmp_path / "raw.csv"
    bad.write_text("model,component,ctx\nllama8b,target,1024\n")
    with pytest.raises(ValueError, match="missing columns"):
        mp.load_raw(bad)
    table = mp.Table(mp.load_raw(RAW))
    with pytest.raises(ValueError, match="no usable graph row"):
        table.best("llama8b", "target", 2048, 1, 1, "graph")
    assert mp.layer_scaled_ms(10.0, 1.0, 3, 61) == pytest.approx(1.0 + 9.0 * 61 / 3)


def test_measure_script_smoke_on_cpu(tmp_path: Path) -> None:
    """Tiny shapes, eager only; needs torch, which the project does not depend on."""
    pytest.importorskip("torch")
    measure = _module("measure")
    assert measure.main(["--tiny", "--out", str(tmp_path), "--only", "llama8b,moe"]) == 0
    with (tmp_path / "h200_raw.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and all(r["finite"] == "1" for r in rows)
    assert {r["component"] for r in rows} == {"head", "target"}
