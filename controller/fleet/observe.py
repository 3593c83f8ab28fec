"""Fleet observation: every replica scraped each tick, per-replica windows, fleet-wide views.

Owns the per-replica previous snapshots (controller.observe.scrape + policies.observation.diff,
the same code as for one server, one pair per replica), the "mean replica" Observation that the
deployment's one policy state learns from (replicas of a deployment are the same hardware and
model, so their windows are samples of one surface: averaged, a window keeps the batch size of
one replica, which is what the cycle-time surface is indexed by), fleet totals for display, and
the conversion of a replica's window into the canary test's ArmWindow. Must not decide or act.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx

from controller.observe import ObserveError, scrape
from policies.canary import ArmWindow
from policies.observation import diff
from policies.types import DecodeMoments, Observation, Snapshot, WorkloadWindow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaObservation:
    """One replica's last tick: its window (None on the first scrape after a start, or when the
    scrape failed: then `error` says why)."""

    replica: str
    profile: str | None
    obs: Observation | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.obs is not None


class FleetObserver:
    """Scrapes every replica; keeps one previous snapshot per replica."""

    def __init__(self, client: httpx.AsyncClient, urls: Mapping[str, str]) -> None:
        self.client = client
        self.urls = dict(urls)
        self.prev: dict[str, Snapshot] = {}

    def forget(self, replica: str) -> None:
        """The replica restarted: its counters start again, the next window starts afresh."""
        self.prev.pop(replica, None)

    async def observe(
        self, profiles: Mapping[str, str | None], now_s: float
    ) -> dict[str, ReplicaObservation]:
        """Scrape every replica whose profile is known (concurrently) at the same `now_s`, so
        that windows of one tick line up (the canary test pairs them by their end time)."""

        async def one(name: str) -> ReplicaObservation:
            profile = profiles.get(name)
            if profile is None:
                self.prev.pop(name, None)
                return ReplicaObservation(name, None, None, "profile unknown (down or starting)")
            try:
                snap = await scrape(self.client, self.urls[name], profile=profile, t_s=now_s)
            except ObserveError as e:
                return ReplicaObservation(name, profile, None, str(e))
            prev = self.prev.get(name)
            self.prev[name] = snap
            return ReplicaObservation(name, profile, replica_window(prev, snap))

        results = await asyncio.gather(*(one(n) for n in self.urls))
        return {r.replica: r for r in results}


def replica_window(prev: Snapshot | None, snap: Snapshot) -> Observation | None:
    """One replica's window between two scrapes; None on its first scrape after a start, after
    a profile change, or when the clock did not move (pure: the bench's fleet replay uses it)."""
    if prev is None or prev.profile != snap.profile or snap.t_s <= prev.t_s:
        return None
    return diff(prev, snap)


def _mean(vals: Sequence[float | None]) -> float | None:
    known = [v for v in vals if v is not None]
    return sum(known) / len(known) if known else None


def _per_replica(vals: Sequence[float | None], n: int) -> float | None:
    """Sum over replicas divided by the replica count (None when no replica reported it)."""
    known = [v for v in vals if v is not None]
    return sum(known) / n if known else None


def _weighted(vals: Sequence[float | None], weights: Sequence[float | None]) -> float | None:
    pairs = [(v, w) for v, w in zip(vals, weights, strict=True) if v is not None and w]
    total = sum(w for _, w in pairs)
    if pairs and total > 0:
        return sum(v * w for v, w in pairs) / total
    return _mean(vals)


def mean_replica(observations: Sequence[Observation]) -> Observation | None:
    """The average replica over one tick: counters summed over replicas and divided by their
    number, gauges averaged (accept length weighted by verify calls). All observations must be
    of the same profile; None for an empty list."""
    obs = list(observations)
    if not obs:
        return None
    profiles = {o.profile for o in obs}
    if len(profiles) != 1:
        raise ValueError(f"mean_replica needs one profile, got {sorted(profiles)}")
    n = len(obs)
    moments = [o.moments for o in obs]
    mom: DecodeMoments | None = None
    if all(m is not None for m in moments):
        ms = [m for m in moments if m is not None]
        mom = DecodeMoments(
            n_steps=sum(m.n_steps for m in ms) / n,
            sum_bs=sum(m.sum_bs for m in ms) / n,
            sum_step_s=sum(m.sum_step_s for m in ms) / n,
            sum_bs2=sum(m.sum_bs2 for m in ms) / n,
            sum_bs_step_s=sum(m.sum_bs_step_s for m in ms) / n,
            sum_generated=sum(m.sum_generated for m in ms) / n,
        )
    names = sorted({w.workload for o in obs for w in o.workloads})
    workloads = tuple(
        WorkloadWindow(
            workload=name,
            generation_tokens=_per_replica(
                [w.generation_tokens for o in obs for w in o.workloads if w.workload == name], n
            ),
            verify_calls=_per_replica(
                [w.verify_calls for o in obs for w in o.workloads if w.workload == name], n
            ),
            requests=_per_replica(
                [w.requests for o in obs for w in o.workloads if w.workload == name], n
            ),
        )
        for name in names
    )
    hists = [o.accepted_drafts_hist for o in obs]
    hist: tuple[float, ...] | None = None
    if all(h is not None for h in hists) and len({len(h or ()) for h in hists}) == 1:
        hist = tuple(sum(col) / n for col in zip(*[h for h in hists if h], strict=True))
    verify = [o.verify_calls for o in obs]
    return Observation(
        t_s=max(o.t_s for o in obs),
        window_s=sum(o.window_s for o in obs) / n,
        profile=obs[0].profile,
        running_reqs=_mean([o.running_reqs for o in obs]),
        queue_reqs=_mean([o.queue_reqs for o in obs]),
        max_running_reqs=_mean([o.max_running_reqs for o in obs]),
        gen_throughput_tok_s=_mean([o.gen_throughput_tok_s for o in obs]),
        spec_accept_length=_weighted([o.spec_accept_length for o in obs], verify),
        spec_accept_rate=_weighted([o.spec_accept_rate for o in obs], verify),
        spec_num_steps=_mean([o.spec_num_steps for o in obs]),
        generation_tokens=_per_replica([o.generation_tokens for o in obs], n),
        verify_calls=_per_replica(verify, n),
        decode_tokens=_per_replica([o.decode_tokens for o in obs], n),
        decode_passes=_per_replica([o.decode_passes for o in obs], n),
        moments=mom,
        workloads=workloads,
        accepted_drafts_hist=hist,
        counter_reset=any(o.counter_reset for o in obs),
        # A rolling restart waits for each batch's slowest boot.
        startup_s=max((o.startup_s for o in obs if o.startup_s is not None), default=None),
    )


def output_tokens(o: Observation) -> float | None:
    """Output tokens of a window: the scheduler's decode counter, else the tokenizer's."""
    if o.decode_tokens is not None:
        return o.decode_tokens
    return o.generation_tokens


def mean_running(o: Observation) -> float | None:
    """Requests in flight while decoding, time-weighted over the window's decode steps (from the
    decode moments), else the gauge at the end of the window."""
    m = o.moments
    if m is not None and m.sum_step_s > 0:
        return m.sum_bs_step_s / m.sum_step_s
    return o.running_reqs


def finished_requests(o: Observation) -> float | None:
    vals = [w.requests for w in o.workloads if w.requests is not None]
    return sum(vals) if vals else None


def arm_window(replica: str, arm: str, o: Observation) -> ArmWindow | None:
    """The canary test's view of one replica's window (None when it lacks tokens or a batch).
    With decode moments: tokens generated in decode steps over the request-seconds of those
    steps (sum of batch x step time), so time a replica sits idle between requests (a faster
    one idles more under closed-loop clients) does not count against it. Without them: output
    tokens over the end-of-window running gauge x window length. Requests waiting in the queue
    (those a capped batch keeps out) are in the server too: the queue gauge over the same
    seconds."""
    if o.counter_reset:
        return None
    m = o.moments
    if m is not None and m.sum_bs_step_s > 0 and m.sum_generated > 0:
        tok, req_s, decode_s = m.sum_generated, m.sum_bs_step_s, m.sum_step_s
    else:
        out, running = output_tokens(o), o.running_reqs
        if out is None or running is None:
            return None
        tok, req_s, decode_s = out, running * o.window_s, o.window_s
    q = o.queue_reqs
    queued = q if q is not None and math.isfinite(q) and q > 0 else 0.0
    running_mean = mean_running(o)
    return ArmWindow(
        arm=arm,
        replica=replica,
        t_s=o.t_s,
        window_s=o.window_s,
        output_tokens=tok,
        request_seconds=req_s,
        running_reqs=running_mean if running_mean is not None else 0.0,
        requests=finished_requests(o),
        queued_seconds=queued * decode_s,
    )


@dataclass(frozen=True)
class FleetTotals:
    """Fleet-wide numbers of one tick, for display and the record."""

    replicas_observed: int
    output_tok_s: float | None
    running_reqs: float | None

    @classmethod
    def of(cls, windows: Mapping[str, ReplicaObservation]) -> FleetTotals:
        obs = [w.obs for w in windows.values() if w.obs is not None]
        rates = [o.output_tok_s for o in obs]
        running = [mean_running(o) for o in obs]
        known_rates = [r for r in rates if r is not None]
        known_running = [r for r in running if r is not None]
        return cls(
            len(obs),
            sum(known_rates) if known_rates else None,
            sum(known_running) if known_running else None,
        )
