"""The fleet actuator: N replicas of the server behind one sglang-router, switched one by one.

Owns the replicas (each a ProcessActuator on its own port: launch, adoption, drain, stop, start
deadline, /server_info check all stay there), the router's process when specpilot launched it,
the registration of ready replicas with the router, and the two moves a fleet makes:
- the rolling switch: take a replica out of the router, wait until it has nothing in flight
  (the router sends it nothing new, so the drain ends), restart it with the new profile, wait
  for /ready, put it back, wait until the router lists it healthy, and only then take the next;
  never more than `max_unavailable()` replicas out at once (replicas already down count);
- the canary move: the same cycle for the one canary replica (and back, on a rollback).
While the router does not answer, a switch waits before touching anything (bounded by
router.wait_timeout_s); a router specpilot launched and that died is relaunched and every ready
replica registered again. Implements the Actuator protocol, so the funnel and the loop can drive
it like one server. Must not decide what to switch to or judge a canary (controller.fleet.canary).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from controller.actuators.base import ServerState, SwitchOutcome, SwitchResult, check_profile
from controller.actuators.process import ProcessActuator
from controller.clock import Clock
from controller.fleet.router import RouterClient, RouterError, RouterProcess, RouterUnavailable
from controller.fleet.settings import FleetSettings
from controller.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")


def _suffixed(path: str, index: int) -> str:
    """server.log_file / pid_file of replica `index`: name.replicaN.ext next to the original."""
    if not path:
        return ""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.replica{index}{p.suffix}"))


def replica_settings(settings: Settings, fleet: FleetSettings, index: int) -> Settings:
    """The [server] of replica `index`: same launch, flags and profiles, its own port and files."""
    port = fleet.replica_ports()[index]
    server = settings.server.model_copy(
        update={
            "host": fleet.host,
            "port": port,
            "pid_file": _suffixed(settings.server.pid_file, index),
            "log_file": _suffixed(settings.server.log_file, index),
        }
    )
    return settings.model_copy(update={"server": server})


@dataclass
class Replica:
    index: int
    settings: Settings
    actuator: ProcessActuator
    profile: str | None = None  # what it runs, as last seen
    out: bool = False  # taken out of the router by a switch in progress

    @property
    def url(self) -> str:
        return self.settings.server.base_url

    @property
    def name(self) -> str:
        return f"replica{self.index}"


@dataclass(frozen=True)
class ReplicaCycle:
    """One replica's trip out of the router and back, for the record."""

    replica: str
    from_profile: str | None
    to_profile: str
    outcome: str
    out_of_router_s: float  # server seconds between the removal and the re-registration
    drain_s: float  # part of it spent waiting for requests in flight
    downtime_s: float  # part of it the replica did not serve at all (restart)
    error: str | None = None


@dataclass
class FleetLog:
    cycles: list[ReplicaCycle] = field(default_factory=list)
    router_relaunches: int = 0


