"""Hybrid profiles: SGLang's in-process adaptive rule running a table that specpilot computes.

Owns: the adaptive table format as SGLang 0.5.23 reads it (`--speculative-adaptive-config`:
batch-size lower bounds as strings, each with `candidate_steps`, hysteresis and EMA keys), an
emulation of SGLang's rule that says which tier each bucket settles on and how often it probes
(`tier_shares`), the tok/s an adaptive profile delivers with a given table (`predict_adaptive`),
the table specpilot generates from its cost and acceptance estimates (`generate_table`), a
distance between tables and the "is a rewrite worth a restart" test (`rewrite_pays`, the switch
rule's economics), and the glue that reads tier costs and acceptance off a ThroughputModel.

SGLang's rule (sglang/srt/speculative/adaptive_spec_params.py, re-implemented as
simulator/adaptive.py does; this module may not import the simulator): per bucket, an EMA
(alpha 0.2) of accepted drafts per request, updated only while drafting; every
`update_interval` batches past `warmup_batches` the tier steps down while
ema <= (prev - 0.5, or 0.5 when prev is 0) + down_hysteresis, else up while
ema > current - 0.5 + up_hysteresis: target = round(ema) + 1 with hysteresis, never a cost. From
tier 0 it always probes the next candidate up (no acceptance data at 0), so a bucket whose EMA
wants 0 alternates 0 and the next candidate, one update interval each. Batch sizes are padded
to the next CUDA-graph size before routing. Tier 0 still runs the draft-extend pass: it is
slower than a server without speculation by that pass (the "draft-extend tax").

What the generated table does: per bucket it keeps the steps whose predicted tok/s at the
bucket's batch sizes are within `margin` of the best tier there (0 included: at large batches no
drafting usually wins, but tier 0 pays the tax, so true baseline may still beat the whole
adaptive profile; the decision compares them), then picks, among candidate subsets and
hysteresis settings, the one whose settled behaviour under SGLang's rule (probing included)
predicts the most tok/s; ties go to fewer candidates (each candidate step captures its own CUDA
graphs: a slower restart).

Must not: read clocks, do I/O, import the simulator or anything outside stdlib/numpy/scipy and
policies. The emulation draws random numbers from a fixed seed: results are deterministic.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from policies.chain import Z90, alpha_from_accept_length
from policies.cycle_time import DRAFT_SHARE_MAX
from policies.explore_value import switch_margin
from policies.forward_cost import line_pair
from policies.types import Estimate, ProfileSpec

# SGLang's per-slot defaults (adaptive_spec_params.py).
SGLANG_UP_HYSTERESIS = 0.0
SGLANG_DOWN_HYSTERESIS = -0.25
SGLANG_EMA_ALPHA = 0.2
SGLANG_UPDATE_INTERVAL = 5
SGLANG_WARMUP_BATCHES = 10

# SGLang's default table (docs SGLANG.md): bs 1-7 -> [1,3,5,7]; 8-31 -> [0,1,3]; 32-63 ->
# [0,1]; >= 64 -> [0]. The peer sglang_adaptive runs it; seed_table restricts it.
SGLANG_DEFAULT_TABLE: dict[str, dict[str, Any]] = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
}

# Buckets of generated tables: one per octave of batch size. Step time per sequence changes
# most at small batches (1 vs 2 streams is a 2x change in load), so SGLang's coarse first
# bucket (1-7) would force one tier on loads whose best tier differs.
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# A step is kept as a candidate of a bucket when its predicted tok/s there is within this
# fraction of the best tier's: the same 2% the switch rule's margin_frac treats as noise.
TABLE_MARGIN = 0.02

# Options whose predicted tok/s are this close count as tied; the tie goes to fewer candidate
# steps (fewer CUDA-graph captures: each costs tens of seconds of restart).
TIE_TOLERANCE = 0.002

# Hysteresis settings tried per bucket (up, down): SGLang's default for small batches, none,
# and two that make the rule stickier, which pays when a bucket's candidates are close.
HYSTERESIS_OPTIONS: tuple[tuple[float, float], ...] = (
    (SGLANG_UP_HYSTERESIS, SGLANG_DOWN_HYSTERESIS),
    (0.0, 0.0),
    (0.5, -0.5),
)

# Emulation length: update intervals simulated after a burn-in. 800 intervals of 5 batches
# give tier shares within ~2-3% (binomial at the flip-flop thresholds) in ~1 ms.
EMULATION_INTERVALS = 800
EMULATION_BURN_IN = 60
EMULATION_SEED = 20250523
# Above this batch size a batch's mean accepted drafts is drawn from its normal limit (as the
# simulator's window engine does).
CLT_BATCH = 16


_SLOT_KEYS = {
    "candidate_steps",
    "up_hysteresis",
    "down_hysteresis",
    "ceiling_coeff",
    "ema_alpha",
    "update_interval",
    "warmup_batches",
}


# --------------------------------------------------------------------------------------------
# Table format


@dataclass(frozen=True)
class SlotRule:
    """One bucket of an adaptive table, with SGLang's defaults."""

    candidate_steps: tuple[int, ...]
    up_hysteresis: float = SGLANG_UP_HYSTERESIS
    down_hysteresis: float = SGLANG_DOWN_HYSTERESIS
    ceiling_coeff: float = 0.0
    ema_alpha: float = SGLANG_EMA_ALPHA
    update_interval: int = SGLANG_UPDATE_INTERVAL
    warmup_batches: int = SGLANG_WARMUP_BATCHES

    def drop_to(self, prev: int) -> float:
        """The EMA at or below which the rule steps down to candidate `prev`."""
        return (0.5 if prev == 0 else prev - 0.5) + self.down_hysteresis

    def rise_from(self, cur: int) -> float:
        """The EMA above which the rule steps up from candidate `cur`."""
        return cur - 0.5 + self.up_hysteresis

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate_steps": list(self.candidate_steps),
            "up_hysteresis": self.up_hysteresis,
            "down_hysteresis": self.down_hysteresis,
            "ceiling_coeff": self.ceiling_coeff,
            "ema_alpha": self.ema_alpha,
            "update_interval": self.update_interval,
            "warmup_batches": self.warmup_batches,
        }


