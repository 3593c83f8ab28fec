"""The control loop: observe -> estimate -> decide -> act -> record, one tick at a time.

Owns the Controller: the live state of one managed server (running profile, previous snapshot,
policy state, overrides, the trial in progress) and the operations the API and CLI call on it
(pin, pause, mode, manual switch, trial abort, clearing a block). The policy decides; the
actuation funnel acts; the store records. This module does no parsing (controller.observe) and
no policy arithmetic (policies/). Time comes from the injected Clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx

from controller.actuators import Actuator, Funnel, SwitchOutcome, SwitchResult
from controller.clock import Clock
from controller.metrics import ControllerMetrics
from controller.observe import ObserveError, scrape
from controller.settings import Settings, policy_settings
from policies import decide as policy
from policies.observation import diff
from policies.types import (
    Action,
    Decision,
    Estimate,
    Mode,
    Observation,
    Overrides,
    ProfilePrediction,
    Reason,
    Snapshot,
)
from store import Store

log = logging.getLogger("specpilot.loop")

STATE_KEY_POLICY = "policy_state"
STATE_KEY_OVERRIDES = "overrides"
RETENTION_EVERY_S = 3600.0  # server time between two Store.apply_retention runs


class ConflictError(Exception):
    """An operation that cannot run now (a switch is in flight): the API answers 409."""


class UnknownProfileError(KeyError):
    """A profile name not in config.toml: the API answers 404."""


@dataclass
class TickRecord:
    """What the status page and `specpilot status` show for a recent tick."""

    t_s: float
    profile: str
    tok_s: float | None
    accept_length: float | None
    batch: float | None
    action: str
    reason: str


class Controller:
    """One managed SGLang server and everything specpilot knows and decides about it."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock,
        store: Store,
        actuator: Actuator,
        client: httpx.AsyncClient,
        metrics: ControllerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.store = store
        self.actuator = actuator
        self.client = client
        self.specs = {s.name: s for s in settings.profile_specs()}
        self.metrics = metrics or ControllerMetrics(self.specs)
        self.psettings = policy_settings(settings)
        self.mode: Mode = settings.controller.mode
        self.funnel = Funnel(actuator, lambda: self.mode)
        self.running: str | None = None
        self.last_good: str | None = None
        self.prev: Snapshot | None = None
        self.last_obs: Observation | None = None
        self.last_decision: Decision | None = None
        self.predictions: list[ProfilePrediction] = []
        self.overrides = Overrides(mode=self.mode)
        self.trial_switch_id: int | None = None  # store id of the switch whose trial runs
        self.history: deque[TickRecord] = deque(maxlen=720)
        self.crash_restarts = 0
        self.next_crash_restart_s = 0.0
        self.ready = False  # first good scrape done
        self.state: policy.PolicyState | None = None
        self._on_tick: list[Callable[[Controller], None]] = []
        self._manual: asyncio.Task[SwitchResult] | None = None
        self._retention_at_s = float("-inf")

    # ----------------------------------------------------------------------------- lifecycle
    async def startup(self) -> None:
        """Warm start from the store, then adopt a running server or start the initial profile."""
        now = self.clock.now()
        probe = await self.actuator.probe()
        if probe.up and probe.profile is not None:
            self.running = probe.profile
            log.info("adopted running server: profile=%s pid=%s", probe.profile, probe.pid)
        elif probe.up:
            raise RuntimeError(
                "a server is up on the port but its /server_info matches no profile in the "
                f"config ({probe.detail}); refusing to start a second one"
            )
        else:
            first = self.settings.server.initial_profile
            result = await self.funnel.start(first)
            if result.outcome is SwitchOutcome.SKIPPED_ADVISORY:
                log.warning(
                    "advisory mode and no server on %s: waiting for one to adopt",
                    self.settings.server.base_url,
                )
            else:
                self._record_switch(result, Reason.SWITCH_MANUAL, now)
                if result.outcome is not SwitchOutcome.OK:
                    raise RuntimeError(f"could not start profile {first}: {result.error}")
                self.running = first
        self.last_good = self.running
        self._close_interrupted_switch(now)
        saved = self.store.load_state(STATE_KEY_POLICY)
        self.state = None
        if saved:
            try:
                self.state = policy.PolicyState.from_dict(saved)
                log.info("warm start: policy state restored from the database")
            except (KeyError, TypeError, ValueError) as e:
                log.warning("saved policy state unusable (%s); starting cold", e)
                self.state = None
        if self.state is None:
            self.state = policy.initial_state(
                list(self.specs.values()),
                self.running or self.settings.server.initial_profile,
                now,
                self.psettings,
            )
        self._load_overrides(now)
        self.metrics.set_profile(self.running)
        self.metrics.set_mode(self.mode)

    def _close_interrupted_switch(self, now: float) -> None:
        """A switch left open by a controller that died mid-switch: its outcome is unknown, but
        the server found now (adopted above) is what runs."""
        open_ = self.store.open_switch()
        if open_ is None:
            return
        self.store.finish_switch(
            int(open_["id"]),
            ended_s=now,
            outcome="unknown",
            error=f"controller restarted during the switch; found {self.running or 'nothing'}",
        )
        log.warning(
            "switch %s -> %s was interrupted by a controller restart; now running: %s",
            open_["from_profile"],
            open_["to_profile"],
            self.running,
        )

    async def _adopt_if_down(self) -> None:
        """No server known (advisory start, or a failed start): adopt one that came up."""
        if self.running is not None or self.funnel.busy:
            return
        probe = await self.actuator.probe()
        if probe.up and probe.profile is not None:
            self.running = probe.profile
            if self.last_good is None:
                self.last_good = probe.profile
            log.info("adopted server running %s", probe.profile)
            self.metrics.set_profile(self.running)

    def _load_overrides(self, now: float) -> None:
        saved = self.store.load_state(STATE_KEY_OVERRIDES) or {}
        mode = Mode(saved.get("mode", self.settings.controller.mode))
        self.mode = mode
        self.overrides = Overrides(
            pin_profile=saved.get("pin_profile")
            if saved.get("pin_profile") in self.specs
            else None,
            pin_until_s=saved.get("pin_until_s"),
            paused_until_s=saved.get("paused_until_s"),
            mode=mode,
            blocked_reason=saved.get("blocked_reason"),
        )
        if self.overrides.blocked_reason:
            self.funnel.blocked_reason = self.overrides.blocked_reason
        self._expire_overrides(now)

    def _save_overrides(self) -> None:
        o = self.overrides
        self.store.save_state(
            STATE_KEY_OVERRIDES,
            {
                "pin_profile": o.pin_profile,
                "pin_until_s": o.pin_until_s,
                "paused_until_s": o.paused_until_s,
                "mode": self.mode.value,
                "blocked_reason": self.funnel.blocked_reason,
            },
        )

    def _expire_overrides(self, now: float) -> None:
        o = self.overrides
        changed = False
        if o.pin_profile is not None and not o.pin_active(now):
            log.info("pin on %s expired", o.pin_profile)
            o = replace(o, pin_profile=None, pin_until_s=None)
            changed = True
        if o.paused_until_s is not None and not o.pause_active(now):
            log.info("pause expired")
            o = replace(o, paused_until_s=None)
            changed = True
        o = replace(o, mode=self.mode, blocked_reason=self.funnel.blocked_reason)
        self.overrides = o
        if changed:
            self._save_overrides()

    # ----------------------------------------------------------------------------- the tick
    async def tick(self) -> Decision:
        """One control step. Never raises for a bad scrape or a failed switch: it records them."""
        t_real = time.perf_counter()
        now = self.clock.now()
        assert self.state is not None, "startup() first"
        self._expire_overrides(now)

        await self._adopt_if_down()
        crash = await self._check_crash(now)
        if crash is not None:
            return crash

        obs: Observation | None = None
        scrape_ok = True
        try:
            snap = await scrape(
                self.client,
                self.settings.server.base_url,
                profile=self.running or "(none)",
                t_s=now,
            )
        except ObserveError as e:
            scrape_ok = False
            self.metrics.scrape_errors.inc()
            self.metrics.target_up.set(0)
            log.warning("scrape failed: %s", e)
        else:
            self.metrics.target_up.set(1)
            self.ready = True
            if self.prev is not None and self.prev.profile == snap.profile:
                obs = diff(self.prev, snap)
            self.prev = snap

        if obs is not None:
            self.last_obs = obs
            self.store.record_observation(obs)
            self.metrics.observe_window(obs)

        if not scrape_ok or obs is not None:
            trial_before = self.state.trial
            self.state, decision = policy.decide(
                self.state, obs, now, self.psettings, self.overrides
            )
            self._record_trial_end(trial_before, decision, now)
            self._record_findings(now)
        else:
            # First good scrape after a start: a window needs two snapshots.
            decision = Decision(
                now, Action.HOLD, self.running, Reason.HOLD_INSUFFICIENT_DATA, {"windows": 0}
            )
        self.predictions = policy.predictions(self.state)
        self.metrics.set_predictions(self.predictions)

        if decision.action is Action.SWITCH and decision.profile != self.running:
            decision = await self._act(decision, now)
        else:
            self._record_decision(decision, acted=False)

        self.store.record_estimates(now, self.predictions)
        self.store.save_state(STATE_KEY_POLICY, self.state.to_dict())
        self.maybe_apply_retention(now)
        self._remember(decision)
        self.metrics.tick_seconds.observe(time.perf_counter() - t_real)
        for cb in self._on_tick:
            cb(self)
        return decision

    def maybe_apply_retention(self, now: float) -> dict[str, int] | None:
        """Downsample and trim the store once per RETENTION_EVERY_S of server time (the first
        tick after a start runs it too); returns the store's counts when it ran."""
        if now - self._retention_at_s < RETENTION_EVERY_S:
            return None
        self._retention_at_s = now
        out = self.store.apply_retention(now)
        log.debug("retention: %s", out)
        return out

    def _remember(self, d: Decision) -> None:
        obs = self.last_obs
        acc = obs.spec_accept_length if obs is not None else None
        self.history.append(
            TickRecord(
                t_s=d.t_s,
                profile=self.running or "",
                tok_s=obs.output_tok_s if obs is not None and obs.t_s == d.t_s else None,
                accept_length=acc,
                batch=obs.running_reqs if obs is not None else None,
                action=d.action.value,
                reason=d.reason.value,
            )
        )
        self.last_decision = d

    def _record_decision(self, d: Decision, *, acted: bool) -> None:
        self.store.record_decision(d, mode=self.mode, acted=acted)
        self.metrics.count_decision(d)
        changed = (
            self.last_decision is None
            or self.last_decision.reason is not d.reason
            or self.last_decision.action is not d.action
            or d.action is Action.SWITCH
        )
        # One summary line per decision that differs from the last; repeats go to debug.
        log.log(logging.INFO if changed else logging.DEBUG, "decision: %s", d.summary())

    # ----------------------------------------------------------------------------- acting
    async def _act(self, d: Decision, now: float) -> Decision:
        pred = next((p.tok_s for p in self.predictions if p.profile == d.profile), None)
        result = await self.funnel.switch(d.profile)
        acted = result.outcome not in (SwitchOutcome.SKIPPED_ADVISORY, SwitchOutcome.REFUSED_BUSY)
        self._record_decision(d, acted=acted)
        if not acted:
            return d
        switch_id = self._record_switch(result, d.reason, now)
        self._after_switch(result, d.reason, now, switch_id, pred)
        return d

    def _after_switch(
        self,
        result: SwitchResult,
        reason: Reason,
        now: float,
        switch_id: int,
        predicted: Estimate | None,
    ) -> None:
        assert self.state is not None
        ok = result.outcome is SwitchOutcome.OK
        self.state = policy.on_switch_done(
            self.state, result.to_profile, ok, result.downtime_s, self.clock.now()
        )
        self.prev = None  # counters restart with the server
        if reason.value.startswith("rollback"):
            self.metrics.rollbacks.labels(reason.value).inc()
        if ok:
            self.running = result.to_profile
            if self.state.trial is not None:
                # The policy judges the new profile against its prediction (policies.trial).
                self.trial_switch_id = switch_id
                self.store.record_trial(
                    switch_id,
                    "running",
                    now,
                    predicted_tok_s=predicted.mean if predicted else None,
                )
            elif reason is not Reason.ROLLBACK_TRIAL_FAILED:
                self.last_good = result.to_profile
        elif result.outcome is SwitchOutcome.UNKNOWN:
            self.overrides = replace(self.overrides, blocked_reason=self.funnel.blocked_reason)
            self._save_overrides()
            log.error("switch outcome unknown: automatic switching stopped: %s", result.error)
        else:
            # Nothing serves now; the policy's next decision rolls back (ROLLBACK_START_FAILED).
            self.running = None
            log.error("switch to %s failed to start: %s", result.to_profile, result.error)
        self.metrics.set_profile(self.running)

    def _record_trial_end(self, before: dict[str, Any] | None, d: Decision, now: float) -> None:
        """Mirror the policy's trial into the store when it ends."""
        sid = self.trial_switch_id
        if before is None or sid is None or self.state is None or self.state.trial is not None:
            return
        if d.reason is Reason.ROLLBACK_TRIAL_FAILED:
            outcome = "failed"
        else:
            outcome = str(d.diagnostics.get("trial_outcome") or "inconclusive")
            if outcome not in ("successful", "failed", "inconclusive"):
                outcome = "inconclusive"
        windows = list(before.get("windows") or [])
        self.store.record_trial(
            sid,
            outcome,
            now,
            predicted_tok_s=(before.get("predicted") or {}).get("mean"),
            observed_tok_s=sum(windows) / len(windows) if windows else None,
            detail={"windows": windows},
        )
        if outcome == "successful":
            self.last_good = str(before["profile"])
        log.info("trial of %s: %s", before.get("profile"), outcome)
        self.trial_switch_id = None

    def _record_findings(self, now: float) -> None:
        assert self.state is not None
        for f in self.state.new_findings:
            msg = (
                f"{f.kind}: {f.subject} moved from {f.before:.4g} to {f.after:.4g}"
                f"{' ' + f.unit if f.unit else ''}"
            )
            self.store.record_finding(f.kind, now, msg, subject=f.subject, numbers=f.to_dict())
            self.metrics.findings.labels(f.kind).inc()
            log.warning("finding: %s", msg)

    async def _check_crash(self, now: float) -> Decision | None:
        """The server died outside a switch: restart the same profile, with backoff."""
        if self.running is None:
            return None  # a failed start: the policy's rollback decides what starts next
        if self.funnel.busy or await self.actuator.alive():
            return None
        if now < self.next_crash_restart_s:
            d = Decision(
                now,
                Action.HOLD,
                self.running or "",
                Reason.HOLD_INSUFFICIENT_DATA,
                {"server_down": True, "restart_in_s": self.next_crash_restart_s - now},
            )
            self._remember(d)
            return d
        target = self.running
        reason = Reason.RESTART_CRASHED
        self.crash_restarts += 1
        d = Decision(now, Action.SWITCH, target, reason, {"crash_restarts": self.crash_restarts})
        self._record_decision(d, acted=True)
        result = await self.funnel.start(target)
        if result.outcome in (SwitchOutcome.SKIPPED_ADVISORY, SwitchOutcome.REFUSED_BUSY):
            self._remember(d)
            return d
        self._record_switch(result, reason, now)
        self.prev = None
        if result.outcome is SwitchOutcome.OK:
            self.state = policy.on_switch_done(
                self.state, target, True, result.downtime_s, self.clock.now()
            )
            self.running = target
            self.next_crash_restart_s = 0.0
        else:
            backoff = min(
                self.settings.server.crash_backoff_max_s,
                self.settings.server.crash_backoff_s * 2 ** min(self.crash_restarts, 10),
            )
            self.next_crash_restart_s = self.clock.now() + backoff
            log.error("restart of %s failed (%s); next try in %.0fs", target, result.error, backoff)
        self.metrics.set_profile(self.running)
        self._remember(d)
        return d

    def _record_switch(self, result: SwitchResult, reason: Reason, now: float) -> int:
        self.metrics.switches.labels(reason.value, result.outcome.value).inc()
        if result.outcome is SwitchOutcome.OK:
            self.metrics.downtime.observe(result.downtime_s)
        sid = self.store.start_switch(result.from_profile, result.to_profile, reason.value, now)
        self.store.finish_switch(
            sid,
            ended_s=self.clock.now(),
            outcome=result.outcome.value,
            downtime_s=result.downtime_s,
            error=result.error,
        )
        return sid

    # ----------------------------------------------------------------------------- operator ops
    def _check_profile(self, profile: str) -> None:
        if profile not in self.specs:
            raise UnknownProfileError(profile)

    def pin(self, profile: str, ttl_s: float | None, reason: str, actor: str) -> None:
        self._check_profile(profile)
        now = self.clock.now()
        until = None if ttl_s is None else now + ttl_s
        self.overrides = replace(self.overrides, pin_profile=profile, pin_until_s=until)
        self.store.record_override(
            "pin", now, actor, profile=profile, ttl_s=ttl_s, until_s=until, reason=reason
        )
        self._save_overrides()

    def unpin(self, reason: str, actor: str) -> None:
        now = self.clock.now()
        self.overrides = replace(self.overrides, pin_profile=None, pin_until_s=None)
        self.store.record_override(
            "unpin", now, actor, profile=None, ttl_s=None, until_s=None, reason=reason
        )
        self._save_overrides()

    def pause(self, ttl_s: float, reason: str, actor: str) -> None:
        now = self.clock.now()
        self.overrides = replace(self.overrides, paused_until_s=now + ttl_s)
        self.store.record_override(
            "pause", now, actor, profile=None, ttl_s=ttl_s, until_s=now + ttl_s, reason=reason
        )
        self._save_overrides()

    def resume(self, reason: str, actor: str) -> None:
        now = self.clock.now()
        self.overrides = replace(self.overrides, paused_until_s=None)
        self.store.record_override(
            "resume", now, actor, profile=None, ttl_s=None, until_s=None, reason=reason
        )
        self._save_overrides()

    def set_mode(self, mode: Mode, reason: str, actor: str) -> None:
        now = self.clock.now()
        self.mode = mode
        self.overrides = replace(self.overrides, mode=mode)
        self.store.record_override("mode", now, actor, mode=mode, reason=reason)
        self.metrics.set_mode(mode)
        self._save_overrides()

    def clear_block(self, reason: str, actor: str) -> None:
        now = self.clock.now()
        self.funnel.clear_block()
        self.overrides = replace(self.overrides, blocked_reason=None)
        self.store.record_override(
            "clear_block", now, actor, profile=None, ttl_s=None, until_s=None, reason=reason
        )
        self._save_overrides()

    def abort_trial(self, reason: str, actor: str) -> bool:
        """Judge the running trial failed now and roll back to the profile before it."""
        assert self.state is not None
        trial = self.state.trial
        if trial is None:
            return False
        if self.funnel.busy or (self._manual is not None and not self._manual.done()):
            raise ConflictError("a switch is in flight")
        now = self.clock.now()
        self.store.record_override(
            "trial_abort", now, actor, profile=str(trial["profile"]), reason=reason
        )
        self.state.trial = None
        if self.trial_switch_id is not None:
            windows = list(trial.get("windows") or [])
            self.store.record_trial(
                self.trial_switch_id,
                "failed",
                now,
                predicted_tok_s=(trial.get("predicted") or {}).get("mean"),
                observed_tok_s=sum(windows) / len(windows) if windows else None,
                detail={"aborted_by": actor, "reason": reason},
            )
            self.trial_switch_id = None
        d = Decision(
            now,
            Action.SWITCH,
            str(trial["from"]),
            Reason.ROLLBACK_TRIAL_FAILED,
            {"aborted_by": actor, "failed_profile": str(trial["profile"])},
        )
        self._manual = asyncio.create_task(self._manual_switch(d))
        return True

    def start_manual_switch(self, profile: str, reason: str, actor: str) -> None:
        """A one-off switch asked by an operator; runs as a task (still a trial)."""
        self._check_profile(profile)
        if self.funnel.busy or (self._manual is not None and not self._manual.done()):
            raise ConflictError("a switch is in flight")
        now = self.clock.now()
        d = Decision(
            now, Action.SWITCH, profile, Reason.SWITCH_MANUAL, {"actor": actor, "why": reason}
        )
        self.store.record_override(
            "switch", now, actor, profile=profile, ttl_s=None, until_s=None, reason=reason
        )
        self._manual = asyncio.create_task(self._manual_switch(d))

    async def _manual_switch(self, d: Decision) -> SwitchResult:
        pred = next((p.tok_s for p in self.predictions if p.profile == d.profile), None)
        result = await self.funnel.switch(d.profile, manual=True)
        acted = result.outcome not in (SwitchOutcome.SKIPPED_ADVISORY, SwitchOutcome.REFUSED_BUSY)
        self._record_decision(d, acted=acted)
        if acted:
            sid = self._record_switch(result, d.reason, d.t_s)
            self._after_switch(result, d.reason, d.t_s, sid, pred)
        return result

    # ----------------------------------------------------------------------------- views
    def override_view(self) -> dict[str, Any]:
        o = self.overrides
        now = self.clock.now()
        return {
            "mode": self.mode.value,
            "pin": (
                {"profile": o.pin_profile, "until_s": o.pin_until_s} if o.pin_active(now) else None
            ),
            "pause": {"until_s": o.paused_until_s} if o.pause_active(now) else None,
            "blocked_reason": self.funnel.blocked_reason,
        }

    def status(self) -> dict[str, Any]:
        obs = self.last_obs
        d = self.last_decision
        return {
            "profile": self.running,
            "last_good_profile": self.last_good,
            "mode": self.mode.value,
            "switch_in_flight": self.funnel.busy,
            "ready": self.ready,
            "overrides": self.override_view(),
            "trial": self._trial_view(),
            "observed": (
                {
                    "t_s": obs.t_s,
                    "window_s": obs.window_s,
                    "output_tok_s": obs.output_tok_s,
                    "running_reqs": obs.running_reqs,
                    "spec_accept_length": obs.spec_accept_length,
                }
                if obs
                else None
            ),
            "estimates": [prediction_view(p) for p in self.predictions],
            "last_decision": decision_view(d) if d else None,
        }

    def _trial_view(self) -> dict[str, Any] | None:
        tr = self.state.trial if self.state is not None else None
        if tr is None:
            return None
        windows = list(tr.get("windows") or [])
        return {
            "profile": tr.get("profile"),
            "from_profile": tr.get("from"),
            "state": "running",
            "windows": len(windows),
            "observed_tok_s": sum(windows) / len(windows) if windows else None,
            "predicted_tok_s": tr.get("predicted"),
        }

    async def run(
        self, stop: asyncio.Event, on_tick: Callable[[Controller], None] | None = None
    ) -> None:
        """Tick every poll_interval_s until `stop` is set (the tick in progress finishes)."""
        if on_tick is not None:
            self._on_tick.append(on_tick)
        interval = self.settings.controller.poll_interval_s
        while not stop.is_set():
            started = self.clock.monotonic()
            try:
                await self.tick()
            except Exception:  # a bug in one tick must not kill the daemon; it is logged loudly
                log.exception("tick failed")
            elapsed = self.clock.monotonic() - started
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    stop.wait(),
                    timeout=self.clock.real_seconds(max(0.0, interval - elapsed))  # type: ignore[attr-defined]
                    or 0.001,
                )


def prediction_view(p: ProfilePrediction) -> dict[str, Any]:
    return {
        "profile": p.profile,
        "tok_s": p.tok_s.to_dict() if p.tok_s else None,
        "accept_length": p.accept_length.to_dict() if p.accept_length else None,
        "cycle_s": p.cycle_s.to_dict() if p.cycle_s else None,
        "breakeven_accept_length": p.breakeven_accept_length,
        "observed_tok_s": p.observed_tok_s,
        "source": p.source,
    }


def decision_view(d: Decision) -> dict[str, Any]:
    return {
        "t_s": d.t_s,
        "action": d.action.value,
        "profile": d.profile,
        "reason": d.reason.value,
        "diagnostics": dict(d.diagnostics),
    }