class FleetActuator:
    """Replicas + router; the Actuator protocol over the whole fleet."""

    def __init__(
        self, settings: Settings, fleet: FleetSettings, clock: Clock, client: httpx.AsyncClient
    ) -> None:
        if not fleet.enabled:
            raise ValueError("fleet.replicas is 0: fleet mode is off")
        self.settings = settings
        self.fleet = fleet
        self.clock = clock
        self.client = client
        self.replicas = [
            Replica(
                i, rs := replica_settings(settings, fleet, i), ProcessActuator(rs, clock, client)
            )
            for i in range(fleet.replicas)
        ]
        self.router = RouterClient(client, fleet.router.base_url, clock, fleet.router.api_key)
        self.router_proc = (
            RouterProcess(fleet.router, reserved=fleet.replica_ports())
            if fleet.router.owned
            else None
        )
        self.log = FleetLog()
        self._lock = asyncio.Lock()
        self._router_adopted = False  # a router we did not launch answers on our router port

    # ------------------------------------------------------------------ replicas

    @property
    def canary(self) -> Replica:
        return self.replicas[self.fleet.canary_replica]

    def replica(self, url_or_name: str) -> Replica:
        for r in self.replicas:
            if url_or_name in (r.url, r.name):
                return r
        raise KeyError(url_or_name)

    def _scale(self) -> float:
        return float(getattr(self.clock, "time_scale", 1.0)) or 1.0

    # ------------------------------------------------------------------ router

    async def ensure_router(self) -> bool:
        """The router answers (launching ours if it is not running), and every ready replica
        that is not out is registered. False when it cannot be reached."""
        if self.router_proc is not None and not self.router_proc.running():
            if await self.router.alive():
                # Something else answers on our router port: do not start a second one. Said
                # once (the fleet loop checks the router every poll).
                if not self._router_adopted:
                    log.warning("a router already answers on %s: adopting it", self.router.base_url)
                self._router_adopted = True
            else:
                self._router_adopted = False
                if self.router_proc.proc is not None:
                    self.log.router_relaunches += 1
                    log.error(
                        "the router (pid %s) exited: relaunching it", self.router_proc.proc.pid
                    )
                proc = self.router_proc
                proc.launch()
                timeout = self.fleet.router.start_timeout_s * self._scale()
                if not await self.router.wait_alive(timeout, gone=lambda: not proc.running()):
                    if not proc.running():
                        log.error("%s", proc.launch_failed())
                    return False
                proc.failure = ""
        elif not await self.router.alive():
            return False
        try:
            await self.reconcile()
        except RouterUnavailable:
            return False
        return True

    def router_failure(self) -> str:
        """Why the router we launch does not come up, for an error message ("" when unknown)."""
        failure = self.router_proc.failure if self.router_proc is not None else ""
        return f" ({failure})" if failure else ""

    async def wait_router(self) -> bool:
        """Wait (at most router.wait_timeout_s) until the router answers; relaunch ours."""
        deadline = self.clock.monotonic() + self.fleet.router.wait_timeout_s
        warned = False
        while not await self.ensure_router():
            if self.clock.monotonic() >= deadline:
                return False
            if not warned:
                log.warning("router %s does not answer: waiting for it", self.router.base_url)
                warned = True
            await self.clock.sleep(min(0.5 * self._scale(), self.fleet.router.wait_timeout_s))
        return True

    async def reconcile(self) -> None:
        """Register every replica that is ready and not out (a router restarted by someone else
        has lost its registrations); nothing else. Raises RouterUnavailable."""
        listed = {w.url for w in await self.router.workers()}
        for r in self.replicas:
            if r.out or r.url in listed:
                continue
            if await r.actuator.endpoint.ready():
                log.info("registering %s (%s) with the router", r.name, r.url)
                await self.router.add(r.url, self._add_timeout())

    def _add_timeout(self) -> float:
        # The router's own readiness check of a new worker takes about a second of real time.
        return max(30.0, self.settings.server.start_timeout_s / 10) * max(1.0, self._scale())

    async def _with_router(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a router call; while the router is unreachable, wait for it and try again."""
        while True:
            try:
                return await call()
            except RouterUnavailable as e:
                log.warning("%s", e)
                if not await self.wait_router():
                    raise
            except RouterError as e:
                # The router lost a worker we were waiting for (it restarted): try again.
                if not await self.router.alive():
                    log.warning("%s", e)
                    if not await self.wait_router():
                        raise RouterUnavailable(str(e)) from e
                    continue
                raise

    # ------------------------------------------------------------------ the Actuator protocol

    async def probe(self) -> ServerState:
        """Up when a replica is up; `profile` is the one most replicas run (a canary or a
        straggler runs another: the detail names them)."""
        states = await asyncio.gather(*(r.actuator.probe() for r in self.replicas))
        for r, st in zip(self.replicas, states, strict=True):
            if st.up:
                r.profile = st.profile
        up = [(r, st) for r, st in zip(self.replicas, states, strict=True) if st.up]
        if not up:
            return ServerState(False, None, None, None, detail="no replica is up")
        counts = Counter(st.profile for _, st in up if st.profile is not None)
        profile = counts.most_common(1)[0][0] if counts else None
        detail = ", ".join(
            f"{r.name}={st.profile if st.up else 'down'}"
            for r, st in zip(self.replicas, states, strict=True)
        )
        args = next((st.server_args for _, st in up if st.profile == profile), None)
        return ServerState(
            True, profile, None, args, detail=f"{len(up)}/{len(states)} up: {detail}"
        )

    async def start(self, profile: str) -> SwitchResult:
        """Start `profile` on every replica that runs nothing (replicas already up are adopted)
        and register the ready ones. OK when every replica runs `profile`."""
        check_profile(profile, self.settings.profiles)
        if not await self.wait_router():
            return SwitchResult(
                SwitchOutcome.REFUSED_BUSY,
                None,
                profile,
                0.0,
                error=f"router {self.router.base_url} unavailable: nothing started"
                + self.router_failure(),
            )
        async with self._lock:
            results = await asyncio.gather(*(r.actuator.start(profile) for r in self.replicas))
            for r, res in zip(self.replicas, results, strict=True):
                if res.ok:
                    r.profile = profile
            try:
                await self._with_router(self.reconcile)
            except (RouterUnavailable, RouterError) as e:
                return SwitchResult(SwitchOutcome.UNKNOWN, None, profile, 0.0, error=str(e))
        bad = [
            f"{r.name}: {res.outcome.value} {res.error or ''}".strip()
            for r, res in zip(self.replicas, results, strict=True)
            if not res.ok
        ]
        downtime = max((res.downtime_s for res in results), default=0.0)
        if not bad:
            return SwitchResult(SwitchOutcome.OK, profile, profile, downtime)
        worst = (
            SwitchOutcome.UNKNOWN
            if any(res.outcome is SwitchOutcome.UNKNOWN for res in results)
            else SwitchOutcome.START_FAILED
            if any(res.outcome is SwitchOutcome.START_FAILED for res in results)
            else SwitchOutcome.REFUSED_BUSY
        )
        return SwitchResult(worst, None, profile, downtime, error="; ".join(bad))

    async def switch(self, profile: str) -> SwitchResult:
        """Rolling switch of every replica that does not run `profile`."""
        return await self.rolling_switch(profile)

    async def alive(self) -> bool:
        """Every replica's process runs (one that died is restarted by `start`)."""
        return all(await asyncio.gather(*(r.actuator.alive() for r in self.replicas)))

    async def shutdown(self, *, adopted: bool = True) -> None:
        """Replicas (when owns_server; without `adopted`, only those this process launched)
        and a router specpilot launched."""
        stop = [r for r in self.replicas if adopted or r.actuator.launched_here()]
        await asyncio.gather(*(r.actuator.shutdown() for r in stop))
        await self.stop_router()

    async def stop_router(self) -> None:
        """Stop the router specpilot launched, if any (a failed start-up: the replicas stay)."""
        if self.router_proc is not None:
            await self.router_proc.stop()

    # ------------------------------------------------------------------ switches

    async def rolling_switch(
        self, profile: str, targets: Sequence[Replica] | None = None, *, every: bool = False
    ) -> SwitchResult:
        """Switch `targets` (default: every replica) to `profile`, at most max_unavailable()
        out of the router at once (a target whose server died is started first, alone, without
        a slot); stops at the first replica that fails. Replicas already on
        `profile` are skipped unless `every` (a rewritten adaptive table: each restarts to read
        it). `downtime_s` is the fleet's lost capacity in server seconds (sum of replica
        downtimes / replicas)."""
        check_profile(profile, self.settings.profiles)
        t0 = self.clock.monotonic()
        if not await self.wait_router():
            return SwitchResult(
                SwitchOutcome.REFUSED_BUSY,
                None,
                profile,
                0.0,
                error=f"router {self.router.base_url} unavailable for "
                f"{self.fleet.router.wait_timeout_s:g} s: no replica touched"
                + self.router_failure(),
            )
        if self._lock.locked():
            return SwitchResult(
                SwitchOutcome.REFUSED_BUSY, None, profile, 0.0, error="a fleet switch is in flight"
            )
        async with self._lock:
            await self.probe()
            todo = [r for r in (targets or self.replicas) if every or r.profile != profile]
            froms = Counter(r.profile for r in todo)
            from_profile = froms.most_common(1)[0][0] if froms else profile
            cycles: list[ReplicaCycle] = []
            while todo:
                # A replica still to switch whose server died is out of service already:
                # starting it on `profile` gives capacity back and takes no slot (counted as
                # out, it held the only one: the rollout waited for it and gave up).
                up = await asyncio.gather(*(r.actuator.alive() for r in todo))
                dead = [r for r, ok in zip(todo, up, strict=True) if not ok]
                if dead:
                    log.warning(
                        "%s down: started on %s first", ", ".join(r.name for r in dead), profile
                    )
                    todo = dead + [r for r in todo if r not in dead]
                    slots = len(dead)
                else:
                    slots = await self._free_slots()
                if slots <= 0:
                    return self._result(
                        SwitchOutcome.REFUSED_BUSY if not cycles else SwitchOutcome.UNKNOWN,
                        from_profile,
                        profile,
                        cycles,
                        "too many replicas are already out of the router (max_unavailable "
                        f"{self.fleet.max_unavailable()}): waited "
                        f"{self.fleet.router.wait_timeout_s:g} s",
                    )
                batch, todo = todo[:slots], todo[slots:]
                done = await asyncio.gather(*(self._cycle(r, profile) for r in batch))
                cycles.extend(done)
                failed = [c for c in done if c.outcome != SwitchOutcome.OK.value]
                if failed:
                    worst = (
                        SwitchOutcome.UNKNOWN
                        if any(c.outcome == SwitchOutcome.UNKNOWN.value for c in failed)
                        else SwitchOutcome.START_FAILED
                    )
                    return self._result(
                        worst,
                        from_profile,
                        profile,
                        cycles,
                        "; ".join(f"{c.replica}: {c.error}" for c in failed),
                    )
            log.info(
                "rolling switch to %s done in %.0f s (%d replicas)",
                profile,
                self.clock.monotonic() - t0,
                len(cycles),
            )
            return self._result(SwitchOutcome.OK, from_profile, profile, cycles, None)

    def _result(
        self,
        outcome: SwitchOutcome,
        from_profile: str | None,
        profile: str,
        cycles: Sequence[ReplicaCycle],
        error: str | None,
    ) -> SwitchResult:
        lost = sum(c.downtime_s for c in cycles) / len(self.replicas)
        return SwitchResult(outcome, from_profile, profile, lost, error=error)

    async def _free_slots(self) -> int:
        """How many more replicas may go out now: max_unavailable minus those out or down.
        Waits (bounded) while there is no slot."""
        deadline = self.clock.monotonic() + self.fleet.router.wait_timeout_s
        while True:
            listed = await self._with_router(self.router.workers)
            healthy = {w.url for w in listed if w.healthy}
            unavailable = sum(1 for r in self.replicas if r.out or r.url not in healthy)
            slots = self.fleet.max_unavailable() - unavailable
            if slots > 0 or self.clock.monotonic() >= deadline:
                return slots
            await self.clock.sleep(1.0 * self._scale())
            await self.ensure_router()  # registers replicas that came back

    async def _cycle(self, r: Replica, profile: str) -> ReplicaCycle:
        """Out of the router, drained, restarted with `profile`, ready, back in the router."""
        from_profile = r.profile
        t_out = self.clock.monotonic()
        r.out = True
        drain_s = 0.0
        try:
            removed = await self._with_router(
                lambda: self.router.remove(r.url, self._add_timeout())
            )
            log.info("%s out of the router (%s)", r.name, "removed" if removed else "not listed")
            # The router sends nothing new now: wait for what is in flight (server time).
            t_drain = self.clock.monotonic()
            await r.actuator.endpoint.drain(self.settings.server.drain_timeout_s)
            drain_s = self.clock.monotonic() - t_drain
            res = await r.actuator.switch(profile)
            if res.outcome is SwitchOutcome.START_FAILED and from_profile is not None:
                # Give the fleet its capacity back with what ran before.
                log.error(
                    "%s: %s failed to start (%s); restoring %s",
                    r.name,
                    profile,
                    res.error,
                    from_profile,
                )
                back = await r.actuator.start(from_profile)
                r.profile = from_profile if back.ok else None
            elif res.ok:
                r.profile = profile
            if await r.actuator.endpoint.ready():
                await self._with_router(lambda: self.router.add(r.url, self._add_timeout()))
            cycle = ReplicaCycle(
                r.name,
                from_profile,
                profile,
                res.outcome.value,
                self.clock.monotonic() - t_out,
                drain_s,
                res.downtime_s,
                res.error,
            )
        except (RouterUnavailable, RouterError) as e:
            # The router stayed away longer than router.wait_timeout_s: the replica serves (or
            # not) outside it; reconcile registers it again once the router answers.
            cycle = ReplicaCycle(
                r.name,
                from_profile,
                profile,
                SwitchOutcome.UNKNOWN.value,
                self.clock.monotonic() - t_out,
                drain_s,
                0.0,
                f"router: {e}",
            )
        finally:
            r.out = False
        self.log.cycles.append(cycle)
        log.info(
            "%s: %s -> %s %s, out of the router %.1f s (drain %.1f s, down %.1f s)",
            r.name,
            from_profile,
            profile,
            cycle.outcome,
            cycle.out_of_router_s,
            cycle.drain_s,
            cycle.downtime_s,
        )
        return cycle

    async def canary_start(self, profile: str) -> SwitchResult:
        """Run `profile` on the canary replica only."""
        return await self.rolling_switch(profile, [self.canary])

    async def canary_end(self, profile: str) -> SwitchResult:
        """Put the canary replica back on `profile` (a rollback)."""
        return await self.rolling_switch(profile, [self.canary])
