"""Turn the raw H200 measurements into the simulator profiles h200-llama8b and h200-moe.

Owns: reading ``tools/h200/results/h200_raw.csv`` and ``h200_meta.json`` (written by
``measure.py``), the rules that turn medians into profile numbers (which rows count, the MoE
layer scaling, the draft fits, the derived prefill and KV-capacity numbers), and writing
``simulator/profiles/h200-*.toml``.

Must not: measure anything, or carry a hand-edited number. Every measured value in the profiles
is recomputable from the CSV with the functions here (``--check`` does it, and so do the tests);
everything else is listed under ``[provenance].assumed`` with its reason.

Usage: ``python tools/h200/make_profiles.py`` (write) or ``--check`` (exit 1 if the profiles on
disk differ from what the CSV gives).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RAW_CSV = RESULTS / "h200_raw.csv"
META_JSON = RESULTS / "h200_meta.json"
PROFILES_DIR = HERE.parent.parent / "simulator" / "profiles"

# The profile's mean context; the draft fits are read there (linear between 1k and 4k, as the
# simulator interpolates the target table).
CONTEXT_TOKENS = 2048
# Draft-extend is costed per cycle without a token count in the profile format; 4 tokens per
# sequence (3 steps + bonus) sits between the 2-step and 5-step tiers. The CSV has 1..8.
EXTEND_TOKENS = 4
# SGLang's default --mem-fraction-static on a large GPU is about this; used only for the
# derived KV capacity of the 8B profile (an assumption, said so in the profile).
MEM_FRACTION_STATIC = 0.88
REQUIRED_COLUMNS = (
    "model",
    "component",
    "ctx",
    "batch",
    "tokens",
    "mode",
    "attn",
    "median_ms",
    "finite",
    "error",
    "layers_measured",
    "layers_full",
)


@dataclass(frozen=True)
class Row:
    model: str
    component: str
    ctx: int
    batch: int
    tokens: int
    mode: str
    attn: str
    median_ms: float
    layers_measured: int
    layers_full: int


def load_raw(path: Path = RAW_CSV) -> list[Row]:
    """Rows that are usable timings: finite output, no error, a positive median."""
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}")
        rows = []
        for i, r in enumerate(reader, start=2):
            try:
                med = float(r["median_ms"])
                row = Row(
                    model=r["model"],
                    component=r["component"],
                    ctx=int(r["ctx"]),
                    batch=int(r["batch"]),
                    tokens=int(r["tokens"]),
                    mode=r["mode"],
                    attn=r["attn"],
                    median_ms=med,
                    layers_measured=int(r["layers_measured"]),
                    layers_full=int(r["layers_full"]),
                )
            except ValueError as exc:
                raise ValueError(f"{path}:{i}: bad value ({exc})") from exc
            if r["error"] or r["finite"] != "1" or not math.isfinite(med) or med <= 0:
                continue
            rows.append(row)
    return rows


def load_meta(path: Path = META_JSON) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads(path.read_text())
    for key in ("environment", "grid", "models"):
        if key not in meta:
            raise ValueError(f"{path}: missing {key!r}")
    return meta


class Table:
    """Index of usable rows by (model, component, ctx, batch, tokens, mode)."""

    def __init__(self, rows: Iterable[Row]) -> None:
        self._rows: dict[tuple[str, str, int, int, int, str], list[Row]] = {}
        for r in rows:
            key = (r.model, r.component, r.ctx, r.batch, r.tokens, r.mode)
            self._rows.setdefault(key, []).append(r)

    def best(self, model: str, component: str, ctx: int, batch: int, tokens: int, mode: str) -> Row:
        """The fastest attention variant of one shape (a serving kernel packs GQA and splits
        the KV length at once; each variant here does one of the two, see measure.attend)."""
        found = self._rows.get((model, component, ctx, batch, tokens, mode))
        if not found:
            raise ValueError(
                f"no usable {mode} row for {model} {component} ctx={ctx} B={batch} n={tokens}"
            )
        return min(found, key=lambda r: r.median_ms)

    def ms(self, model: str, component: str, ctx: int, batch: int, tokens: int) -> float:
        return self.best(model, component, ctx, batch, tokens, "graph").median_ms


def layer_scaled_ms(total_ms: float, head_ms: float, measured: int, full: int) -> float:
    """Forward time of the full depth from a forward of ``measured`` layers: the layers' part
    (total minus embedding + final norm + LM head, timed alone as "head") times full/measured."""
    return head_ms + (total_ms - head_ms) * full / measured


def target_ms(t: Table, model: str, ctx: int, batch: int, tokens: int) -> float:
    row = t.best(model, "target", ctx, batch, tokens, "graph")
    if row.layers_measured == row.layers_full:
        return row.median_ms
    head = t.ms(model, "head", 0, batch, tokens)
    return layer_scaled_ms(row.median_ms, head, row.layers_measured, row.layers_full)


def target_cube(
    t: Table, model: str, contexts: Sequence[int], tokens: Sequence[int], batches: Sequence[int]
) -> list[list[list[float]]]:
    """ms[context][tokens][batch], the simulator's table layout, rounded to 0.1 us."""
    return [
        [[round(target_ms(t, model, c, b, n), 4) for b in batches] for n in tokens]
        for c in contexts
    ]


