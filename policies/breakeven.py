"""Break-even accept length and the tok/s <-> accept length relations (docs/FIELD.md).

Owns the closed-form arithmetic that links a speculative profile's accept length and cycle time
to the throughput of the baseline. Speculation pays when accept_len / cycle_s > baseline tok/s per
sequence, so the break-even accept length is baseline_tok_s x cycle_s. At a batch size B the
baseline serves B / T_base(B) tok/s and a speculative profile B x E[L] / T_cycle(B), so the
batch-size variant is T_cycle(B) / T_base(B).

Must not: estimate anything (the estimator modules do), or know about profiles or decisions. Accept
lengths here always count accepted drafts + the bonus token (SGLang's `spec_accept_length`).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray


def _positive(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return v


def breakeven_accept_length(baseline_tok_s: float, cycle_s: float) -> float:
    """Accept length (drafts + bonus) at which a profile with cycle time `cycle_s` matches a
    single-stream baseline of `baseline_tok_s`: 82 tok/s at 30 ms -> 2.46."""
    return _positive("baseline_tok_s", baseline_tok_s) * _positive("cycle_s", cycle_s)


def accept_length_for(target_tok_s: float, cycle_s: float) -> float:
    """Accept length one stream needs to reach `target_tok_s` at `cycle_s` per verify cycle:
    100 tok/s at 30 ms -> 3.0, 120 tok/s -> 3.6."""
    return _positive("target_tok_s", target_tok_s) * _positive("cycle_s", cycle_s)


def tok_s_for(accept_length: float, cycle_s: float, batch: float = 1.0) -> float:
    """Throughput of `batch` sequences that each emit `accept_length` tokens per `cycle_s`."""
    return (
        _positive("batch", batch)
        * _positive("accept_length", accept_length)
        / _positive("cycle_s", cycle_s)
    )


def breakeven_accept_length_batch(
    baseline_step_s: ArrayLike, cycle_s: ArrayLike
) -> NDArray[np.float64]:
    """Per batch size: the accept length at which B x L / T_cycle(B) equals B / T_base(B), i.e.
    T_cycle(B) / T_base(B) (baseline tok/s per sequence x cycle time at that batch size).
    Arrays broadcast; non-positive or non-finite inputs raise."""
    base = np.asarray(baseline_step_s, dtype=np.float64)
    cyc = np.asarray(cycle_s, dtype=np.float64)
    if not (np.all(np.isfinite(base)) and np.all(base > 0)):
        raise ValueError("baseline_step_s must be finite and positive")
    if not (np.all(np.isfinite(cyc)) and np.all(cyc > 0)):
        raise ValueError("cycle_s must be finite and positive")
    return np.asarray(cyc / base, dtype=np.float64)


def accept_length_for_batch(
    target_tok_s: ArrayLike, batch: ArrayLike, cycle_s: ArrayLike
) -> NDArray[np.float64]:
    """Per batch size: accept length needed for `target_tok_s` in total over `batch` sequences
    at `cycle_s` per cycle: target x cycle / B. Arrays broadcast."""
    tgt = np.asarray(target_tok_s, dtype=np.float64)
    b = np.asarray(batch, dtype=np.float64)
    cyc = np.asarray(cycle_s, dtype=np.float64)
    for name, arr in (("target_tok_s", tgt), ("batch", b), ("cycle_s", cyc)):
        if not (np.all(np.isfinite(arr)) and np.all(arr > 0)):
            raise ValueError(f"{name} must be finite and positive")
    return np.asarray(tgt * cyc / b, dtype=np.float64)
