"""Cost model of one SGLang deployment, speculation shapes, workloads and chain-acceptance draws.

Owns: the profile file format (`simulator/profiles/NAME.toml`) and its validation, the step-time
model (`SimProfile.target_step_s`, `draft_step_s`, `cycle_s`, prefill, restart phases), the
built-in workloads and the chain-acceptance maths and draws shared by both engines.
Must not: run a clock, hold request state (that is `simulator.engine`), decide adaptive tiers
(that is `simulator.adaptive`), or import controller/store/policies.

Profile format (a refinement of docs/ARCHITECTURE.md; every key there keeps its meaning):

```toml
name = "kimi-k2.5-pcie-tuned"
description = "one line"
kind = "field"                 # "field" | "measured" | "assumed"
[provenance]
measured = ["..."]             # numbers taken from measurements (FIELD.md, an H200 run)
assumed = ["..."]              # everything else, with the reason

[target]                       # ONE target forward, milliseconds
model = "roofline"             # or "table"
# roofline: T(B, n, ctx) = fixed_ms + (n > 1) * verify_fixed_ms
#                          + max(mem_ms + expert_ms * u(B * n), compute_ms_per_token * B * n)
#                          + kv_ms_per_seq_per_1k_ctx * B * ctx / 1000
#   u(t) = 1 - (1 - moe_topk / moe_experts) ** t: the share of routed experts that t tokens
#   touch (a MoE forward streams only the experts its tokens route to; 0 when expert_ms = 0).
fixed_ms = 8.4                 # per-forward latency floor (launches, all-reduce latency)
verify_fixed_ms = 5.5          # extra cost of a verify forward (n > 1) over a decode forward
mem_ms = 1.5                   # weights every forward reads (attention, dense, shared expert)
expert_ms = 52.8               # (optional, default 0) reading ALL routed experts once
moe_experts = 384              # (optional) routed experts per layer
moe_topk = 8                   # (optional) experts per token
compute_ms_per_token = 0.3
kv_ms_per_seq_per_1k_ctx = 0.04
# table: measured medians, interpolated (linear in B and n, linear in ctx between contexts,
# linear extrapolation past the last point):
# batch = [1, 2, 4, 8, 16, 32, 64, 128]
# tokens = [1, 2, 3, 4, 6, 8]
# context = [1024, 4096]
# ms = [ [ [..len(batch)..] ..len(tokens).. ] ..len(context).. ]   # ms[context][tokens][batch]
# moe_experts, moe_topk: (optional) the measured model's routing; the table holds its cost, these
# say what a user would tell specpilot (SimProfile.expert_share)
prefill_fixed_ms = 30.0        # (optional, default 30) one prefill (extend) forward
prefill_ms_per_1k_tokens = 120.0   # (optional, default 120) per 1000 prompt tokens

[draft]                        # EAGLE-3 head, milliseconds
step_ms = 0.45                 # one draft step at B = 1
step_ms_per_seq = 0.004        # added per sequence in the batch
extend_ms = 0.1                # draft-extend pass after each verify (also paid at adaptive step 0)
extend_ms_per_seq = 0.002      # (optional, default 0) per sequence
prefill_ms_per_1k_tokens = 5.0 # (optional, default 0) draft prefill of a new prompt

[serving]
overhead_ms_per_step = 0.18    # scheduler/sampling overhead per decode cycle, outside the GPU
overhead_ms_per_seq = 0.0      # (optional, default 0) per sequence in the batch
context_tokens = 2048          # mean context used when the caller does not give one
max_running_requests = 128     # default when the flags do not set it (48 with speculation)
kv_capacity_tokens = 400000

[restart]                      # seconds, reported in sglang:startup_time_seconds{phase}
load_s = 180.0
graph_capture_s_per_tier = 40.0   # once per captured tier (baseline 1; adaptive one per step)
warmup_s = 10.0
```
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROFILES_DIR = Path(__file__).parent / "profiles"

# SGLang forces --max-running-requests to 48 when it is unset and speculation is on
# (srt/arg_groups/speculative_hook.py); a profile's own default applies without speculation.
SGLANG_SPEC_DEFAULT_MAX_RUNNING = 48

# SGLang's default adaptive table (srt/speculative/adaptive_spec_params.py), kept here because
# SpecConfig.tiers needs the candidate union; simulator.adaptive owns the rule itself.
DEFAULT_ADAPTIVE_CONFIG: dict[str, dict[str, Any]] = {
    "1": {
        "candidate_steps": [1, 3, 5, 7],
        "up_hysteresis": 0.0,
        "down_hysteresis": -0.25,
        "ceiling_coeff": 0,
    },
    "8": {
        "candidate_steps": [0, 1, 3],
        "up_hysteresis": 0.0,
        "down_hysteresis": 0.0,
        "ceiling_coeff": 0,
    },
    "32": {
        "candidate_steps": [0, 1],
        "up_hysteresis": 0.0,
        "down_hysteresis": 0.0,
        "ceiling_coeff": 0,
    },
    "64": {
        "candidate_steps": [0],
        "up_hysteresis": 0.0,
        "down_hysteresis": 0.0,
        "ceiling_coeff": 0,
    },
}


# --------------------------------------------------------------------------------------------
# Speculation shape and cost drift
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecConfig:
    """The speculation shape a server was launched with (resolved from its flags).

    `draft_tokens` is the tokens verified per sequence per cycle (steps + 1 for topk 1, 1 for the
    baseline). With topk > 1 the cost model verifies `draft_tokens` tokens but acceptance still
    follows the chain model over `num_steps` (a tree is not modelled: conservative).
    """

    algorithm: str | None
    num_steps: int = 0
    topk: int = 1
    draft_tokens: int = 1
    adaptive: bool = False
    adaptive_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.algorithm is None:
            if self.num_steps != 0 or self.draft_tokens != 1 or self.adaptive:
                raise ValueError(
                    "SpecConfig without an algorithm is the baseline: num_steps must be 0, "
                    f"draft_tokens 1 and adaptive False (got num_steps={self.num_steps}, "
                    f"draft_tokens={self.draft_tokens}, adaptive={self.adaptive})"
                )
            return
        if self.num_steps < 0 or (self.num_steps == 0 and not self.adaptive):
            raise ValueError(
                f"SpecConfig {self.algorithm}: num_steps must be >= 1 (got {self.num_steps})"
            )
        if self.topk < 1:
            raise ValueError(f"SpecConfig: topk must be >= 1 (got {self.topk})")
        if self.draft_tokens < 1:
            raise ValueError(f"SpecConfig: draft_tokens must be >= 1 (got {self.draft_tokens})")
        if self.adaptive and self.topk != 1:
            raise ValueError("SpecConfig: adaptive speculation needs topk 1 (as SGLang)")

    @classmethod
    def baseline(cls) -> SpecConfig:
        return cls(algorithm=None)

    @classmethod
    def eagle3(
        cls,
        num_steps: int,
        *,
        adaptive: bool = False,
        adaptive_config: Mapping[str, Any] | None = None,
    ) -> SpecConfig:
        """EAGLE-3, topk 1, steps + 1 draft tokens (what SGLang rewrites topk-1 configs to)."""
        return cls(
            algorithm="EAGLE3",
            num_steps=num_steps,
            topk=1,
            draft_tokens=num_steps + 1,
            adaptive=adaptive,
            adaptive_config=adaptive_config,
        )

    @property
    def speculative(self) -> bool:
        return self.algorithm is not None

    @property
    def tiers(self) -> tuple[int, ...]:
        """Step counts with captured CUDA graphs: the adaptive candidates' union plus the launch
        tier (SGLang registers the launch state, then builds every other candidate), else the
        launch tier alone (0 for the baseline)."""
        if not self.adaptive:
            return (self.num_steps,)
        cfg = self.adaptive_config if self.adaptive_config is not None else DEFAULT_ADAPTIVE_CONFIG
        steps = {self.num_steps}
        for key, entry in cfg.items():
            if str(key).isdigit() and isinstance(entry, Mapping):
                steps.update(int(s) for s in entry.get("candidate_steps", []))
        return tuple(sorted(steps))


@dataclass(frozen=True)
class CostScale:
    """A change of system state (FIELD.md's later boot): multiplies step costs."""

    verify: float = 1.0  # target forward with tokens_per_seq > 1 (verify)
    base: float = 1.0  # target forward with tokens_per_seq == 1 (decode)
    draft: float = 1.0

    def __post_init__(self) -> None:
        for name in ("verify", "base", "draft"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"CostScale.{name} must be a positive finite number (got {v})")


NO_SCALE = CostScale()


# --------------------------------------------------------------------------------------------
# Workloads and chain acceptance
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A request class: chain acceptance `alpha` per draft token and length distributions.

    Output lengths are lognormal with mean `output_tokens` and log-sd `output_sigma`, rounded,
    at least 1 and at most `max_output_factor` x the mean (see `output_length_pmf`).
    """

    name: str
    alpha: float
    output_tokens: float
    prompt_tokens: float = 512.0
    output_sigma: float = 0.6
    max_output_factor: float = 8.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.alpha <= 1.0):
            raise ValueError(f"workload {self.name}: alpha must be in [0, 1] (got {self.alpha})")
        if not self.output_tokens >= 1:
            raise ValueError(
                f"workload {self.name}: output_tokens must be >= 1 (got {self.output_tokens})"
            )
        if not self.prompt_tokens >= 1:
            raise ValueError(
                f"workload {self.name}: prompt_tokens must be >= 1 (got {self.prompt_tokens})"
            )
        if not self.output_sigma >= 0:
            raise ValueError(f"workload {self.name}: output_sigma must be >= 0")

    @property
    def max_output(self) -> int:
        return max(1, math.ceil(self.output_tokens * self.max_output_factor))

    def _mu(self) -> float:
        return math.log(self.output_tokens) - self.output_sigma**2 / 2.0

    def sample_output_tokens(self, rng: np.random.Generator, size: int | None = None) -> Any:
        """Draw output lengths (ints); the same law as `output_length_pmf`."""
        if self.output_sigma == 0:
            raw = np.full(1 if size is None else size, self.output_tokens)
        else:
            raw = rng.lognormal(self._mu(), self.output_sigma, 1 if size is None else size)
        n = np.clip(np.rint(raw), 1, self.max_output).astype(np.int64)
        return int(n[0]) if size is None else n

    def output_length_pmf(self) -> np.ndarray:
        """pmf[n] = P(output length == n), n = 0..max_output (pmf[0] = 0). Read-only, cached."""
        return _length_pmf(self.output_tokens, self.output_sigma, self.max_output, self._mu())

    def output_length_moments(self) -> tuple[float, float]:
        """(mean, standard deviation) of the output length law."""
        pmf = self.output_length_pmf()
        n = np.arange(len(pmf))
        mean = float(np.dot(pmf, n))
        return mean, math.sqrt(max(0.0, float(np.dot(pmf, n * n)) - mean * mean))


@functools.cache
def _length_pmf(mean: float, sigma: float, top: int, mu: float) -> np.ndarray:
    pmf = np.zeros(top + 1)
    if sigma == 0:
        pmf[min(top, max(1, round(mean)))] = 1.0
    else:
        from scipy.special import ndtr  # normal CDF; scipy.stats is slow to import

        cdf = ndtr((np.log(np.arange(top + 1) + 0.5) - mu) / sigma)
        # n rounds to n for x in [n - .5, n + .5); below 1.5 rounds or clips to 1; the upper
        # tail is clipped to top.
        pmf[1] = cdf[1]
        pmf[2:top] = np.diff(cdf[1:top])
        pmf[top] = 1.0 - cdf[top - 1]
    pmf.setflags(write=False)
    return pmf


def expected_accept_length(alpha: float, draft_tokens_minus_1: int) -> float:
    """E[L] of a chain of g = draft_tokens_minus_1 drafts, bonus token included:
    (1 - alpha^(g+1)) / (1 - alpha), at most g + 1 (FIELD.md)."""
    g = int(draft_tokens_minus_1)
    if g < 0:
        raise ValueError(f"draft count must be >= 0 (got {g})")
    if alpha >= 1.0:
        return float(g + 1)
    return float((1.0 - alpha ** (g + 1)) / (1.0 - alpha))


def alpha_for_accept_length(accept_length: float, draft_tokens_minus_1: int) -> float:
    """The alpha whose chain of g drafts has E[L] = accept_length (inverse of the above)."""
    g = int(draft_tokens_minus_1)
    if not (1.0 <= accept_length <= g + 1):
        raise ValueError(f"accept length {accept_length} impossible with {g} drafts")
    from scipy.optimize import brentq

    if accept_length >= g + 1:
        return 1.0
    if accept_length <= 1.0:
        return 0.0
    return float(brentq(lambda a: expected_accept_length(a, g) - accept_length, 0.0, 1.0 - 1e-12))


def accepted_drafts_pmf(alpha: float, num_steps: int) -> np.ndarray:
    """pmf[k] = P(A == k), k = 0..num_steps, A = min(Geometric, num_steps): the chain accepts
    draft i with probability alpha given the first i-1 were accepted."""
    g = int(num_steps)
    k = np.arange(g + 1)
    pmf = (1.0 - alpha) * alpha**k
    pmf[g] = alpha**g
    return pmf


def draw_accepted_drafts(rng: np.random.Generator, alpha: Any, num_steps: int) -> np.ndarray:
    """Accepted drafts per sequence for one verify: min(Geometric(1 - alpha) - 1, num_steps).
    `alpha` is a scalar or one value per sequence (the output has its shape)."""
    a = np.asarray(alpha, dtype=float)
    if num_steps <= 0:
        return np.zeros(a.shape, dtype=np.int64)
    p = np.clip(1.0 - a, 1e-12, 1.0)  # alpha 1 means every draft accepted: p -> 0 saturates
    return np.minimum(rng.geometric(p) - 1, num_steps).astype(np.int64)


# Built-in workloads. Alphas come from FIELD.md's accept lengths through the chain formula:
# - default: the field's own drafter (37K samples). alpha 0.55 gives E[L_2] = 1.85 (SGLang logged
#   1.85-2.12 at 2 steps) and, with the tuned profile's costs, 5-step ~89 tok/s (field 86.7):
#   a constant-alpha chain cannot hit 94.0 at 2 steps and 86.7 at 5 steps exactly (real
#   acceptance decays with depth), 0.55 keeps both within 5%.
# - chat: the strong public drafter's lowest number, GSM8K 3.17 at 3 steps (natural-language
#   answers; real chat is usually a little lower still): alpha 0.8455.
# - code: HumanEval 3.37 at 3 steps: alpha 0.8862.
# - math: Math500 3.49 at 3 steps: alpha 0.9101.
# Lengths are assumptions (typical chat answers, code completions, long math derivations).
_BUILTIN_WORKLOADS: dict[str, Workload] = {
    "default": Workload("default", alpha=0.55, output_tokens=512.0, prompt_tokens=1024.0),
    "chat": Workload("chat", alpha=0.8455, output_tokens=400.0, prompt_tokens=1024.0),
    "code": Workload("code", alpha=0.8862, output_tokens=600.0, prompt_tokens=1536.0),
    "math": Workload("math", alpha=0.9101, output_tokens=800.0, prompt_tokens=256.0),
}

# Which field number each built-in alpha reproduces: (accept length, drafts).
WORKLOAD_SOURCES: dict[str, tuple[float, int, str]] = {
    "default": (1.8525, 2, "field drafter, SGLang logs 1.85-2.12 at 2 steps"),
    "chat": (3.17, 3, "AQ-MedAI Kimi-K2 EAGLE-3, GSM8K, 3 steps / 4 tokens"),
    "code": (3.37, 3, "AQ-MedAI Kimi-K2 EAGLE-3, HumanEval, 3 steps / 4 tokens"),
    "math": (3.49, 3, "AQ-MedAI Kimi-K2 EAGLE-3, Math500, 3 steps / 4 tokens"),
}


def builtin_workloads() -> dict[str, Workload]:
    """chat, code, math and "default" (the field's own drafter); a fresh dict each call."""
    return dict(_BUILTIN_WORKLOADS)


# --------------------------------------------------------------------------------------------
# Profile file validation
# --------------------------------------------------------------------------------------------


class ProfileError(ValueError):
    """A profile file (or override) is invalid: says which file, which key and what is wrong."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        super().__init__(f"{source}: {key}: {problem}")
        self.source = source
        self.key = key
        self.problem = problem


_NUM = (int, float)

# section -> key -> (required, kind) ; kind "num>=0", "num>0", "int>0", "str", "strlist", ...
_SCHEMA: dict[str, dict[str, tuple[bool, str]]] = {
    "": {
        "name": (True, "str"),
        "description": (True, "str"),
        "kind": (True, "kind"),
        "provenance": (True, "table"),
        "target": (True, "table"),
        "draft": (True, "table"),
        "serving": (True, "table"),
        "restart": (True, "table"),
    },
    "provenance": {"measured": (True, "strlist"), "assumed": (True, "strlist")},
    "target.roofline": {
        "model": (True, "str"),
        "fixed_ms": (True, "num>=0"),
        "verify_fixed_ms": (True, "num>=0"),
        "mem_ms": (True, "num>=0"),
        "compute_ms_per_token": (True, "num>=0"),
        "kv_ms_per_seq_per_1k_ctx": (True, "num>=0"),
        "expert_ms": (False, "num>=0"),
        "moe_experts": (False, "int>0"),
        "moe_topk": (False, "int>0"),
        "prefill_fixed_ms": (False, "num>=0"),
        "prefill_ms_per_1k_tokens": (False, "num>=0"),
    },
    "target.table": {
        "model": (True, "str"),
        "batch": (True, "axis"),
        "tokens": (True, "axis"),
        "context": (True, "axis"),
        "ms": (True, "cube"),
        "moe_experts": (False, "int>0"),
        "moe_topk": (False, "int>0"),
        "prefill_fixed_ms": (False, "num>=0"),
        "prefill_ms_per_1k_tokens": (False, "num>=0"),
    },
    "draft": {
        "step_ms": (True, "num>=0"),
        "step_ms_per_seq": (True, "num>=0"),
        "extend_ms": (True, "num>=0"),
        "extend_ms_per_seq": (False, "num>=0"),
        "prefill_ms_per_1k_tokens": (False, "num>=0"),
    },
    "serving": {
        "overhead_ms_per_step": (True, "num>=0"),
        "overhead_ms_per_seq": (False, "num>=0"),
        "context_tokens": (True, "num>0"),
        "max_running_requests": (True, "int>0"),
        "kv_capacity_tokens": (True, "int>0"),
    },
    "restart": {
        "load_s": (True, "num>=0"),
        "graph_capture_s_per_tier": (True, "num>=0"),
        "warmup_s": (True, "num>=0"),
    },
}

_KINDS = ("field", "measured", "assumed")


def _check_value(source: str, key: str, kind: str, v: Any) -> None:
    def bad(problem: str) -> ProfileError:
        return ProfileError(source, key, f"{problem} (got {v!r})")

    if kind == "str":
        if not isinstance(v, str) or not v.strip():
            raise bad("must be a non-empty string")
    elif kind == "kind":
        if v not in _KINDS:
            raise bad(f"must be one of {', '.join(_KINDS)}")
    elif kind == "table":
        if not isinstance(v, dict):
            raise bad("must be a table")
    elif kind == "strlist":
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise bad("must be a list of strings")
    elif kind in ("num>=0", "num>0"):
        if isinstance(v, bool) or not isinstance(v, _NUM) or not math.isfinite(v):
            raise bad("must be a finite number")
        if v < 0 or (kind == "num>0" and v == 0):
            raise bad("must be > 0" if kind == "num>0" else "must be >= 0")
    elif kind == "int>0":
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise bad("must be a positive integer")
    elif kind == "axis":
        if (
            not isinstance(v, list)
            or not v
            or not all(isinstance(x, _NUM) and not isinstance(x, bool) for x in v)
        ):
            raise bad("must be a non-empty list of numbers")
        if any(b <= a for a, b in itertools.pairwise(v)) or v[0] <= 0:
            raise bad("must be positive and strictly increasing")
    elif kind == "cube":
        pass  # shape checked against the axes by _check_table
    else:  # pragma: no cover - schema typo
        raise AssertionError(kind)


def _check_section(source: str, prefix: str, data: Mapping[str, Any], schema_key: str) -> None:
    schema = _SCHEMA[schema_key]
    for key in data:
        if key not in schema:
            known = ", ".join(sorted(schema))
            raise ProfileError(source, f"{prefix}{key}", f"unknown key (known: {known})")
    for key, (required, kind) in schema.items():
        if key not in data:
            if required:
                raise ProfileError(source, f"{prefix}{key}", "missing")
            continue
        _check_value(source, f"{prefix}{key}", kind, data[key])


def _check_table(source: str, t: Mapping[str, Any]) -> np.ndarray:
    nb, nt, nc = len(t["batch"]), len(t["tokens"]), len(t["context"])
    if any(int(x) != x for x in t["tokens"]) or t["tokens"][0] != 1:
        raise ProfileError(
            source, "target.tokens", "must be integers starting at 1 (the decode forward)"
        )
    try:
        cube = np.asarray(t["ms"], dtype=float)
    except (TypeError, ValueError) as exc:
        raise ProfileError(
            source, "target.ms", f"must be a nested list of numbers ({exc})"
        ) from exc
    if cube.shape != (nc, nt, nb):
        raise ProfileError(
            source,
            "target.ms",
            f"shape {cube.shape} does not match ms[context][tokens][batch] = ({nc}, {nt}, {nb})",
        )
    if not np.all(np.isfinite(cube)) or np.any(cube <= 0):
        raise ProfileError(source, "target.ms", "every entry must be a positive finite number")
    return cube


# --------------------------------------------------------------------------------------------
# Cost components
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RooflineTarget:
    fixed_ms: float
    verify_fixed_ms: float
    mem_ms: float
    compute_ms_per_token: float
    kv_ms_per_seq_per_1k_ctx: float
    expert_ms: float = 0.0
    moe_experts: int = 1
    moe_topk: int = 1

    def ms(self, batch: np.ndarray, n: int, ctx: float) -> np.ndarray:
        tokens = batch * n
        expert_share = 1.0 - (1.0 - min(1.0, self.moe_topk / self.moe_experts)) ** tokens
        mem = self.mem_ms + self.expert_ms * expert_share
        return (
            self.fixed_ms
            + (self.verify_fixed_ms if n > 1 else 0.0)
            + np.maximum(mem, self.compute_ms_per_token * tokens)
            + self.kv_ms_per_seq_per_1k_ctx * batch * ctx / 1000.0
        )


def _interp_extrap(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise linear through (xs, ys), extended linearly past both ends."""
    if len(xs) == 1:
        return np.full_like(x, ys[0], dtype=float)
    idx = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    x0, x1 = xs[idx], xs[idx + 1]
    y0, y1 = ys[idx], ys[idx + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _blend(values: np.ndarray, axis_points: tuple[float, ...], x: float, axis: int) -> np.ndarray:
    """Linear interpolation (extrapolation past the ends) of `values` along `axis` at scalar x."""
    xs = np.asarray(axis_points, dtype=float)
    if len(xs) == 1:
        return np.take(values, 0, axis=axis)
    i = int(np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2))
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return np.take(values, i, axis=axis) * (1.0 - w) + np.take(values, i + 1, axis=axis) * w


@dataclass(frozen=True)
class TableTarget:
    batch: tuple[float, ...]
    tokens: tuple[float, ...]
    context: tuple[float, ...]
    cube: np.ndarray = field(compare=False)  # ms[context][tokens][batch]
    # The measured model's routing (informational: the table holds its cost), 1/1 = dense.
    moe_experts: int = 1
    moe_topk: int = 1

    def ms(self, batch: np.ndarray, n: int, ctx: float) -> np.ndarray:
        bs = np.asarray(self.batch, dtype=float)
        # Interpolate in batch for every (context, tokens) row, then blend rows linearly in
        # tokens and in context (scalars, so one pair of weights each).
        rows = np.stack(
            [
                np.stack(
                    [_interp_extrap(batch, bs, self.cube[ci, ti]) for ti in range(len(self.tokens))]
                )
                for ci in range(len(self.context))
            ]
        )  # [ctx, tokens, batch]
        by_tokens = _blend(rows, self.tokens, float(n), axis=1)  # [ctx, batch]
        out = _blend(by_tokens, self.context, float(ctx), axis=0)  # [batch]
        return np.maximum(out, 0.1 * float(self.cube.min()))


@dataclass(frozen=True)
class DraftCost:
    step_ms: float
    step_ms_per_seq: float
    extend_ms: float
    extend_ms_per_seq: float = 0.0
    prefill_ms_per_1k_tokens: float = 0.0


@dataclass(frozen=True)
class Serving:
    overhead_ms_per_step: float
    context_tokens: float
    max_running_requests: int
    kv_capacity_tokens: int
    overhead_ms_per_seq: float = 0.0


@dataclass(frozen=True)
class RestartCost:
    load_s: float
    graph_capture_s_per_tier: float
    warmup_s: float


# Defaults for optional prefill keys: an assumption for a large MoE over TP (documented in the
# module docstring); profiles that know better set them.
DEFAULT_PREFILL_FIXED_MS = 30.0
DEFAULT_PREFILL_MS_PER_1K = 120.0


@dataclass(frozen=True)
class SimProfile:
    """Cost model of one deployment, loaded from a profile file (see the module docstring)."""

    name: str
    description: str
    kind: str
    provenance: Mapping[str, tuple[str, ...]]
    target: RooflineTarget | TableTarget
    draft: DraftCost
    serving: Serving
    restart: RestartCost
    prefill_fixed_ms: float = DEFAULT_PREFILL_FIXED_MS
    prefill_ms_per_1k_tokens: float = DEFAULT_PREFILL_MS_PER_1K
    source: str = "<memory>"

    @property
    def expert_share(self) -> float:
        """The routed share of experts each token reaches (top-k / experts), 0 for a dense
        model: what a user tells specpilot's estimators about this model ([policy] moe_experts,
        moe_topk)."""
        e, k = self.target.moe_experts, self.target.moe_topk
        return k / e if e > 1 else 0.0

    # -- step costs (seconds) --------------------------------------------------------------

    def target_step_s(
        self,
        batch: int | np.ndarray,
        tokens_per_seq: int,
        context_tokens: float | None = None,
        scale: CostScale = NO_SCALE,
    ) -> Any:
        """One target forward of `batch` sequences with `tokens_per_seq` tokens each."""
        n = int(tokens_per_seq)
        if n < 1:
            raise ValueError(f"tokens_per_seq must be >= 1 (got {tokens_per_seq})")
        ctx = self.serving.context_tokens if context_tokens is None else float(context_tokens)
        b = np.asarray(batch, dtype=float)
        if np.any(b < 1):
            raise ValueError(f"batch must be >= 1 (got {batch})")
        ms = self.target.ms(np.atleast_1d(b), n, ctx) * (scale.verify if n > 1 else scale.base)
        return _like(batch, ms / 1000.0)

    def draft_step_s(self, batch: int | np.ndarray, scale: CostScale = NO_SCALE) -> Any:
        b = np.atleast_1d(np.asarray(batch, dtype=float))
        ms = (self.draft.step_ms + self.draft.step_ms_per_seq * b) * scale.draft
        return _like(batch, ms / 1000.0)

    def draft_extend_s(self, batch: int | np.ndarray, scale: CostScale = NO_SCALE) -> Any:
        b = np.atleast_1d(np.asarray(batch, dtype=float))
        ms = (self.draft.extend_ms + self.draft.extend_ms_per_seq * b) * scale.draft
        return _like(batch, ms / 1000.0)

    def overhead_s(self, batch: int | np.ndarray) -> Any:
        b = np.atleast_1d(np.asarray(batch, dtype=float))
        ms = self.serving.overhead_ms_per_step + self.serving.overhead_ms_per_seq * b
        return _like(batch, ms / 1000.0)

    def cycle_phases_s(
        self,
        batch: int | np.ndarray,
        spec: SpecConfig,
        steps: int | None = None,
        context_tokens: float | None = None,
        scale: CostScale = NO_SCALE,
    ) -> dict[str, Any]:
        """One decode cycle split into SGLang's forward_execution categories plus "overhead"
        (CPU, not in any category). Baseline: decode. Speculative with g steps: eagle_draft
        (g draft steps), target_verify (g + 1 tokens per sequence; g = 0 verifies the bonus
        token alone, costed as a decode forward), eagle_draft_extend."""
        over = self.overhead_s(batch)
        if not spec.speculative:
            return {"decode": self.target_step_s(batch, 1, context_tokens, scale), "overhead": over}
        g = spec.num_steps if steps is None else int(steps)
        if g < 0:
            raise ValueError(f"steps must be >= 0 (got {steps})")
        # topk > 1 verifies spec.draft_tokens tokens at the launch tier.
        n = g + 1 if (spec.topk == 1 or g != spec.num_steps) else spec.draft_tokens
        return {
            "eagle_draft": g * self.draft_step_s(batch, scale),
            "target_verify": self.target_step_s(batch, n, context_tokens, scale),
            "eagle_draft_extend": self.draft_extend_s(batch, scale),
            "overhead": over,
        }

    def cycle_s(
        self,
        batch: int | np.ndarray,
        spec: SpecConfig,
        steps: int | None = None,
        context_tokens: float | None = None,
        scale: CostScale = NO_SCALE,
    ) -> Any:
        """One decode cycle of the whole batch (see cycle_phases_s)."""
        phases = self.cycle_phases_s(batch, spec, steps, context_tokens, scale)
        return sum(phases.values())

    def prefill_s(
        self, num_requests: int, prompt_tokens: float, spec: SpecConfig, scale: CostScale = NO_SCALE
    ) -> float:
        """One prefill (extend) step admitting `num_requests` with `prompt_tokens` in total;
        speculative servers also prefill the draft model. Produces each request's first token."""
        if num_requests <= 0:
            return 0.0
        ms = (self.prefill_fixed_ms + self.prefill_ms_per_1k_tokens * prompt_tokens / 1000.0) * (
            scale.base
        )
        if spec.speculative:
            ms += self.draft.prefill_ms_per_1k_tokens * prompt_tokens / 1000.0 * scale.draft
        return ms / 1000.0

    # -- serving and restart ----------------------------------------------------------------

    def max_running_requests(self, spec: SpecConfig) -> int:
        """The default when the flags do not set it: SGLang forces 48 with speculation."""
        if spec.speculative:
            return SGLANG_SPEC_DEFAULT_MAX_RUNNING
        return self.serving.max_running_requests

    def restart_phases_s(self, spec: SpecConfig) -> dict[str, float]:
        """Seconds per startup phase: weights, one CUDA-graph capture per tier, warmup."""
        return {
            "load": self.restart.load_s,
            "cuda_graph": self.restart.graph_capture_s_per_tier * len(spec.tiers),
            "warmup": self.restart.warmup_s,
        }

    def restart_s(self, spec: SpecConfig) -> float:
        return float(sum(self.restart_phases_s(spec).values()))


def startup_times(phases: Mapping[str, float]) -> dict[str, float]:
    """SGLang's startup_time record (sglang:startup_time_seconds by phase) from a launch's
    phases (SimProfile.restart_phases_s): the engine's clock covers loading and graph capture,
    not the warmup request that follows it."""
    load = float(phases.get("load", 0.0))
    graphs = float(phases.get("cuda_graph", 0.0))
    return {
        "load_weight": load,
        "kv_cache_allocation": 0.0,  # folded into the profile's load phase
        "scheduler_e2e": load + graphs,
        "tokenizer_e2e": load + graphs,
    }


def _like(batch: int | np.ndarray, values: np.ndarray) -> Any:
    """Return a float for scalar input, an array for array input."""
    if np.ndim(batch) == 0:
        return float(values.reshape(-1)[0])
    return values.reshape(np.shape(batch))


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped in simulator/profiles/."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def _resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise FileNotFoundError(f"profile file not found: {p}")
        return p
    candidate = PROFILES_DIR / f"{name_or_path}.toml"
    if not candidate.is_file():
        raise FileNotFoundError(
            f"unknown profile {name_or_path!r}; built-in: {', '.join(builtin_profiles())}"
        )
    return candidate


def _apply_overrides(
    source: str, raw: dict[str, Any], overrides: Mapping[str, Any]
) -> float | None:
    """Dotted keys replace values in the raw document before validation; `restart_s` is
    returned separately (it rescales the restart phases after loading)."""
    restart_total: float | None = None
    for key, value in overrides.items():
        if key == "restart_s":
            if isinstance(value, bool) or not isinstance(value, _NUM) or not value > 0:
                raise ProfileError(f"{source} (override)", key, f"must be > 0 (got {value!r})")
            restart_total = float(value)
            continue
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in ("target", "draft", "serving", "restart"):
            raise ValueError(
                f"unknown override key {key!r}: use 'restart_s' or 'section.key' with section "
                "target, draft, serving or restart"
            )
        section, name = parts
        schema_key = section
        if section == "target":
            schema_key = (
                "target.table" if raw["target"].get("model") == "table" else "target.roofline"
            )
        if name not in _SCHEMA[schema_key]:
            raise ValueError(f"unknown override key {key!r} for this profile ({source})")
        raw[section][name] = value
    return restart_total


def load_profile(name_or_path: str, overrides: Mapping[str, Any] | None = None) -> SimProfile:
    """Load a built-in profile by name or a profile file by path, validate it and apply
    overrides: {"restart_s": 60} scales the restart phases so that a one-tier restart takes
    60 s (multi-tier restarts keep their proportion); {"target.verify_fixed_ms": 9} replaces one
    key. Unknown keys and bad values raise ValueError (ProfileError) naming file and key."""
    path = _resolve(name_or_path)
    source = str(path)
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except UnicodeDecodeError:
        raise ProfileError(source, "<file>", "not UTF-8 text, so not TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(source, "<file>", f"not valid TOML ({exc})") from exc
    return profile_from_dict(raw, source=source, overrides=overrides)


def profile_from_dict(
    raw_in: Mapping[str, Any], *, source: str = "<dict>", overrides: Mapping[str, Any] | None = None
) -> SimProfile:
    """Validate a parsed profile document (the TOML file's content) and build the profile."""
    raw: dict[str, Any] = copy.deepcopy(dict(raw_in))
    _check_section(source, "", raw, "")
    _check_section(source, "provenance.", raw["provenance"], "provenance")
    model = raw["target"].get("model")
    if model not in ("roofline", "table"):
        raise ProfileError(source, "target.model", f"must be 'roofline' or 'table' (got {model!r})")
    restart_total = _apply_overrides(source, raw, overrides or {})
    tkey = "target.table" if model == "table" else "target.roofline"
    _check_section(source, "target.", raw["target"], tkey)
    for section in ("draft", "serving", "restart"):
        _check_section(source, f"{section}.", raw[section], section)

    t = raw["target"]
    target: RooflineTarget | TableTarget
    if t.get("moe_topk", 1) > t.get("moe_experts", 1):
        raise ProfileError(source, "target.moe_topk", "must not exceed moe_experts")
    if model == "table":
        cube = _check_table(source, t)
        target = TableTarget(
            batch=tuple(float(x) for x in t["batch"]),
            tokens=tuple(float(x) for x in t["tokens"]),
            context=tuple(float(x) for x in t["context"]),
            cube=cube,
            moe_experts=int(t.get("moe_experts", 1)),
            moe_topk=int(t.get("moe_topk", 1)),
        )
    else:
        if t.get("expert_ms", 0) > 0 and ("moe_experts" not in t or "moe_topk" not in t):
            raise ProfileError(source, "target.expert_ms", "needs moe_experts and moe_topk")
        target = RooflineTarget(
            fixed_ms=float(t["fixed_ms"]),
            verify_fixed_ms=float(t["verify_fixed_ms"]),
            mem_ms=float(t["mem_ms"]),
            compute_ms_per_token=float(t["compute_ms_per_token"]),
            kv_ms_per_seq_per_1k_ctx=float(t["kv_ms_per_seq_per_1k_ctx"]),
            expert_ms=float(t.get("expert_ms", 0.0)),
            moe_experts=int(t.get("moe_experts", 1)),
            moe_topk=int(t.get("moe_topk", 1)),
        )
    d, s, r = raw["draft"], raw["serving"], raw["restart"]
    restart = RestartCost(
        float(r["load_s"]), float(r["graph_capture_s_per_tier"]), float(r["warmup_s"])
    )
    if restart_total is not None:
        one_tier = restart.load_s + restart.graph_capture_s_per_tier + restart.warmup_s
        if one_tier <= 0:
            raise ProfileError(source, "restart_s", "cannot scale a zero restart time")
        f = restart_total / one_tier
        restart = RestartCost(
            restart.load_s * f, restart.graph_capture_s_per_tier * f, restart.warmup_s * f
        )
    return SimProfile(
        name=raw["name"],
        description=raw["description"],
        kind=raw["kind"],
        provenance={k: tuple(v) for k, v in raw["provenance"].items()},
        target=target,
        draft=DraftCost(
            step_ms=float(d["step_ms"]),
            step_ms_per_seq=float(d["step_ms_per_seq"]),
            extend_ms=float(d["extend_ms"]),
            extend_ms_per_seq=float(d.get("extend_ms_per_seq", 0.0)),
            prefill_ms_per_1k_tokens=float(d.get("prefill_ms_per_1k_tokens", 0.0)),
        ),
        serving=Serving(
            overhead_ms_per_step=float(s["overhead_ms_per_step"]),
            context_tokens=float(s["context_tokens"]),
            max_running_requests=int(s["max_running_requests"]),
            kv_capacity_tokens=int(s["kv_capacity_tokens"]),
            overhead_ms_per_seq=float(s.get("overhead_ms_per_seq", 0.0)),
        ),
        restart=restart,
        prefill_fixed_ms=float(t.get("prefill_fixed_ms", DEFAULT_PREFILL_FIXED_MS)),
        prefill_ms_per_1k_tokens=float(
            t.get("prefill_ms_per_1k_tokens", DEFAULT_PREFILL_MS_PER_1K)
        ),
        source=source,
    )
