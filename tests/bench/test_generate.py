"""`specpilot generate-scenarios`: random days in the documented format, reproducible from the
seed, every one a scenario the bench loads and replays; `--scenario DIR` replays them all."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from controller.bench import generate as G
from controller.bench.cli import bench, generate_scenarios, scenario_paths
from controller.bench.scenario import ScenarioError, load_scenario
from simulator.model import builtin_profiles, builtin_workloads

runner = CliRunner()


def _app(cmd: object) -> typer.Typer:
    app = typer.Typer()
    app.command()(cmd)  # type: ignore[arg-type]
    return app


def test_the_same_seed_draws_the_same_days_and_another_seed_others() -> None:
    a = [g.toml() for g in G.generate(15, 12)]
    assert a == [g.toml() for g in G.generate(15, 12)]
    assert a != [g.toml() for g in G.generate(16, 12)]
    # A longer run of the same seed starts with the same days.
    assert [g.toml() for g in G.generate(15, 20)][:12] == a


@pytest.mark.parametrize("seed", [0, 1, 15])
def test_every_day_is_a_valid_scenario_within_the_documented_ranges(
    tmp_path: Path, seed: int
) -> None:
    days = G.generate(seed, 40)
    assert [g.filename for g in days] == [f"r{seed}-{i:02d}.toml" for i in range(40)]
    paths = G.write(days, tmp_path)
    fleets = 0
    for p in paths:
        raw = tomllib.loads(p.read_text())
        sc = load_scenario(p)
        assert sc.name == p.stem
        assert raw["profile"] in builtin_profiles()
        chains = raw["profiles"][1:]
        assert raw["profiles"][0] == "baseline" and len(chains) in G.CHAINS_PER_DAY
        steps = [int(c.removeprefix("eagle3-").removesuffix("step")) for c in chains]
        assert steps == sorted(set(steps)) and set(steps) <= set(G.CHAIN_STEPS)
        assert raw["initial_profile"] in raw["profiles"]
        fleets += "replicas" in raw
        assert G.PHASES[0] <= len(raw["phases"]) <= G.PHASES[1]
        for ph in raw["phases"]:
            assert ph["concurrency"] in G.CONCURRENCY
            lo, hi = min(G.PHASE_S) * G.PHASE_JITTER[0], max(G.PHASE_S) * G.PHASE_JITTER[1]
            assert lo - 1 <= ph["duration_s"] <= hi
            assert set(ph["workloads"]) <= set(builtin_workloads())
            assert 1 <= len(ph["workloads"]) <= 2
    # About a fifth of the days are fleets (FLEET_SHARE): some, not all.
    assert 0 < fleets < len(paths)


def test_a_bad_count_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        G.generate(1, 0)


def test_the_command_writes_the_files_and_never_replaces_one_unasked(tmp_path: Path) -> None:
    app = _app(generate_scenarios)
    out = tmp_path / "days"
    r = runner.invoke(app, [str(out), "--seed", "7", "--count", "3"])
    assert r.exit_code == 0, r.output
    assert "wrote 3 scenarios" in r.output
    first = {p.name: p.read_text() for p in out.iterdir()}
    assert sorted(first) == ["r7-00.toml", "r7-01.toml", "r7-02.toml"]
    # An edited file survives a second run into the same directory; --force replaces it.
    (out / "r7-01.toml").write_text("# mine\n")
    r = runner.invoke(app, [str(out), "--seed", "7", "--count", "3"])
    assert r.exit_code == 2
    assert "exists" in r.output and "--force" in r.output
    assert (out / "r7-01.toml").read_text() == "# mine\n"
    assert (out / "r7-02.toml").read_text() == first["r7-02.toml"]
    r = runner.invoke(app, [str(out), "--seed", "7", "--count", "3", "--force"])
    assert r.exit_code == 0, r.output
    assert {p.name: p.read_text() for p in out.iterdir()} == first
    r = runner.invoke(app, [str(tmp_path / "x"), "--count", "0"])
    assert r.exit_code == 2


def test_scenario_paths_expand_directories_and_name_what_is_missing(tmp_path: Path) -> None:
    paths = G.write(G.generate(3, 3), tmp_path / "d")
    one = tmp_path / "one.toml"
    one.write_text((tmp_path / "d" / "r3-00.toml").read_text())
    assert scenario_paths([tmp_path / "d", one]) == [*sorted(paths), one]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScenarioError, match=r"no \*\.toml"):
        scenario_paths([tmp_path / "empty"])
    with pytest.raises(ScenarioError, match="no such file"):
        scenario_paths([tmp_path / "missing.toml"])


def test_bench_replays_a_generated_directory(tmp_path: Path) -> None:
    days = [g for g in G.generate(5, 40) if "replicas" not in g.document][:2]
    for g in days:
        # Short: the first phase only, at most 20 minutes.
        g.document["phases"] = g.document["phases"][:1]
        g.document["phases"][0]["duration_s"] = min(g.document["phases"][0]["duration_s"], 1200)
    G.write(days, tmp_path / "d")
    out = tmp_path / "r.json"
    r = runner.invoke(
        _app(bench),
        ["--scenario", str(tmp_path / "d"), "--policy", "specpilot", "--json", str(out)],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    assert sorted({row["scenario"] for row in rows}) == sorted(g.document["name"] for g in days)
    assert all(row["tokens"] > 0 for row in rows)
    r = runner.invoke(_app(bench), ["--scenario", str(tmp_path / "nowhere")])
    assert r.exit_code == 2
    assert "no such file or directory" in r.output


def test_the_summary_over_scenarios_averages_the_rows_they_share() -> None:
    from rich.console import Console

    from controller.bench.metrics import Row
    from controller.bench.report import print_results, summary_table
    from controller.bench.runner import ScenarioResult

    def row(sc: str, pol: str, dp: float, bs: float) -> Row:
        return Row(sc, pol, 1000.0 * dp, dp, bs, 0, 0, None, 0, 0.0)

    def result(sc: str, rows: list[Row]) -> ScenarioResult:
        return ScenarioResult(scenario=None, rows=rows, replays={}, measurements=None)  # type: ignore[arg-type]

    a = result("a", [row("a", "specpilot", 0.96, 1.0), row("a", "static:eagle3-2step", 1, 1)])
    a.rows += [
        row("a", "oracle_dp", 1.0, 1.04),
        row("a", "ucb", 0.8, 0.8),
        row("a", "greedy", 1, 1),
    ]
    b = result("b", [row("b", "specpilot", 0.90, 0.94), row("b", "oracle_dp", 1.0, 1.1)])
    b.rows.append(row("b", "ucb", float("nan"), float("nan")))  # no traffic: no ratio
    t = summary_table([a, b])
    cells = {c.header: list(c.cells) for c in t.columns}
    # The rows both scenarios have; a static profile (another set's) and greedy (a's only) not.
    assert cells["policy"] == ["specpilot", "oracle_dp", "ucb"]
    assert cells["mean /oracle_dp"] == ["0.9300", "1.0000", "0.8000"]
    assert cells["min"] == ["0.9000", "1.0000", "0.8000"]
    assert cells["mean /best_static"] == ["0.9700", "1.0700", "0.8000"]
    assert cells[">= 0.95 x oracle_dp"] == ["1 of 2", "2 of 2", "0 of 2"]
    # More than 0.5% above specpilot: greedy on a (a peer: specpilot's row counts it), oracle_dp
    # on both; ucb, without tokens on b, on neither.
    assert cells["> 0.5% above specpilot"] == ["1 of 2", "2 of 2", "0 of 2"]
    # 0.4% above is within the target's slack.
    a.rows[-1] = row("a", "greedy", 0.9638, 1)
    t = summary_table([a, b])
    assert list(t.columns[-1].cells) == ["0 of 2", "2 of 2", "0 of 2"]
    # Without specpilot's row nothing is measured against it.
    solo = summary_table([result("c", [row("c", "ucb", 0.8, 0.8)])])
    assert list(solo.columns[-1].cells) == ["-"]
    console = Console(record=True, width=200)
    # One scenario: its own table says it all; two: the summary follows.
    assert "all 2 scenarios" not in _printed(console, print_results, [a])
    assert "all 2 scenarios" in _printed(console, print_results, [a, b])


def _printed(console: object, fn: object, results: object) -> str:
    from unittest import mock

    with (
        mock.patch("controller.bench.report.scenario_table", return_value=""),
        mock.patch("controller.bench.report.target_checks", return_value=[]),
        mock.patch("controller.bench.report.fleet_notes", return_value=[]),
    ):
        fn(results, console)  # type: ignore[operator]
    return console.export_text()  # type: ignore[attr-defined]


def test_an_absurd_count_is_refused() -> None:
    """--count 100000000 would write files for hours: bounded by MAX_COUNT."""
    with pytest.raises(ValueError, match="at most"):
        G.generate(1, G.MAX_COUNT + 1)
    r = runner.invoke(_app(generate_scenarios), ["unused-dir", "--count", "100000000"])
    assert r.exit_code == 2 and "--count" in r.output
    assert not Path("unused-dir").exists()
