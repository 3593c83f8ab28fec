"""`specpilot breakeven --table`: the adaptive table specpilot would generate for a deployment.

Owns the offline view of a hybrid profile: a simulator profile's cost model stands in for the
fitted cycle-time surface (tier g: g draft steps + a verify of g + 1 tokens + the draft-extend
pass; tier 0: a decode forward + the draft-extend pass), a workload's alpha for the acceptance,
and policies.hybrid.generate_table computes the table; each bucket is printed with its
candidates, hysteresis, the tiers SGLang's rule settles on, the predicted tok/s next to the true
baseline's, and the break-even accept length of each candidate step next to the accept length
the workload reaches at that step (FIELD.md's rule at the bucket's batch size:
T_g(B) / T_base(B)).
Must not: decide anything or touch a server.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from policies.hybrid import (
    DEFAULT_BUCKETS,
    AcceptModel,
    CycleFn,
    adaptive_breakdown,
    generate_table,
    tokens_per_seq_cycle,
)
from policies.types import Estimate
from simulator.model import SimProfile, SpecConfig, builtin_workloads, load_profile

FIELD_PROFILES = ("kimi-k2.5-pcie-tuned", "kimi-k2.5-pcie-later-boot")
DEFAULT_STEPS = (0, 1, 2, 3, 4, 5, 6, 7)
# SGLang forces --max-running-requests 48 with speculation when unset; the field's bench
# scenarios set 64 for every profile (so baseline and speculation serve the same concurrency).
DEFAULT_MAX_BS = 64


def sim_cycle_fn(sim: SimProfile) -> CycleFn:
    """A simulator profile's cost model as exact tier cycle times (no interval)."""

    def cyc(batch: float, g: int) -> Estimate:
        spec = SpecConfig.eagle3(max(g, 1), adaptive=g == 0)
        t = float(sim.cycle_s(batch, spec, steps=g))
        return Estimate(t, t, t)

    return cyc


def sim_baseline_step(sim: SimProfile, batch: float) -> float:
    return float(sim.cycle_s(batch, SpecConfig.baseline()))


def field_table(
    profile: str,
    workload: str = "default",
    steps: Sequence[int] = DEFAULT_STEPS,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    max_bs: int = DEFAULT_MAX_BS,
) -> dict[str, Any]:
    """The generated table of one simulator profile and its per-bucket explanation (JSON)."""
    sim = load_profile(profile)
    wls = builtin_workloads()
    if workload not in wls:
        raise ValueError(f"unknown workload {workload!r} (built-in: {', '.join(sorted(wls))})")
    alpha = wls[workload].alpha
    acc = AcceptModel.single(alpha, workload)
    cyc = sim_cycle_fn(sim)
    table, choices = generate_table(cyc, acc, steps, buckets, max_bs=max_bs)
    al, sh = acc.alphas_of("mean")
    rows = []
    for c in choices:
        b = c.points[len(c.points) // 2]
        base_s = sim_baseline_step(sim, b)
        br = adaptive_breakdown(table, acc, cyc, b, launch_steps=max(steps), max_bs=max_bs)
        assert br is not None  # the cost model prices every tier
        per_step = {}
        for g in sorted(set(c.rule.candidate_steps) | set(br.shares)):
            t = cyc(b, g).mean
            per_step[str(g)] = {
                "breakeven_accept_length": t / base_s,
                "accept_length": tokens_per_seq_cycle(al, sh, g),
                "tok_s": b * tokens_per_seq_cycle(al, sh, g) / t,
            }
        best_fixed = max(c.fixed_score, key=lambda g: c.fixed_score[g])
        rows.append(
            {
                "bucket": c.lower,
                "batch": b,
                "candidate_steps": list(c.rule.candidate_steps),
                "up_hysteresis": c.rule.up_hysteresis,
                "down_hysteresis": c.rule.down_hysteresis,
                "tier_shares": {str(g): s for g, s in br.shares.items()},
                "adaptive_tok_s": br.tok_s.mean,
                "baseline_tok_s": b / base_s,
                "best_tier": best_fixed,
                "steps": per_step,
            }
        )
    return {
        "profile": profile,
        "workload": workload,
        "alpha": alpha,
        "max_running_requests": max_bs,
        "table": table,
        "buckets": rows,
    }


def print_field_tables(
    console: Console,
    profiles: Sequence[str],
    workload: str,
    steps: Sequence[int],
    max_bs: int,
    as_json: bool = False,
) -> None:
    outs = [field_table(p, workload, steps, DEFAULT_BUCKETS, max_bs) for p in profiles]
    if as_json:
        console.print_json(json.dumps(outs))
        return
    for out in outs:
        t = Table(
            title=f"{out['profile']}: generated adaptive table ({out['workload']} workload, "
            f"alpha {out['alpha']:.4g}, max running {out['max_running_requests']})"
        )
        for col in (
            "bucket (bs >=)",
            "candidate_steps",
            "hyst up/down",
            "settles on (at B)",
            "adaptive tok/s",
            "baseline tok/s",
            "break-even accept len (L at step)",
        ):
            t.add_column(col)
        for r in out["buckets"]:
            settles = " ".join(
                f"{g}:{s:.0%}" for g, s in sorted(r["tier_shares"].items(), key=lambda x: int(x[0]))
            )
            be = "  ".join(
                f"{g}: {v['breakeven_accept_length']:.2f} ({v['accept_length']:.2f})"
                for g, v in r["steps"].items()
            )
            t.add_row(
                str(r["bucket"]),
                str(r["candidate_steps"]),
                f"{r['up_hysteresis']:g}/{r['down_hysteresis']:g}",
                f"{settles} (B={r['batch']})",
                f"{r['adaptive_tok_s']:.1f}",
                f"{r['baseline_tok_s']:.1f}",
                be,
            )
        console.print(t)
        console.print(
            "  step 0 pays the draft-extend pass: its break-even accept length is above 1 "
            "(tier 0 emits one token per cycle, so it never quite reaches the true baseline)."
        )
        console.print(f"  --speculative-adaptive-config: {json.dumps(out['table'])}")
