"""Scenario files: the shipped ones parse, bad ones fail naming file and key, expansions."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from controller.bench.scenario import (
    ADAPTIVE_PROFILE,
    DEFAULT_PROFILES,
    ScenarioError,
    bench_profile,
    load_scenario,
    shipped_scenarios,
    shipped_scenarios_dir,
)

GOOD = """
name = "ok"
profile = "kimi-k2.5-pcie-tuned"
seed = 4
[profile_overrides]
restart_s = 60
[[phases]]
duration_s = 600
concurrency = 2
workloads = { chat = 3, code = 1 }
[workloads.chat]
alpha = 0.5
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_shipped_scenarios_parse_and_cover_the_issue_list() -> None:
    paths = shipped_scenarios()
    names = {load_scenario(p).name for p in paths}
    assert {
        "tuned-one-stream",
        "later-boot",
        "strong-drafter",
        "concurrency-cycle",
        "code-chat-shift",
        "short-burst",
        "stationary-noisy",
        "verify-drift",
    } <= names
    for p in paths:
        sc = load_scenario(p)
        assert sc.duration_s == pytest.approx(86400.0), p  # every shipped scenario is a day
        assert sc.initial_profile in sc.profiles


def test_good_file(tmp_path: Path) -> None:
    sc = load_scenario(_write(tmp_path, GOOD))
    assert sc.name == "ok" and sc.seed == 4 and sc.poll_interval_s == 10.0
    assert sc.initial_profile == "baseline"
    assert sc.profiles == DEFAULT_PROFILES
    assert sc.kind == "stationary"
    (ph,) = sc.phases
    assert ph.mix == {"chat": 0.75, "code": 0.25}
    assert sc.workloads["chat"].alpha == 0.5
    assert sc.workloads["chat"].output_tokens == 400.0  # built-in value kept
    sim = sc.sim_profile()
    assert sim.restart_s(bench_profile("baseline").sim) == pytest.approx(60.0)
    assert ADAPTIVE_PROFILE in sc.catalog()


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda t: t.replace('name = "ok"\n', ""), "name"),
        (lambda t: "bogus = 1\n" + t, "bogus"),
        (lambda t: t.replace("kimi-k2.5-pcie-tuned", "no-such-profile"), "profile"),
        (lambda t: t.replace("restart_s = 60", "restart_s = -1"), "profile_overrides"),
        (lambda t: t.replace("restart_s = 60", "nope = 1"), "profile_overrides"),
        (lambda t: t.replace("duration_s = 600", "duration_s = 0"), "phases[0].duration_s"),
        (lambda t: t.replace("concurrency = 2", "concurrency = 1.5"), "phases[0].concurrency"),
        (lambda t: t.replace("chat = 3", "poetry = 3"), "phases[0].workloads.poetry"),
        (lambda t: t.replace("alpha = 0.5", "alpha = 1.5"), "workloads.chat.alpha"),
        (lambda t: t + "[workloads.new]\nalpha = 0.5\n", "workloads.new.output_tokens"),
        (lambda t: 'initial_profile = "eagle3-9step"\n' + t, "initial_profile"),
        (lambda t: 'profiles = ["baseline", "medusa"]\n' + t, "profiles[1]"),
        (lambda t: 'profiles = ["baseline", "eagle3-adaptive"]\n' + t, "profiles[1]"),
        (lambda t: 'kind = "weird"\n' + t, "kind"),
        (
            lambda t: t.replace("concurrency = 2", "concurrency = 2\nverify_cost_scale = [1]"),
            "phases[0].verify_cost_scale",
        ),
        (
            lambda t: t.replace("concurrency = 2", "concurrency = 2\nramp_steps = 4"),
            "phases[0].ramp_steps",
        ),
        (lambda t: t.split("[[phases]]")[0], "phases"),
        (lambda t: t + "[[[broken\n", "<file>"),
    ],
)
def test_bad_files_name_file_and_key(tmp_path: Path, edit, key: str) -> None:  # type: ignore[no-untyped-def]
    p = _write(tmp_path, edit(GOOD))
    with pytest.raises(ScenarioError) as ei:
        load_scenario(p)
    assert ei.value.key == key
    assert str(p) in str(ei.value) and key in str(ei.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(tmp_path / "absent.toml")


def test_repeat_ramp_and_hours_scale(tmp_path: Path) -> None:
    text = GOOD.replace("seed = 4", "seed = 4\nrepeat = 2").replace(
        "concurrency = 2", "concurrency = 2\nverify_cost_scale = [1.0, 2.0]\nramp_steps = 4"
    )
    sc = load_scenario(_write(tmp_path, text))
    assert len(sc.phases) == 8 and sc.kind == "changing"
    assert [p.verify_cost_scale for p in sc.phases[:4]] == pytest.approx(
        [1.125, 1.375, 1.625, 1.875]
    )
    assert sc.phases[4].verify_cost_scale == pytest.approx(1.125)  # the repeat starts over
    assert sc.duration_s == pytest.approx(1200.0)
    assert all(a.end_s == pytest.approx(b.start_s) for a, b in itertools.pairwise(sc.phases))
    short = sc.scaled(0.5)
    assert short.duration_s == pytest.approx(600.0) and short.poll_interval_s == 10.0
    with pytest.raises(ValueError):
        sc.scaled(0.0)


def test_profile_names() -> None:
    p = bench_profile("eagle3-4step")
    assert p.spec.num_steps == 4 and p.spec.draft_tokens == 5 and p.sim.num_steps == 4
    a = bench_profile(ADAPTIVE_PROFILE)
    assert a.spec.adaptive and a.sim.adaptive and a.spec.candidate_steps == a.sim.tiers
    for bad in ("eagle3-0step", "eagle", "Baseline"):
        with pytest.raises(ValueError):
            bench_profile(bad)


def test_stress_scenarios_parse() -> None:
    """scenarios/stress/ (not in the default set) holds documented-format files only, each
    named as its file."""
    paths = sorted((shipped_scenarios_dir() / "stress").glob("*.toml"))
    assert len(paths) >= 20
    for p in paths:
        assert load_scenario(p).name == p.stem, p


@pytest.mark.parametrize(
    ("edit", "key", "problem"),
    [
        (
            lambda t: t.replace("duration_s = 600", "duration_s = 1e300"),
            "phases[0].duration_s",
            "must be <= 2592000",
        ),
        (
            lambda t: t.replace(
                "concurrency = 2",
                "concurrency = 2\nverify_cost_scale = [1.0, 2.0]\nramp_steps = 100000000",
            ),
            "phases[0].ramp_steps",
            "between 2 and 1000",
        ),
        (lambda t: "repeat = 100000000\n" + t, "repeat", "between 1 and 100000"),
        (
            lambda t: "repeat = 5000\n" + t,
            "repeat",
            "at most 30 days",
        ),
        (lambda t: "poll_interval_s = 0.001\n" + t, "poll_interval_s", "at most 500000"),
    ],
)
def test_absurd_sizes_are_refused_naming_file_and_key(
    tmp_path: Path,
    edit,  # type: ignore[no-untyped-def]
    key: str,
    problem: str,
) -> None:
    """A typo such as duration_s = 1e300 would replay for ever: the size limits refuse it."""
    p = _write(tmp_path, edit(GOOD))
    with pytest.raises(ScenarioError) as ei:
        load_scenario(p)
    assert ei.value.key == key
    assert str(p) in str(ei.value) and problem in str(ei.value)


def test_the_size_limits_hold_for_hours_scale_too(tmp_path: Path) -> None:
    sc = load_scenario(_write(tmp_path, GOOD))
    assert sc.scaled(100.0).duration_s == pytest.approx(60000.0)
    with pytest.raises(ValueError, match="at most 30 days") as ei:
        sc.scaled(1e300)
    assert str(tmp_path / "s.toml") in str(ei.value)


def test_a_long_ramp_without_ramp_steps_is_capped(tmp_path: Path) -> None:
    text = GOOD.replace("duration_s = 600", "duration_s = 2592000").replace(
        "concurrency = 2", "concurrency = 2\nverify_cost_scale = [1.0, 2.0]"
    )
    sc = load_scenario(_write(tmp_path, "poll_interval_s = 30.0\n" + text))
    assert len(sc.phases) == 1000


@pytest.mark.parametrize("name", ["../../tmp/evil", "a/b", "a\\\\b", "/abs"])
def test_a_name_with_a_path_separator_is_refused(tmp_path: Path, name: str) -> None:
    """The name is the --png-dir file's: a separator would write outside the directory."""
    p = _write(tmp_path, GOOD.replace('name = "ok"', f'name = "{name}"'))
    with pytest.raises(ScenarioError, match="path separator") as ei:
        load_scenario(p)
    assert ei.value.key == "name" and str(p) in str(ei.value)


def test_a_binary_file_is_refused_naming_it(tmp_path: Path) -> None:
    p = tmp_path / "binary.toml"
    p.write_bytes(b"\xae\xff\x00garbage")
    with pytest.raises(ScenarioError, match="not UTF-8") as ei:
        load_scenario(p)
    assert ei.value.key == "<file>" and str(p) in str(ei.value)
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path)  # a directory


