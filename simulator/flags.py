"""Launch flags of the simulated SGLang 0.5.23 server and SGLang's resolution rules for them.

Owns: the argparse parser (SGLang's own flag names, plus `--sim-*` flags for the cost model,
time acceleration and fault injection), the resolution SGLang applies to speculative flags
(read from srt/arg_groups/speculative_hook.py and adaptive_spec_params.py of the 0.5.23 wheel),
the resulting `ServerArgs` record, its `/server_info` view and the `SpecConfig` it defines.
Must not: start servers, touch the network or the cost model's numbers (that is
simulator.model), or accept a combination SGLang rejects.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from simulator.model import DEFAULT_ADAPTIVE_CONFIG, SGLANG_SPEC_DEFAULT_MAX_RUNNING, SpecConfig

SGLANG_VERSION = "0.5.23"

# Builtin algorithm names of SpeculativeAlgorithm (srt/speculative/spec_info.py); NEXTN is a
# reserved alias of EAGLE.
SGLANG_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO")
# The EAGLE family (_handle_eagle_family): a chain of draft steps verified by the target. These
# are what the cost model simulates; the others draft differently and are refused by name.
SIMULATED_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
# SGLang's default when --speculative-num-steps is unset (_auto_choose_speculative_params for
# every architecture the simulator stands in for; LlamaForCausalLM would get (5, 4, 8)).
AUTO_SPEC_PARAMS = (3, 1, 4)
FAULT_SCOPES = ("any", "baseline", "spec", "adaptive")


class FlagError(ValueError):
    """A flag combination SGLang 0.5.23 refuses at startup (before it binds its port)."""


@dataclass(frozen=True)
class FaultFlags:
    """Faults injected on demand (see simulator.faults for their behaviour)."""

    start_fail: bool = False
    crash_after_s: float | None = None
    hang_start: bool = False
    metrics: str | None = None  # "500" | "garbage"
    slow_ms: float = 0.0
    scope: str = "any"  # any | baseline | spec | adaptive | steps=N


@dataclass(frozen=True)
class ServerArgs:
    """The resolved launch configuration: what `/server_info` reports as flat keys."""

    model_path: str
    served_model_name: str
    host: str
    port: int
    enable_metrics: bool
    max_running_requests: int | None  # None: the profile's default (no speculation)
    decode_log_interval: int
    tp_size: int
    dp_size: int
    ep_size: int
    enable_metrics_for_all_schedulers: bool
    tokenizer_metrics_custom_labels_header: str
    tokenizer_metrics_allowed_custom_labels: list[str] | None
    extra_metric_labels: dict[str, str] | None
    speculative_algorithm: str | None
    speculative_draft_model_path: str | None
    speculative_num_steps: int | None
    speculative_eagle_topk: int | None
    speculative_num_draft_tokens: int | None
    speculative_attention_mode: str
    speculative_adaptive: bool
    speculative_adaptive_config: str | None
    trust_remote_code: bool
    context_length: int | None
    mem_fraction_static: float | None
    log_level: str
    sim_profile: str
    sim_speed: float
    sim_seed: int
    sim_overrides: dict[str, Any] = field(default_factory=dict)
    sim_workloads: dict[str, dict[str, float]] = field(default_factory=dict)
    sim_cost_scale: dict[str, float] = field(default_factory=dict)
    faults: FaultFlags = field(default_factory=FaultFlags)
    adaptive_config: dict[str, Any] | None = None  # parsed --speculative-adaptive-config
    warnings: tuple[str, ...] = ()
    launch_command: str = ""

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm is not None

    def server_info(self) -> dict[str, Any]:
        """Flat resolved args as `/server_info` reports them (plus version, launch_command)."""
        d = asdict(self)
        for private in ("faults", "adaptive_config", "warnings"):
            d.pop(private)
        d["version"] = SGLANG_VERSION
        return d


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _json_str_dict(text: str) -> dict[str, str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"label1": "value1"}\'')
    return {k: str(v) for k, v in value.items()}


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _workload_def(text: str) -> tuple[str, dict[str, float]]:
    """NAME=ALPHA[:OUTPUT_TOKENS[:PROMPT_TOKENS]] -> (name, fields)."""
    name, sep, spec = text.partition("=")
    parts = spec.split(":") if sep else []
    if not name or not 1 <= len(parts) <= 3:
        raise argparse.ArgumentTypeError(
            f"expected NAME=ALPHA[:OUTPUT_TOKENS[:PROMPT_TOKENS]], got {text!r}"
        )
    try:
        numbers = [float(p) for p in parts]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from e
    if not 0.0 <= numbers[0] < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: ALPHA must be in [0, 1)")
    if any(n <= 0 for n in numbers[1:]):
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be > 0")
    keys = ("alpha", "output_tokens", "prompt_tokens")
    return name, dict(zip(keys, numbers, strict=False))


def _fault_scope(text: str) -> str:
    if text in FAULT_SCOPES:
        return text
    if text.startswith("steps="):
        try:
            int(text.removeprefix("steps="))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"bad steps in {text!r}") from e
        return text
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(FAULT_SCOPES)} or steps=N")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simulator",
        description="SGLang 0.5.23 stand-in: same launch flags, endpoints and metric names, "
        "served from a cost model (simulator/profiles/*.toml) in accelerated time.",
    )
    g = p.add_argument_group("SGLang flags")
    g.add_argument("--model-path", "--model", dest="model_path", required=True)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--enable-metrics", action="store_true")
    g.add_argument("--max-running-requests", type=_positive_int, default=None)
    g.add_argument("--decode-log-interval", type=_positive_int, default=40)
    g.add_argument(
        "--tp-size", "--tensor-parallel-size", dest="tp_size", type=_positive_int, default=1
    )
    g.add_argument(
        "--dp-size", "--data-parallel-size", dest="dp_size", type=_positive_int, default=1
    )
    g.add_argument("--ep-size", "--expert-parallel-size", dest="ep_size", type=_positive_int,
                   default=1)  # fmt: skip
    g.add_argument("--enable-metrics-for-all-schedulers", action="store_true")
    g.add_argument("--tokenizer-metrics-custom-labels-header", default="x-custom-labels")
    g.add_argument("--tokenizer-metrics-allowed-custom-labels", nargs="+", default=None)
    g.add_argument("--extra-metric-labels", type=_json_str_dict, default=None)
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--context-length", type=_positive_int, default=None)
    g.add_argument("--mem-fraction-static", type=float, default=None)
    g.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )

    s = p.add_argument_group("speculative decoding")
    s.add_argument(
        "--speculative-algorithm",
        default=None,
        metavar="{" + ",".join(SGLANG_ALGORITHMS) + "}",
        help="case-insensitive, as in SGLang",
    )
    s.add_argument(
        "--speculative-draft-model-path",
        "--speculative-draft-model",
        dest="speculative_draft_model_path",
        default=None,
    )
    s.add_argument("--speculative-num-steps", type=int, default=None)
    s.add_argument("--speculative-eagle-topk", type=int, default=None)
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    s.add_argument("--speculative-attention-mode", choices=["prefill", "decode"], default="prefill")
    s.add_argument("--speculative-adaptive", action="store_true")
    s.add_argument("--speculative-adaptive-config", default=None, metavar="FILE.json")

    m = p.add_argument_group("simulator")
    m.add_argument(
        "--sim-profile",
        default="kimi-k2.5-pcie-tuned",
        help="built-in profile name or path to a profile TOML",
    )
    m.add_argument(
        "--sim-speed",
        type=_positive_float,
        default=1.0,
        help="time runs this many times faster than the wall clock",
    )
    m.add_argument("--sim-seed", type=int, default=0)
    m.add_argument(
        "--sim-override",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="profile override, e.g. restart_s=2 or target.verify_fixed_ms=9",
    )
    m.add_argument(
        "--sim-workload",
        type=_workload_def,
        action="append",
        default=[],
        metavar="NAME=ALPHA[:OUT[:PROMPT]]",
        help="add or replace a workload (per-token acceptance, mean lengths)",
    )
    m.add_argument(
        "--sim-cost-scale",
        type=_key_value,
        action="append",
        default=[],
        metavar="verify|base|draft=X",
        help="multiply step costs (a later boot's system state)",
    )

    f = p.add_argument_group("fault injection")
    f.add_argument(
        "--sim-fault-start-fail",
        action="store_true",
        help="exit non-zero during loading, before binding the port",
    )
    f.add_argument(
        "--sim-fault-crash-after-s",
        type=_non_negative_float,
        default=None,
        metavar="S",
        help="crash (exit 1) S wall seconds after the port binds",
    )
    f.add_argument(
        "--sim-fault-hang-start",
        action="store_true",
        help="never finish loading (port never binds)",
    )
    f.add_argument(
        "--sim-fault-metrics",
        choices=["500", "garbage"],
        default=None,
        help="serve HTTP 500 or unparsable text on /metrics",
    )
    f.add_argument(
        "--sim-fault-slow-ms",
        type=_non_negative_float,
        default=0.0,
        metavar="MS",
        help="delay every HTTP response by MS wall milliseconds",
    )
    f.add_argument(
        "--sim-fault-scope",
        type=_fault_scope,
        default="any",
        help="apply the faults only to this speculative shape: "
        "any | baseline | spec | adaptive | steps=N",
    )
    return p


def load_adaptive_config(path: str | None) -> tuple[dict[str, Any], list[int]]:
    """Read and validate an adaptive config as _load_adaptive_config does; return it and the
    union of its candidate steps (sorted)."""
    if path is None:
        cfg: Any = DEFAULT_ADAPTIVE_CONFIG
    else:
        try:
            cfg = json.loads(Path(path).read_text())
        except OSError as e:
            raise FlagError(f"--speculative-adaptive-config: cannot read {path}: {e}") from e
        except json.JSONDecodeError as e:
            raise FlagError(f"--speculative-adaptive-config: {path} is not JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise FlagError(f"--speculative-adaptive-config: {path} must hold a JSON object")
    steps: set[int] = set()
    bs_keys = 0
    for key, entry in cfg.items():
        if not key.isdigit():
            continue
        cand = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if (
            not isinstance(cand, list)
            or not cand
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in cand)
        ):
            raise FlagError(
                f"BS {key}: candidate_steps must be a list of non-negative ints, got {cand!r}"
            )
        steps.update(cand)
        bs_keys += 1
    if bs_keys == 0:
        raise FlagError(
            "speculative_adaptive_config must contain at least one integer-string BS key, "
            f'e.g. {{"1": {{"candidate_steps": [1,3,7]}}}}. Got keys: {list(cfg.keys())}'
        )
    return dict(cfg), sorted(steps)


def resolve(ns: argparse.Namespace, argv: Sequence[str]) -> ServerArgs:
    """Apply SGLang 0.5.23's resolution to parsed flags; FlagError where SGLang refuses."""
    warnings: list[str] = []
    algo: str | None = ns.speculative_algorithm
    steps: int | None = ns.speculative_num_steps
    topk: int | None = ns.speculative_eagle_topk
    draft: int | None = ns.speculative_num_draft_tokens
    adaptive: bool = ns.speculative_adaptive
    max_running: int | None = ns.max_running_requests
    adaptive_cfg: dict[str, Any] | None = None

    if ns.tokenizer_metrics_allowed_custom_labels and not ns.tokenizer_metrics_custom_labels_header:
        raise FlagError(
            "Please set --tokenizer-metrics-custom-labels-header when setting "
            "--tokenizer-metrics-allowed-custom-labels."
        )
    if ns.tp_size % ns.ep_size != 0:
        raise FlagError(f"tp_size ({ns.tp_size}) must be divisible by ep_size ({ns.ep_size})")
    for name, value in (("num-steps", steps), ("eagle-topk", topk), ("num-draft-tokens", draft)):
        if value is not None and value < (0 if name == "num-steps" else 1):
            raise FlagError(f"--speculative-{name} must be positive, got {value}")

    if algo is not None:
        algo = algo.upper()
        if algo == "NEXTN":  # _resolve_speculative_algorithm_alias
            algo = "EAGLE"
        if algo not in SGLANG_ALGORITHMS:
            raise FlagError(f"Unknown speculative algorithm name: {ns.speculative_algorithm}")
        if algo not in SIMULATED_ALGORITHMS:
            raise FlagError(
                f"--speculative-algorithm {algo}: the simulator models EAGLE-family chain "
                f"drafting only ({', '.join(SIMULATED_ALGORITHMS)}, NEXTN)"
            )
        if ns.speculative_draft_model_path is None:
            # SGLang fills it only for MTP architectures (DeepSeek, GLM...); any other target
            # fails to load a draft model from no path.
            raise FlagError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")

        if adaptive:  # _maybe_disable_adaptive, then _init_adaptive_speculative_params
            reason = None
            if algo not in ("EAGLE", "EAGLE3"):
                reason = f"speculative_algorithm={algo} (only EAGLE/EAGLE3 are supported)"
            elif topk is not None and topk != 1:
                reason = f"speculative_eagle_topk={topk} (only topk=1 is supported)"
            if reason is not None:
                warnings.append(
                    f"speculative_adaptive disabled: {reason}. "
                    "Falling back to static speculative params."
                )
                adaptive = False
        if adaptive:
            adaptive_cfg, candidates = load_adaptive_config(ns.speculative_adaptive_config)
            if ns.speculative_adaptive_config is None:
                adaptive_cfg = None  # SpecConfig reads None as SGLang's default table
            if topk is None:
                topk = 1
            if steps is None:
                steps = candidates[len(candidates) // 2]
            if steps not in candidates:
                raise FlagError(
                    f"--speculative-num-steps={steps} is not in the adaptive config "
                    f"candidate_steps {candidates}. Pass one of those values."
                )
            draft = steps + 1

        # _handle_eagle_family
        if max_running is None:
            max_running = SGLANG_SPEC_DEFAULT_MAX_RUNNING
            warnings.append(
                "Max running requests is reset to 48 for speculative decoding. You can override "
                "this by explicitly setting --max-running-requests."
            )
        if not adaptive and steps is None:
            if topk is not None or draft is not None:
                # SGLang asserts here (AssertionError, no message): say what it means.
                raise FlagError(
                    "--speculative-eagle-topk and --speculative-num-draft-tokens need "
                    "--speculative-num-steps (leave all three unset for SGLang's defaults)"
                )
            steps, topk, draft = AUTO_SPEC_PARAMS
        if topk is None:
            # SGLang 0.5.23 reaches `speculative_eagle_topk > 1` with None and dies (TypeError).
            raise FlagError("--speculative-num-steps needs --speculative-eagle-topk")
        if topk == 1 and draft != steps + 1:
            warnings.append(
                "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                "speculative_eagle_topk == 1"
            )
            draft = steps + 1
        if draft is None:
            raise FlagError(
                "--speculative-eagle-topk > 1 needs --speculative-num-draft-tokens (tree size)"
            )
        if steps == 0 and not adaptive:
            raise FlagError("--speculative-num-steps must be >= 1 without --speculative-adaptive")
    elif adaptive:
        # handle_speculative_decoding only looks at adaptive with an algorithm set; say so.
        warnings.append("--speculative-adaptive has no effect without --speculative-algorithm")
        adaptive = False

    faults = FaultFlags(
        start_fail=ns.sim_fault_start_fail,
        crash_after_s=ns.sim_fault_crash_after_s,
        hang_start=ns.sim_fault_hang_start,
        metrics=ns.sim_fault_metrics,
        slow_ms=ns.sim_fault_slow_ms,
        scope=ns.sim_fault_scope,
    )
    cost_scale: dict[str, float] = {}
    for key, value in ns.sim_cost_scale:
        if key not in ("verify", "base", "draft"):
            raise FlagError(f"--sim-cost-scale: unknown key {key!r} (verify, base, draft)")
        if not isinstance(value, int | float) or value <= 0:
            raise FlagError(f"--sim-cost-scale {key}: must be a number > 0, got {value!r}")
        cost_scale[key] = float(value)

    return ServerArgs(
        model_path=ns.model_path,
        served_model_name=ns.served_model_name or ns.model_path,
        host=ns.host,
        port=ns.port,
        enable_metrics=ns.enable_metrics,
        max_running_requests=max_running,
        decode_log_interval=ns.decode_log_interval,
        tp_size=ns.tp_size,
        dp_size=ns.dp_size,
        ep_size=ns.ep_size,
        enable_metrics_for_all_schedulers=ns.enable_metrics_for_all_schedulers,
        tokenizer_metrics_custom_labels_header=ns.tokenizer_metrics_custom_labels_header,
        tokenizer_metrics_allowed_custom_labels=ns.tokenizer_metrics_allowed_custom_labels,
        extra_metric_labels=ns.extra_metric_labels,
        speculative_algorithm=algo,
        speculative_draft_model_path=ns.speculative_draft_model_path,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=draft,
        speculative_attention_mode=ns.speculative_attention_mode,
        speculative_adaptive=adaptive,
        speculative_adaptive_config=ns.speculative_adaptive_config if adaptive else None,
        trust_remote_code=ns.trust_remote_code,
        context_length=ns.context_length,
        mem_fraction_static=ns.mem_fraction_static,
        log_level=ns.log_level,
        sim_profile=ns.sim_profile,
        sim_speed=ns.sim_speed,
        sim_seed=ns.sim_seed,
        sim_overrides=dict(ns.sim_override),
        sim_workloads=dict(ns.sim_workload),
        sim_cost_scale=cost_scale,
        faults=faults,
        adaptive_config=adaptive_cfg,
        warnings=tuple(warnings),
        launch_command=shlex.join(["python", "-m", "simulator", *argv]),
    )


def parse_args(argv: Sequence[str]) -> ServerArgs:
    """Parse and resolve; argparse errors exit 2 (as SGLang's), FlagError is raised."""
    ns = build_parser().parse_args(list(argv))
    return resolve(ns, argv)


def spec_config(args: ServerArgs) -> SpecConfig:
    """The speculation shape the engine runs for these resolved args."""

    if args.speculative_algorithm is None:
        return SpecConfig(algorithm=None)
    assert args.speculative_num_steps is not None
    assert args.speculative_eagle_topk is not None
    assert args.speculative_num_draft_tokens is not None
    return SpecConfig(
        algorithm=args.speculative_algorithm,
        num_steps=args.speculative_num_steps,
        topk=args.speculative_eagle_topk,
        draft_tokens=args.speculative_num_draft_tokens,
        adaptive=args.speculative_adaptive,
        adaptive_config=args.adaptive_config,
    )