def at_context(values_by_ctx: Mapping[int, float], ctx: float) -> float:
    """Linear in context between the measured contexts (as the simulator reads its table)."""
    xs = sorted(values_by_ctx)
    return float(np.interp(ctx, xs, [values_by_ctx[x] for x in xs]))


@dataclass(frozen=True)
class LinearFit:
    intercept_ms: float
    per_seq_ms: float
    worst_rel_err: float


def fit_linear(batches: Sequence[int], ms: Sequence[float]) -> LinearFit:
    slope, intercept = np.polyfit(np.asarray(batches, float), np.asarray(ms, float), 1)
    pred = intercept + slope * np.asarray(batches, float)
    worst = float(np.max(np.abs(pred - ms) / np.asarray(ms)))
    return LinearFit(float(intercept), float(slope), worst)


def draft_fit(t: Table, drafter: str, component: str, tokens: int, batches: Sequence[int],
              contexts: Sequence[int]) -> LinearFit:  # fmt: skip
    """Draft cost at CONTEXT_TOKENS, linear in batch: what the profile's [draft] keys model."""
    ms = [
        at_context({c: t.ms(drafter, component, c, b, tokens) for c in contexts}, CONTEXT_TOKENS)
        for b in batches
    ]
    return fit_linear(batches, ms)


def prefill_terms(cube: list[list[list[float]]], tokens: Sequence[int], batches: Sequence[int]
                  ) -> tuple[float, float]:  # fmt: skip
    """Derived (not measured as prefill): the forward floor (decode, B=1, shortest context) and
    the marginal cost of 1000 more tokens in one forward, from the two largest token counts of
    the shortest-context verify forwards, where the forward is compute-bound."""
    row = cube[0][len(tokens) - 1]  # shortest context, most tokens per sequence
    n = tokens[-1]
    b0, b1 = batches[-2], batches[-1]
    per_1k = (row[-1] - row[-2]) / ((b1 - b0) * n) * 1000.0
    return cube[0][0][0], per_1k


def attention_caveat(
    cube: list[list[list[float]]], contexts: Sequence[int], tokens: Sequence[int],
    batches: Sequence[int],
) -> str:  # fmt: skip
    """Say where the stand-in attention is weakest: the largest verify/decode step at the
    longest context (neither path both packs GQA and splits the KV length there)."""
    ci, ni = len(contexts) - 1, tokens.index(2) if 2 in tokens else 1
    ratios = [cube[ci][ni][i] / cube[ci][0][i] for i in range(len(batches))]
    i = int(np.argmax(ratios))
    return (
        f"verify attention: at ctx {contexts[ci]}, B={batches[i]} the 2-token verify forward "
        f"takes {cube[ci][ni][i]:.2f} ms against {cube[ci][0][i]:.2f} ms for decode "
        f"({ratios[i]:.2f}x); part of that is the stand-in kernels (GQA packing without split-KV "
        "or split-KV without packing), which FA3/FlashInfer in SGLang avoid, so mid-batch, "
        "long-context verify is likely pessimistic here"
    )


def moe_kernel_caveat(
    t: Table, model: str, tm: Mapping[str, Any], meta: Mapping[str, Any],
    contexts: Sequence[int], tokens: Sequence[int], batches: Sequence[int],
) -> str:  # fmt: skip
    """How fast the measured layers stream the routed experts at the largest shape, where
    every expert is active: the effective bandwidth against the measured copy bandwidth."""
    moe = tm["moe"]
    b, n, c = batches[-1], tokens[-1], contexts[0]
    layers_ms = t.ms(model, "target", c, b, n) - t.ms(model, "head", 0, b, n)
    expert_bytes = (
        tm["layers_measured"] * moe["experts"] * 3 * tm["hidden"] * moe["expert_intermediate"] * 2
    )
    tb_s = expert_bytes / (layers_ms * 1e-3) / 1e12
    copy = meta.get("ceilings", {}).get("copy_tb_s")
    share = f" ({tb_s / copy:.0%} of the measured {copy} TB/s copy rate)" if copy else ""
    return (
        "MoE kernel: sort-by-expert + torch grouped_mm (two grouped GEMMs, unfused SiLU, "
        f"gather/scatter); at B={b}, n={n} its layers stream all routed experts at "
        f"{tb_s:.2f} TB/s{share}, attention and the rest included, so large-batch times are "
        "likely above a tuned fused-MoE kernel's"
    )