def test_a_profile_file_beside_the_scenario_is_found_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from simulator.model import PROFILES_DIR

    d = tmp_path / "mine"
    d.mkdir()
    (d / "prof.toml").write_text((PROFILES_DIR / "kimi-k2.5-pcie-tuned.toml").read_text())
    p = d / "s.toml"
    p.write_text(GOOD.replace('"kimi-k2.5-pcie-tuned"', '"prof.toml"'))
    monkeypatch.chdir(tmp_path)
    sc = load_scenario(p)
    assert sc.profile == str(d / "prof.toml")
    assert sc.sim_profile().restart_s(bench_profile("baseline").sim) == pytest.approx(60.0)


@pytest.mark.parametrize(
    ("content", "problem"),
    [(b"", "name: missing"), (b"\xff\xfe garbage", "<file>: not UTF-8 text")],
)
def test_a_bad_profile_file_is_blamed_on_profile_naming_the_file(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    (tmp_path / "prof.toml").write_bytes(content)
    p = _write(tmp_path, GOOD.replace('"kimi-k2.5-pcie-tuned"', '"prof.toml"'))
    with pytest.raises(ScenarioError) as ei:
        load_scenario(p)
    assert ei.value.key == "profile"
    assert f"{tmp_path / 'prof.toml'}: {problem}" in str(ei.value)


def test_one_phase_repeated_is_stationary_and_a_ramp_is_not(tmp_path: Path) -> None:
    assert load_scenario(_write(tmp_path, "repeat = 3\n" + GOOD)).kind == "stationary"
    ramp = GOOD.replace("concurrency = 2", "concurrency = 2\nverify_cost_scale = [1.0, 1.5]")
    assert load_scenario(_write(tmp_path, ramp)).kind == "changing"
