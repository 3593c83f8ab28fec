"""`specpilot breakeven --table`: the generated adaptive tables of the field's profiles."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from controller.cli import app
from controller.hybrid_table import FIELD_PROFILES, field_table
from policies.hybrid import parse_table, table_steps

runner = CliRunner()


def test_later_boot_table_never_drafts_and_stays_below_true_baseline() -> None:
    out = field_table("kimi-k2.5-pcie-later-boot")
    assert table_steps(out["table"]) == (0,)
    for row in out["buckets"]:
        # Tier 0 pays the draft-extend pass: the adaptive profile cannot reach the baseline.
        assert row["adaptive_tok_s"] < row["baseline_tok_s"]
        assert row["steps"]["0"]["breakeven_accept_length"] > 1.0


def test_tuned_table_drafts_where_the_accept_length_clears_break_even() -> None:
    out = field_table("kimi-k2.5-pcie-tuned")
    slots = parse_table(out["table"])
    assert slots[1].candidate_steps != (0,)
    for row in out["buckets"]:
        for g, v in row["steps"].items():
            if g in {str(s) for s in row["candidate_steps"]} and g != "0":
                # A drafting step is only kept where it pays: accept length near or above
                # its break-even at the bucket's batch size.
                assert v["accept_length"] >= 0.97 * v["breakeven_accept_length"]
    one = out["buckets"][0]
    assert one["adaptive_tok_s"] > one["baseline_tok_s"]


def test_cli_prints_tables_and_json() -> None:
    res = runner.invoke(app, ["breakeven", "--table"], env={"COLUMNS": "220"})
    assert res.exit_code == 0, res.output
    for p in FIELD_PROFILES:
        assert p in res.output
    assert "break-even accept len" in res.output
    res = runner.invoke(
        app,
        [
            "breakeven",
            "--table",
            "--json",
            "--sim-profile",
            "kimi-k2.5-pcie-tuned",
            "--candidate-step",
            "0",
            "--candidate-step",
            "2",
            "--workload",
            "chat",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [d["profile"] for d in data] == ["kimi-k2.5-pcie-tuned"]
    assert set(table_steps(data[0]["table"])) <= {0, 2}
    res = runner.invoke(app, ["breakeven", "--table", "--sim-profile", "nope"])
    assert res.exit_code == 2 and "unknown profile" in res.output
    res = runner.invoke(app, ["breakeven"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["breakeven", "--baseline-tok-s", "82", "--cycle-ms", "30"])
    assert res.exit_code == 0 and "2.46" in res.output