def drafter_weight_bytes(d: Mapping[str, Any]) -> int:
    """EAGLE-3 head weights (bf16); the embedding is shared with the target, as in SGLang."""
    h, q = d["hidden"], d["heads"] * d["head_dim"]
    kv = 2 * d["kv_heads"] * d["head_dim"]
    params = (
        3 * d["target_hidden"] * h  # fc
        + (q + kv) * 2 * h  # qkv over [embedding, hidden]
        + q * h  # o
        + 3 * h * d["intermediate"]  # gate, up, down
        + d["draft_vocab"] * h  # lm head
    )
    return 2 * params


@dataclass(frozen=True)
class ProfileSpec:
    name: str
    target: str
    drafter: str
    description: str
    serving_overhead_ms: float
    serving_overhead_ms_per_seq: float
    restart: tuple[float, float, float]
    restart_reason: str
    kv_capacity_tokens: int | None  # None: derived from memory (fits on the GPU)
    kv_capacity_reason: str
    extra_assumed: tuple[str, ...]


SPECS = (
    ProfileSpec(
        name="h200-llama8b",
        target="llama8b",
        drafter="eagle3-llama8b",
        description=(
            "Llama-3.1-8B-shaped dense decoder (all 32 layers) + EAGLE-3 head on one NVIDIA "
            "H200, bf16, CUDA graphs: target forward table measured (tools/h200)"
        ),
        serving_overhead_ms=0.2,
        serving_overhead_ms_per_seq=0.001,
        restart=(30.0, 10.0, 5.0),
        restart_reason=(
            "restart 30 s load + 10 s CUDA-graph capture per tier + 5 s warmup: typical of "
            "SGLang starting an 8B model from a local checkpoint on one Hopper GPU; not measured "
            "here (capture_s in the CSV is our stand-in forward's ~20 ms per graph, far below "
            "SGLang's capture of dozens of batch sizes)"
        ),
        kv_capacity_tokens=None,
        kv_capacity_reason="",
        extra_assumed=(),
    ),
    ProfileSpec(
        name="h200-moe",
        target="moe",
        drafter="eagle3-moe",
        description=(
            "Kimi-K2-shaped MoE (384 experts, top-8, hidden 7168) as if one NVIDIA H200 ran all "
            "61 layers: 3 layers measured (bf16, CUDA graphs), scaled by layer count (tools/h200)"
        ),
        serving_overhead_ms=0.2,
        serving_overhead_ms_per_seq=0.001,
        restart=(180.0, 40.0, 10.0),
        restart_reason=(
            "restart 180 s load + 40 s CUDA-graph capture per tier + 10 s warmup, as the Kimi "
            "field profile (a 1T model restarts in minutes); not measured here"
        ),
        kv_capacity_tokens=400000,
        kv_capacity_reason=(
            "KV capacity 400k tokens, as the Kimi field profile: the full 61-layer model does not "
            "fit one H200, so no capacity can be derived from this GPU's memory"
        ),
        extra_assumed=(
            "scaling: T(61 layers) = head + (T(3 layers) - head) * 61/3 per shape, head = "
            "embedding + final norm + LM head timed alone at the same (B, n); all 61 layers "
            "counted as MoE (Kimi-K2's first layer is dense) and one GPU's bandwidth serves "
            "them all: no tensor/expert parallelism, no all-reduce or all-to-all, which a real "
            "multi-GPU deployment adds",
            "attention: GQA stand-in for MLA (64 query heads, 2 KV heads of 128: 1024 B/token/"
            "layer vs MLA's 1152), so attention cost tracks MLA's KV bytes, not its kernels",
            "routing: random weights and inputs route near-uniformly; real routing is skewed "
            "and correlated, so fewer distinct experts (cheaper verify) at mid batch sizes",
            "drafter: EAGLE-3 head shapes assumed (hidden 7168, 56 heads x 128, 8 KV heads, "
            "intermediate 18432, 32k draft vocabulary): the public Kimi-K2 EAGLE-3 drafters "
            "describe a Llama-style head at hidden 7168 without these numbers here",
        ),
    ),
)


