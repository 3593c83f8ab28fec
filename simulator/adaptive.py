"""SGLang 0.5.23's in-process adaptive speculation rule (`--speculative-adaptive`), as a model.

Owns: parsing and validating an adaptive config (the `--speculative-adaptive-config` JSON, as a
dict), the per-batch-size slots and their EMA rule, and routing a batch size to its slot. Both
engines use it. Must not: know costs or time (SGLang's rule never measures cost), draw random
numbers, or import sglang.

Behaviour, read from sglang/srt/speculative/adaptive_spec_params.py (0.5.23) and re-implemented:
- Config keys that are digit strings are batch-size lower bounds; each maps to
  `candidate_steps` (non-empty list of ints >= 0) and optional `up_hysteresis`,
  `down_hysteresis`, `ceiling_coeff`, `ema_alpha`, `update_interval`, `warmup_batches`.
  Non-digit top-level keys are defaults merged under every slot's entry.
- Every slot starts at the launch `--speculative-num-steps` if it is one of its candidates, else
  at its middle candidate; its EMA starts at (steps - 1).
- After each verify the slot of the batch's size gets the per-request accepted-draft counts: the
  EMA moves only while drafting (steps > 0); the batch counter always advances. Past
  `warmup_batches`, every `update_interval`-th batch recomputes the tier:
  from 0 it probes the next candidate up; otherwise it steps down while
  ema <= (prev - 0.5 or 0.5 when prev is 0) + down_hysteresis, and, only if it did not move down,
  steps up while ema > current - 0.5 + up_hysteresis. That is target = round(ema) + 1 with
  hysteresis. An optional ceiling (ceil(ema x ceiling_coeff)) caps only non-increasing moves.
- A batch size is padded up to the next CUDA-graph batch size before routing (SGLang routes the
  padded size), then goes to the slot with the largest lower bound <= it.
- Tier 0 still runs the draft-extend pass (the cost model charges it; see SimProfile.cycle_s).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from simulator.model import DEFAULT_ADAPTIVE_CONFIG

_SLOT_KEYS = {
    "candidate_steps",
    "up_hysteresis",
    "down_hysteresis",
    "ceiling_coeff",
    "ema_alpha",
    "update_interval",
    "warmup_batches",
}


@dataclass(frozen=True)
class SlotConfig:
    """One batch-size bucket of the adaptive table, with SGLang's defaults."""

    candidate_steps: tuple[int, ...]
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25
    ceiling_coeff: float = 0.0
    ema_alpha: float = 0.2
    update_interval: int = 5
    warmup_batches: int = 10

    def drop_to(self, prev: int) -> float:
        """The EMA at or below which the rule steps down to candidate `prev`."""
        return (0.5 if prev == 0 else prev - 0.5) + self.down_hysteresis

    def rise_from(self, cur: int) -> float:
        """The EMA above which the rule steps up from candidate `cur`."""
        return cur - 0.5 + self.up_hysteresis


def _num(key: str, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"adaptive config {key}.{name}: must be a finite number (got {v!r})")
    return float(v)


