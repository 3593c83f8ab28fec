"""The fleet's control loop: one deployment, N replicas, one policy state, canaries and rollouts.

Owns, per deployment: the running profile, the one PolicyState every replica's windows feed
(through the mean replica: the replicas are the same hardware and model), the canary in progress,
and the moves: when the policy asks for a switch, the candidate first runs on the canary replica
(controller.fleet.canary judges it on the router's own traffic), then is promoted by a rolling
switch or rolled back; with canaries off (or one replica) the switch rolls through directly.
A replica that died outside a switch is started again. Advisory mode decides and never acts.
Decides nothing itself (policies.decide and policies.canary do) and does no HTTP of its own
(controller.fleet.observe and controller.fleet.actuator do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from controller import adaptive_tables
from controller.actuators.base import SwitchOutcome, SwitchResult
from controller.clock import Clock
from controller.fleet.actuator import FleetActuator
from controller.fleet.canary import CanaryTrial, could_judge
from controller.fleet.observe import (
    FleetObserver,
    FleetTotals,
    ReplicaObservation,
    mean_replica,
    output_tokens,
)
from controller.fleet.settings import FleetSettings
from controller.settings import Settings, policy_settings
from policies import decide as policy
from policies.canary import CanaryVerdict, Verdict
from policies.hybrid_decide import rewrites_table
from policies.types import Action, Decision, Mode, Observation, Overrides, Reason

log = logging.getLogger("specpilot.fleet")


@dataclass(frozen=True)
class FleetTick:
    t_s: float
    running: str | None
    replicas: dict[str, str | None]  # name -> profile
    totals: FleetTotals
    action: str  # hold | canary | promote | rollback | rolling | restart
    detail: str


@dataclass(frozen=True)
class CanaryRecord:
    candidate: str
    current: str
    verdict: CanaryVerdict | None
    outcome: str  # promoted | rolled_back | start_failed | crashed
    t_s: float


@dataclass
class FleetRecord:
    ticks: deque[FleetTick] = field(default_factory=lambda: deque(maxlen=720))
    canaries: list[CanaryRecord] = field(default_factory=list)
    switches: list[SwitchResult] = field(default_factory=list)
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=720))


def deployment_window(
    windows: Mapping[str, ReplicaObservation], running: str
) -> Observation | None:
    """What the deployment's one policy state learns from in a tick: the mean replica over the
    replicas that have a window of the deployment's profile (a canary's window is not one) and
    served in it. A replica the router sent nothing (fewer streams than replicas) would add
    window seconds without a decode step, which the policy would learn as non-decode time per
    token of every profile (4 replicas, one stream: 0.1 s a token, 30x the truth, and every
    profile predicted at ~8 tok/s whatever its decode rate). When none served, all of them
    (an idle window: the policy holds).

    Its queue is dropped (unknown) in a tick where some replica has no window (restarting, or
    its first scrape after a start): the router sent that replica's clients to the others, whose
    queues then hold them too (one of 2 replicas down: 3x the queue behind the cap), which is
    not the load the deployment offers each replica."""
    mine = [w.obs for w in windows.values() if w.obs is not None and w.profile == running]
    served = [o for o in mine if (output_tokens(o) or 0.0) > 0.0]
    obs = mean_replica(served or mine)
    if obs is not None and any(w.obs is None for w in windows.values()):
        obs = replace(obs, queue_reqs=None)
    return obs


def plan_move(
    d: Decision,
    running: str,
    forced: str | None,
    rejected: Mapping[str, float],
    now_s: float,
    fleet: FleetSettings,
    replicas: int,
    mode: Mode,
    canary_traffic: Callable[[], bool] | None = None,
    unjudged: Mapping[str, float] | None = None,
) -> tuple[str, str | None, str]:
    """What the fleet does with one decision (pure; the bench's fleet replay uses it too):
    ("hold", None, why), ("canary", target, why), ("rollout", target, why) or ("rewrite",
    running, why). A candidate whose canary was rolled back is not tried again for
    canary.retry_after_s (an operator's forced canary is); advisory mode never acts; canaries
    need at least two replicas. A switch to the running adaptive profile that rewrites its
    table (policies.hybrid_decide judged that the restart repays) restarts every replica on
    the same profile, rolling, with no canary: a canary compares two profiles' windows, and
    the new table is the same profile's. `canary_traffic` is asked only when a canary would
    start: False (the canary replica, or every other, served no usable traffic in the last
    window: canary.could_judge) rolls the policy's switch straight through, as with canaries
    off: a canary there could only run out of time unjudged; the policy's own trial judges the
    switch, as on one server. An operator's forced canary still runs. So does a candidate
    whose last canary was rolled back unjudged (`unjudged`: its time ran out before enough
    traffic to compare) within canary.retry_after_s: a second canary could run out of time the
    same way (traffic that comes and goes), and the switch is no less the policy's."""
    target = forced or (d.profile if d.action is Action.SWITCH else None)
    rewrite = forced is None and target == running and rewrites_table(d)
    if target is None or (target == running and not rewrite):
        return "hold", None, d.reason.value
    if mode is Mode.ADVISORY:
        what = f"rewrite {target}'s adaptive table" if rewrite else f"try {target}"
        return "hold", None, f"advisory: would {what} ({d.reason.value})"
    if rewrite:
        return "rewrite", target, d.reason.value

    def recent(rolled_back: Mapping[str, float] | None) -> float | None:
        """Seconds since `target`'s canary was rolled back, within retry_after_s (else None;
        an operator's forced canary is never held back)."""
        since = (rolled_back or {}).get(target)
        if forced is not None or since is None or now_s - since >= fleet.canary.retry_after_s:
            return None
        return now_s - since

    if (ago := recent(rejected)) is not None:
        return "hold", None, f"{target}'s canary was rolled back {ago:.0f} s ago"
    if fleet.canary.enabled and replicas >= 2:
        if forced is None and canary_traffic is not None and not canary_traffic():
            return "rollout", target, f"{d.reason.value} (no canary: its replica has no traffic)"
        if recent(unjudged) is not None:
            return "rollout", target, f"{d.reason.value} (no canary: its last ran out unjudged)"
        return "canary", target, d.reason.value
    return "rollout", target, d.reason.value


def note_rollback(
    rejected: dict[str, float],
    unjudged: dict[str, float],
    target: str,
    verdict: CanaryVerdict | None,
    now_s: float,
) -> bool:
    """Record a canary of `target` rolled back at `now_s` in the map plan_move reads for it
    (`rejected`, or `unjudged` when the verdict judged nothing: out of time without traffic to
    compare) and return whether it was judged (a canary that did not start, `verdict` None, is:
    the policy backs a judged candidate off as a failed start)."""
    judged = verdict is None or not verdict.unjudged
    (rejected if judged else unjudged)[target] = now_s
    return judged


class FleetController:
    def __init__(
        self,
        settings: Settings,
        fleet: FleetSettings,
        *,
        clock: Clock,
        client: httpx.AsyncClient,
        actuator: FleetActuator | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.clock = clock
        self.client = client
        self.actuator = actuator or FleetActuator(settings, fleet, clock, client)
        self.observer = FleetObserver(client, {r.name: r.url for r in self.actuator.replicas})
        self.specs = settings.profile_specs()
        self.psettings = fleet.policy_settings(policy_settings(settings))
        self.mode: Mode = settings.controller.mode
        self.overrides = Overrides(mode=self.mode)
        self.running: str | None = None
        self.state: policy.PolicyState | None = None
        self.canary: CanaryTrial | None = None
        self.rejected: dict[str, float] = {}  # candidate -> when its canary was rolled back
        self.unjudged: dict[str, float] = {}  # ... rolled back unjudged (out of time, no traffic)
        self.record = FleetRecord()
        self.last: dict[str, ReplicaObservation] = {}
        self.busy = False  # a switch is in flight (ticks observe only)
        self._on_tick: list[Callable[[FleetController], None]] = []
        # What each managed adaptive table file last held (adaptive_tables.sync).
        self._tables_written: dict[Path, str] = {}
        self._forced: str | None = None

    # ------------------------------------------------------------------ lifecycle

    async def startup(self) -> None:
        """The router up, every replica up and registered, all on one profile."""
        if not await self.actuator.wait_router():
            raise RuntimeError(f"router {self.actuator.router.base_url} does not answer")
        probe = await self.actuator.probe()
        first = probe.profile or self.settings.server.initial_profile
        result = await self.actuator.start(first)
        if result.outcome is SwitchOutcome.REFUSED_BUSY:
            # Replicas up on other profiles (a canary left by an earlier controller): roll them.
            log.warning("replicas disagree (%s): rolling them to %s", probe.detail, first)
            rolled = await self.actuator.rolling_switch(first)
            # Why start refused comes first: what the roll met (no slot, say) follows from it.
            error = f"{result.error}; rolling them to {first}: {rolled.error}"
            result = rolled if rolled.ok else replace(rolled, error=error)
        if not result.ok:
            raise RuntimeError(f"fleet could not start {first}: {result.error}")
        self.running = first
        self.state = policy.initial_state(
            self.specs,
            first,
            self.clock.now(),
            self.psettings,
            adaptive_tables=adaptive_tables.initial_tables(self.settings),
        )
        if probe.profile is None:
            # The replicas' boots were seen, not a fleet found serving: the dwell follows them.
            policy.on_start_up(self.state, self.clock.now())
        log.info(
            "fleet up: %d replicas on %s behind %s",
            len(self.actuator.replicas),
            first,
            self.actuator.router.base_url,
        )

    async def shutdown(self) -> None:
        """Stop what this fleet owns (replicas with owns_server, a router specpilot launched).
        Advisory mode stops no replica it adopted, as on one server: it only decides."""
        await self.actuator.shutdown(adopted=self.mode is not Mode.ADVISORY)

    # ------------------------------------------------------------------ operator ops

    def request_canary(self, profile: str) -> None:
        """Try `profile` as a canary at the next tick (an operator's or the demo's request)."""
        if profile not in self.settings.profiles:
            raise KeyError(profile)
        self._forced = profile

    # ------------------------------------------------------------------ the tick

    def _profiles(self) -> dict[str, str | None]:
        return {r.name: (None if r.out else r.profile) for r in self.actuator.replicas}

    async def tick(self) -> FleetTick:
        assert self.state is not None and self.running is not None, "startup() first"
        now = self.clock.now()
        windows = await self.observer.observe(self._profiles(), now)
        self.last = windows
        totals = FleetTotals.of(windows)
        action, detail = "hold", ""
        if (router := await self._check_router()) is not None:
            action, detail = router
        elif not await self.actuator.alive():
            action, detail = await self._restart_dead()
        elif self.canary is not None:
            action, detail = await self._canary_step(windows, now)
        else:
            action, detail = await self._decide(windows, now)
        t = FleetTick(now, self.running, self._profiles(), totals, action, detail)
        self.record.ticks.append(t)
        for cb in self._on_tick:
            cb(self)
        return t

    async def _check_router(self) -> tuple[str, str] | None:
        """The router between switches: None when it answers and lists every ready replica
        (registering those a restarted router lost). One specpilot launched and that died is
        launched again here, not at the next switch: until then no client reaches the fleet.
        Advisory mode only reports it."""
        base = self.actuator.router.base_url
        if self.mode is Mode.ADVISORY:
            if await self.actuator.router.alive():
                return None
            return "hold", f"router {base} does not answer (advisory: not relaunched)"
        relaunches = self.actuator.log.router_relaunches
        if not await self.actuator.ensure_router():
            log.error("router %s does not answer%s", base, self.actuator.router_failure())
            return "hold", f"router {base} does not answer"
        if self.actuator.log.router_relaunches > relaunches:
            return "restart", f"relaunched the router {base} and registered the ready replicas"
        return None

    async def _restart_dead(self) -> tuple[str, str]:
        """Start every dead replica again on the deployment's profile. A canary whose replica
        died ends there: its replica comes back on the current profile, so the trial could only
        run out of time without a window (holding every decision meanwhile). The candidate
        crashed under the fleet's traffic: it is backed off as after a failed start."""
        assert self.running is not None
        if self.mode is Mode.ADVISORY:
            return "hold", "a replica is down (advisory: not restarted)"
        trial = self.canary
        crashed = trial is not None and not await self.actuator.canary.actuator.alive()
        result = await self.actuator.start(self.running)
        for r in self.actuator.replicas:
            self.observer.forget(r.name)  # counters of a restarted replica start from 0
        detail = f"restarted dead replicas: {result.outcome.value} {result.error or ''}".strip()
        if trial is None or not crashed:
            return "restart", detail
        self.canary = None
        self._canary_failed(trial.candidate, None, "crashed", self.clock.now())
        log.error("canary %s: %s died; %s", trial.candidate, trial.replica, detail)
        return "rollback", f"canary {trial.candidate} ended: {trial.replica} died; {detail}"

    async def _decide(self, windows: dict[str, ReplicaObservation], now: float) -> tuple[str, str]:
        assert self.state is not None and self.running is not None
        obs = deployment_window(windows, self.running)
        failed = all(w.error is not None for w in windows.values())
        forced, self._forced = self._forced, None
        if obs is None and not failed and forced is None:
            return "hold", "waiting for a window on every replica"
        self.state, d = policy.decide(
            self.state, obs if not failed else None, now, self.psettings, self.overrides
        )
        self.record.decisions.append(d)
        # The deployment's adaptive tables (one file per profile, every replica launches it).
        adaptive_tables.sync(self.settings, self.state, None, self._tables_written)
        running = self.running
        move, target, why = plan_move(
            d,
            running,
            forced,
            self.rejected,
            now,
            self.fleet,
            len(self.actuator.replicas),
            self.mode,
            partial(could_judge, windows, self.actuator.canary.name, running, self.fleet.canary),
            self.unjudged,
        )
        if move == "rollout" and why != d.reason.value:
            log.info("fleet: %s", why)
        if move == "canary" and target is not None:
            return await self._start_canary(target, now, d.reason if forced is None else None)
        if move == "rollout" and target is not None:
            return await self._rollout(target, d.reason if forced is None else Reason.SWITCH_MANUAL)
        if move == "rewrite" and target is not None:
            return await self._rollout(target, d.reason, every=True)
        return "hold", why

    async def _start_canary(
        self, target: str, now: float, reason: Reason | None
    ) -> tuple[str, str]:
        assert self.running is not None
        self.busy = True
        try:
            res = await self.actuator.canary_start(target)
        finally:
            self.busy = False
        canary = self.actuator.canary
        self.observer.forget(canary.name)
        if not res.ok:
            self._canary_failed(target, None, "start_failed", now)
            if canary.profile != self.running and canary.profile is not None:
                await self.actuator.canary_end(self.running)
            return "rollback", f"canary {target} did not start: {res.error}"
        self.canary = CanaryTrial(target, self.running, canary.name, now, self.fleet.canary)
        # A new boot of the candidate: its windows will judge it in the policy's estimates too.
        assert self.state is not None
        self.state = policy.on_canary_started(self.state, target)
        why = reason.value if reason else "requested"
        log.info("canary: %s on %s (%s), the rest on %s", target, canary.name, why, self.running)
        return "canary", f"{target} on {canary.name} ({why})"

    def _canary_failed(
        self, target: str, v: CanaryVerdict | None, outcome: str, now: float
    ) -> None:
        assert self.state is not None and self.running is not None
        judged = note_rollback(self.rejected, self.unjudged, target, v, now)
        # The policy backs a judged candidate off as it does a failed start (never a switch of
        # its own).
        self.state = policy.on_canary_rejected(self.state, target, self.clock.now(), judged=judged)
        self.record.canaries.append(CanaryRecord(target, self.running, v, outcome, now))

    async def _canary_step(
        self, windows: dict[str, ReplicaObservation], now: float
    ) -> tuple[str, str]:
        trial = self.canary
        assert trial is not None and self.state is not None
        if (cw := trial.candidate_window(windows)) is not None:
            policy.observe_canary(self.state, cw)
        v = trial.add(windows)
        if v is None or v.verdict is Verdict.CONTINUE:
            return "hold", f"canary {trial.candidate}: " + (v.summary() if v else "warming up")
        log.info("canary %s: %s", trial.candidate, v.summary())
        self.canary = None
        if v.verdict is Verdict.ROLLBACK:
            self.busy = True
            try:
                res = await self.actuator.canary_end(trial.current)
            finally:
                self.busy = False
            self.observer.forget(trial.replica)
            self._canary_failed(trial.candidate, v, "rolled_back", now)
            self.record.switches.append(res)
            return "rollback", f"canary {trial.candidate} rolled back: {v.summary()}"
        self.record.canaries.append(
            CanaryRecord(trial.candidate, trial.current, v, "promoted", now)
        )
        _, detail = await self._rollout(trial.candidate, Reason.SWITCH_PREDICTED_GAIN)
        return "promote", f"canary {trial.candidate} promoted ({v.summary()}); {detail}"

    async def _rollout(
        self, target: str, reason: Reason, *, every: bool = False
    ) -> tuple[str, str]:
        """Every replica onto `target`, rolling (`every`: those already on it restart too: a
        rewritten adaptive table is read at launch)."""
        assert self.state is not None
        self.busy = True
        try:
            res = await self.actuator.rolling_switch(target, every=every)
        finally:
            self.busy = False
        for r in self.actuator.replicas:
            self.observer.forget(r.name)
        self.record.switches.append(res)
        self.state = policy.on_switch_done(
            self.state, target, res.ok, res.downtime_s, self.clock.now()
        )
        if res.ok:
            self.running = target
            return "rolling", f"all replicas on {target} ({reason.value})"
        log.error("rolling switch to %s: %s %s", target, res.outcome.value, res.error)
        return "rolling", f"rolling switch to {target} {res.outcome.value}: {res.error}"

    # ------------------------------------------------------------------ views / running

    def status(self) -> dict[str, Any]:
        return {
            "profile": self.running,
            "mode": self.mode.value,
            "switch_in_flight": self.busy,
            "router": self.actuator.router.base_url,
            "replicas": [
                {
                    "name": r.name,
                    "url": r.url,
                    "profile": r.profile,
                    "out_of_router": r.out,
                    "output_tok_s": (
                        w.obs.output_tok_s if (w := self.last.get(r.name)) and w.obs else None
                    ),
                }
                for r in self.actuator.replicas
            ],
            "canary": self.canary.view() if self.canary else None,
            "adaptive_tables": adaptive_tables.status_view(self.state),
            "canaries": [
                {
                    "candidate": c.candidate,
                    "current": c.current,
                    "outcome": c.outcome,
                    "verdict": c.verdict.to_dict() if c.verdict else None,
                }
                for c in self.record.canaries
            ],
        }

    async def run(
        self, stop: asyncio.Event, on_tick: Callable[[FleetController], None] | None = None
    ) -> None:
        """Tick every poll_interval_s (server time) until `stop` is set."""
        if on_tick is not None:
            self._on_tick.append(on_tick)
        interval = self.settings.controller.poll_interval_s
        scale = float(getattr(self.clock, "time_scale", 1.0)) or 1.0
        while not stop.is_set():
            started = self.clock.monotonic()
            try:
                await self.tick()
            except Exception:  # one bad tick must not end the fleet's loop; logged loudly
                log.exception("fleet tick failed")
            wait = max(0.0, interval - (self.clock.monotonic() - started)) / scale
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait or 0.001)
