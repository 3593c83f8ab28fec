"""Measure the verify-cost surface of stand-in LLM forwards on one GPU (made for an NVIDIA H200).

Owns: building decoder models from their configs with random bf16 weights (no downloads, no
sglang), timing their forward passes over a preallocated KV cache with CUDA events (eager and
CUDA-graph replay), and writing raw results (CSV + JSON metadata) incrementally to an output
folder, so that a run stopped at its time limit still leaves usable rows.

Must not: download anything, import sglang, or write anywhere but ``--out``. Turning raw results
into simulator profiles is ``tools/h200/make_profiles.py``'s job.

Models (see tools/h200/README.md for what is scaled and why):
- ``llama8b``: Llama-3.1-8B shapes, all 32 layers (it fits one GPU with room for the KV cache).
- ``moe``: Kimi-K2-shaped MoE layers (hidden 7168, 384 routed experts, top-8, expert
  intermediate 2048, one shared expert); attention is a GQA stand-in for MLA with a similar KV
  footprint. Only ``layers_measured`` layers fit one GPU; make_profiles scales by layer count.
- ``eagle3-llama8b`` / ``eagle3-moe``: EAGLE-3-shaped drafters (fc fusing 3 hidden states, one
  decoder layer over [embedding, hidden], lm_head over a 32k draft vocabulary).

Run on the GPU machine: ``PYTHONUNBUFFERED=1 python3 tools/h200/measure.py --out $OUT``.
Smoke test anywhere (CPU, tiny shapes, eager only): add ``--tiny``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

BATCHES = (1, 2, 4, 8, 16, 32, 64, 96, 128)
TOKENS = (1, 2, 3, 4, 6, 8)
CONTEXTS = (1024, 4096)
CSV_FIELDS = (
    "model",
    "component",
    "ctx",
    "batch",
    "tokens",
    "mode",
    "median_ms",
    "mean_ms",
    "min_ms",
    "p10_ms",
    "p90_ms",
    "reps",
    "warmup",
    "capture_s",
    "layers_measured",
    "layers_full",
    "finite",
    "error",
    "attn",
    "reps_ms",
)


@dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    expert_intermediate: int
    shared_experts: int


@dataclass(frozen=True)
class DecoderShape:
    """Shapes of a decoder stack; ``moe`` set means every measured layer's MLP is an MoE."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers_measured: int
    layers_full: int
    moe: MoEShape | None = None
    rope_theta: float = 500000.0


@dataclass(frozen=True)
class DraftShape:
    """EAGLE-3 head: fc (3*target_hidden -> hidden), one layer whose attention reads 2*hidden."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    target_hidden: int
    target_vocab: int
    draft_vocab: int


# Llama-3.1-8B config.json values.
LLAMA8B = DecoderShape("llama8b", 4096, 32, 8, 128, 14336, 128256, 32, 32)
# Kimi-K2 layer: hidden 7168, 384 experts, top-8, moe_intermediate 2048, 1 shared expert, 61
# layers, vocab 163840, 64 heads. MLA (kv_lora 512 + rope 64 = 1152 B/token/layer in bf16) is
# replaced by GQA with 2 KV heads of 128 (1024 B/token/layer): same order of KV bytes.
MOE = DecoderShape(
    "moe", 7168, 64, 2, 128, 0, 163840, 3, 61, MoEShape(384, 8, 2048, 1), rope_theta=50000.0
)
# EAGLE-3 heads. Llama-3.1-8B's public EAGLE-3 drafters use the target's layer shapes and a
# 32000-token draft vocabulary; the MoE drafter's shapes are assumed (Llama-architecture head at
# hidden 7168, as the public Kimi-K2 EAGLE-3 drafter describes itself).
EAGLE3_LLAMA8B = DraftShape("eagle3-llama8b", 4096, 32, 8, 128, 14336, 4096, 128256, 32000)
EAGLE3_MOE = DraftShape("eagle3-moe", 7168, 56, 8, 128, 18432, 7168, 163840, 32000)


def tiny(shape: Any) -> Any:
    """Shrink any shape for a CPU smoke test; keeps GQA, MoE and fusion structure."""
    if isinstance(shape, DecoderShape):
        moe = MoEShape(16, 4, 32, 1) if shape.moe else None
        return replace(
            shape,
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            intermediate=128,
            vocab=512,
            layers_measured=2,
            layers_full=4 if shape.moe else 2,
            moe=moe,
        )
    return replace(
        shape,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        target_hidden=64,
        target_vocab=512,
        draft_vocab=256,
    )


# ---------------------------------------------------------------- building blocks


def rand_weight(shape: tuple[int, ...], fan_in: int, device: torch.device) -> torch.Tensor:
    # Scaled like a trained init (std 1/sqrt(fan_in)) so activations stay O(1) through the stack;
    # random, never zero, so the kernels see real data.
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, fan_in**-0.5)


def norm_weight(n: int, device: torch.device) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, device=device)).to(torch.bfloat16)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-5)


@dataclass(frozen=True)
class Step:
    """Per-shape constants made once outside the timed forward: RoPE tables for positions
    ctx..ctx+n-1 and, for the packed verify path, the additive causal bias."""

    cos: torch.Tensor
    sin: torch.Tensor
    bias: torch.Tensor | None


def step_state(
    ctx: int, n: int, head_dim: int, group: int, theta: float, device: torch.device, packed: bool
) -> Step:
    """packed=False (or n == 1) leaves bias None, which selects the unpacked SDPA path."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    pos = torch.arange(ctx, ctx + n, device=device).float()
    ang = torch.outer(pos, inv)
    ang = torch.cat([ang, ang], dim=-1)
    cos = ang.cos().to(torch.bfloat16)[:, None, :]  # (n, 1, d): broadcasts over heads
    sin = ang.sin().to(torch.bfloat16)[:, None, :]
    return Step(cos, sin, packed_bias(ctx, n, group, device) if packed and n > 1 else None)