def parse_adaptive_config(cfg: Mapping[str, Any] | None) -> dict[int, SlotConfig]:
    """Validate a parsed `--speculative-adaptive-config` JSON (None = SGLang's default table)
    and return {batch-size lower bound: SlotConfig}. Errors name the key."""
    raw = DEFAULT_ADAPTIVE_CONFIG if cfg is None else cfg
    if not isinstance(raw, Mapping):
        raise ValueError(f"adaptive config must be a JSON object (got {type(raw).__name__})")
    shared = {k: v for k, v in raw.items() if not str(k).isdigit()}
    for k in shared:
        if k not in _SLOT_KEYS - {"candidate_steps"}:
            raise ValueError(f"adaptive config: unknown key {k!r}")
    slots: dict[int, SlotConfig] = {}
    for key, entry in raw.items():
        if not str(key).isdigit():
            continue
        if not isinstance(entry, Mapping):
            raise ValueError(f"adaptive config {key}: must be an object (got {entry!r})")
        unknown = set(entry) - _SLOT_KEYS
        if unknown:
            raise ValueError(f"adaptive config {key}: unknown keys {sorted(unknown)}")
        merged = {**shared, **entry}
        steps = merged.get("candidate_steps")
        if (
            not isinstance(steps, list | tuple)
            or not steps
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps)
        ):
            raise ValueError(
                f"adaptive config {key}.candidate_steps: must be a non-empty list of "
                f"non-negative ints (got {steps!r})"
            )
        ema_alpha = _num(key, "ema_alpha", merged.get("ema_alpha", 0.2))
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"adaptive config {key}.ema_alpha: must be in (0, 1]")
        interval = merged.get("update_interval", 5)
        warmup = merged.get("warmup_batches", 10)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"adaptive config {key}.update_interval: must be an int >= 1")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"adaptive config {key}.warmup_batches: must be an int >= 0")
        slots[int(key)] = SlotConfig(
            candidate_steps=tuple(sorted(set(steps))),
            up_hysteresis=_num(key, "up_hysteresis", merged.get("up_hysteresis", 0.0)),
            down_hysteresis=_num(key, "down_hysteresis", merged.get("down_hysteresis", -0.25)),
            ceiling_coeff=_num(key, "ceiling_coeff", merged.get("ceiling_coeff", 0)),
            ema_alpha=ema_alpha,
            update_interval=interval,
            warmup_batches=warmup,
        )
    if not slots:
        raise ValueError(
            "adaptive config must contain at least one integer-string batch-size key, e.g. "
            f'{{"1": {{"candidate_steps": [1, 3, 7]}}}}; got keys {list(raw)}'
        )
    return slots


