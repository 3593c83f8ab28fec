"""controller.model_routing: the served model's MoE routing from its config.json, local or in the
hub cache, for the known layouts; dense, unreadable and absent models give None."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.model_routing import find_routing, routing_of


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"n_routed_experts": 384, "num_experts_per_tok": 8}, (384, 8)),  # DeepSeek-V3 / Kimi-K2
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, (8, 2)),  # Mixtral
        ({"num_experts": 128, "num_experts_per_tok": 8}, (128, 8)),  # Qwen3-MoE
        ({"text_config": {"n_routed_experts": 384, "num_experts_per_tok": 8}}, (384, 8)),
        ({"hidden_size": 4096, "num_hidden_layers": 32}, None),  # dense Llama
        ({"num_experts": 8, "num_experts_per_tok": 16}, None),  # inconsistent
        ({"num_experts": True, "num_experts_per_tok": 1}, None),
        ({"text_config": "x"}, None),
    ],
)
def test_routing_of_known_layouts(config: dict[str, object], want: tuple[int, int] | None) -> None:
    assert routing_of(config) == want


def test_local_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_local_experts": 8, "top_k": 2}))
    r = find_routing(str(tmp_path), env={})
    assert r is not None and (r.experts, r.topk) == (8, 2)
    assert r.source == tmp_path / "config.json"


def test_hub_cache_snapshot(tmp_path: Path) -> None:
    snap = tmp_path / "hub" / "models--moonshotai--Kimi-K2.5" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    cfg = {"text_config": {"n_routed_experts": 384, "num_experts_per_tok": 8}}
    (snap / "config.json").write_text(json.dumps(cfg))
    for env in ({"HF_HOME": str(tmp_path)}, {"HF_HUB_CACHE": str(tmp_path / "hub")}):
        r = find_routing("moonshotai/Kimi-K2.5", env=env)
        assert r is not None and (r.experts, r.topk) == (384, 8)
    assert find_routing("moonshotai/Other", env={"HF_HOME": str(tmp_path)}) is None


def test_unreadable_and_absent_give_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert find_routing(str(tmp_path), env={}) is None
    assert find_routing(None) is None
    assert find_routing("", env={}) is None
    assert find_routing(str(tmp_path / "missing"), env={"HOME": str(tmp_path)}) is None
    assert find_routing("org/model", env={"HOME": str(tmp_path)}) is None


def test_policy_settings_take_the_routing_unless_policy_sets_it(tmp_path: Path) -> None:
    from controller.settings import load_settings, policy_settings

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_experts": 64, "num_experts_per_tok": 4}))
    flags = f"[server]\ncommon_flags = ['--model-path', '{model}']\n"
    cfg = tmp_path / "c.toml"
    cfg.write_text(flags + "[profiles.baseline]\n")
    ps = policy_settings(load_settings(cfg))
    assert (ps.moe_experts, ps.moe_topk) == (64, 4)
    cfg.write_text(flags + "[policy]\nmoe_experts = 384\nmoe_topk = 8\n[profiles.baseline]\n")
    ps = policy_settings(load_settings(cfg))
    assert (ps.moe_experts, ps.moe_topk) == (384, 8)
    cfg.write_text("[profiles.baseline]\n")
    ps = policy_settings(load_settings(cfg))
    assert (ps.moe_experts, ps.moe_topk) == (0, 0)