def _num(key: str, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"adaptive table {key}.{name}: must be a finite number (got {v!r})")
    return float(v)


def parse_table(table: Mapping[str, Any]) -> dict[int, SlotRule]:
    """Validate a table (the parsed JSON) as SGLang does and return {lower bound: SlotRule}.
    Non-digit top-level keys are defaults merged under every bucket. Errors name the key."""
    if not isinstance(table, Mapping):
        raise ValueError(f"adaptive table must be a JSON object (got {type(table).__name__})")
    shared = {k: v for k, v in table.items() if not str(k).isdigit()}
    for k in shared:
        if k not in _SLOT_KEYS - {"candidate_steps"}:
            raise ValueError(f"adaptive table: unknown key {k!r}")
    out: dict[int, SlotRule] = {}
    for key, entry in table.items():
        if not str(key).isdigit():
            continue
        if not isinstance(entry, Mapping):
            raise ValueError(f"adaptive table {key}: must be an object (got {entry!r})")
        unknown = set(entry) - _SLOT_KEYS
        if unknown:
            raise ValueError(f"adaptive table {key}: unknown keys {sorted(unknown)}")
        m = {**shared, **entry}
        steps = m.get("candidate_steps")
        if (
            not isinstance(steps, list | tuple)
            or not steps
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps)
        ):
            raise ValueError(
                f"adaptive table {key}.candidate_steps: must be a non-empty list of "
                f"non-negative ints (got {steps!r})"
            )
        ema = _num(key, "ema_alpha", m.get("ema_alpha", SGLANG_EMA_ALPHA))
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"adaptive table {key}.ema_alpha: must be in (0, 1]")
        every = m.get("update_interval", SGLANG_UPDATE_INTERVAL)
        warm = m.get("warmup_batches", SGLANG_WARMUP_BATCHES)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"adaptive table {key}.update_interval: must be an int >= 1")
        if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
            raise ValueError(f"adaptive table {key}.warmup_batches: must be an int >= 0")
        out[int(key)] = SlotRule(
            candidate_steps=tuple(sorted(set(steps))),
            up_hysteresis=_num(key, "up_hysteresis", m.get("up_hysteresis", 0.0)),
            down_hysteresis=_num(
                key, "down_hysteresis", m.get("down_hysteresis", SGLANG_DOWN_HYSTERESIS)
            ),
            ceiling_coeff=_num(key, "ceiling_coeff", m.get("ceiling_coeff", 0.0)),
            ema_alpha=ema,
            update_interval=every,
            warmup_batches=warm,
        )
    if not out:
        raise ValueError(
            "adaptive table must contain at least one integer-string batch-size key, e.g. "
            f'{{"1": {{"candidate_steps": [1, 3]}}}}; got keys {list(table)}'
        )
    return out


def table_json(slots: Mapping[int, SlotRule]) -> dict[str, Any]:
    """The JSON object SGLang reads, keys in batch-size order."""
    return {str(b): slots[b].to_json() for b in sorted(slots)}


def table_steps(table: Mapping[str, Any]) -> tuple[int, ...]:
    """Every candidate step of a table (each one captures CUDA graphs at launch)."""
    return tuple(sorted({s for r in parse_table(table).values() for s in r.candidate_steps}))