class AdaptiveSlot:
    """EMA state of one batch-size bucket (SGLang's AdaptiveStepSlot)."""

    def __init__(self, initial_steps: int, cfg: SlotConfig) -> None:
        self.cfg = cfg
        cands = cfg.candidate_steps
        self.current_steps = initial_steps if initial_steps in cands else cands[len(cands) // 2]
        self.ema_accept_len = float(self.current_steps - 1)  # accepted drafts, bonus excluded
        self.batch_count = 0

    def update(self, num_correct_drafts_per_req: Sequence[int] | Any) -> bool:
        """Feed one verify's accepted drafts per request; True if the tier changed."""
        n = len(num_correct_drafts_per_req)
        if n == 0:
            return False
        if self.current_steps > 0:
            batch_avg = float(sum(num_correct_drafts_per_req)) / n
            a = self.cfg.ema_alpha
            self.ema_accept_len = (1.0 - a) * self.ema_accept_len + a * batch_avg
        self.batch_count += 1
        if self.batch_count <= self.cfg.warmup_batches:
            return False
        if (self.batch_count - self.cfg.warmup_batches) % self.cfg.update_interval != 0:
            return False
        return self.recompute()

    def batches_to_next_decision(self) -> int:
        """Verify batches until the next tier recomputation (the batch that triggers it
        included)."""
        bc, warm, every = self.batch_count, self.cfg.warmup_batches, self.cfg.update_interval
        if bc < warm:
            return warm + every - bc
        return every - (bc - warm) % every

    def advance(self, batch_means: Any) -> bool:
        """Apply several verify batches at once, given each batch's mean accepted drafts;
        identical to calling `update` once per batch (EMA in closed form between decisions).
        True if the tier changed."""
        means = np.asarray(batch_means, dtype=float)
        changed = False
        a = self.cfg.ema_alpha
        while means.size:
            k = min(self.batches_to_next_decision(), means.size)
            seg, means = means[:k], means[k:]
            if self.current_steps > 0:
                w = a * (1.0 - a) ** np.arange(k - 1, -1, -1)
                self.ema_accept_len = (1.0 - a) ** k * self.ema_accept_len + float(np.dot(w, seg))
            self.batch_count += k
            if self.batches_to_next_decision() == self.cfg.update_interval and (
                self.batch_count > self.cfg.warmup_batches
            ):
                changed |= self.recompute()
        return changed

    def recompute(self) -> bool:
        """Recompute the tier from the EMA (SGLang's _recompute_params); True if it changed."""
        cands = self.cfg.candidate_steps
        old = self.current_steps
        idx = cands.index(old)
        old_idx = idx
        if old == 0:
            # A zero-step interval has no acceptance data: probe the next candidate up.
            idx = min(idx + 1, len(cands) - 1)
            target = cands[idx]
            if target > 0 and self.ema_accept_len < 0:
                self.ema_accept_len = float(target - 1)
            return self._apply(target)
        while idx > 0 and self.ema_accept_len <= self.cfg.drop_to(cands[idx - 1]):
            idx -= 1
        if idx >= old_idx:
            while idx < len(cands) - 1 and self.ema_accept_len > self.cfg.rise_from(cands[idx]):
                idx += 1
        target = cands[idx]
        if self.cfg.ceiling_coeff > 0:
            ceiling = max(1, math.ceil(self.ema_accept_len * self.cfg.ceiling_coeff))
            if ceiling < target <= old:
                while idx > 0 and cands[idx] > ceiling:
                    idx -= 1
                target = cands[idx]
        return self._apply(target)

    def stay_bounds(self) -> tuple[float, float, float]:
        """(lo, hi, ceiling): `recompute` keeps the current tier (> 0) at an EMA e with
        lo < e <= hi and, when ceiling > 0, max(1, ceil(e x ceiling)) >= the tier: the same
        comparisons it makes (the drop to the candidate under it, the rise to the one over it,
        the ceiling on a tier with one under it)."""
        cfg, g = self.cfg, self.current_steps
        cands = cfg.candidate_steps
        idx = cands.index(g)
        lo = cfg.drop_to(cands[idx - 1]) if idx > 0 else -math.inf
        hi = cfg.rise_from(g) if idx < len(cands) - 1 else math.inf
        return lo, hi, cfg.ceiling_coeff if idx > 0 else 0.0

    def _apply(self, target: int) -> bool:
        if target != self.current_steps:
            self.current_steps = target
            return True
        return False


def spec_cuda_graph_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's decode CUDA-graph batch sizes with speculation on (cuda_graph_hook.py):
    1-8, 10-32 step 2, 40-64 step 4, 72-256 step 8, then step 16, plus max_bs itself."""
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


class AdaptiveRule:
    """Routes a batch size to its slot (SGLang's AdaptiveSpeculativeParams).

    `cuda_graph_bs` is the list of captured batch sizes used for padding before routing;
    None means no padding (CUDA graphs disabled)."""

    def __init__(
        self,
        initial_steps: int,
        config: Mapping[str, Any] | None = None,
        cuda_graph_bs: Sequence[int] | None = None,
    ) -> None:
        slots = parse_adaptive_config(config)
        self._bounds = sorted(slots)
        self.slots = {b: AdaptiveSlot(initial_steps, slots[b]) for b in self._bounds}
        self._graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    @property
    def candidate_steps(self) -> list[int]:
        return sorted({s for slot in self.slots.values() for s in slot.cfg.candidate_steps})

    def bucket(self, batch_size: int) -> int:
        """The slot key (batch-size lower bound) a batch of this size is routed to."""
        padded = batch_size
        if self._graph_bs is not None:
            i = bisect.bisect_left(self._graph_bs, batch_size)
            padded = self._graph_bs[i] if i < len(self._graph_bs) else batch_size
        i = bisect.bisect_right(self._bounds, padded) - 1
        return self._bounds[max(0, i)]

    def steps_for_batch(self, batch_size: int) -> int:
        return self.slots[self.bucket(batch_size)].current_steps

    def on_verify_complete(
        self, num_correct_drafts_per_req: Sequence[int] | Any, batch_size: int
    ) -> int | None:
        """Feed one verify; returns the slot's new tier if it changed, else None."""
        slot = self.slots[self.bucket(batch_size)]
        if slot.update(num_correct_drafts_per_req):
            return slot.current_steps
        return None
