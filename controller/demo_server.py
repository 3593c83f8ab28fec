"""The simulated server both demos run (`specpilot demo` and `specpilot demo --fleet N`).

Owns what the two demos share about the managed server: the simulator profile, the SGLang flags
every launch carries (the shipped config.toml's common_flags plus the simulator's own), and the
three demo profiles (baseline, EAGLE-3 2-step, 5-step). It must not start anything or know about
the loop, the fleet or the rich tables; each demo builds its own settings around these pieces.
"""

from __future__ import annotations

from typing import Any

SIM_PROFILE = "kimi-k2.5-pcie-tuned"


def eagle_flags(steps: int) -> list[str]:
    """SGLang flags for an EAGLE-3 chain of `steps` draft steps (topk 1, steps + 1 tokens)."""
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "lightseekorg/kimi-k2.5-eagle3",
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(steps + 1),
    ]


def sim_common_flags(speed: float) -> list[str]:
    """The common_flags of the demo server: the shipped config's, then the simulator's profile
    and time scale."""
    return [
        "--model-path",
        "moonshotai/Kimi-K2.5",
        "--enable-metrics",
        "--max-running-requests",
        "64",
        "--tokenizer-metrics-custom-labels-header",
        "x-custom-labels",
        "--tokenizer-metrics-allowed-custom-labels",
        "workload",
        "--sim-profile",
        SIM_PROFILE,
        "--sim-speed",
        f"{speed:g}",
    ]


def demo_profiles() -> dict[str, dict[str, Any]]:
    """The [profiles] table of the demos: baseline, EAGLE-3 2-step and 5-step."""
    return {
        "baseline": {"flags": []},
        "eagle3-2step": {"flags": eagle_flags(2)},
        "eagle3-5step": {"flags": eagle_flags(5)},
    }
