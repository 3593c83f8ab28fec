"""`specpilot bench` end to end (short): JSON rows with the exact keys, every policy, a PNG,
friendly errors; the full shipped run is slow-marked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from controller.bench.cli import bench
from controller.bench.metrics import JSON_KEYS
from controller.bench.report import replay_budget, target_checks
from controller.bench.runner import run_scenario
from controller.bench.scenario import load_scenario, shipped_scenarios

app = typer.Typer()
app.command()(bench)
runner = CliRunner()

SHORT = """
name = "e2e"
profile = "kimi-k2.5-pcie-tuned"
seed = 9
max_running_requests = 64
[[phases]]
duration_s = 1200
concurrency = 1
workloads = { chat = 1.0 }
[[phases]]
duration_s = 1200
concurrency = 64
workloads = { chat = 1.0 }
"""


def test_short_bench_writes_json_with_exact_keys(tmp_path: Path) -> None:
    sc = tmp_path / "e2e.toml"
    sc.write_text(SHORT)
    out = tmp_path / "out" / "bench.json"
    png = tmp_path / "png"
    r = runner.invoke(
        app, ["--scenario", str(sc), "--json", str(out), "--png-dir", str(png), "--timing"]
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    assert all(tuple(row) == JSON_KEYS for row in rows)
    policies = [row["policy"] for row in rows]
    assert policies == [
        "specpilot",
        "specpilot_hybrid",
        "oracle_dp",
        "oracle_free",
        "best_static",
        "static:baseline",
        "static:eagle3-2step",
        "static:eagle3-5step",
        "sglang_adaptive",
        "vllm_batch_threshold",
        "greedy",
        "ucb",
    ]
    by = {row["policy"]: row for row in rows}
    assert by["oracle_dp"]["ratio_oracle_dp"] == 1.0
    assert by["best_static"]["ratio_best_static"] == 1.0
    assert all(row["scenario"] == "e2e" for row in rows)
    assert all(isinstance(row["switches"], int) and row["tokens"] > 0 for row in rows)
    assert (png / "e2e.png").stat().st_size > 10_000
    assert "timing:" in r.output and "specpilot" in r.output


def test_policy_filter_and_hours_scale(tmp_path: Path) -> None:
    sc = tmp_path / "e2e.toml"
    sc.write_text(SHORT)
    out = tmp_path / "b.json"
    r = runner.invoke(
        app,
        [
            "-s",
            str(sc),
            "--json",
            str(out),
            "-p",
            "greedy",
            "-p",
            "oracle_dp",
            "--hours-scale",
            "0.5",
        ],
    )
    assert r.exit_code == 0, r.output
    assert [row["policy"] for row in json.loads(out.read_text())] == ["oracle_dp", "greedy"]
    assert "hours x0.5" in r.output


def test_a_row_only_some_scenarios_have_is_left_out_where_missing(tmp_path: Path) -> None:
    """A static row of a profile one scenario does not have: asked for with both, it runs where
    it exists and is named as left out elsewhere, instead of failing the whole run; a fleet
    has every policy row, specpilot_hybrid included."""
    single = tmp_path / "e2e.toml"
    single.write_text(SHORT.replace("duration_s = 1200", "duration_s = 300"))
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        SHORT.replace(
            'name = "e2e"',
            'name = "e2e-fleet"\nreplicas = 2\nprofiles = ["baseline", "eagle3-2step"]',
        ).replace("duration_s = 1200", "duration_s = 300")
    )
    out = tmp_path / "b.json"
    args = ["-s", str(single), "-s", str(fleet), "--json", str(out)]
    r = runner.invoke(
        app, [*args, "-p", "specpilot_hybrid", "-p", "static:eagle3-5step", "-p", "specpilot"]
    )
    assert r.exit_code == 0, r.output
    rows = {(row["scenario"], row["policy"]) for row in json.loads(out.read_text())}
    assert ("e2e", "specpilot_hybrid") in rows and ("e2e", "static:eagle3-5step") in rows
    assert ("e2e-fleet", "specpilot") in rows and ("e2e-fleet", "specpilot_hybrid") in rows
    assert ("e2e-fleet", "static:eagle3-5step") not in rows
    assert "e2e-fleet has no 'static:eagle3-5step' row; left out there" in r.output


def test_errors_are_friendly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(SHORT.replace("concurrency = 64", "concurrency = -1"))
    r = runner.invoke(app, ["-s", str(bad)])
    assert r.exit_code == 2
    assert "bad.toml: phases[1].concurrency" in r.output
    good = tmp_path / "e2e.toml"
    good.write_text(SHORT)
    r = runner.invoke(app, ["-s", str(good), "-p", "nope"])
    assert r.exit_code == 2 and "unknown policy 'nope'" in r.output


@pytest.mark.parametrize("path", shipped_scenarios(), ids=lambda p: p.stem)
def test_short_shipped_scenario(path: Path) -> None:
    """The CI-short version of the full replay below: every shipped scenario with its phases 50x
    shorter (about half an hour), specpilot and the oracles, through the same code."""
    sc = load_scenario(path).scaled(0.02)
    res = run_scenario(sc, ["specpilot", "oracle_dp", "oracle_free"])
    rows = {r.policy: r for r in res.rows}
    sp, dp, free = rows["specpilot"], rows["oracle_dp"], rows["oracle_free"]
    assert sp.tokens > 0 and dp.tokens > 0
    # Free switches bound what paying ones can do; the clairvoyant DP is not beaten beyond
    # the noise of the measured per-phase rates it plans with.
    assert dp.tokens <= free.tokens * (1 + 1e-9)
    assert sp.ratio_oracle_dp <= 1.02, sp
    assert 0 <= sp.false_switches <= sp.switches


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPECPILOT_LONG") != "1", reason="SPECPILOT_LONG=1 runs it")
@pytest.mark.parametrize("path", shipped_scenarios(), ids=lambda p: p.stem)
def test_full_shipped_scenario(path: Path) -> None:
    """The full 24-hour replay of a shipped scenario: every policy, with the issue's targets and
    each replay's wall time against the 10-second budget printed (measured and reported, not
    asserted: performance is the benchmark's to measure, not a timed test's)."""
    res = run_scenario(load_scenario(path))
    assert all(r.tokens > 0 for r in res.rows)
    checks = [*target_checks(res), replay_budget(res.timings, res.scenario.duration_s)]
    for ok, text in checks:
        print(("met    " if ok else "MISSED ") + text)


def test_the_replay_budget_names_every_replay_over_it() -> None:
    half_day = 12 * 3600.0
    ok, text = replay_budget({"specpilot": 2.0, "ucb": 1.0}, half_day)
    assert ok and text == "replay <= 10 s per 24 h: slowest specpilot 4.00 s"
    ok, text = replay_budget({"a": 6.0, "b": 5.5, "c": 1.0}, half_day)
    assert not ok and text == "replay <= 10 s per 24 h: over it a 12.00 s, b 11.00 s"


def test_a_scenario_without_traffic_has_null_ratios_and_no_ratio_target(tmp_path: Path) -> None:
    """No profile serves a token all scenario: the ratios are undefined. The JSON says null
    (strict JSON has no NaN: jq and most parsers refuse it) and --check misses nothing."""
    sc = tmp_path / "idle.toml"
    sc.write_text(
        'name = "idle"\nprofile = "h200-llama8b"\ninitial_profile = "eagle3-2step"\n'
        "[[phases]]\nduration_s = 1800\nconcurrency = 0\nworkloads = { chat = 1.0 }\n"
    )
    out = tmp_path / "idle.json"
    r = runner.invoke(
        app, ["--scenario", str(sc), "--json", str(out), "--check", "-p", "specpilot"]
    )
    assert r.exit_code == 0, r.output
    assert "no ratio targets" in r.output and "MISSED" not in r.output
    rows = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"JSON holds {c}"))
    sp = next(x for x in rows if x["policy"] == "specpilot")
    assert sp["tokens"] == 0 and sp["ratio_oracle_dp"] is None and sp["ratio_best_static"] is None
    assert sp["false_switches"] == 0


@pytest.mark.parametrize(
    ("option", "where", "problem"),
    [
        ("--json", "file/x.json", "is not a directory"),
        ("--json", "adir", "is a directory"),
        ("--png-dir", "file", "is not a directory"),
        ("--png-dir", "file/sub", "is not a directory"),
    ],
)
def test_unwritable_outputs_fail_before_any_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str, where: str, problem: str
) -> None:
    """A long benchmark must not lose its results to an output path it could have checked
    first: a bad --json / --png-dir is one line and exit 2, before replaying anything."""
    import controller.bench.cli as bench_cli

    def no_replay(*_: object) -> None:
        pytest.fail("replayed before checking the outputs")

    monkeypatch.setattr(bench_cli, "run_scenario", no_replay)
    sc = tmp_path / "e2e.toml"
    sc.write_text(SHORT)
    (tmp_path / "file").write_text("not a directory\n")
    (tmp_path / "adir").mkdir()
    r = runner.invoke(app, ["--scenario", str(sc), option, str(tmp_path / where)])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert f"{option}: " in r.output and problem in r.output
    assert (tmp_path / "file").read_text() == "not a directory\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_an_output_in_proc_fails_before_any_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import controller.bench.cli as bench_cli

    monkeypatch.setattr(bench_cli, "run_scenario", lambda *_: pytest.fail("replayed"))
    sc = tmp_path / "e2e.toml"
    sc.write_text(SHORT)
    r = runner.invoke(app, ["--scenario", str(sc), "--json", "/proc/x.json"])
    assert r.exit_code == 2 and "--json: cannot write in /proc" in r.output


def test_the_png_of_a_scenario_stays_in_the_png_dir(tmp_path: Path) -> None:
    """The loader refuses a name with a separator; one built in code is made a file name."""
    from dataclasses import replace

    from controller.bench.cli import png_name

    sc = load_scenario(shipped_scenarios()[0])
    assert png_name(sc) == f"{sc.name}.png"
    assert png_name(replace(sc, name="../../tmp/evil")) == ".._.._tmp_evil.png"
    assert png_name(replace(sc, name="a\\b")) == "a_b.png"
    bad = tmp_path / "evil.toml"
    bad.write_text(SHORT.replace('name = "e2e"', 'name = "../../tmp/evil"'))
    r = runner.invoke(app, ["--scenario", str(bad), "--png-dir", str(tmp_path / "png")])
    assert r.exit_code == 2 and "evil.toml: name: must not hold a path separator" in r.output
    assert not (tmp_path.parent.parent / "tmp" / "evil.png").exists()


def test_a_binary_scenario_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "binary.toml"
    bad.write_bytes(b"\xae\xff garbage")
    r = runner.invoke(app, ["--scenario", str(bad)])
    assert r.exit_code == 2 and f"{bad}: <file>: not UTF-8 text" in r.output.replace("\n", "")


def test_an_absurd_hours_scale_is_refused(tmp_path: Path) -> None:
    sc = tmp_path / "e2e.toml"
    sc.write_text(SHORT)
    r = runner.invoke(app, ["--scenario", str(sc), "--hours-scale", "1e300"])
    assert r.exit_code == 2 and "at most 30 days" in r.output


def test_a_scenarios_own_text_is_printed_and_drawn_as_written(tmp_path: Path) -> None:
    # Rich markup in the table ("[/x]" raised after every replay had run) and matplotlib's
    # mathtext in the PNG ("$\\x$" raised): neither may lose the results.
    sc = tmp_path / "t.toml"
    text = SHORT.replace('name = "e2e"', 'name = "[red]e2e"\ndescription = "[/ratio] $\\\\nope$"')
    sc.write_text(text.replace("concurrency = 64", 'concurrency = 64\nlabel = "rush $5"'))
    out, png = tmp_path / "b.json", tmp_path / "png"
    r = runner.invoke(
        app, ["-s", str(sc), "-p", "specpilot", "--json", str(out), "--png-dir", str(png)]
    )
    assert r.exit_code == 0, r.output
    assert "[red]e2e [changing]" in r.output and "[/ratio] $\\nope$" in r.output
    assert f"wrote {png / '[red]e2e.png'}" in r.output
    assert (png / "[red]e2e.png").stat().st_size > 0
    assert {row["scenario"] for row in json.loads(out.read_text())} == {"[red]e2e"}


def test_two_files_of_one_name_are_refused_and_one_file_twice_runs_once(tmp_path: Path) -> None:
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(SHORT.replace("duration_s = 1200", "duration_s = 60"))
    b.write_text(a.read_text())
    r = runner.invoke(app, ["-s", str(tmp_path)])
    assert r.exit_code == 2
    assert f"{b}: name: 'e2e' is also the name of {a}" in r.output.replace("\n", "")
    out = tmp_path / "o.json"
    r = runner.invoke(app, ["-s", str(a), "-s", str(a), "-p", "specpilot", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert len(json.loads(out.read_text())) == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("e2e", "x" * 201), "name: at most 200 bytes"),
        (("[[phases]]", "[workloads.chat]\noutput_tokens = 1e9\n[[phases]]"), "must be <= 1000000"),
        (("[[phases]]", "[workloads.chat]\noutput_sigma = 18\n[[phases]]"), "must be <= 4"),
        (("[[phases]]", "[workloads.chat]\noutput_sigma = -1\n[[phases]]"), "must be >= 0"),
    ],
)
def test_sizes_past_what_a_replay_can_hold_are_refused(
    tmp_path: Path, edit: tuple[str, str], message: str
) -> None:
    sc = tmp_path / "s.toml"
    sc.write_text(SHORT.replace(*edit, 1))
    r = runner.invoke(app, ["-s", str(sc)])
    assert r.exit_code == 2 and message in r.output.replace("\n", ""), r.output


def test_fixed_output_lengths_are_a_workload(tmp_path: Path) -> None:
    sc = tmp_path / "s.toml"
    text = SHORT.replace("duration_s = 1200", "duration_s = 120")
    sc.write_text(text.replace("[[phases]]", "[workloads.chat]\noutput_sigma = 0\n[[phases]]", 1))
    assert load_scenario(sc).workloads["chat"].output_sigma == 0.0
    r = runner.invoke(app, ["-s", str(sc), "-p", "specpilot"])
    assert r.exit_code == 0, r.output
