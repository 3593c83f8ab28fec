"""Two Snapshots -> one Observation: counter deltas with reset detection, per workload.

Owns the one piece of code that turns cumulative server state into a poll window (the daemon and
the benchmark both call `diff`). Rules:
- A counter that went backwards means the server restarted inside the window: every counter
  began again at 0, so the whole window is a reset window (`counter_reset=True`) and each delta is
  the current value. (SGLang restarts all its counters together; mixing per-counter rules would
  pair tokens of one boot with verify calls of another.)
- Missing stays missing: a counter absent (or non-finite, or negative) on either side gives None,
  never 0. A workload series present now but not before began at 0 inside the window (Prometheus
  creates labelled series on first use), unless the previous snapshot reported no series at all
  for that counter (then the source was not reporting, and the delta is unknown: None).
- Gauges are the current snapshot's values (non-finite -> None).
- A profile change between the two snapshots is not a same-profile window: `diff` returns an
  Observation for the current profile with `counter_reset=True` and no counter deltas at all
  (every delta None, no workloads, no moments, no histogram); gauges still come from `cur`.

Must not: estimate, smooth, or judge (the estimator modules do); read clocks; do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from policies.types import DecodeMoments, Observation, Snapshot, WorkloadWindow


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _counter(x: float | None) -> float | None:
    if type(x) is float:  # the common case, without _finite's conversion (NaN compares False)
        return x if 0.0 <= x < math.inf else None
    v = _finite(x)
    return v if v is not None and v >= 0.0 else None


def _went_back(prev: float | None, cur: float | None) -> bool:
    if type(prev) is float and type(cur) is float:  # both counters, the later one lower
        return 0.0 <= cur < prev < math.inf  # (NaN compares False)
    p, c = _counter(prev), _counter(cur)
    return p is not None and c is not None and c < p


def _delta(prev: float | None, cur: float | None, reset: bool) -> float | None:
    c = _counter(cur)
    if c is None:
        return None
    if reset:
        return c
    p = _counter(prev)
    if p is None:
        return None
    return c - p


def _map_delta(
    prev: Mapping[str, float], cur: Mapping[str, float], key: str, reset: bool
) -> float | None:
    if key not in cur:
        return None
    c = _counter(cur[key])
    if c is None:
        return None
    if reset:
        return c
    if key in prev:
        return _delta(prev[key], c, False)
    # A new labelled series starts at 0, but only if the source reported this counter before.
    return c if prev else None


def _any_went_back(prev: Snapshot, cur: Snapshot) -> bool:
    scalars = (
        (prev.decode_tokens, cur.decode_tokens),
        (prev.decode_passes, cur.decode_passes),
    )
    if any(_went_back(p, c) for p, c in scalars):
        return True
    for pm, cm in (
        (prev.generation_tokens, cur.generation_tokens),
        (prev.verify_calls, cur.verify_calls),
        (prev.requests, cur.requests),
    ):
        if any(_went_back(pm[k], cm[k]) for k in cm.keys() & pm.keys()):
            return True
    # Every decode_moments component (n_steps, sums of B, step_s, B^2, ...) is monotone.
    if (
        prev.moments is not None
        and cur.moments is not None
        and any(_went_back(p, c) for p, c in zip(prev.moments, cur.moments, strict=False))
    ):
        return True
    pa, ca = prev.accepted_drafts_hist, cur.accepted_drafts_hist
    if pa is not None and ca is not None and len(pa) == len(ca):
        return any(_went_back(p, c) for p, c in zip(pa, ca, strict=True))
    return False


def _moments_delta(
    prev: tuple[float, ...] | None, cur: tuple[float, ...] | None, reset: bool
) -> DecodeMoments | None:
    if cur is None or len(cur) != 6:
        return None
    if reset:
        vals = [_counter(c) for c in cur]
    else:
        if prev is None or len(prev) != 6:
            return None
        vals = [_delta(p, c, False) for p, c in zip(prev, cur, strict=True)]
    if any(v is None for v in vals):
        return None
    n, sb, ss, sb2, sbs, sg = (float(v) for v in vals if v is not None)
    return DecodeMoments(
        n_steps=n, sum_bs=sb, sum_step_s=ss, sum_bs2=sb2, sum_bs_step_s=sbs, sum_generated=sg
    )


def _hist_delta(
    prev: tuple[float, ...] | None, cur: tuple[float, ...] | None, reset: bool
) -> tuple[float, ...] | None:
    if cur is None:
        return None
    cvals = [_counter(c) for c in cur]
    if any(v is None for v in cvals):
        return None
    if reset:
        return tuple(float(v) for v in cvals if v is not None)
    # A histogram of another shape belongs to another chain length: not a delta.
    if prev is None or len(prev) != len(cur):
        return None
    out = [_delta(p, c, False) for p, c in zip(prev, cur, strict=True)]
    if any(v is None for v in out):
        return None
    return tuple(float(v) for v in out if v is not None)


def _sum_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(sum(known)) if known else None


def diff(prev: Snapshot, cur: Snapshot) -> Observation:
    """The poll window between two snapshots of the same server (see the module docstring).

    Raises ValueError when `cur` is not later than `prev`."""
    t0, t1 = _finite(prev.t_s), _finite(cur.t_s)
    if t0 is None or t1 is None:
        raise ValueError(f"snapshot times must be finite, got {prev.t_s!r} and {cur.t_s!r}")
    if t1 <= t0:
        raise ValueError(f"snapshots out of order: cur.t_s={t1} is not after prev.t_s={t0}")
    gauges = {
        "running_reqs": _counter(cur.running_reqs),
        "queue_reqs": _counter(cur.queue_reqs),
        "max_running_reqs": _counter(cur.max_running_reqs),
        "gen_throughput_tok_s": _counter(cur.gen_throughput_tok_s),
        "spec_accept_length": _counter(cur.spec_accept_length),
        "spec_accept_rate": _counter(cur.spec_accept_rate),
        "spec_num_steps": _counter(cur.spec_num_steps),
        "startup_s": _counter(cur.startup_s),
    }
    if prev.profile != cur.profile:
        return Observation(
            t_s=t1, window_s=t1 - t0, profile=cur.profile, counter_reset=True, **gauges
        )

    reset = _any_went_back(prev, cur)
    keys = sorted(
        set(cur.generation_tokens)
        | set(cur.verify_calls)
        | set(cur.requests)
        | set(prev.generation_tokens)
        | set(prev.verify_calls)
        | set(prev.requests)
    )
    workloads = tuple(
        WorkloadWindow(
            workload=k,
            generation_tokens=_map_delta(prev.generation_tokens, cur.generation_tokens, k, reset),
            verify_calls=_map_delta(prev.verify_calls, cur.verify_calls, k, reset),
            requests=_map_delta(prev.requests, cur.requests, k, reset),
        )
        for k in keys
    )
    return Observation(
        t_s=t1,
        window_s=t1 - t0,
        profile=cur.profile,
        generation_tokens=_sum_or_none([w.generation_tokens for w in workloads]),
        verify_calls=_sum_or_none([w.verify_calls for w in workloads]),
        decode_tokens=_delta(prev.decode_tokens, cur.decode_tokens, reset),
        decode_passes=_delta(prev.decode_passes, cur.decode_passes, reset),
        moments=_moments_delta(prev.moments, cur.moments, reset),
        workloads=workloads,
        accepted_drafts_hist=_hist_delta(
            prev.accepted_drafts_hist, cur.accepted_drafts_hist, reset
        ),
        counter_reset=reset,
        **gauges,
    )
