"""SGLang 0.5.23's launch-flag rules as the simulator applies them (accept, reject, rewrite)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.__main__ import main
from simulator.faults import Faults, spec_shape_matches
from simulator.flags import FlagError, parse_args, spec_config
from simulator.model import SpecConfig

BASE = ["--model-path", "kimi"]
DRAFT = ["--speculative-draft-model-path", "d"]


def spec(*argv: str) -> tuple[SpecConfig, tuple[str, ...], int | None]:
    args = parse_args([*BASE, *argv])
    return spec_config(args), args.warnings, args.max_running_requests


def test_baseline_defaults() -> None:
    args = parse_args(BASE)
    assert spec_config(args) == SpecConfig(algorithm=None)
    assert args.max_running_requests is None
    assert args.decode_log_interval == 40
    assert args.host == "127.0.0.1" and args.port == 30000
    info = args.server_info()
    assert info["version"] == "0.5.23"
    assert info["speculative_algorithm"] is None
    assert info["launch_command"].startswith("python -m simulator --model-path kimi")


def test_eagle3_two_step_and_max_running_default_48() -> None:
    s, warnings, mrr = spec(
        "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-num-steps", "2",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
    )  # fmt: skip
    assert s == SpecConfig("EAGLE3", num_steps=2, topk=1, draft_tokens=3)
    assert mrr == 48
    assert any("reset to 48" in w for w in warnings)


def test_explicit_max_running_requests_is_kept() -> None:
    _, warnings, mrr = spec(
        "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "1", "--max-running-requests", "64",
    )  # fmt: skip
    assert mrr == 64
    assert not any("reset to 48" in w for w in warnings)


def test_topk1_rewrites_draft_tokens_with_warning() -> None:
    s, warnings, _ = spec(
        "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
    )  # fmt: skip
    assert s.draft_tokens == 6
    assert any("adjusted to speculative_num_steps + 1" in w for w in warnings)


def test_steps_unset_picks_3_1_4() -> None:
    s, _, _ = spec("--speculative-algorithm", "EAGLE3", *DRAFT)
    assert (s.num_steps, s.topk, s.draft_tokens) == (3, 1, 4)


@pytest.mark.parametrize(
    "extra",
    [["--speculative-eagle-topk", "1"], ["--speculative-num-draft-tokens", "4"]],
)
def test_steps_unset_with_topk_or_tokens_rejected(extra: list[str]) -> None:
    with pytest.raises(FlagError, match="need --speculative-num-steps"):
        parse_args([*BASE, "--speculative-algorithm", "EAGLE3", *DRAFT, *extra])


def test_steps_without_topk_rejected() -> None:
    with pytest.raises(FlagError, match="needs --speculative-eagle-topk"):
        parse_args([*BASE, "--speculative-algorithm", "EAGLE3", *DRAFT,
                    "--speculative-num-steps", "2"])  # fmt: skip


def test_topk_gt1_needs_draft_tokens_and_keeps_them() -> None:
    with pytest.raises(FlagError, match="num-draft-tokens"):
        parse_args([*BASE, "--speculative-algorithm", "EAGLE", *DRAFT,
                    "--speculative-num-steps", "5", "--speculative-eagle-topk", "4"])  # fmt: skip
    s, _, _ = spec(
        "--speculative-algorithm",
        "EAGLE",
        *DRAFT,
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "4",
        "--speculative-num-draft-tokens",
        "8",
    )
    assert (s.num_steps, s.topk, s.draft_tokens) == (5, 4, 8)


def test_algorithm_names() -> None:
    s, _, _ = spec("--speculative-algorithm", "nextn", *DRAFT)
    assert s.algorithm == "EAGLE"
    s, _, _ = spec("--speculative-algorithm", "eagle3", *DRAFT)
    assert s.algorithm == "EAGLE3"
    with pytest.raises(FlagError, match="Unknown speculative algorithm name: MEDUSA"):
        parse_args([*BASE, "--speculative-algorithm", "MEDUSA", *DRAFT])
    with pytest.raises(FlagError, match="EAGLE-family"):
        parse_args([*BASE, "--speculative-algorithm", "NGRAM", *DRAFT])
    with pytest.raises(FlagError, match="draft-model-path"):
        parse_args([*BASE, "--speculative-algorithm", "EAGLE3"])


def test_adaptive_default_table_picks_middle_candidate() -> None:
    s, _, _ = spec("--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-adaptive")
    # union of the default table's candidates is [0, 1, 3, 5, 7]; SGLang takes the middle one
    assert s.adaptive and (s.num_steps, s.topk, s.draft_tokens) == (3, 1, 4)
    assert s.tiers == (0, 1, 3, 5, 7)


def test_adaptive_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "a.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": [1, 2]}, "16": {"candidate_steps": [0]}}))
    s, _, _ = spec(
        "--speculative-algorithm",
        "EAGLE3",
        *DRAFT,
        "--speculative-adaptive",
        "--speculative-adaptive-config",
        str(cfg),
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "9",
    )
    assert s.num_steps == 2 and s.draft_tokens == 3
    assert s.adaptive_config is not None and "16" in s.adaptive_config
    with pytest.raises(FlagError, match="not in the adaptive config candidate_steps"):
        parse_args([*BASE, "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-adaptive",
                    "--speculative-adaptive-config", str(cfg), "--speculative-num-steps", "5",
                    "--speculative-eagle-topk", "1"])  # fmt: skip
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": {"candidate_steps": [-1]}}))
    with pytest.raises(FlagError, match="candidate_steps must be a list of non-negative ints"):
        parse_args([*BASE, "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-adaptive",
                    "--speculative-adaptive-config", str(bad)])  # fmt: skip
    nokeys = tmp_path / "nokeys.json"
    nokeys.write_text(json.dumps({"ema_alpha": 0.3}))
    with pytest.raises(FlagError, match="at least one integer-string BS key"):
        parse_args([*BASE, "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-adaptive",
                    "--speculative-adaptive-config", str(nokeys)])  # fmt: skip
    with pytest.raises(FlagError, match="cannot read"):
        parse_args([*BASE, "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-adaptive",
                    "--speculative-adaptive-config", str(tmp_path / "missing.json")])  # fmt: skip


def test_adaptive_disabled_with_warning_for_topk_gt1_and_without_algorithm() -> None:
    s, warnings, _ = spec(
        "--speculative-algorithm",
        "EAGLE3",
        *DRAFT,
        "--speculative-adaptive",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "4",
        "--speculative-num-draft-tokens",
        "8",
    )
    assert not s.adaptive and s.topk == 4
    assert any("speculative_adaptive disabled" in w for w in warnings)
    s, warnings, _ = spec("--speculative-adaptive")
    assert s == SpecConfig(algorithm=None)
    assert any("no effect" in w for w in warnings)


def test_custom_labels_need_header() -> None:
    with pytest.raises(FlagError, match="--tokenizer-metrics-custom-labels-header"):
        parse_args([*BASE, "--tokenizer-metrics-custom-labels-header", "",
                    "--tokenizer-metrics-allowed-custom-labels", "workload"])  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["--no-such-flag"],
        ["--sim-speed", "0"],
        ["--decode-log-interval", "0"],
        ["--speculative-attention-mode", "fast"],
        ["--extra-metric-labels", "[1]"],
        ["--sim-workload", "chat=1.5"],
        ["--sim-fault-metrics", "404"],
        ["--sim-fault-scope", "weird"],
    ],
)
def test_argparse_rejects(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args([*BASE, *argv])
    assert e.value.code == 2


def test_sim_flags() -> None:
    args = parse_args([*BASE, "--sim-workload", "sql=0.9:300", "--sim-override", "restart_s=2",
                       "--sim-cost-scale", "verify=1.6", "--extra-metric-labels",
                       '{"cluster": "a"}'])  # fmt: skip
    assert args.sim_workloads == {"sql": {"alpha": 0.9, "output_tokens": 300.0}}
    assert args.sim_overrides == {"restart_s": 2}
    assert args.sim_cost_scale == {"verify": 1.6}
    assert args.extra_metric_labels == {"cluster": "a"}
    with pytest.raises(FlagError, match="unknown key"):
        parse_args([*BASE, "--sim-cost-scale", "gpu=2"])


def test_main_exits_1_on_rejected_flags_and_unknown_profile(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*BASE, "--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-num-steps",
                 "2"]) == 1  # fmt: skip
    assert "ValueError: --speculative-num-steps needs --speculative-eagle-topk" in (
        capsys.readouterr().err
    )
    assert main([*BASE, "--sim-profile", "no-such-profile"]) == 1
    assert "unknown profile" in capsys.readouterr().err
    assert main([*BASE, "--sim-override", "bogus=1"]) == 1


def test_fault_scopes() -> None:
    base = SpecConfig(algorithm=None)
    two = SpecConfig("EAGLE3", num_steps=2, draft_tokens=3)
    ada = SpecConfig("EAGLE3", num_steps=3, draft_tokens=4, adaptive=True)
    assert spec_shape_matches("any", base) and spec_shape_matches("baseline", base)
    assert not spec_shape_matches("baseline", two) and spec_shape_matches("spec", two)
    assert spec_shape_matches("steps=2", two) and not spec_shape_matches("steps=5", two)
    assert spec_shape_matches("adaptive", ada) and not spec_shape_matches("steps=3", ada)
    args = parse_args([*BASE, "--sim-fault-start-fail", "--sim-fault-scope", "steps=5"])
    assert Faults.from_flags(args.faults, two) == Faults()
    assert Faults.from_flags(args.faults, SpecConfig("EAGLE3", 5, draft_tokens=6)).start_fail


def test_ep_size_must_divide_tp_size() -> None:
    assert parse_args([*BASE, "--tp-size", "8", "--ep-size", "8"]).ep_size == 8
    with pytest.raises(FlagError, match="divisible"):
        parse_args([*BASE, "--tp-size", "8", "--ep-size", "3"])
