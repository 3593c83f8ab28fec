"""The served model's MoE routing, read from its Hugging Face config.json.

Owns `find_routing(model_path)`: where `--model-path` names a local model directory, or a
repository id already in the local Hugging Face hub cache (what SGLang itself loads from), the
routed expert count and experts per token of that model, so the cycle estimator's roofline knows
how a forward's expert reads saturate with its tokens (policies/forward_cost.py) without the
user restating facts of their model. `[policy] moe_experts` / `moe_topk` win over it.

Must not: touch the network (a model not on this machine is simply not read), or fail the
controller: an unreadable or unfamiliar config gives None.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

# Keys of the expert count in the model families SGLang serves (DeepSeek/Kimi: n_routed_experts;
# Mixtral: num_local_experts; Qwen-MoE: num_experts) and of the experts each token picks.
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
# Multimodal models nest the language model's config (Kimi-K2.5: text_config).
NESTED_KEYS = ("text_config", "language_config", "llm_config")


class Routing(NamedTuple):
    """Routed experts, experts per token, and the config.json they were read from."""

    experts: int
    topk: int
    source: Path


def routing_of(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """(experts, top-k) of a config.json's contents, looking into a nested language model's
    config; None for a dense model or an unfamiliar layout."""
    for cfg in (config, *(config.get(k) for k in NESTED_KEYS)):
        if not isinstance(cfg, Mapping):
            continue
        experts = next((cfg[k] for k in EXPERT_KEYS if _count(cfg.get(k))), None)
        topk = next((cfg[k] for k in TOPK_KEYS if _count(cfg.get(k))), None)
        if experts is not None and topk is not None and 1 <= topk <= experts and experts > 1:
            return int(experts), int(topk)
    return None


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def candidate_configs(model_path: str, env: Mapping[str, str] | None = None) -> list[Path]:
    """Where the config.json of `model_path` may lie on this machine: the directory itself, or
    the hub cache's snapshots of that repository id (HF_HUB_CACHE, HF_HOME/hub, ~/.cache)."""
    e = os.environ if env is None else env
    local = Path(model_path).expanduser()
    if local.is_dir():
        return [local / "config.json"]
    if model_path.count("/") != 1 or model_path.startswith(("/", ".", "~")):
        return []
    if e.get("HF_HUB_CACHE"):
        hub = Path(e["HF_HUB_CACHE"])
    elif e.get("HF_HOME"):
        hub = Path(e["HF_HOME"]) / "hub"
    else:
        hub = Path(e.get("HOME", "~")).expanduser() / ".cache" / "huggingface" / "hub"
    repo = hub / ("models--" + model_path.replace("/", "--")) / "snapshots"
    if not repo.is_dir():
        return []
    snaps = sorted(repo.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return [s / "config.json" for s in snaps]


def find_routing(model_path: str | None, env: Mapping[str, str] | None = None) -> Routing | None:
    """The MoE routing of the model at `model_path` (the newest readable config), or None."""
    if not model_path:
        return None
    for path in candidate_configs(model_path, env):
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(config, Mapping):
            continue
        found = routing_of(config)
        if found is not None:
            return Routing(found[0], found[1], path)
        return None  # the model's own config says dense (or a layout not known here)
    return None