def packed_bias(ctx: int, n: int, group: int, device: torch.device) -> torch.Tensor:
    """(n*group, ctx+n) additive bias for GQA-packed rows r = i*group + j (token i, head j of
    the group): row r may see keys <= ctx + i. The row stride is padded to 16 elements, as the
    memory-efficient kernel wants aligned bias rows (otherwise it pads a copy on every call)."""
    length = ctx + n
    padded = -(-length // 16) * 16
    buf = torch.zeros(n * group, padded, dtype=torch.bfloat16, device=device)
    token = torch.arange(n * group, device=device)[:, None] // group
    col = torch.arange(padded, device=device)[None, :]
    buf.masked_fill_(col > ctx + token, float("-inf"))
    return buf[:, :length]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    splits: int | None = None,
) -> torch.Tensor:
    """q (B, n, Hq, d) against cache views kc/vc (B, L, Hkv, d) whose last n rows are the new
    tokens; returns (B, n, Hq, d). Causal, bottom-right aligned: new token i sees the ctx
    cached keys and new tokens <= i.

    n == 1 (decode): SDPA with a lower-right CausalBias, which runs the flash kernel (GQA native;
    for one query it packs the group's heads and splits the KV length).
    n > 1 (verify) with a bias, "packed": fold the g query heads that share a KV head into the
    query axis, (B, Hkv, n*g, d), so each KV head is read once, as FlashInfer and FA3 do; split
    the keys into chunks when batch x KV heads is too small to fill the GPU (split-KV, merged by
    log-sum-exp); the causal rule is an additive bias on the memory-efficient kernel.
    n > 1 without a bias, "unpacked": SDPA as for decode. torch's flash kernel packs GQA only for
    a single query, so this re-reads the KV cache once per query head. The run times both for
    every verify shape (CSV column attn); make_profiles takes the faster, the closer stand-in
    for a serving kernel.
    """
    b, _, hq, d = q.shape
    length, hkv = kc.shape[1], kc.shape[2]
    if n == 1 or bias is None:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            kc.transpose(1, 2),
            vc.transpose(1, 2),
            attn_mask=causal_lower_right(n, length),
            enable_gqa=True,
        )
        return o.transpose(1, 2)
    g = hq // hkv
    m = n * g
    qf = q.reshape(b, n, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, m, d)
    ctx = length - n
    s = min(kv_splits(b, hkv, ctx) if splits is None else splits, SPLIT.max_splits)
    if s == 1:
        # One chunk: plain SDPA, forced onto the memory-efficient kernel so a missing kernel is
        # an error rather than a silent slow fallback (CPU: math).
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION if q.is_cuda else SDPBackend.MATH):
            o = F.scaled_dot_product_attention(
                qf, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=bias[None, None]
            )
        return o.reshape(b, hkv, n, g, d).permute(0, 2, 1, 3, 4).reshape(b, n, hq, d)
    # Split the cached keys into s chunks (multiples of 16 keys, so bias slices stay aligned);
    # the last chunk also holds the n new keys and is the only one that needs the causal bias.
    chunk = -(-ctx // (s * 16)) * 16
    starts = list(range(0, ctx, chunk)) if ctx > 0 else [0]
    outs, lses = [], []
    for i, start in enumerate(starts):
        end = length if i == len(starts) - 1 else start + chunk
        o_i, lse_i = _chunk_attention(
            qf,
            kc[:, start:end].transpose(1, 2),
            vc[:, start:end].transpose(1, 2),
            bias[:, start:end] if i == len(starts) - 1 else None,
        )
        outs.append(o_i)
        lses.append(lse_i)
    if len(outs) == 1:
        o = outs[0]
    else:  # merge the partial softmaxes by their log-sum-exp (split-KV, as flash decoding)
        lse = torch.stack(lses)
        w = torch.exp(lse - torch.logsumexp(lse, dim=0))
        o = (torch.stack(outs).float() * w.unsqueeze(-1)).sum(dim=0).to(q.dtype)
    return o.reshape(b, hkv, n, g, d).permute(0, 2, 1, 3, 4).reshape(b, n, hq, d)


@dataclass
class SplitLimit:
    """Most KV chunks the packed path may use (--max-kv-splits). Default 1: split-KV over the
    memory-efficient kernel was tried on the H200 (results/trial-split-kv) and gained nothing
    where the packed path loses (small batch, long context), while costing up to 17% at B=16.
    pick_attention lowers it to 1 if the split path fails its check."""

    max_splits: int = 1


SPLIT = SplitLimit()


def kv_splits(b: int, hkv: int, ctx: int) -> int:
    """KV chunks for the packed path: enough (batch x KV head x chunk) blocks to cover the
    H200's 132 SMs about twice, chunks of at least 256 keys, at most 16 chunks."""
    s = 1
    while b * hkv * s < 256 and s < 16 and ctx // (2 * s) >= 256:
        s *= 2
    return s


def _chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H, M, d) over one key chunk (B, H, Lc, d): output and log-sum-exp."""
    b, h, m, _ = q.shape
    if q.is_cuda:
        # The memory-efficient kernel (what SDPA runs for a masked call), asked for its LSE.
        attn_bias = None if bias is None else bias[None, None].expand(b, h, m, k.shape[2])
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, attn_bias, True)[
            :2
        ]
        return o, lse[..., :m]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def attend_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, n: int) -> torch.Tensor:
    """float64 reference: explicit key repetition and an explicit bottom-right mask."""
    length = kc.shape[1]
    g = q.shape[2] // kc.shape[2]
    qq = q.double().transpose(1, 2)
    kk = kc.double().transpose(1, 2).repeat_interleave(g, dim=1)
    vv = vc.double().transpose(1, 2).repeat_interleave(g, dim=1)
    s = qq @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    row = torch.arange(n, device=q.device)[:, None]
    col = torch.arange(length, device=q.device)[None, :]
    s = s.masked_fill(col > row + (length - n), float("-inf"))
    return (s.softmax(-1) @ vv).transpose(1, 2)


class KVCache:
    """Preallocated (layers, Bmax, Lmax, Hkv, d) K and V, filled with random values."""

    def __init__(
        self, layers: int, bmax: int, lmax: int, kv_heads: int, head_dim: int, dev: torch.device
    ) -> None:
        shape = (layers, bmax, lmax, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
        self.v = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def attention_block(
    x: torch.Tensor,
    wqkv: torch.Tensor,
    wo: torch.Tensor,
    kv: KVCache,
    layer: int,
    b: int,
    n: int,
    ctx: int,
    step: Step,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Fused QKV projection, RoPE, KV-cache write at ctx..ctx+n-1, attention, output projection."""
    qkv = F.linear(x, wqkv)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rope(q.view(b, n, heads, head_dim), step.cos, step.sin)
    k = apply_rope(k.view(b, n, kv_heads, head_dim), step.cos, step.sin)
    kc, vc = kv.k[layer], kv.v[layer]
    kc[:b, ctx : ctx + n] = k
    vc[:b, ctx : ctx + n] = v.view(b, n, kv_heads, head_dim)
    o = attend(q, kc[:b, : ctx + n], vc[:b, : ctx + n], n, step.bias)
    return F.linear(o.reshape(b * n, heads * head_dim), wo)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


