"""Non-decode time: the share of wall time a server spends outside decode/verify cycles.

Owns one number and its use: `p`, seconds of non-decode time (prefill/extend steps, scheduling,
idle) per decode token, learned from each window as (window_s - decode seconds) / decode tokens,
where decode seconds are `decode_moments`' sum of step times. The cycle model predicts decode
tokens per decode second, r = B x E[L] / T(B); a window of wall time W holds W / (1/r + p)
decode tokens, so the tok/s a profile delivers is 1 / (1/r + p).

Why one pooled `p` for every profile: prefill work is per request (its prompt, once), and the
decode tokens per request are fixed by the workload, not by the speculation; so prefill seconds
per decode token do not depend on the profile (a speculative server also prefills its draft
model: a few percent more, which this ignores and the policy's margin covers). A faster profile
finishes requests sooner and so spends a larger share of its time in prefill: scaling by a
share learned on another profile would get that wrong, a per-token cost gets it right. `p`
moves with the workload mix (prompt and output lengths), so it is forgotten on the time scale
of the mix.

Must not: decide, read clocks, or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.forgetting import decay
from policies.types import Estimate, Observation


@dataclass
class NonDecodeTime:
    """Forgotten sums of non-decode seconds and decode tokens over recent windows."""

    half_life_s: float = 120.0
    # Minimum decode tokens behind an estimate: below it `per_token_s` is None and predictions
    # stay decode-only (a handful of tokens says nothing about prefill per token).
    min_tokens: float = 200.0
    nondecode_s: float = 0.0
    tokens: float = 0.0
    rejected: int = 0

    def update(self, obs: Observation) -> float | None:
        """Feed one same-profile window; returns its non-decode seconds per decode token, or
        None when the window lacks decode moments or decode tokens (or is impossible)."""
        m = obs.moments
        if m is None or m.n_steps <= 0 or obs.window_s <= 0:
            return None
        tok = m.sum_generated if math.isfinite(m.sum_generated) else math.nan
        if not (tok > 0) and obs.decode_tokens is not None:
            tok = obs.decode_tokens
        if not (math.isfinite(tok) and tok > 0 and math.isfinite(m.sum_step_s)):
            return None
        # Step times are measured on the GPU side and the window on the scraper's clock: a
        # decode-bound window may sum slightly over its length. Clamp at 0 (never negative);
        # a window whose steps exceed it by more than 10% is not one poll window: rejected.
        if m.sum_step_s > 1.1 * obs.window_s:
            self.rejected += 1
            return None
        nd = max(obs.window_s - m.sum_step_s, 0.0)
        lam = decay(obs.window_s, self.half_life_s)
        self.nondecode_s = self.nondecode_s * lam + nd
        self.tokens = self.tokens * lam + tok
        return nd / tok

    def per_token_s(self) -> float | None:
        if self.tokens < self.min_tokens:
            return None
        return self.nondecode_s / self.tokens

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NonDecodeTime:
        return cls(**dict(d))


def wall_rate(decode_rate: float, per_token_s: float | None) -> float:
    """Tok/s over wall time of a profile that decodes `decode_rate` tokens per decode second,
    with `per_token_s` seconds of non-decode time per decode token."""
    if per_token_s is None or per_token_s <= 0 or decode_rate <= 0:
        return decode_rate
    if not math.isfinite(decode_rate):
        return 1.0 / per_token_s
    return 1.0 / (1.0 / decode_rate + per_token_s)


def wall_estimate(e: Estimate, per_token_s: float | None) -> Estimate:
    """`wall_rate` applied to a decode-rate estimate (monotone: the interval maps end to end)."""
    if per_token_s is None or per_token_s <= 0:
        return e
    return Estimate(
        wall_rate(e.mean, per_token_s),
        wall_rate(e.low, per_token_s),
        wall_rate(e.high, per_token_s),
        e.n,
    )
