"""The traffic the server is offered: concurrency (the batch served and the load behind it) and
the workload mix, each restartable from the windows since a detected change.

Owns `Concurrency` and `WorkloadMix` (forgotten sums over recent windows, the last windows kept
as they came so a change point can restart them from where it began).

Must not: decide anything, read clocks (times come in with the data), or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from policies.forgetting import all_finite, decay
from policies.types import Observation

# Workloads below this token share are ignored in the mix (their accept length barely moves the
# harmonic mean, and requiring an estimate for each would stall predictions on rare labels).
MIN_MIX_SHARE = 0.02

# Windows the traffic estimators (concurrency, mix) keep as they came, to restart from the
# windows since a detected change: a CUSUM confirms a change a few windows after it began
# (bench-estimators: within 3), and its start is dated back by as many.
RECENT_WINDOWS = 32


class _RecentWindows:
    """What the traffic estimators (Concurrency, WorkloadMix) share: the last RECENT_WINDOWS
    windows kept as they came, as (t_s, window_s, *what the window added), and `rebase`, which
    restarts the estimate from the windows since a detected change. Each estimator supplies
    `_absorb` (one window in, forgetting the rest), `discount`, and `_set_aside` /
    `_add_back` (its forgotten sums taken out, zeroed, and added back)."""

    recent: list[tuple[Any, ...]]

    def _absorb(self, window_s: float, *added: Any) -> None:
        raise NotImplementedError

    def discount(self, factor: float) -> None:
        raise NotImplementedError

    def _set_aside(self) -> Any:
        raise NotImplementedError

    def _add_back(self, old: Any) -> None:
        raise NotImplementedError

    def _remember(self, t_s: float, window_s: float, *added: Any) -> None:
        self.recent = [*self.recent[-(RECENT_WINDOWS - 1) :], (t_s, window_s, *added)]

    def rebase(self, t_s: float, factor: float) -> int:
        """A detected change whose first window ended at `t_s`: the estimate is that of the
        windows since (a uniform discount would leave it where it was, a blend of two regimes,
        until more windows came), with `factor` of the older data left as a trace. Returns how
        many windows it now rests on."""
        since = [r[1:] for r in self.recent if r[0] >= t_s - 1e-9]
        self.discount(factor)
        if since:
            old = self._set_aside()
            for window_s, *added in since:
                self._absorb(window_s, *added)
            self._add_back(old)
        return len(since)


class Concurrency(_RecentWindows):
    """Batch size being served: step-weighted mean of the moments' batch sizes per window
    (sum_bs / n_steps), else the running-requests gauge; forgotten with a short half-life so it
    describes the traffic now. Beside it the load offered: the batch plus the requests queued
    behind a cap that binds (the running batch at the server's max running requests), which a
    profile with a higher cap would run too; a queue below the cap (requests waiting for their
    prefill, a full KV pool) is none. The last RECENT_WINDOWS windows are kept as they came, so
    a detected change can restart the estimate from the windows since (`rebase`)."""

    def __init__(self, half_life_s: float = 30.0) -> None:
        self.half_life_s = float(half_life_s)
        self.w = 0.0
        self.wb = 0.0
        self.wl = 0.0
        self.last_t_s: float | None = None
        self.recent: list[tuple[float, float, float, float]] = []  # (t_s, window_s, batch, load)

    @staticmethod
    def window_batch(obs: Observation) -> float | None:
        m = obs.moments
        if m is not None and m.n_steps > 0 and all_finite(m.sum_bs, m.n_steps):
            b = m.sum_bs / m.n_steps
            return b if b >= 1.0 - 1e-9 else None
        if obs.running_reqs is not None and math.isfinite(obs.running_reqs):
            return obs.running_reqs
        return None

    @staticmethod
    def window_load(batch: float, obs: Observation, cap: float | None) -> float:
        """The load a window offered: `batch`, plus the queue when the batch is at `cap` (the
        running profile's max running requests; within a request or 5% of it, since
        requests finish and queued ones join between steps)."""
        q = obs.queue_reqs
        if cap is None or q is None or not (0.0 < q < math.inf):
            return batch
        return batch + q if batch >= cap - max(1.0, 0.05 * cap) else batch

    def update(self, obs: Observation, cap: float | None = None) -> tuple[float, float] | None:
        """Absorb a window (`cap`: the running profile's max running requests, None where
        unknown). Returns its (batch, load offered), None without a batch size."""
        b = self.window_batch(obs)
        if b is None:
            return None
        load = self.window_load(b, obs, cap)
        self._absorb(obs.window_s, b, load)
        self.last_t_s = obs.t_s
        self._remember(obs.t_s, obs.window_s, b, load)
        return b, load

    def _absorb(self, window_s: float, b: float, load: float) -> None:
        lam = decay(window_s, self.half_life_s)
        self.w = self.w * lam + 1.0
        self.wb = self.wb * lam + b
        self.wl = self.wl * lam + load

    def estimate(self) -> float | None:
        """The batch size the running profile serves."""
        return self.wb / self.w if self.w > 0 else None

    def load(self) -> float | None:
        """The load offered: what a profile without a binding cap would run."""
        return self.wl / self.w if self.w > 0 else None

    def discount(self, factor: float) -> None:
        """Keep only `factor` of the windows seen so far."""
        f = min(max(factor, 0.0), 1.0)
        self.w *= f
        self.wb *= f
        self.wl *= f

    def _set_aside(self) -> tuple[float, float, float]:
        old = (self.w, self.wb, self.wl)
        self.w = self.wb = self.wl = 0.0
        return old

    def _add_back(self, old: tuple[float, float, float]) -> None:
        self.w += old[0]
        self.wb += old[1]
        self.wl += old[2]

    def to_dict(self) -> dict[str, Any]:
        return {
            "half_life_s": self.half_life_s,
            "w": self.w,
            "wb": self.wb,
            "wl": self.wl,
            "last_t_s": self.last_t_s,
            "recent": [list(r) for r in self.recent],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Concurrency:
        """Also reads states saved before the offered load was kept (it was the batch then)."""
        obj = cls(d["half_life_s"])
        obj.w, obj.wb, obj.last_t_s = float(d["w"]), float(d["wb"]), d.get("last_t_s")
        obj.wl = float(d.get("wl", obj.wb))
        obj.recent = [
            (float(r[0]), float(r[1]), float(r[2]), float(r[3] if len(r) > 3 else r[2]))
            for r in d.get("recent", [])
        ]
        return obj


class WorkloadMix(_RecentWindows):
    """Generated-token share per workload over recent windows (profile-independent: a request
    produces the same tokens whatever the speculation), and the finished requests behind them
    (forgotten alike: how precisely the shares are known). The last RECENT_WINDOWS windows are
    kept as they came, so a detected change can restart the shares from the windows since
    (`rebase`)."""

    def __init__(self, half_life_s: float = 120.0) -> None:
        self.half_life_s = float(half_life_s)
        self.tokens: dict[str, float] = {}
        self.requests = 0.0
        # Whether the last window with tokens counted its finished requests (SGLang's
        # num_requests_total); without counts the shares' precision is unknown, not zero.
        self.counts_requests = False
        # (t_s, window_s, tokens per workload, finished requests)
        self.recent: list[tuple[float, float, dict[str, float], float]] = []

    def update(self, obs: Observation) -> None:
        adds: dict[str, float] = {}
        req = 0.0
        counted = True
        for w in obs.workloads:
            g = w.generation_tokens
            if g is not None and math.isfinite(g) and g > 0:
                adds[w.workload] = adds.get(w.workload, 0.0) + float(g)
                r = w.requests
                if r is None or not math.isfinite(r):
                    counted = False
                elif r > 0:
                    req += float(r)
        if adds:
            self.counts_requests = counted
        self._absorb(obs.window_s, adds, req)
        self._remember(obs.t_s, obs.window_s, adds, req)

    def _absorb(self, window_s: float, adds: Mapping[str, float], requests: float) -> None:
        lam = decay(window_s, self.half_life_s)
        for k in self.tokens:
            self.tokens[k] *= lam
        for k, g in adds.items():
            self.tokens[k] = self.tokens.get(k, 0.0) + g
        self.requests = self.requests * lam + requests
        # Drop workloads that have faded out entirely: keeps the state small and JSON bounded.
        self.tokens = {k: v for k, v in self.tokens.items() if v > 1e-6}

    def discount(self, factor: float) -> None:
        """Keep only `factor` of the tokens (and requests) seen so far."""
        f = min(max(factor, 0.0), 1.0)
        self.tokens = {k: v * f for k, v in self.tokens.items()}
        self.requests *= f

    def _set_aside(self) -> tuple[dict[str, float], float]:
        old = (self.tokens, self.requests)
        self.tokens, self.requests = {}, 0.0
        return old

    def _add_back(self, old: tuple[dict[str, float], float]) -> None:
        for k, v in old[0].items():
            self.tokens[k] = self.tokens.get(k, 0.0) + v
        self.requests += old[1]

    def shares(self) -> dict[str, float]:
        tot = sum(self.tokens.values())
        if tot <= 0:
            return {}
        return {k: v / tot for k, v in sorted(self.tokens.items()) if v / tot >= MIN_MIX_SHARE}

    def to_dict(self) -> dict[str, Any]:
        return {
            "half_life_s": self.half_life_s,
            "tokens": dict(self.tokens),
            "requests": self.requests,
            "counts_requests": self.counts_requests,
            "recent": [[t, w, dict(a), r] for t, w, a, r in self.recent],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkloadMix:
        obj = cls(d["half_life_s"])
        obj.tokens = {k: float(v) for k, v in d["tokens"].items()}
        obj.requests = float(d.get("requests", 0.0))
        obj.counts_requests = bool(d.get("counts_requests", False))
        obj.recent = [
            (float(t), float(w), {k: float(v) for k, v in a.items()}, float(r))
            for t, w, a, r in d.get("recent", [])
        ]
        return obj