# ---------------------------------------------------------------- MoE


@dataclass
class MoEImpl:
    name: str = "grouped_mm"


MOE_IMPL = MoEImpl()


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def route(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Kimi/DeepSeek-V3 style: sigmoid scores, top-k, weights renormalised over the chosen k.
    # (Their grouped top-k and the score-correction bias change which experts win, not the cost.)
    scores = F.linear(x, w_router).float().sigmoid()
    w, idx = scores.topk(top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype), idx


def moe_grouped(
    x: torch.Tensor, lw: dict[str, torch.Tensor], m: MoEShape, expert_ids: torch.Tensor
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert and run two grouped GEMMs over all experts.

    Static shapes and no host sync, so it is CUDA-graph capturable. Versus fused MoE kernels
    (SGLang's Triton fused_moe, DeepGEMM): an extra gather and scatter of activations, an
    unfused SiLU*up, and grouped-GEMM tiles not tuned for a handful of rows per expert.
    """
    t = x.shape[0]
    w, idx = route(x, lw["router"], m.top_k)
    flat = idx.reshape(-1)
    sorted_e, order = flat.sort()
    xs = x.index_select(0, order // m.top_k)
    offs = torch.searchsorted(sorted_e, expert_ids, right=True, out_int32=True)
    h = _grouped_mm(xs, lw["w13_t"], offs)
    gate, up = h.chunk(2, dim=-1)
    y = _grouped_mm(F.silu(gate) * up, lw["w2_t"], offs)
    pairs = torch.empty_like(y).index_copy_(0, order, y)
    out = (pairs.view(t, m.top_k, -1) * w.unsqueeze(-1)).sum(dim=1)
    return out + swiglu(x, lw["shared_gu"], lw["shared_down"])


def moe_reference(x: torch.Tensor, lw: dict[str, torch.Tensor], m: MoEShape) -> torch.Tensor:
    """float64 per-token loop over its chosen experts: the definition moe_grouped must match."""
    w, idx = route(x, lw["router"], m.top_k)
    xd = x.double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(m.top_k):
            e = int(idx[t, j])
            h = xd[t] @ lw["w13_t"][e].double()
            gate, up = h.chunk(2)
            out[t] += float(w[t, j]) * ((F.silu(gate) * up) @ lw["w2_t"][e].double())
    sg, su = (xd @ lw["shared_gu"].double().T).chunk(2, dim=-1)
    return out + (F.silu(sg) * su) @ lw["shared_down"].double().T


def moe_loop(
    x: torch.Tensor, lw: dict[str, torch.Tensor], m: MoEShape, expert_ids: torch.Tensor
) -> torch.Tensor:
    """Fallback: sorted tokens, one GEMM pair per active expert (host sync: eager only)."""
    t = x.shape[0]
    w, idx = route(x, lw["router"], m.top_k)
    sorted_e, order = idx.reshape(-1).sort()
    xs = x.index_select(0, order // m.top_k)
    counts = torch.bincount(sorted_e, minlength=m.experts).tolist()
    outs = []
    start = 0
    for e, c in enumerate(counts):
        if c:
            gate, up = (xs[start : start + c] @ lw["w13_t"][e]).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ lw["w2_t"][e])
            start += c
    y = torch.cat(outs)
    pairs = torch.empty_like(y).index_copy_(0, order, y)
    out = (pairs.view(t, m.top_k, -1) * w.unsqueeze(-1)).sum(dim=1)
    return out + swiglu(x, lw["shared_gu"], lw["shared_down"])


def moe_block(
    x: torch.Tensor, lw: dict[str, torch.Tensor], m: MoEShape, expert_ids: torch.Tensor
) -> torch.Tensor:
    if MOE_IMPL.name == "grouped_mm":
        return moe_grouped(x, lw, m, expert_ids)
    return moe_loop(x, lw, m, expert_ids)


# ---------------------------------------------------------------- models


class Target:
    """Decoder stack with random weights; forward(ids (B, n)) -> greedy next tokens (B*n,)."""

    def __init__(self, s: DecoderShape, bmax: int, lmax: int, dev: torch.device) -> None:
        self.s = s
        self.dev = dev
        h, d = s.hidden, s.head_dim
        qkv_out = (s.heads + 2 * s.kv_heads) * d
        self.embed = rand_weight((s.vocab, h), 1, dev)
        self.lm_head = rand_weight((s.vocab, h), h, dev)
        self.norm = norm_weight(h, dev)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(s.layers_measured):
            lw = {
                "ln1": norm_weight(h, dev),
                "ln2": norm_weight(h, dev),
                "wqkv": rand_weight((qkv_out, h), h, dev),
                "wo": rand_weight((h, s.heads * d), s.heads * d, dev),
            }
            if s.moe is None:
                lw["w_gu"] = rand_weight((2 * s.intermediate, h), h, dev)
                lw["w_down"] = rand_weight((h, s.intermediate), s.intermediate, dev)
            else:
                m = s.moe
                i = m.expert_intermediate
                lw["router"] = rand_weight((m.experts, h), h, dev)
                # Stored as (E, out, in) like checkpoints; the grouped GEMM reads the transpose.
                lw["w13_t"] = rand_weight((m.experts, 2 * i, h), h, dev).transpose(-2, -1)
                lw["w2_t"] = rand_weight((m.experts, h, i), i, dev).transpose(-2, -1)
                si = i * m.shared_experts
                lw["shared_gu"] = rand_weight((2 * si, h), h, dev)
                lw["shared_down"] = rand_weight((h, si), si, dev)
            self.layers.append(lw)
        self.expert_ids = (
            torch.arange(s.moe.experts, device=dev) if s.moe is not None else torch.empty(0)
        )
        self.kv = KVCache(s.layers_measured, bmax, lmax, s.kv_heads, d, dev)

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.lm_head, self.norm]
        for lw in self.layers:
            tensors += list(lw.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, ids: torch.Tensor, ctx: int, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        b, n = ids.shape
        x = F.embedding(ids.reshape(-1), self.embed)
        for li, lw in enumerate(self.layers):
            h = rms_norm(x, lw["ln1"])
            x = x + attention_block(
                h, lw["wqkv"], lw["wo"], self.kv, li, b, n, ctx, step, s.heads, s.kv_heads,
                s.head_dim,
            )  # fmt: skip
            h = rms_norm(x, lw["ln2"])
            if s.moe is None:
                x = x + swiglu(h, lw["w_gu"], lw["w_down"])
            else:
                x = x + moe_block(h, lw, s.moe, self.expert_ids)
        # Verify needs logits at every one of the n positions, so the LM head sees B*n rows.
        logits = F.linear(rms_norm(x, self.norm), self.lm_head)
        return logits.argmax(dim=-1), logits

    def head_only(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding + final norm + LM head + argmax: the part that does not scale with layers."""
        x = F.embedding(ids.reshape(-1), self.embed)
        logits = F.linear(rms_norm(x, self.norm), self.lm_head)
        return logits.argmax(dim=-1), logits


class Drafter:
    """EAGLE-3 head. step: one token per sequence from the previous draft hidden state.
    extend: n tokens per sequence from the target's 3 captured hidden states (fc fusion)."""

    def __init__(self, s: DraftShape, bmax: int, lmax: int, dev: torch.device) -> None:
        self.s = s
        h, d = s.hidden, s.head_dim
        self.embed = rand_weight((s.target_vocab, h), 1, dev)
        self.fc = rand_weight((h, 3 * s.target_hidden), 3 * s.target_hidden, dev)
        self.ln_in = norm_weight(h, dev)
        self.ln_hid = norm_weight(h, dev)
        self.ln2 = norm_weight(h, dev)
        self.norm = norm_weight(h, dev)
        self.wqkv = rand_weight(((s.heads + 2 * s.kv_heads) * d, 2 * h), 2 * h, dev)
        self.wo = rand_weight((h, s.heads * d), s.heads * d, dev)
        self.w_gu = rand_weight((2 * s.intermediate, h), h, dev)
        self.w_down = rand_weight((h, s.intermediate), s.intermediate, dev)
        self.lm_head = rand_weight((s.draft_vocab, h), h, dev)
        self.kv = KVCache(1, bmax, lmax, s.kv_heads, d, dev)

    def forward(
        self,
        ids: torch.Tensor,
        hidden_in: torch.Tensor,
        ctx: int,
        step: Step,
        fuse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        b, n = ids.shape
        hid = F.linear(hidden_in, self.fc) if fuse else hidden_in
        emb = F.embedding(ids.reshape(-1), self.embed)
        h = torch.cat([rms_norm(emb, self.ln_in), rms_norm(hid, self.ln_hid)], dim=-1)
        x = hid + attention_block(
            h, self.wqkv, self.wo, self.kv, 0, b, n, ctx, step, s.heads, s.kv_heads, s.head_dim
        )
        x = x + swiglu(rms_norm(x, self.ln2), self.w_gu, self.w_down)
        logits = F.linear(rms_norm(x, self.norm), self.lm_head)
        return logits.argmax(dim=-1), logits


# ---------------------------------------------------------------- checks


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref).norm() / ref.norm())


VERIFY_ATTN: list[str] = []  # verify attention paths that passed pick_attention's check


def pick_attention(dev: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    """Check each attention path against a float64 reference on fresh random inputs; the
    paths that pass are the ones the run times (VERIFY_ATTN)."""
    report: dict[str, Any] = {}
    # (B, Hq, Hkv, n, length, KV splits): one query; verify with one chunk, with the split
    # heuristic (4 chunks of 256 keys), with 3 uneven chunks; MoE-like head ratio.
    cases = (
        (2, 8, 2, 1, 37, None),
        (3, 8, 2, 3, 64, None),
        (1, 32, 8, 8, 1032, None),
        (2, 64, 2, 4, 130, 3),
        (1, 64, 2, 6, 300, 1),
    )
    VERIFY_ATTN.clear()
    for name in ("packed", "unpacked"):
        worst = 0.0
        try:
            for b, hq, hkv, n, length, splits in cases:
                q = torch.randn(b, n, hq, 128, device=dev, dtype=torch.bfloat16)
                # Views into a longer cache, as in the model (non-contiguous batch stride).
                kc = torch.randn(b, length + 5, hkv, 128, device=dev, dtype=torch.bfloat16)
                vc = torch.randn(b, length + 5, hkv, 128, device=dev, dtype=torch.bfloat16)
                k, v = kc[:, :length], vc[:, :length]
                packed = name == "packed" and n > 1
                bias = packed_bias(length - n, n, hq // hkv, dev) if packed else None
                out = attend(q, k, v, n, bias, splits)
                worst = max(worst, rel_err(out, attend_reference(q, k, v, n)))
        except Exception as exc:  # a path the build lacks is skipped, with the reason recorded
            report[name] = f"error: {exc!r}"[:300]
            log(f"attention {name}: {report[name]}")
            continue
        report[name] = worst
        log(f"attention {name}: rel err {worst:.2e}")
        if worst < 2e-2:
            VERIFY_ATTN.append(name)
    if "packed" not in VERIFY_ATTN and SPLIT.max_splits > 1:
        # Keep GQA packing without split-KV rather than lose the packed path altogether.
        SPLIT.max_splits = 1
        report["packed_without_splits"] = pick_attention(dev, log)
        return report
    if "unpacked" not in VERIFY_ATTN:  # decode (n == 1) always runs the unpacked flash path
        raise SystemExit(f"the decode attention path failed the reference check: {report}")
    report["timed"] = list(VERIFY_ATTN)
    report["max_kv_splits"] = SPLIT.max_splits
    return report


def pick_moe(dev: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    m = MoEShape(16, 4, 64, 1)
    h = 128
    lw = {
        "router": rand_weight((m.experts, h), h, dev),
        "w13_t": rand_weight((m.experts, 2 * m.expert_intermediate, h), h, dev).transpose(-2, -1),
        "w2_t": rand_weight((m.experts, h, m.expert_intermediate), 64, dev).transpose(-2, -1),
        "shared_gu": rand_weight((2 * m.expert_intermediate, h), h, dev),
        "shared_down": rand_weight((h, m.expert_intermediate), 64, dev),
    }
    ids = torch.arange(m.experts, device=dev)
    for name in ("grouped_mm", "loop"):
        MOE_IMPL.name = name
        try:
            worst = 0.0
            for t in (1, 5, 24):
                x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
                worst = max(worst, rel_err(moe_block(x, lw, m, ids), moe_reference(x, lw, m)))
        except Exception as exc:
            report[name] = f"error: {exc!r}"[:300]
            log(f"moe {name}: {report[name]}")
            continue
        report[name] = worst
        log(f"moe {name}: rel err {worst:.2e}")
        if worst < 2e-2:
            report["chosen"] = name
            return report
    raise SystemExit(f"no MoE path passed the reference check: {report}")


# ---------------------------------------------------------------- timing


class Timer:
    """CUDA events per repetition on a GPU; perf_counter with a sync on the CPU."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        if not self.cuda:
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * (len(ys) - 1))))]


@dataclass
class Runner:
    out: Path
    dev: torch.device
    warmup: int
    reps: int
    min_reps: int
    time_per_shape_s: float
    deadline: float
    graphs: bool
    log: Callable[[str], None]
    rows: int = 0
    skipped: list[str] = field(default_factory=list)
    graph_broken: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.timer = Timer(self.dev)
        self.csv_path = self.out / "h200_raw.csv"
        new = not self.csv_path.exists()
        self.fh = self.csv_path.open("a", newline="")
        self.writer = csv.DictWriter(self.fh, fieldnames=CSV_FIELDS)
        if new:
            self.writer.writeheader()

    def write(self, row: dict[str, Any]) -> None:
        self.writer.writerow(row)
        self.fh.flush()
        self.rows += 1

    def reps_for(self, one_ms: float) -> int:
        # Keep each shape short: as many reps as fit the per-shape budget, within [min, max].
        budget = self.time_per_shape_s * 1e3 / max(one_ms, 1e-3)
        return int(max(self.min_reps, min(self.reps, budget)))

    def measure(
        self, key: dict[str, Any], variants: dict[str, Callable[[], tuple[torch.Tensor, ...]]]
    ) -> dict[str, float]:
        """Time each variant (same computation, another attention path) as a captured CUDA
        graph, then the fastest one eagerly; one CSV row per (mode, variant)."""
        result: dict[str, float] = {}
        if time.monotonic() > self.deadline:
            self.skipped.append(json.dumps(key))
            return result
        names = list(variants)
        probe = self.timer.run(variants[names[0]], self.warmup, 2)
        reps = self.reps_for(statistics.median(probe))
        model = key["model"]
        graph_ms: dict[str, float] = {}
        if self.graphs and model not in self.graph_broken:
            for name in names:
                ms = self._graph(key, name, variants[name], reps)
                if ms is None:
                    break
                graph_ms[name] = ms
                result[f"graph:{name}"] = ms
        chosen = min(graph_ms, key=lambda k: graph_ms[k]) if graph_ms else names[0]
        fn = variants[chosen]
        times = self.timer.run(fn, 0 if chosen == names[0] else self.warmup, reps)
        logits = fn()[1]
        self.timer.sync()
        finite = bool(torch.isfinite(logits).all())
        result[f"eager:{chosen}"] = self._row(key, "eager", chosen, times, 0.0, finite, "")
        return result

    def _graph(
        self, key: dict[str, Any], name: str, fn: Callable[[], tuple[torch.Tensor, ...]], reps: int
    ) -> float | None:
        model = key["model"]
        graph = torch.cuda.CUDAGraph()
        static: tuple[torch.Tensor, ...] | None = None
        try:
            # Warm the capture path on a side stream first (library handles, workspaces), as
            # PyTorch's CUDA-graph notes advise.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            self.timer.sync()
            t0 = time.perf_counter()
            # Each graph gets its own private pool, freed with it: sharing one pool handle across
            # graphs that are destroyed in turn trips an allocator assert in torch 2.11.
            with torch.cuda.graph(graph):
                static = fn()
            self.timer.sync()
            capture_s = time.perf_counter() - t0
            times = self.timer.run(graph.replay, self.warmup, reps)
            finite = bool(torch.isfinite(static[1]).all())
            return self._row(key, "graph", name, times, capture_s, finite, "")
        except Exception as exc:  # record why, run the remaining shapes of this model eagerly
            msg = f"{type(exc).__name__}: {exc}"[:300]
            self.graph_broken[model] = msg
            self.log(f"graph capture failed for {model}: {msg}")
            self._row(key, "graph", name, [], 0.0, False, msg)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            return None
        finally:
            del static, graph

    def _row(
        self,
        key: dict[str, Any],
        mode: str,
        attn: str,
        times: list[float],
        capture_s: float,
        finite: bool,
        error: str,
    ) -> float:
        med = statistics.median(times) if times else float("nan")
        self.write(
            {
                **key,
                "mode": mode,
                "attn": attn,
                "median_ms": f"{med:.5f}",
                "mean_ms": f"{statistics.fmean(times):.5f}" if times else "nan",
                "min_ms": f"{min(times):.5f}" if times else "nan",
                "p10_ms": f"{pct(times, 0.1):.5f}" if times else "nan",
                "p90_ms": f"{pct(times, 0.9):.5f}" if times else "nan",
                "reps": len(times),
                "warmup": self.warmup,
                "capture_s": f"{capture_s:.4f}",
                "finite": int(finite),
                "error": error,
                "reps_ms": ";".join(f"{t:.4f}" for t in times),
            }
        )
        return med


# ---------------------------------------------------------------- sections


def attn_variants(n: int) -> list[str]:
    """Decode (n == 1) has one attention path; verify times every path that passed its check."""
    return ["decode"] if n == 1 else list(VERIFY_ATTN)


def measure_target(
    r: Runner,
    s: DecoderShape,
    contexts: tuple[int, ...],
    batches: tuple[int, ...],
    tokens: tuple[int, ...],
    meta: dict[str, Any],
) -> None:
    dev = r.dev
    t0 = time.monotonic()
    model = Target(s, max(batches), max(contexts) + max(tokens), dev)
    r.timer.sync()
    meta["models"][s.name] = {
        **asdict(s),
        "weight_bytes_measured": model.weight_bytes(),
        "kv_cache_bytes": model.kv.nbytes(),
        "build_s": round(time.monotonic() - t0, 2),
    }
    r.log(
        f"{s.name}: built {model.weight_bytes() / 1e9:.1f} GB weights, "
        f"{model.kv.nbytes() / 1e9:.1f} GB KV in {time.monotonic() - t0:.1f}s"
    )
    base = {"model": s.name, "layers_measured": s.layers_measured, "layers_full": s.layers_full}
    for b in batches:
        for n in tokens:
            ids = torch.randint(0, s.vocab, (b, n), device=dev)
            res = r.measure(
                {**base, "component": "head", "ctx": 0, "batch": b, "tokens": n},
                {"none": lambda ids=ids: model.head_only(ids)},
            )
            if res:
                r.log(f"{s.name} head B={b} n={n}: {fmt(res)}")
    for ctx in contexts:
        for b in batches:
            for n in tokens:
                ids = torch.randint(0, s.vocab, (b, n), device=dev)
                variants = {}
                for attn in attn_variants(n):
                    st = step_state(
                        ctx, n, s.head_dim, s.heads // s.kv_heads, s.rope_theta, dev,
                        attn == "packed",
                    )  # fmt: skip
                    variants[attn] = lambda ids=ids, ctx=ctx, st=st: model.forward(ids, ctx, st)
                res = r.measure(
                    {**base, "component": "target", "ctx": ctx, "batch": b, "tokens": n}, variants
                )
                if res:
                    r.log(f"{s.name} ctx={ctx} B={b} n={n}: {fmt(res)}")
    meta["models"][s.name]["section_s"] = round(time.monotonic() - t0, 1)


def measure_drafter(
    r: Runner,
    s: DraftShape,
    contexts: tuple[int, ...],
    batches: tuple[int, ...],
    tokens: tuple[int, ...],
    meta: dict[str, Any],
) -> None:
    dev = r.dev
    t0 = time.monotonic()
    d = Drafter(s, max(batches), max(contexts) + max(tokens), dev)
    meta["models"][s.name] = asdict(s)
    base = {"model": s.name, "layers_measured": 1, "layers_full": 1}
    group = s.heads // s.kv_heads
    for ctx in contexts:
        for b in batches:
            ids = torch.randint(0, s.target_vocab, (b, 1), device=dev)
            hid = torch.randn(b, s.hidden, device=dev, dtype=torch.bfloat16)
            st = step_state(ctx, 1, s.head_dim, group, 500000.0, dev, False)
            res = r.measure(
                {**base, "component": "draft_step", "ctx": ctx, "batch": b, "tokens": 1},
                {
                    "decode": lambda ids=ids, hid=hid, ctx=ctx, st=st: d.forward(
                        ids, hid, ctx, st, False
                    )
                },
            )
            if res:
                r.log(f"{s.name} step ctx={ctx} B={b}: {fmt(res)}")
            for n in tokens:
                ids = torch.randint(0, s.target_vocab, (b, n), device=dev)
                hid3 = torch.randn(b * n, 3 * s.target_hidden, device=dev, dtype=torch.bfloat16)
                variants = {}
                for attn in attn_variants(n):
                    st = step_state(ctx, n, s.head_dim, group, 500000.0, dev, attn == "packed")
                    variants[attn] = lambda ids=ids, hid3=hid3, ctx=ctx, st=st: d.forward(
                        ids, hid3, ctx, st, True
                    )
                res = r.measure(
                    {**base, "component": "draft_extend", "ctx": ctx, "batch": b, "tokens": n},
                    variants,
                )
                if res:
                    r.log(f"{s.name} extend ctx={ctx} B={b} n={n}: {fmt(res)}")
    meta["models"][s.name]["section_s"] = round(time.monotonic() - t0, 1)


def fmt(res: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.3f} ms" for k, v in res.items())


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- environment


def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc!r}"


def environment(dev: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": str(dev),
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(
            gpu_name=p.name,
            gpu_total_memory_bytes=p.total_memory,
            sm_count=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
            cudnn=torch.backends.cudnn.version(),
            nvidia_smi=sh(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,"
                    "clocks.max.sm,power.limit,temperature.gpu",
                    "--format=csv",
                ]
            ),
        )
    return env


def _copy_tb_s(timer: Timer, dev: torch.device) -> float:
    src = torch.randn(2**30, device=dev, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = statistics.median(timer.run(lambda: dst.copy_(src), 3, 10))
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e12  # bytes read + written


def _gemm_tflop_s(timer: Timer, dev: torch.device) -> float:
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = statistics.median(timer.run(lambda: x @ y, 3, 10))
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def ceilings(dev: torch.device, log: Callable[[str], None]) -> dict[str, float]:
    """Copy bandwidth and bf16 GEMM rate on random data: the roofs the timings sit under."""
    if dev.type != "cuda":
        return {}
    timer = Timer(dev)
    bw = _copy_tb_s(timer, dev)
    tflops = _gemm_tflop_s(timer, dev)
    free(dev)
    log(f"ceilings: copy {bw:.2f} TB/s (read+write), bf16 GEMM {tflops:.0f} TFLOP/s")
    return {"copy_tb_s": round(bw, 3), "bf16_gemm_tflop_s": round(tflops, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for h200_raw.csv + meta")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and grid (CPU smoke test)")
    ap.add_argument(
        "--only",
        default="llama8b,eagle3-llama8b,eagle3-moe,moe",
        help="comma-separated sections to run (to rerun only what is missing)",
    )
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20, help="most timed repetitions per shape")
    ap.add_argument("--min-reps", type=int, default=10, help="fewest timed repetitions per shape")
    ap.add_argument("--time-per-shape-s", type=float, default=0.4)
    ap.add_argument("--deadline-s", type=float, default=500.0, help="stop starting new shapes")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument(
        "--max-kv-splits", type=int, default=1, help="split-KV chunks for packed verify (1: off)"
    )
    args = ap.parse_args(argv)

    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log_fh = (args.out / "h200_log.txt").open("a")

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - start:7.1f}s] {msg}"
        print(line, flush=True)
        log_fh.write(line + "\n")
        log_fh.flush()

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    if args.tiny:
        contexts, batches, tokens = (16, 40), (1, 3), (1, 3)
        shapes: dict[str, Any] = {
            "llama8b": tiny(LLAMA8B),
            "moe": tiny(MOE),
            "eagle3-llama8b": tiny(EAGLE3_LLAMA8B),
            "eagle3-moe": tiny(EAGLE3_MOE),
        }
    else:
        contexts, batches, tokens = CONTEXTS, BATCHES, TOKENS
        shapes = {
            "llama8b": LLAMA8B,
            "moe": MOE,
            "eagle3-llama8b": EAGLE3_LLAMA8B,
            "eagle3-moe": EAGLE3_MOE,
        }
    meta: dict[str, Any] = {
        "environment": environment(dev),
        "grid": {"contexts": contexts, "batches": batches, "tokens": tokens},
        "timing": {
            "method": "CUDA events around each repetition after warm-up; median reported",
            "warmup": args.warmup,
            "reps_max": args.reps,
            "reps_min": args.min_reps,
            "time_per_shape_s": args.time_per_shape_s,
        },
        "tiny": args.tiny,
        "models": {},
    }
    meta_path = args.out / "h200_meta.json"

    def save_meta() -> None:
        meta_path.write_text(json.dumps(meta, indent=2, default=str))

    log(f"environment: {json.dumps(meta['environment'], default=str)}")
    save_meta()
    if args.max_kv_splits < 1:
        raise SystemExit("--max-kv-splits must be >= 1")
    SPLIT.max_splits = args.max_kv_splits
    meta["checks"] = {"attention": pick_attention(dev, log), "moe": pick_moe(dev, log)}
    meta["ceilings"] = ceilings(dev, log)
    save_meta()
    graphs = dev.type == "cuda" and not args.no_graphs
    runner = Runner(
        out=args.out,
        dev=dev,
        warmup=args.warmup,
        reps=args.reps,
        min_reps=args.min_reps,
        time_per_shape_s=args.time_per_shape_s,
        deadline=start + args.deadline_s,
        graphs=graphs,
        log=log,
    )
    if MOE_IMPL.name != "grouped_mm":
        runner.graph_broken["moe"] = "MoE fallback needs a host sync: not capturable"
    for name in [x.strip() for x in args.only.split(",") if x.strip()]:
        if name not in shapes:
            raise SystemExit(f"unknown section {name!r}; choose from {sorted(shapes)}")
        s = shapes[name]
        try:
            if isinstance(s, DecoderShape):
                measure_target(runner, s, contexts, batches, tokens, meta)
            else:
                measure_drafter(runner, s, contexts, batches, tokens, meta)
            free(dev)
        except torch.cuda.OutOfMemoryError as exc:  # keep what was measured, say what was not
            log(f"{name}: out of memory: {exc}")
            meta.setdefault("errors", {})[name] = f"OOM: {exc}"[:500]
            free(dev)
        save_meta()
    meta["graph_broken"] = runner.graph_broken
    meta["skipped_after_deadline"] = runner.skipped
    meta["rows"] = runner.rows
    meta["environment_end"] = environment(dev).get("nvidia_smi")
    meta["wall_s"] = round(time.monotonic() - start, 1)
    save_meta()
    log(f"done: {runner.rows} rows, {len(runner.skipped)} shapes skipped, {meta['wall_s']}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