def seed_table(candidate_steps_allowed: Sequence[int]) -> dict[str, Any]:
    """SGLang's default table restricted to the allowed steps (a bucket left empty keeps the
    allowed step nearest to its default's middle): what an adaptive profile launches with
    before specpilot has estimates to compute a table from."""
    allowed = _allowed(candidate_steps_allowed)
    out: dict[int, SlotRule] = {}
    for key, entry in SGLANG_DEFAULT_TABLE.items():
        want = entry["candidate_steps"]
        keep = [s for s in want if s in allowed]
        if not keep:
            mid = want[len(want) // 2]
            keep = [min(allowed, key=lambda s: (abs(s - mid), s))]
        out[int(key)] = SlotRule(
            tuple(keep), float(entry["up_hysteresis"]), float(entry["down_hysteresis"])
        )
    return table_json(out)


def _allowed(candidate_steps_allowed: Sequence[int]) -> tuple[int, ...]:
    allowed = tuple(sorted(set(int(s) for s in candidate_steps_allowed)))
    if not allowed or allowed[0] < 0:
        raise ValueError(
            f"candidate steps must be a non-empty list of ints >= 0 (got {candidate_steps_allowed})"
        )
    return allowed


def cuda_graph_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's decode CUDA-graph batch sizes with speculation on (cuda_graph_hook.py): 1-8,
    10-32 step 2, 40-64 step 4, 72-256 step 8, then step 16, plus max_bs itself."""
    sizes = (
        list(range(1, 9))
        + list(range(10, 33, 2))
        + list(range(40, 65, 4))
        + list(range(72, 257, 8))
        + list(range(272, max_bs + 1, 16))
    )
    sizes = [s for s in sizes if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def route(slots: Mapping[int, SlotRule], batch: int, max_bs: int | None) -> int:
    """The bucket (lower bound) a batch of this size runs in: padded to the next CUDA-graph
    batch size first (None: no padding), then the largest lower bound <= it."""
    padded = batch
    if max_bs is not None:
        gs = cuda_graph_batch_sizes(max_bs)
        i = bisect.bisect_left(gs, batch)
        padded = gs[i] if i < len(gs) else batch
    bounds = sorted(slots)
    i = bisect.bisect_right(bounds, padded) - 1
    return bounds[max(0, i)]


def table_distance(
    old: Mapping[str, Any] | None, new: Mapping[str, Any], max_bs: int = 256
) -> float:
    """Share of batch sizes 1..max_bs (each octave weighted alike) whose bucket rule differs
    between two tables: 0 for tables that behave identically, 1 when every batch size runs a
    different rule (or there is no old table)."""
    if old is None:
        return 1.0
    a, b = parse_table(old), parse_table(new)
    sizes = np.arange(1, max_bs + 1)
    w = 1.0 / sizes  # log weighting: each octave counts the same
    differ = np.array(
        [a[route(a, int(s), None)] != b[route(b, int(s), None)] for s in sizes], dtype=float
    )
    return float(np.dot(w, differ) / w.sum())


# --------------------------------------------------------------------------------------------
# Inputs: acceptance and tier costs


@dataclass(frozen=True)
class AcceptModel:
    """Chain acceptance per workload (alpha per draft token, with a ~90% interval) and the
    workload mix as token shares. Sequences in a batch belong to a workload in proportion to
    its tokens / its accept length (a workload that yields more per cycle finishes sooner)."""

    alphas: Mapping[str, Estimate]
    shares: Mapping[str, float]
    # Derived, computed once per model: (alphas, token shares) per which alpha, as tuples; tokens
    # per sequence-cycle per (which alpha, tier).
    _values: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _per_cycle: dict[tuple[str, int], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.alphas:
            raise ValueError("AcceptModel needs at least one workload")
        for w, a in self.alphas.items():
            if not (0.0 <= a.low <= a.mean <= a.high <= 1.0):
                raise ValueError(f"alpha of {w!r} must satisfy 0 <= low <= mean <= high <= 1")
        if set(self.shares) - set(self.alphas):
            missing = sorted(set(self.shares) - set(self.alphas))
            raise ValueError(f"mix names workloads without an alpha: {missing}")
        if any(not (s >= 0 and math.isfinite(s)) for s in self.shares.values()):
            raise ValueError("mix shares must be finite and >= 0")

    @classmethod
    def single(cls, alpha: float, name: str = "default") -> AcceptModel:
        return cls({name: Estimate(alpha, alpha, alpha)}, {name: 1.0})

    @functools.cached_property
    def _mix_values(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """The workloads in the mix and their token shares (summing to 1)."""
        names = [w for w, s in self.shares.items() if s > 0] or list(self.alphas)
        sh = np.array([self.shares.get(w, 1.0) for w in names], dtype=float)
        return tuple(names), tuple((sh / sh.sum()).tolist())

    def values_of(self, which: str = "mean") -> tuple[tuple[float, ...], tuple[float, ...]]:
        """alphas_of as tuples of floats (computed once per model)."""
        hit = self._values.get(which)
        if hit is None:
            names, shares = self._mix_values
            al = tuple(float(getattr(self.alphas[w], which)) for w in names)
            hit = self._values[which] = (al, shares)
        return hit

    def alphas_of(self, which: str = "mean") -> tuple[np.ndarray, np.ndarray]:
        """(alpha per workload, token share per workload) for the workloads in the mix."""
        al, sh = self.values_of(which)
        return np.array(al), np.array(sh)

    def tokens_per_cycle(self, which: str, g: int) -> float:
        """tokens_per_seq_cycle at tier g with the `which` ("low", "mean", "high") alphas."""
        key = (which, g)
        hit = self._per_cycle.get(key)
        if hit is None:
            hit = self._per_cycle[key] = _tokens_per_cycle(*self.values_of(which), g)
        return hit


def _accepted_mean(alpha: np.ndarray, g: int) -> np.ndarray:
    """E[accepted drafts] of a g-step chain per alpha: sum_{i=1..g} alpha^i."""
    if g <= 0:
        return np.zeros_like(alpha)
    return np.sum(alpha[:, None] ** np.arange(1, g + 1), axis=1)


def slot_shares(alphas: np.ndarray, token_shares: np.ndarray, g: int) -> np.ndarray:
    """Share of a batch's sequences per workload at tier g: tokens / accept length."""
    w = token_shares / (1.0 + _accepted_mean(alphas, g))
    return w / w.sum()


@functools.lru_cache(maxsize=4096)
def _tokens_per_cycle(alphas: tuple[float, ...], shares: tuple[float, ...], g: int) -> float:
    """tokens_per_seq_cycle memoised on its values (the fixed profiles' alphas and the mix
    hold across the looks of a running adaptive profile)."""
    return tokens_per_seq_cycle(np.array(alphas), np.array(shares), g)


def tokens_per_seq_cycle(alphas: np.ndarray, token_shares: np.ndarray, g: int) -> float:
    """Tokens one sequence emits per cycle at tier g under the mix (harmonic, token-weighted)."""
    return float(1.0 / np.sum(token_shares / (1.0 + _accepted_mean(alphas, g))))


# (batch, steps) -> cycle seconds of one tier: steps >= 1 drafts and verifies steps + 1 tokens;
# steps 0 is adaptive tier 0 (a decode forward plus the draft-extend pass).
CycleFn = Callable[[float, int], Estimate | None]


# --------------------------------------------------------------------------------------------
# SGLang's rule, emulated


def _recompute(r: SlotRule, g: int, ema: float) -> tuple[int, float]:
    """SGLang's _recompute_params: the new tier (and EMA) of a bucket."""
    cands = r.candidate_steps
    idx = cands.index(g)
    old_idx = idx
    if g == 0:
        idx = min(idx + 1, len(cands) - 1)
        target = cands[idx]
        if target > 0 and ema < 0:
            ema = float(target - 1)
        return target, ema
    while idx > 0 and ema <= r.drop_to(cands[idx - 1]):
        idx -= 1
    if idx >= old_idx:
        while idx < len(cands) - 1 and ema > r.rise_from(cands[idx]):
            idx += 1
    target = cands[idx]
    if r.ceiling_coeff > 0:
        ceiling = max(1, math.ceil(ema * r.ceiling_coeff))
        if ceiling < target <= g:
            while idx > 0 and cands[idx] > ceiling:
                idx -= 1
            target = cands[idx]
    return target, ema


def _accepted_pmf(alphas: np.ndarray, slots: np.ndarray, g: int) -> np.ndarray:
    """P(a sequence of the batch accepts k drafts), k = 0..g, at tier g: a sequence is of
    workload w with probability slots[w], and accepts k with alpha^k (1 - alpha), truncated at
    g (the rest of the tail, alpha^g, all at k = g)."""
    k = np.arange(g + 1)
    p = (1.0 - alphas[:, None]) * alphas[:, None] ** k
    p[:, g] = alphas**g
    return slots @ p


@functools.lru_cache(maxsize=512)
def _batch_sum_cdf(pmf: tuple[float, ...], n: int) -> np.ndarray:
    """CDF of the accepted drafts summed over a batch of n independent sequences of `pmf`
    (its n-fold convolution)."""
    one = np.array(pmf)
    out = one
    for _ in range(n - 1):
        out = np.convolve(out, one)
    cdf = np.cumsum(out)
    return cdf / cdf[-1]


def _block_increments(
    rng: np.random.Generator,
    every: int,
    a: float,
    g: int,
    n: int,
    alphas: np.ndarray,
    shares: np.ndarray,
    size: int,
) -> np.ndarray:
    """`size` EMA increments of one update interval (`every` batches, EMA alpha `a`) at tier g
    with batches of n sequences: sum_i a (1 - a)^(every - 1 - i) x_i, x_i a batch's mean
    accepted drafts. Each sequence's accepted drafts are independent draws of one pmf (the
    workloads' mixture by their share of the batch's slots), so a batch's sum is drawn from that
    pmf's n-fold convolution: exact, and n times fewer draws than one per sequence. Above
    CLT_BATCH the batch mean is normal."""
    draw = _increment_draw(rng, n, every, size)
    w = a * (1.0 - a) ** np.arange(every - 1, -1, -1)
    pmf = _accepted_pmf(alphas, slot_shares(alphas, shares, g), g)
    if n > CLT_BATCH:
        k = np.arange(g + 1)
        mean = float(np.dot(pmf, k))
        var = max(0.0, float(np.dot(pmf, k * k)) - mean * mean)
        sd = math.sqrt(var / n * float(np.dot(w, w)))
        return mean * float(w.sum()) + sd * draw
    cdf = _batch_sum_cdf(tuple(float(x) for x in pmf), n)
    sums = np.searchsorted(cdf, draw, side="right")
    return (np.minimum(sums, len(cdf) - 1) / n) @ w


def _increment_draw(rng: np.random.Generator, n: int, every: int, size: int) -> np.ndarray:
    """The random numbers _block_increments reads: `size` standard normals above CLT_BATCH,
    else `size` x `every` uniforms. Their shape depends on the batch size, the update interval
    and the size only, never on the tier."""
    return rng.standard_normal(size) if n > CLT_BATCH else rng.random((size, every))


# A table generation reads a few dozen; each holds EMULATION_BURN_IN + EMULATION_INTERVALS floats.
@functools.lru_cache(maxsize=256)
def _visit_increments(
    visit: int,
    every: int,
    a: float,
    g: int,
    n: int,
    alphas: tuple[float, ...],
    shares: tuple[float, ...],
    size: int,
) -> tuple[float, ...]:
    """_block_increments for the `visit`-th tier an emulation draws for (0 for the first), from a
    generator seeded EMULATION_SEED: every draw before it had the same shape, so the generator
    stands where those draws left it whatever the tiers were, and the emulations of other rules
    (candidates, hysteresis, start) at the same batch and acceptance read the same increments."""
    rng = np.random.default_rng(EMULATION_SEED)
    for _ in range(visit):
        _increment_draw(rng, n, every, size)
    inc = _block_increments(rng, every, a, g, n, np.array(alphas), np.array(shares), size)
    return tuple(inc.tolist())


def _stay_bounds(r: SlotRule, g: int) -> tuple[float, float, float]:
    """(lo, hi, ceiling): _recompute keeps tier g > 0 at an EMA e with lo < e <= hi and, when
    ceiling > 0, max(1, ceil(e x ceiling)) >= g: the same comparisons it makes (the drop to the
    candidate under g, the rise to the one over it, the ceiling on a tier with one under it)."""
    cands = r.candidate_steps
    idx = cands.index(g)
    lo = r.drop_to(cands[idx - 1]) if idx > 0 else -math.inf
    hi = r.rise_from(g) if idx < len(cands) - 1 else math.inf
    return lo, hi, r.ceiling_coeff if idx > 0 else 0.0


@functools.lru_cache(maxsize=4096)
def _tier_shares_cached(
    r: SlotRule, n: int, alphas: tuple[float, ...], shares: tuple[float, ...], start: int
) -> tuple[tuple[int, float], ...]:
    cands = r.candidate_steps
    g = start if start in cands else cands[len(cands) // 2]
    ema = float(g - 1)
    decay = (1.0 - r.ema_alpha) ** r.update_interval
    total = EMULATION_BURN_IN + EMULATION_INTERVALS
    inc: dict[int, tuple[float, ...]] = {}
    pos: dict[int, int] = {}
    counts: dict[int, int] = {}

    it = 0
    while it < total:
        first = it
        if g == 0:  # tier 0 has no acceptance to average: the rule looks after one interval
            it += 1
        else:
            # The run of intervals at tier g in a tight loop (the EMA takes the tier's
            # increments), up to the first after which the rule may move: _recompute decides.
            if g not in inc:
                every, a = r.update_interval, r.ema_alpha
                inc[g] = _visit_increments(len(inc), every, a, g, n, alphas, shares, total)
                pos[g] = 0
            lo, hi, ceil_c = _stay_bounds(r, g)
            xs, p = inc[g], pos[g]
            while it < total:
                ema = decay * ema + xs[p]
                p += 1
                it += 1
                if not lo < ema <= hi or (ceil_c > 0 and max(1, math.ceil(ema * ceil_c)) < g):
                    break
            pos[g] = p
        c = it - max(first, EMULATION_BURN_IN)  # the intervals after the burn-in count
        if c > 0:
            counts[g] = counts.get(g, 0) + c
        g, ema = _recompute(r, g, ema)
    return tuple(sorted((k, v / EMULATION_INTERVALS) for k, v in counts.items()))


def tier_shares(
    rule: SlotRule, batch: int, accept: AcceptModel, launch_steps: int = 1
) -> dict[int, float]:
    """Share of verify batches at each tier of one bucket under SGLang's rule over
    EMULATION_INTERVALS update intervals after a burn-in, started as SGLang starts a slot (at
    `launch_steps` if it is a candidate, else the middle candidate), batches of `batch`
    sequences with the acceptance of `accept` (mean alphas). A bucket with a single candidate
    stays on it; one whose EMA wants 0 alternates 0 and its next candidate. The rule can be
    bistable (a tier's truncated acceptance keeps it there): the start then matters, as it does
    on a server between restarts."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1 (got {batch})")
    if len(rule.candidate_steps) == 1:
        return {rule.candidate_steps[0]: 1.0}
    al, sh = accept.values_of("mean")
    key_a = tuple(round(x, 4) for x in al)
    key_s = tuple(round(x, 3) for x in sh)
    return dict(_tier_shares_cached(rule, int(batch), key_a, key_s, int(launch_steps)))


@dataclass(frozen=True)
class AdaptiveBreakdown:
    """What predict_adaptive computed at one batch size."""

    batch: float
    bucket: int
    shares: Mapping[int, float]  # tier -> share of verify batches
    tok_s: Estimate
    accept_length: float  # tokens per sequence per cycle, tier mix
    cycle_s: float  # mean cycle seconds, tier mix
    tier_tok_s: Mapping[int, float] = field(default_factory=dict)  # each tier held fixed


def _tier_terms(
    cycle: CycleFn, accept: AcceptModel, batch: float, g: int
) -> tuple[Estimate, tuple[float, float, float]] | None:
    c = cycle(batch, g)
    if c is None:
        return None
    lo, mid, hi = (accept.tokens_per_cycle(which, g) for which in ("low", "mean", "high"))
    return c, (lo, mid, hi)


def _breakdown_int(
    slots: Mapping[int, SlotRule],
    accept: AcceptModel,
    cycle: CycleFn,
    batch: int,
    launch_steps: int,
    max_bs: int | None,
) -> AdaptiveBreakdown | None:
    b = route(slots, batch, max_bs)
    shares = tier_shares(slots[b], batch, accept, launch_steps)
    num = [0.0, 0.0, 0.0]  # tokens per sequence-cycle x share: low, mean, high
    den = [0.0, 0.0, 0.0]  # cycle seconds x share: high, mean, low (pairs with num)
    per_tier: dict[int, float] = {}
    n = math.inf
    for g, pi in shares.items():
        terms = _tier_terms(cycle, accept, float(batch), g)
        if terms is None:
            return None
        c, (l_lo, l_mid, l_hi) = terms
        n = min(n, c.n)
        per_tier[g] = batch * l_mid / c.mean
        for i, (L, T) in enumerate(((l_lo, c.high), (l_mid, c.mean), (l_hi, c.low))):
            num[i] += pi * L
            den[i] += pi * T
    mean = batch * num[1] / den[1]
    low = batch * num[0] / den[0] if math.isfinite(den[0]) else 0.0
    high = batch * num[2] / den[2] if den[2] > 0 else math.inf
    return AdaptiveBreakdown(
        batch=float(batch),
        bucket=b,
        shares=shares,
        tok_s=Estimate(mean, min(low, mean), max(high, mean), n),
        accept_length=num[1],
        cycle_s=den[1],
        tier_tok_s=per_tier,
    )


@functools.lru_cache(maxsize=64)
def _parsed_json(text: str) -> Mapping[int, SlotRule]:
    return MappingProxyType(parse_table(json.loads(text)))


# The tables parsed last, by identity: id -> (the table, its JSON round trip, its rules). A
# decision asks about the same few table objects at many batch sizes and every window; comparing
# with the round trip costs far less than serialising again, and a table changed in place no
# longer compares equal.
_RECENT: dict[int, tuple[Mapping[str, Any], Any, Mapping[int, SlotRule]]] = {}
_RECENT_MAX = 16


def _parsed(table: Mapping[str, Any]) -> Mapping[int, SlotRule]:
    """parse_table, memoised on the table's JSON (a decision prices the same few tables at many
    batch sizes)."""
    hit = _RECENT.get(id(table))
    if hit is not None and hit[0] is table and hit[1] == table:
        return hit[2]
    try:
        text = json.dumps(table, sort_keys=True)
    except (TypeError, ValueError):
        return parse_table(table)  # not JSON: parse_table says what is wrong with it
    slots = _parsed_json(text)
    if len(_RECENT) >= _RECENT_MAX:
        _RECENT.clear()
    _RECENT[id(table)] = (table, json.loads(text), slots)
    return slots


def adaptive_breakdown(
    table: Mapping[str, Any],
    accept: AcceptModel,
    cycle: CycleFn,
    batch: float,
    *,
    launch_steps: int = 1,
    max_bs: int | None = None,
) -> AdaptiveBreakdown | None:
    """predict_adaptive with its workings; None when a tier the rule uses has no cost."""
    if not (batch >= 1 and math.isfinite(batch)):
        raise ValueError(f"batch must be a finite number >= 1 (got {batch!r})")
    slots = _parsed(table)
    lo = math.floor(batch)
    hi = lo if lo == batch else lo + 1
    a = _breakdown_int(slots, accept, cycle, lo, launch_steps, max_bs)
    if hi == lo or a is None:
        return a
    bb = _breakdown_int(slots, accept, cycle, hi, launch_steps, max_bs)
    if bb is None:
        return None
    w = batch - lo

    def mix(x: float, y: float) -> float:
        return (1.0 - w) * x + w * y

    shares = {g: mix(a.shares.get(g, 0.0), bb.shares.get(g, 0.0)) for g in {*a.shares, *bb.shares}}
    return AdaptiveBreakdown(
        batch=batch,
        bucket=a.bucket if w < 0.5 else bb.bucket,
        shares={g: s for g, s in sorted(shares.items()) if s > 0},
        tok_s=Estimate(
            mix(a.tok_s.mean, bb.tok_s.mean),
            mix(a.tok_s.low, bb.tok_s.low),
            mix(a.tok_s.high, bb.tok_s.high),
            min(a.tok_s.n, bb.tok_s.n),
        ),
        accept_length=mix(a.accept_length, bb.accept_length),
        cycle_s=mix(a.cycle_s, bb.cycle_s),
        tier_tok_s={
            g: mix(a.tier_tok_s.get(g, 0.0), bb.tier_tok_s.get(g, 0.0))
            for g in set(a.tier_tok_s) & set(bb.tier_tok_s)
        },
    )


def predict_adaptive(
    table: Mapping[str, Any],
    accept: AcceptModel,
    cycle: CycleFn,
    batch: float,
    *,
    launch_steps: int = 1,
    max_bs: int | None = None,
) -> Estimate | None:
    """Decode tok/s of an adaptive server running `table` at `batch` sequences: the tiers SGLang's
    rule settles on in the batch's bucket (probing from tier 0 included), each with its accept
    length and its cycle time (tier 0 with the draft-extend pass):
    B x sum_g pi_g E[L_g] / sum_g pi_g T_g(B), pi_g the share of verify batches at tier g.
    The interval pairs low acceptance with slow cycles. A fractional batch blends the two
    integer sizes around it. None when a tier in use has no cost estimate."""
    br = adaptive_breakdown(table, accept, cycle, batch, launch_steps=launch_steps, max_bs=max_bs)
    return None if br is None else br.tok_s


# --------------------------------------------------------------------------------------------
# Table generation


@dataclass(frozen=True)
class BucketChoice:
    """Why a bucket got its rule: the fixed-tier scores and the emulated one."""

    lower: int
    points: tuple[int, ...]
    fixed_score: Mapping[int, float]  # step -> mean tok/s relative to the best tier
    kept: tuple[int, ...]  # steps within the margin
    rule: SlotRule
    score: float  # the rule's emulated tok/s relative to the best tier


def _bucket_points(lo: int, hi: int) -> tuple[int, ...]:
    """Batch sizes that stand for a bucket [lo, hi]: its ends and geometric middle."""
    if hi <= lo:
        return (lo,)
    mid = round(math.sqrt(lo * hi))
    return tuple(sorted({lo, mid, hi}))


def _subsets(kept: tuple[int, ...], best: int) -> list[tuple[int, ...]]:
    """Contiguous runs of the kept steps that contain the best one (a rule moves one candidate
    at a time, so a gap would be jumped anyway)."""
    i = kept.index(best)
    out = []
    for a in range(0, i + 1):
        for b in range(i, len(kept)):
            out.append(kept[a : b + 1])
    return out


def generate_table(
    cycle: CycleFn,
    accept: AcceptModel,
    candidate_steps_allowed: Sequence[int],
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    max_bs: int = 128,
    launch_steps: int | None = None,
    margin: float = TABLE_MARGIN,
) -> tuple[dict[str, Any], list[BucketChoice]]:
    """The adaptive table for the fitted costs (`cycle`, tier 0 with its draft-extend tax) and
    acceptance (`accept`), with only `candidate_steps_allowed`, one bucket per lower bound in
    `buckets` up to `max_bs` (the server's max running requests; batch sizes are padded as
    SGLang pads them). Returns (table JSON, one BucketChoice per bucket). Steps whose cost is
    unknown (`cycle` gives None) are left out; ValueError when none is known at some bucket."""
    allowed = _allowed(candidate_steps_allowed)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1) (got {margin})")
    bounds = sorted({int(b) for b in buckets if 1 <= int(b) <= max_bs})
    if not bounds or bounds[0] != 1:
        bounds = sorted({1, *bounds})
    launch = launch_steps if launch_steps is not None else max(allowed)
    slots: dict[int, SlotRule] = {}
    choices: list[BucketChoice] = []
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] - 1 if i + 1 < len(bounds) else max_bs
        pts = _bucket_points(lo, hi)
        lens = {g: accept.tokens_per_cycle("mean", g) for g in allowed}
        cyc: dict[int, list[float]] = {}
        for g in allowed:
            row = []
            for b in pts:
                c = cycle(float(b), g)
                if c is None or not c.mean > 0:
                    row = []
                    break
                row.append(c.mean)
            if row:
                cyc[g] = row
        if not cyc:
            raise ValueError(f"no candidate step has a cost estimate at batch sizes {pts}")
        best_at = [max(b * lens[g] / cyc[g][j] for g in cyc) for j, b in enumerate(pts)]
        score = {
            g: float(np.mean([b * lens[g] / cyc[g][j] / best_at[j] for j, b in enumerate(pts)]))
            for g in cyc
        }
        best = max(score, key=lambda g: (score[g], -g))
        kept = tuple(sorted({best} | {g for g, s in score.items() if s >= 1.0 - margin}))
        options: list[tuple[float, int, int, SlotRule]] = []
        for cands in _subsets(kept, best):
            hyst = HYSTERESIS_OPTIONS if len(cands) > 1 else HYSTERESIS_OPTIONS[:1]
            for k, (up, down) in enumerate(hyst):
                rule = SlotRule(cands, up, down)
                s = 0.0
                for j, b in enumerate(pts):
                    # SGLang's rule can be bistable (truncated acceptance depends on the tier):
                    # a rule is scored by its worst start (launch, lowest or highest tier), so a
                    # table never relies on where the EMA happens to begin.
                    worst = math.inf
                    for start in sorted({cands[0], cands[-1]} | ({launch} & set(cands))):
                        shares = tier_shares(rule, b, accept, start)
                        num = sum(p * lens[g] for g, p in shares.items())
                        den = sum(p * cyc[g][j] for g, p in shares.items())
                        worst = min(worst, b * num / den)
                    s += worst / best_at[j]
                options.append((s / len(pts), len(cands), k, rule))
        top = max(o[0] for o in options)
        tied = [o for o in options if o[0] >= top - TIE_TOLERANCE]
        pick = min(tied, key=lambda o: (o[1], o[2]))
        slots[lo] = pick[3]
        choices.append(BucketChoice(lo, pts, score, kept, pick[3], pick[0]))
    return table_json(slots), choices


# --------------------------------------------------------------------------------------------
# Rewrites and restarts


def rewrite_pays(
    current: Estimate,
    new: Estimate,
    *,
    horizon_s: float,
    restart_s: float,
    margin_frac: float,
    margin_z: float,
) -> tuple[bool, float]:
    """The switch rule's economics for a restart into a new table: (pays, net tokens) with
    net = (N - C - margin) x max(H - R, 0) - C x R and margin = margin_frac x C +
    margin_z x sd(N - C); it pays when the gain clears the margin and net > 0."""
    c, n = current.mean, new.mean
    margin = switch_margin(current, new, margin_frac, margin_z)
    gain = n - c
    net = (gain - margin) * max(horizon_s - restart_s, 0.0) - c * restart_s
    return gain - margin > 0 and net > 0, net


# --------------------------------------------------------------------------------------------
# Self-correction: what the adaptive profile's own windows say about its prediction


@dataclass
class LogRatio:
    """Exponentially forgotten moments of log(observed / predicted) over windows (each window
    weighted by the share of it the ratio speaks for): the mean is the correction, its scatter
    over the effective number of windows its standard error. JSON as a list of five floats."""

    w: float = 0.0  # forgotten weight (windows)
    w2: float = 0.0  # forgotten sum of squared weights (effective n = w^2 / w2)
    sx: float = 0.0
    sxx: float = 0.0
    count: float = 0.0  # weight since the last discount (the minimum-data rule counts these)

    def add(self, x: float, weight: float = 1.0) -> None:
        if not (math.isfinite(x) and weight > 0):
            return
        self.w += weight
        self.w2 += weight * weight
        self.sx += weight * x
        self.sxx += weight * x * x
        self.count += weight

    def scale(self, f: float) -> None:
        self.w *= f
        self.w2 *= f * f
        self.sx *= f
        self.sxx *= f

    def merged(self, other: LogRatio) -> LogRatio:
        return LogRatio(
            self.w + other.w,
            self.w2 + other.w2,
            self.sx + other.sx,
            self.sxx + other.sxx,
            self.count + other.count,
        )

    def mean(self) -> float:
        return self.sx / self.w if self.w > 0 else 0.0

    def se(self, floor: float) -> float:
        """Standard error of the mean (at least `floor`: a handful of identical windows is not
        certainty about the next hour)."""
        if self.w <= 0:
            return math.inf
        var = max(self.sxx / self.w - self.mean() ** 2, 0.0)
        n_eff = self.w * self.w / self.w2 if self.w2 > 0 else 1.0
        return max(math.sqrt(var / max(n_eff, 1.0)), floor)

    def to_json(self) -> list[float]:
        return [self.w, self.w2, self.sx, self.sxx, self.count]

    @classmethod
    def from_json(cls, v: Sequence[float]) -> LogRatio:
        if len(v) != 5 or not all(isinstance(x, int | float) for x in v):
            raise ValueError(f"LogRatio JSON must be 5 numbers (got {v!r})")
        return cls(*(float(x) for x in v))


def scale_estimate(e: Estimate, log_factor: float, log_se: float) -> Estimate:
    """`e` multiplied by exp(log_factor), its interval widened by a ~90% band of `log_se` on the
    factor (relative half-widths add in quadrature)."""
    f = math.exp(log_factor)
    mean = e.mean * f
    if not (e.mean > 0):
        return Estimate(mean, e.low * f, e.high * f, e.n)
    band = Z90 * log_se
    lo_rel = math.hypot(1.0 - e.low / e.mean, band) if math.isfinite(band) else 1.0
    hi_rel = math.hypot(e.high / e.mean - 1.0, band) if math.isfinite(e.high) else math.inf
    return Estimate(mean, max(mean * (1.0 - lo_rel), 0.0), mean * (1.0 + hi_rel), e.n)


def corrected_cycle(
    cycle: CycleFn, factor: Callable[[float, int], tuple[float, float] | None]
) -> CycleFn:
    """`cycle` with each tier's time at a batch size scaled by `factor(batch, g)` -> (log factor,
    its standard error), where the factor knows one; uncorrected elsewhere."""

    def at(batch: float, g: int) -> Estimate | None:
        e = cycle(batch, g)
        if e is None:
            return None
        f = factor(batch, g)
        return e if f is None else scale_estimate(e, f[0], f[1])

    return at


# --------------------------------------------------------------------------------------------
# Reading the inputs off specpilot's estimators


def accept_model_from(
    accept_predict: Callable[[str, str], Estimate | None],
    fixed_specs: Sequence[ProfileSpec],
    mix: Mapping[str, float],
) -> AcceptModel | None:
    """Chain alphas per workload in `mix` from the fixed speculative profiles' accept-length
    predictions (`accept_predict(profile, workload)`), the deepest chain with a prediction
    first (it says most about the tail). None when a workload of the mix has none."""
    specs = sorted(
        (p for p in fixed_specs if p.speculative and not p.adaptive and p.num_steps >= 1),
        key=lambda p: -p.num_steps,
    )
    if not specs:
        return None
    names = [w for w, s in mix.items() if s > 0] or ["*"]
    alphas: dict[str, Estimate] = {}
    for w in names:
        for p in specs:
            e = accept_predict(p.name, w)
            if e is None:
                continue
            g = p.num_steps
            alphas[w] = Estimate(
                alpha_from_accept_length(e.mean, g),
                alpha_from_accept_length(e.low, g),
                alpha_from_accept_length(e.high, g),
                e.n,
            )
            break
        else:
            return None
    shares = {w: float(mix.get(w, 1.0)) for w in names}
    return AcceptModel(alphas, shares)


def _one_chain(known: Mapping[int, Estimate], t0: Estimate | None, g: int) -> Estimate | None:
    """Tier g's cycle from one run chain of G steps and tier 0 (the target's decode forward and
    the draft-extend pass): a chain's cycle is tier 0's plus its draft forwards (a few percent)
    and the verify forward's excess over a decode forward, which is anywhere between all per
    verified token (the line through tier 0 and the chain) and all fixed (a verify of any width
    costs what the chain's does: FIELD.md's verify at 20-30 ms against a decode forward at 11).
    The middle of that range, with the range as its interval (with the chain's own spread)."""
    if t0 is None:
        return None  # one tier says nothing of how the cycle grows with steps
    ((G, eg),) = known.items()
    line = t0.mean + g / G * (eg.mean - t0.mean)
    lo, hi = sorted((line, eg.mean))
    mean = (lo + hi) / 2.0
    if not mean > 0:
        return None
    half = math.hypot((hi - lo) / 2.0, eg.high - eg.mean, t0.high - t0.mean)
    return Estimate(mean, max(mean - half, 1e-9), mean + half, min(eg.n, t0.n))


def _run(known: Mapping[int, Estimate]) -> dict[int, Estimate]:
    """The chains priced by their own windows (n > 0), not read off others."""
    return {g: e for g, e in known.items() if e.n > 0}


def _held_to_run(known: Mapping[int, Estimate], t0: Estimate | None) -> dict[int, Estimate]:
    """The chains never run (n == 0: a reading of the run ones, centred on a guess) held to what
    the run chains and tier 0 allow: the cycle never falls with more steps, and between two
    anchors lies between their chord and the upper one (the verify's excess over a decode
    forward anywhere from all per verified token to all fixed, as `_one_chain`); beyond the
    last, between it and the chord of the last two continued. Lines through an unheld guess
    carried it to every tier (stress z4: 2-step read off 5-step below the decode step put tier
    1 under tier 0 and tier 7 half a millisecond dearer than the run chain allows)."""
    anchors = {g: e.mean for g, e in _run(known).items()}
    if t0 is not None:
        anchors[0] = t0.mean
    out = dict(known)
    for g, e in known.items():
        if e.n > 0:
            continue
        pair = line_pair(anchors, g)
        if pair is not None and pair[0] < g:
            # Between two anchors, or beyond the last two: their chord at g.
            a, b = pair
            chord = anchors[a] + (g - a) / (b - a) * (anchors[b] - anchors[a])
            lo, hi = (chord, anchors[b]) if g < b else (anchors[b], chord)
        elif any(a < g for a in anchors):
            lo, hi = anchors[max(a for a in anchors if a < g)], math.inf
        elif anchors:
            lo, hi = 0.0, anchors[min(anchors)]
        else:
            continue
        if not lo <= hi or lo <= e.mean <= hi:
            continue  # run chains out of order (a change between them) say nothing here
        m = min(max(e.mean, lo), hi)
        out[g] = Estimate(m, min(max(e.low, lo), m), max(min(e.high, hi), m), e.n)
    return out


def tier_cycle_from(
    fixed: Mapping[int, Callable[[float], Estimate | None]],
    baseline: Callable[[float], Estimate | None] | None,
) -> CycleFn:
    """A CycleFn from the cycle estimates of fixed profiles (steps -> estimate at a batch) and
    the true baseline's. Tier g with a run fixed profile of g steps: its estimate. Other g >= 1:
    linear in g between the two nearest run tiers (extrapolated along the end secant, the
    interval widened by 10% per step of distance: verify growth with tokens saturates for MoE
    and is steeper when compute-bound). Tier 0: the baseline's decode step plus the draft-extend
    tax, taken uniform on [0, DRAFT_SHARE_MAX x T_g / (g + 1)] of the shallowest run tier (the
    draft model's share of a cycle, shared by g draft steps and one extend pass). With
    one run chain and the baseline's data, the other tiers are priced by `_one_chain`, so the
    tiers of a profile set with one chain (baseline, 2-step and an adaptive profile whose table
    uses 1 step) are priced, and its own windows can correct them. A chain never run is held
    to what the run ones and tier 0 allow (`_held_to_run`) before any tier is read off it."""

    @functools.lru_cache(maxsize=256)
    def read_at(batch: float) -> dict[int, Estimate]:
        known = {s: f(batch) for s, f in fixed.items()}
        return {s: e for s, e in known.items() if e is not None}

    @functools.lru_cache(maxsize=256)
    def tier0_at(batch: float) -> Estimate | None:
        # Every other tier at a batch size may read tier 0 (the hold, one chain): read it once.
        known = read_at(batch)
        if baseline is None or not known:
            return None
        base = baseline(batch)
        if base is None:
            return None
        ref = _run(known) or known
        g1 = min(ref)
        tax_max = DRAFT_SHARE_MAX * ref[g1].mean / (g1 + 1)
        half = math.hypot(base.mean - base.low, tax_max / 2.0)
        mean = base.mean + tax_max / 2.0
        return Estimate(mean, max(mean - half, 1e-9), mean + half, base.n)

    @functools.lru_cache(maxsize=256)
    def chains_at(batch: float) -> dict[int, Estimate]:
        # Every tier at a batch size reads the same chains' estimates: read them once.
        return _held_to_run(read_at(batch), tier0_at(batch))

    def at(batch: float, g: int) -> Estimate | None:
        if g == 0:
            return tier0_at(batch)
        known = chains_at(batch)
        if g in known:
            return known[g]
        if len(known) == 1:
            return _one_chain(known, tier0_at(batch), g)
        pair = line_pair(known, g)
        if pair is None:
            return None  # no chain priced at this batch size
        a, b = pair
        dist = max(g - b, a - g, 0)
        ea, eb = known[a], known[b]
        w = (g - a) / (b - a)
        mean = ea.mean + w * (eb.mean - ea.mean)
        half = math.hypot((1 - w) * (ea.high - ea.mean), w * (eb.high - eb.mean))
        half = math.hypot(half, 0.10 * dist * abs(eb.mean - ea.mean) / max(b - a, 1) + 0.0)
        if mean <= 0:
            return None
        return Estimate(mean, max(mean - half, 1e-9), mean + half, min(ea.n, eb.n))

    return at


__all__ = [
    "DEFAULT_BUCKETS",
    "SGLANG_DEFAULT_TABLE",
    "TABLE_MARGIN",
    "AcceptModel",
    "AdaptiveBreakdown",
    "BucketChoice",
    "CycleFn",
    "LogRatio",
    "SlotRule",
    "accept_model_from",
    "adaptive_breakdown",
    "corrected_cycle",
    "cuda_graph_batch_sizes",
    "generate_table",
    "parse_table",
    "predict_adaptive",
    "rewrite_pays",
    "route",
    "scale_estimate",
    "seed_table",
    "table_distance",
    "table_json",
    "table_steps",
    "tier_cycle_from",
    "tier_shares",
]