def build_profile(spec: ProfileSpec, t: Table, meta: Mapping[str, Any]) -> dict[str, Any]:
    grid = meta["grid"]
    contexts = [int(c) for c in grid["contexts"]]
    batches = [int(b) for b in grid["batches"]]
    tokens = [int(n) for n in grid["tokens"]]
    env = meta["environment"]
    cube = target_cube(t, spec.target, contexts, tokens, batches)
    step = draft_fit(t, spec.drafter, "draft_step", 1, batches, contexts)
    extend = draft_fit(t, spec.drafter, "draft_extend", EXTEND_TOKENS, batches, contexts)
    prefill_fixed, prefill_per_1k = prefill_terms(cube, tokens, batches)
    tm = meta["models"][spec.target]
    dm = meta["models"][spec.drafter]
    kv_per_token = tm["layers_full"] * 2 * tm["kv_heads"] * tm["head_dim"] * 2
    kv_per_token += 2 * dm["kv_heads"] * dm["head_dim"] * 2  # the drafter's one layer
    if spec.kv_capacity_tokens is None:
        budget = env["gpu_total_memory_bytes"] * MEM_FRACTION_STATIC
        budget -= tm["weight_bytes_measured"] + drafter_weight_bytes(dm)
        kv_capacity = int(budget // kv_per_token)
        kv_reason = (
            f"KV capacity {kv_capacity} tokens = ({MEM_FRACTION_STATIC} x "
            f"{env['gpu_total_memory_bytes']} B GPU memory - target and draft weights) / "
            f"{kv_per_token} B per token (target + draft layers, bf16): SGLang's static memory "
            "fraction assumed"
        )
    else:
        kv_capacity = spec.kv_capacity_tokens
        kv_reason = spec.kv_capacity_reason
    run = (
        f"{env.get('gpu_name')} (driver {driver(env)}, torch {env['torch']}, CUDA "
        f"{env['cuda_runtime']}), {env['date_utc']}"
    )
    scaled = tm["layers_full"] != tm["layers_measured"]
    measured = [
        f"run: {run}; raw medians in tools/h200/results/h200_raw.csv, metadata in h200_meta.json",
        "target.ms: median of 10-20 CUDA-graph replays (CUDA events, 5 warm-up) of one full "
        "forward with a KV cache of ctx tokens (random bf16 weights, random token ids, random "
        "cache), B sequences x n tokens each, LM head over all B*n positions; per shape the "
        "faster of two exact causal attention paths (CSV column attn)",
        f"target model: {shape_line(tm)}"
        + (
            f"; {tm['layers_measured']} layers measured, scaled to {tm['layers_full']}"
            if scaled
            else ""
        ),
        f"draft.step_ms/step_ms_per_seq: EAGLE-3 draft step (1 token per sequence, one decoder "
        f"layer + LM head over {dm['draft_vocab']} draft tokens), graph medians at ctx "
        f"{CONTEXT_TOKENS} (linear between 1k and 4k), least-squares line over B "
        f"{batches[0]}..{batches[-1]}: worst error {step.worst_rel_err:.0%}",
        f"draft.extend_ms/extend_ms_per_seq: draft-extend pass (fc over 3 target hidden states, "
        f"{EXTEND_TOKENS} tokens per sequence), same fit: worst error {extend.worst_rel_err:.0%}",
    ]
    assumed = [
        "without CUDA graphs (eager) the CSV shows the same forwards launch-bound at small "
        "batch; SGLang serves with graphs, so the table holds graph replays only",
        f"prefill_fixed_ms {prefill_fixed:.3f} = decode forward at B=1, ctx {contexts[0]}; "
        f"prefill_ms_per_1k_tokens {prefill_per_1k:.2f} = slope between the two largest B at "
        f"n={tokens[-1]}, ctx {contexts[0]} (a compute-bound forward): derived, not a measured "
        "prefill (prompt self-attention not included)",
        f"serving overhead {spec.serving_overhead_ms} ms per cycle + "
        f"{spec.serving_overhead_ms_per_seq} ms per sequence: scheduler and sampling time "
        "outside the forward, not measured here",
        spec.restart_reason,
        kv_reason,
        "max_running_requests 128: the largest measured batch; past it the table extrapolates "
        "linearly",
        *spec.extra_assumed,
    ]
    if not tm.get("moe"):  # in the MoE the verify/decode step is mostly experts, not attention
        assumed.append(attention_caveat(cube, contexts, tokens, batches))
    else:
        assumed.append(moe_kernel_caveat(t, spec.target, tm, meta, contexts, tokens, batches))
    return {
        "name": spec.name,
        "description": spec.description,
        "kind": "measured",
        "provenance": {"measured": measured, "assumed": assumed},
        "target": {
            "model": "table",
            "batch": batches,
            "tokens": tokens,
            "context": contexts,
            "ms": cube,
            **(
                {"moe_experts": tm["moe"]["experts"], "moe_topk": tm["moe"]["top_k"]}
                if tm.get("moe")
                else {}
            ),
            "prefill_fixed_ms": round(prefill_fixed, 4),
            "prefill_ms_per_1k_tokens": round(prefill_per_1k, 4),
        },
        "draft": {
            "step_ms": round(step.intercept_ms, 4),
            "step_ms_per_seq": round(step.per_seq_ms, 6),
            "extend_ms": round(extend.intercept_ms, 4),
            "extend_ms_per_seq": round(extend.per_seq_ms, 6),
        },
        "serving": {
            "overhead_ms_per_step": spec.serving_overhead_ms,
            "overhead_ms_per_seq": spec.serving_overhead_ms_per_seq,
            "context_tokens": CONTEXT_TOKENS,
            "max_running_requests": batches[-1],
            "kv_capacity_tokens": kv_capacity,
        },
        "restart": {
            "load_s": spec.restart[0],
            "graph_capture_s_per_tier": spec.restart[1],
            "warmup_s": spec.restart[2],
        },
    }


def driver(env: Mapping[str, Any]) -> str:
    """Driver version from the nvidia-smi CSV captured in the metadata."""
    lines = str(env.get("nvidia_smi", "")).splitlines()
    if len(lines) >= 2:
        header = [h.strip() for h in lines[0].split(",")]
        values = [v.strip() for v in lines[1].split(",")]
        if "driver_version" in header:
            return values[header.index("driver_version")]
    return "unknown"


def shape_line(m: Mapping[str, Any]) -> str:
    attn = f"hidden {m['hidden']}, {m['heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']}"
    moe = m.get("moe")
    if moe:
        ffn = (
            f"MoE {moe['experts']} experts top-{moe['top_k']} x {moe['expert_intermediate']} + "
            f"{moe['shared_experts']} shared"
        )
    else:
        ffn = f"SwiGLU {m['intermediate']}"
    return f"{m['name']}: {attn}, {ffn}, vocab {m['vocab']}, {m['layers_full']} layers"


# ---------------------------------------------------------------- TOML output


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def render_toml(doc: Mapping[str, Any]) -> str:
    """The profile as TOML with one table row per line (readable diffs); checked by parsing it
    back with tomllib, so a formatting slip cannot change a number."""
    out = ["# Generated by tools/h200/make_profiles.py from tools/h200/results/; do not edit."]
    for key, value in doc.items():
        if not isinstance(value, dict):
            out.append(f"{key} = {_toml_value(value)}")
    for section, table in doc.items():
        if not isinstance(table, dict):
            continue
        out.append(f"\n[{section}]")
        for key, value in table.items():
            if key == "ms":
                out.append("ms = [  # ms[context][tokens][batch]")
                for plane in value:
                    out.append("  [")
                    out.extend(f"    {_toml_value(row)}," for row in plane)
                    out.append("  ],")
                out.append("]")
            elif isinstance(value, list) and value and isinstance(value[0], str):
                out.append(f"{key} = [")
                out.extend(f"  {_toml_value(s)}," for s in value)
                out.append("]")
            else:
                out.append(f"{key} = {_toml_value(value)}")
    text = "\n".join(out) + "\n"
    if tomllib.loads(text) != doc:
        raise AssertionError("rendered TOML does not parse back to the same profile")
    return text


def build_all(
    raw: Path = RAW_CSV, meta_path: Path = META_JSON
) -> dict[str, tuple[dict[str, Any], str]]:
    table = Table(load_raw(raw))
    meta = load_meta(meta_path)
    result = {}
    for spec in SPECS:
        doc = build_profile(spec, table, meta)
        result[spec.name] = (doc, render_toml(doc))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--raw", type=Path, default=RAW_CSV)
    ap.add_argument("--meta", type=Path, default=META_JSON)
    ap.add_argument("--out-dir", type=Path, default=PROFILES_DIR)
    ap.add_argument("--check", action="store_true", help="compare with the files, write nothing")
    args = ap.parse_args(argv)
    stale = []
    for name, (_, text) in build_all(args.raw, args.meta).items():
        path = args.out_dir / f"{name}.toml"
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"out of date with {args.raw}: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
