"""The control loop: observe -> estimate -> decide -> act -> record, one tick at a time.

Owns the Controller: the live state of one managed server (running profile, previous snapshot,
policy state, overrides, the trial in progress) and the operations the API and CLI call on it
(pin, pause, mode, manual switch, trial abort, clearing a block). The policy decides; the
actuation funnel acts; the store records. This module does no parsing (controller.observe) and
no policy arithmetic (policies/). Time comes from the injected Clock.

Safety rules the loop owns (the policy owns trials, rollbacks after a failed start or a failed
trial, and the quarantine of a profile that failed to start, `[policy] failed_profile_backoff_s`):
- Every actuation is recorded before the actuator is called (the decision, and an open switch
  row the funnel's `on_start` writes), and finished when it returns: a controller killed in the
  middle leaves an open row that the next start closes as `unknown`, and it adopts the server it
  finds (or waits for the one the interrupted switch was starting) instead of starting another.
- A crash outside a switch restarts the same profile after `[server] crash_backoff_s`, doubling
  per consecutive crash or failed restart up to `crash_backoff_max_s` (unless it repeats: below);
  a crash of the profile on trial rolls back at once to the profile before it (ROLLBACK_CRASH)
  and quarantines it.
- When nothing serves and the policy has no rollback left (the rollback itself failed), the last
  good profile is started again, with the same backoff.
- `[server] start_failure_limit` consecutive failed starts block automatic actuation, as an
  unknown outcome does, until a person clears the block through the API.
- `[controller] scrape_error_limit` consecutive failed scrapes mark the target down: a trial in
  progress ends inconclusive (failed scrapes are never evidence of a low rate) and rolls back;
  outside a trial the loop holds and says why in the status.
- A window never spans a gap: after a failed scrape the next good one starts a new window
  (a hung server's counters stand still while its scrapes fail: a window across the failures
  would read the hang as a very slow rate of the running profile), and so does a scrape more
  than scrape_error_limit + 1 polls after the last (as long a silence as one that would have
  marked the target down: a host or controller that stalled, a hang nobody scraped).
- A crash that repeats (start_failure_limit crashes in a row, or one inside the policy's
  min_dwell_s of the profile's start) while a profile that served before it is not quarantined
  is treated like a failed start: the crashed profile is quarantined (the policy's
  failed-profile backoff) and the profile that served before it comes back at once
  (ROLLBACK_CRASH), instead of restarts of a profile that keeps dying.
- An operator switch (or a trial abort's rollback) runs as a task beside the loop: while it is
  in flight the loop neither scrapes, probes nor decides (as during its own switches), a scrape
  that overlapped a switch's start or end is dropped, and `run` returns only once it ended. None
  begins during `startup` (the API answers then): the start is the daemon's own switch.
- The history is written best effort (`_history`): a write that fails (a full disk, a database
  gone read-only) is counted (specpilot_store_write_errors_total) and logged, the first of a run
  of failures as an error, and the loop goes on from memory: it keeps observing, deciding, and
  restarting a crashed server. The one write that is not best effort is the record of a switch
  away from a serving profile: unrecorded, the switch is not made. An operator's change (pin,
  pause, mode...) is recorded before it takes effect: the API's 503 means nothing changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from controller import adaptive_tables
from controller.actuators import Actuator, Funnel, SwitchOutcome, SwitchResult
from controller.clock import Clock
from controller.metrics import ControllerMetrics
from controller.observe import ObserveError, scrape
from controller.settings import Settings, policy_settings, routing_from
from policies import decide as policy
from policies.hybrid_decide import rewrites_table
from policies.observation import diff
from policies.reconcile import drop_unknown_pin, reconcile_profiles
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
from store import Store, StoreError

log = logging.getLogger("specpilot.loop")

STATE_KEY_POLICY = "policy_state"
STATE_KEY_OVERRIDES = "overrides"  # where Store.save_overrides writes them
STATE_KEY_LOOP = "loop"  # last good profile and the store id of the running trial's switch

_RECORDABLE = (SwitchOutcome.OK, SwitchOutcome.START_FAILED, SwitchOutcome.UNKNOWN)
RETENTION_EVERY_S = 3600.0  # server time between two Store.apply_retention runs
# Server seconds between two saves of a policy state that only learned (estimators, streams):
# a warm start after a kill loses at most this much learning. What a warm start must never lose
# (a switch, a trial, a quarantine, a new adaptive table: `_policy_milestones`) is saved on the
# tick it happens, and the whole state when the loop stops.
POLICY_STATE_SAVE_EVERY_S = 60.0
# The switch id `_actuate` returns for a start that acted but whose switch row could not be
# written (a full disk): no row has it (SQLite's row ids start at 1).
UNRECORDED_SWITCH = -1
# Where the loop saves, beside the overrides row (Store.save_overrides), the config file's mode
# at the time the row's mode was saved: a mode set through the API survives a restart while the
# file's mode is unchanged, and an edit of the file's mode wins at the next start.
STATE_KEY_MODE_SOURCE = "mode_source"


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
        if self.psettings.moe_experts:
            log.info(
                "model routing: %d experts, top-%d (from %s)",
                self.psettings.moe_experts,
                self.psettings.moe_topk,
                routing_from(settings, self.psettings.moe_experts),
            )
        self.mode: Mode = settings.controller.mode
        self.funnel = Funnel(actuator, lambda: self.mode)
        self.running: str | None = None
        self.last_good: str | None = None
        self.prev: Snapshot | None = None
        self.last_obs: Observation | None = None
        self.last_decision: Decision | None = None
        self.predictions: list[ProfilePrediction] = []
        # What each managed adaptive table file last held (adaptive_tables.sync).
        self._tables_written: dict[Path, str] = {}
        self.overrides = Overrides(mode=self.mode)
        self.trial_switch_id: int | None = None  # store id of the switch whose trial runs
        self.history: deque[TickRecord] = deque(maxlen=720)
        # Consecutive crashes and failed restarts (the backoff's exponent); reset once a server
        # has served for crash_backoff_max_s.
        self.crash_restarts = 0
        self.next_crash_restart_s = 0.0
        # A restart the loop owes (profile, reason, diagnostics), due at next_crash_restart_s.
        self.restart_plan: tuple[str, Reason, dict[str, Any]] | None = None
        self.start_failures = 0  # consecutive START_FAILED outcomes (start_failure_limit)
        self.scrape_errors = 0  # consecutive failed scrapes (scrape_error_limit)
        self.store_failures = 0  # history writes failed since the last tick that wrote (_history)
        self.served_since_s: float | None = None  # when the running server last came up
        self.ready = False  # first good scrape done
        # startup() runs (the API answers meanwhile): a switch in flight for the status, and
        # no operator switch may begin (the start is the daemon's switch); the profile it starts
        # (or waits for), None before it chose one.
        self.starting = False
        self.starting_profile: str | None = None
        self.state: policy.PolicyState | None = None
        self._on_tick: list[Callable[[Controller], None]] = []
        self._manual: asyncio.Task[SwitchResult] | None = None
        # Bumped when an actuation starts and when it ends: a scrape that began in another
        # epoch saw a server that is gone (or not yet up) and is dropped.
        self._epoch = 0
        # The profile that served last (crashed or not), and the one that served before it:
        # where a profile that keeps crashing goes back to.
        self._served_last: str | None = None
        self.came_from: str | None = None
        self._retention_at_s = float("-inf")
        self._policy_saved_at_s = float("-inf")
        self._policy_saved_key: str | None = None
        self._loop_saved: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------- lifecycle
    async def startup(self) -> None:
        """Warm start from the store, then adopt a running server (or wait for the one an
        interrupted switch was starting) or start the initial profile. `starting` is True
        meanwhile: the API answers during a cold start, the status shows a switch in flight (and
        `starting_profile` as the target's down_reason) and an operator switch is a
        ConflictError."""
        self.starting = True
        try:
            await self._startup()
        finally:
            self.starting = False
            self.starting_profile = None

    async def _startup(self) -> None:
        now = self.clock.now()
        # Durable operator state first: a mode set to advisory or a block set before the last
        # stop must hold for this start too.
        self._load_overrides(now)
        interrupted = self.store.open_switch()
        probe = await self.actuator.probe()
        started = False  # a server this start-up launched (not one adopted)
        if probe.up and probe.profile is not None:
            self.running = probe.profile
            log.info("adopted running server: profile=%s pid=%s", probe.profile, probe.pid)
        elif probe.up:
            raise RuntimeError(
                "a server is up on the port but its /server_info matches no profile in the "
                f"config ({probe.detail}); refusing to start a second one"
            )
        found = self.running or (
            f"server process {probe.pid} still starting" if probe.pid is not None else "nothing"
        )
        self._close_interrupted_switch(interrupted, found, now)
        self._load_loop_state()
        if self.running is None:
            chosen = self._operator_start_profile(now)
            first = chosen or self.settings.server.initial_profile
            if interrupted is not None and chosen is None:
                # A process still loading is the interrupted switch's target: wait for it (the
                # actuator adopts a server loading the asked profile); otherwise bring back the
                # profile that served before the switch.
                wanted = interrupted["to_profile"] if probe.pid is not None else None
                wanted = wanted or interrupted["from_profile"]
                if wanted in self.specs:
                    first = str(wanted)
            result, sid = await self._start_up_with(first, now)
            fallback = self.settings.server.initial_profile
            if chosen is not None and result.outcome is SwitchOutcome.START_FAILED:
                # The overrides' choice must not keep the daemon from starting at all.
                log.error("could not start %s: %s; starting %s", first, result.error, fallback)
                if self.overrides.pin_profile == first:
                    self._drop_failed_pin(result)
                first = fallback
                result, sid = await self._start_up_with(first, now)
            if sid is None and result.outcome is SwitchOutcome.SKIPPED_ADVISORY:
                log.warning(
                    "advisory mode and no server on %s: waiting for one to adopt",
                    self.settings.server.base_url,
                )
            elif sid is None and self.funnel.blocked_reason is not None:
                # Blocked before this start: wait for a person (the status says why); once the
                # block is cleared the loop starts this profile.
                self.last_good = self.last_good or first
                log.error("not starting %s: %s", first, result.error)
            elif result.outcome is not SwitchOutcome.OK:
                raise RuntimeError(f"could not start profile {first}: {result.error}")
            else:
                self.running = first
                self.served_since_s = self.clock.now()
                started = True
        if self.last_good is None or self.last_good not in self.specs:
            self.last_good = self.running
        saved = self.store.load_state(STATE_KEY_POLICY)
        tables = adaptive_tables.initial_tables(self.settings)
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
                adaptive_tables=tables,
            )
            if started:
                # Its boot was seen, not a server found serving: the dwell follows it.
                policy.on_start_up(self.state, self.clock.now())
        # The config may have been edited since the state was saved: it describes the profiles
        # configured now (removed ones forgotten, new ones untried, changed ones re-measured).
        changes = reconcile_profiles(
            self.state,
            list(self.specs.values()),
            self.settings.profile_digests(),
            running=self.running or self.settings.server.initial_profile,
            adaptive_tables=tables,
            now_s=now,
        )
        if changes:
            log.info("profiles changed in the config since the saved state: %s", changes.describe())
        self._settle_restored_state()
        if self.running is not None:
            self._serving(self.running)
        self.metrics.set_profile(self.running)
        self.metrics.set_mode(self.mode)

    async def _start_up_with(self, profile: str, now: float) -> tuple[SwitchResult, int | None]:
        """The start-up's start of `profile` (nothing serves): shown as the status's target
        while it runs."""
        self.starting_profile = profile
        d = Decision(now, Action.SWITCH, profile, Reason.START, {"startup": True})
        return await self._actuate(d, start=True)

    def _operator_start_profile(self, now: float) -> str | None:
        """The profile the operator's overrides restored from the store ask a start with no
        server up to launch instead of `initial_profile`: the pinned one while a pin is in
        force, the last good one while a pause is (a pause holds what served), else None."""
        o = self.overrides
        if o.pin_active(now) and o.pin_profile in self.specs:
            return str(o.pin_profile)
        if o.pause_active(now) and self.last_good in self.specs:
            return str(self.last_good)
        return None

    def _serving(self, profile: str) -> None:
        """`profile` serves from now on (a start, switch, restart or adoption): remember the
        one that served before it, where a profile that keeps crashing goes back to."""
        if profile != self._served_last:
            self.came_from = self._served_last
            self._served_last = profile

    def _settle_restored_state(self) -> None:
        """A restored policy state may describe a moment the server has left behind: a switch
        the last controller decided but never reported (its process is gone: the shell lost it),
        or a trial of a profile that no longer runs."""
        assert self.state is not None
        self.state.pending = None
        trial = self.state.trial
        if trial is not None and trial.get("profile") != self.running:
            log.info("the trial of %s ended with the last controller", trial.get("profile"))
            self.state.trial = None
        if self.state.trial is None:
            self.trial_switch_id = None

    def _close_interrupted_switch(
        self, open_: dict[str, Any] | None, found: str, now: float
    ) -> None:
        """A switch left open by a controller that died mid-switch: its outcome is unknown, but
        the server found now (adopted above) is what runs."""
        if open_ is None:
            return
        self.store.finish_switch(
            int(open_["id"]),
            ended_s=now,
            outcome="unknown",
            error=f"controller restarted during the switch; found {found}",
        )
        log.warning(
            "switch %s -> %s was interrupted by a controller restart; found: %s",
            open_["from_profile"],
            open_["to_profile"],
            found,
        )

    def _load_loop_state(self) -> None:
        saved = self.store.load_state(STATE_KEY_LOOP) or {}
        last_good = saved.get("last_good")
        if last_good in self.specs:
            self.last_good = str(last_good)
        sid = saved.get("trial_switch_id")
        self.trial_switch_id = int(sid) if isinstance(sid, int) else None

    def _save_loop_state(self) -> None:
        """Save the loop's own warm-start state when it changed (it rarely does)."""
        value = {"last_good": self.last_good, "trial_switch_id": self.trial_switch_id}
        if value != self._loop_saved:
            self.store.save_state(STATE_KEY_LOOP, value)
            self._loop_saved = value

    def _policy_milestones(self) -> str:
        """The part of the policy state a warm start must find as it was: what runs, the last
        switch, a pending switch, the trial, quarantines, rollbacks, detected changes and the
        adaptive tables. Everything else (the estimators' learning) may be a little behind."""
        assert self.state is not None
        st = self.state
        trial = st.trial or {}
        hybrid = getattr(st, "hybrid", None)
        return json.dumps(
            [
                self.running,
                st.running,
                st.last_switch_s,
                st.switches[-1] if st.switches else None,
                st.pending,
                trial.get("profile"),
                trial.get("from"),
                st.failed,
                st.rollback_to,
                st.last_change_s,
                st.regime_start_s,
                None if hybrid is None else hybrid.tables,
            ],
            sort_keys=True,
            default=str,
        )

    def save_policy_state(self, now: float, *, force: bool = False) -> bool:
        """Save the policy state for warm start when a milestone changed, when the last save is
        POLICY_STATE_SAVE_EVERY_S old, or when `force`d; returns whether it wrote."""
        assert self.state is not None
        key = self._policy_milestones()
        if (
            not force
            and key == self._policy_saved_key
            and now - self._policy_saved_at_s < POLICY_STATE_SAVE_EVERY_S
        ):
            return False
        self.store.save_state(STATE_KEY_POLICY, self.state.to_dict())
        self._policy_saved_key = key
        self._policy_saved_at_s = now
        return True

    async def _adopt_if_down(self) -> None:
        """No server known (advisory start, or a failed start): adopt one that came up."""
        if self.running is not None or self.funnel.busy:
            return
        probe = await self.actuator.probe()
        if self._manual_in_flight():
            return  # the operator's switch (its task) brings a server; it is not adopted
        if probe.up and probe.profile is not None:
            self.running = probe.profile
            self._serving(probe.profile)
            self.served_since_s = self.clock.now()
            self.prev = None
            self.restart_plan = None  # someone else brought a server back
            if self.last_good is None:
                self.last_good = probe.profile
            log.info("adopted server running %s", probe.profile)
            self.metrics.set_profile(self.running)

    def _load_overrides(self, now: float) -> None:
        """The operator state saved before the last stop (pin, pause, block, mode)."""
        saved = self.store.load_state(STATE_KEY_OVERRIDES) or {}
        mode = self._start_mode(saved.get("mode"))
        self.mode = mode
        restored = Overrides(
            pin_profile=saved.get("pin_profile"),
            pin_until_s=saved.get("pin_until_s"),
            paused_until_s=saved.get("paused_until_s"),
            mode=mode,
            blocked_reason=saved.get("blocked_reason"),
        )
        self.overrides = drop_unknown_pin(restored, self.specs)
        if self.overrides.pin_profile != restored.pin_profile:
            log.warning(
                "the pin to %s is dropped: no such profile in the config", restored.pin_profile
            )
        if self.overrides.blocked_reason:
            self.funnel.blocked_reason = self.overrides.blocked_reason
        if saved and saved.get("mode") != mode.value:
            # The file won over the saved mode: the saved row says so from now on.
            self._save_overrides()
        self._expire_overrides(now)

    def _start_mode(self, saved_mode: object) -> Mode:
        """The mode this start runs in. The config file's mode, unless a mode set through the
        API (PUT /v1/mode) was saved while the file said what it says now: an operator's mode
        outlives a restart, an edit of the file's mode wins at the next start. A saved mode
        whose file mode was not recorded (a row saved before it was) is taken to predate the
        file: the file wins. One log line whenever the saved mode and the file differ."""
        file_mode = self.settings.controller.mode
        if saved_mode is None:
            return file_mode
        try:
            saved = Mode(str(saved_mode))
        except ValueError:
            log.warning("saved mode %r unreadable: mode=%s from the config", saved_mode, file_mode)
            return file_mode
        if saved is file_mode:
            return file_mode
        source = self.store.load_state(STATE_KEY_MODE_SOURCE) or {}
        saved_file = source.get("file_mode") if source.get("mode") == saved.value else None
        if saved_file == file_mode.value:
            log.warning(
                "mode=%s (set through the API, saved in the database) overrides the config's "
                "mode=%s, which has not changed since; PUT /v1/mode or `specpilot mode` changes it",
                saved.value,
                file_mode.value,
            )
            return saved
        log.warning(
            "mode=%s from the config wins over the saved mode=%s (%s)",
            file_mode.value,
            saved.value,
            f"the config said mode={saved_file} when it was saved"
            if saved_file
            else "saved before the config's mode was recorded with it",
        )
        self.store.record_override(
            "mode",
            self.clock.now(),
            "config",
            mode=file_mode,
            reason=f"config mode changed since the saved mode={saved.value} was set",
        )
        return file_mode

    def _save_overrides(self, o: Overrides | None = None) -> None:
        """Save the overrides `o` (default: with the mode and the block as they are now;
        self.overrides catches up at the next tick), and beside them the config file's mode at
        this moment (what `_start_mode` compares the file with at the next start); one commit."""
        if o is None:
            o = self._current_overrides()
        with self.store.batch():
            self.store.save_overrides(o)
            self.store.save_state(
                STATE_KEY_MODE_SOURCE,
                {"mode": o.mode.value, "file_mode": self.settings.controller.mode.value},
            )

    def _operator_change(self, kind: str, actor: str, new: Overrides, **row: Any) -> None:
        """An operator's change of the overrides: its audit row and the saved overrides in one
        commit, then in effect. A StoreError (the API's 503) leaves everything as it was."""
        with self.store.batch():
            self.store.record_override(kind, self.clock.now(), actor, **row)
            self._save_overrides(new)
        self.overrides = new

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
            with self._history("the expired override"):
                self._save_overrides()

    # ----------------------------------------------------------------------------- the tick
    async def tick(self) -> Decision:
        """One control step. Never raises for a bad scrape or a failed switch: it records them."""
        t_real = time.perf_counter()
        now = self.clock.now()
        assert self.state is not None, "startup() first"
        self._expire_overrides(now)
        if self._manual_in_flight():
            return self._switch_in_flight_tick(now, t_real)

        await self._adopt_if_down()
        handled = await self._check_server(now)
        if handled is not None:
            self._refresh_predictions()
            return self._end_tick(handled, now, t_real)

        obs, scrape_ok = await self._observe(now)
        if self._manual_in_flight():
            return self._switch_in_flight_tick(now, t_real)
        if not scrape_ok or obs is not None:
            trial_before = self.state.trial
            self.state, decision = policy.decide(
                self.state, obs, now, self.psettings, self.overrides
            )
            self._record_trial_end(trial_before, decision, now)
            self._record_findings(now)
            if not scrape_ok:
                decision = self._judge_scrape_errors(decision, now)
        else:
            # First good scrape after a start: a window needs two snapshots.
            decision = Decision(
                now, Action.HOLD, self.running or "", Reason.HOLD_INSUFFICIENT_DATA, {"windows": 0}
            )
        self._refresh_predictions()
        # Hybrid profiles: the table a launch gets is on disk before any actuation.
        with self._history("a new adaptive table"):
            adaptive_tables.sync(self.settings, self.state, self.store, self._tables_written)

        # A switch to the running profile restarts it only to rewrite its adaptive table.
        rewrite = rewrites_table(decision)
        if decision.action is Action.SWITCH and (decision.profile != self.running or rewrite):
            decision = await self._act(decision, now)
        else:
            with self._history("the decision"):
                self._record_decision(decision, acted=False)
        return self._end_tick(decision, now, t_real)

    def _manual_in_flight(self) -> bool:
        """An operator switch or a trial abort's rollback (the `_manual` task) is running."""
        return self._manual is not None and not self._manual.done()

    def _switching(self) -> bool:
        """A switch is in flight: the loop's own (the funnel) or the operator's task."""
        return self.funnel.busy or self._manual_in_flight()

    @property
    def switch_in_flight(self) -> bool:
        """What the status and specpilot_switch_in_flight report: an actuation in progress, or
        the start-up (it adopts or starts the server)."""
        return self.starting or self.funnel.busy

    def _refuse_switch_now(self) -> None:
        """ConflictError (the API's 409) when an operator's switch cannot begin: the start-up
        runs (it starts the server, the daemon's own switch) or a switch is in flight."""
        if self.starting:
            raise ConflictError("the server is starting: try again once the start-up finished")
        if self._switching():
            raise ConflictError("a switch is in flight")

    def _switch_in_flight_tick(self, now: float, t_real: float) -> Decision:
        """A tick while the operator's switch task runs: like the ticks the loop's own switch
        holds back, it scrapes, probes, decides and records nothing (the server is being
        stopped or loaded; what serves is learned from the task's result). The daemon's per-tick
        callbacks (watchdog, status, a SIGHUP reload) still run."""
        d = Decision(
            now,
            Action.HOLD,
            self.running or "",
            Reason.HOLD_COOLDOWN,
            {"switch_in_flight": True},
        )
        return self._after_tick(d, t_real)

    def _refresh_predictions(self) -> None:
        """What every profile is predicted to deliver, as decide sees it (the configured
        stale_widen): for the status, the estimates table, the metrics and a trial's baseline."""
        assert self.state is not None
        self.predictions = policy.predictions(self.state, self.psettings.stale_widen)
        self.metrics.set_predictions(self.predictions)

    async def _observe(self, now: float) -> tuple[Observation | None, bool]:
        """Scrape the server: (the window since the last scrape or None, whether it answered).
        With nothing running there is nothing to observe (and nothing to count as an error)."""
        if self.running is None:
            self.metrics.target_up.set(0)
            return None, False
        epoch = self._epoch
        try:
            snap = await scrape(
                self.client, self.settings.server.base_url, profile=self.running, t_s=now
            )
        except ObserveError as e:
            if epoch != self._epoch:
                return self._drop_scrape()
            # The next good scrape starts a new window: one across the failures would read a
            # hung server's standstill as a low rate of the running profile.
            self.prev = None
            self.scrape_errors += 1
            self.metrics.scrape_errors.inc()
            self.metrics.target_up.set(0)
            limit = self.settings.controller.scrape_error_limit
            if self.scrape_errors == limit:
                log.error("target down: %d consecutive failed scrapes (last: %s)", limit, e)
            else:
                log.warning("scrape failed (%d in a row): %s", self.scrape_errors, e)
            return None, False
        if epoch != self._epoch:
            return self._drop_scrape()
        if self.scrape_errors >= self.settings.controller.scrape_error_limit:
            log.warning("target up again after %d failed scrapes", self.scrape_errors)
        self.scrape_errors = 0
        self.metrics.target_up.set(1)
        self.ready = True
        obs = None
        prev = self.prev
        if prev is not None and prev.profile == snap.profile:
            ctl = self.settings.controller
            gap_s = snap.t_s - prev.t_s
            if gap_s > (ctl.scrape_error_limit + 1) * ctl.poll_interval_s:
                log.warning(
                    "no window over the %.0f s since the last scrape (more than "
                    "scrape_error_limit + 1 = %d polls): a new window starts",
                    gap_s,
                    ctl.scrape_error_limit + 1,
                )
            else:
                obs = diff(prev, snap)
        self.prev = snap
        if obs is not None:
            self.last_obs = obs
            with self._history("an observation"):
                self.store.record_observation(obs)
            self.metrics.observe_window(obs)
        return obs, True

    def _drop_scrape(self) -> tuple[Observation | None, bool]:
        """A scrape that overlapped the start or the end of a switch: it may have read the old
        server, the new one or neither, under the wrong profile. Neither a window nor an error;
        the next scrape starts a new window."""
        log.debug("scrape dropped: a switch started or ended while it was in flight")
        self.prev = None
        return None, True

    def _judge_scrape_errors(self, d: Decision, now: float) -> Decision:
        """The trial's consecutive-error limit: a profile on trial whose scrapes keep failing
        cannot be judged. Its trial ends inconclusive (a failed scrape is no evidence of a low
        rate) and the profile before it comes back; the unobservable profile is quarantined like
        one that failed to start."""
        assert self.state is not None
        trial = self.state.trial
        n = self.scrape_errors
        if (
            n < self.settings.controller.scrape_error_limit
            or trial is None
            or trial.get("profile") != self.running
            or d.action is not Action.HOLD
        ):
            return d
        failed = str(trial["profile"])
        self.state.trial = None
        self.state.failed[failed] = now
        self._finish_trial("inconclusive", now, trial, {"scrape_errors": n})
        return Decision(
            now,
            Action.SWITCH,
            str(trial["from"]),
            Reason.ROLLBACK_TRIAL_FAILED,
            {"trial_outcome": "inconclusive", "scrape_errors": n, "failed_profile": failed},
        )

    def _end_tick(self, decision: Decision, now: float, t_real: float) -> Decision:
        assert self.state is not None
        failures = self.store_failures
        try:
            with self.store.batch():  # one commit for the tick's closing writes
                self.store.record_estimates(now, self.predictions)
                self.save_policy_state(now)
                self._save_loop_state()
        except StoreError as e:
            self._policy_saved_key = None  # not saved: the next tick tries again
            self._loop_saved = None
            self._history_failed("the tick's estimates and state", e)
        else:
            if failures:
                log.warning(
                    "history writes succeed again, after %d failed: what they carried is "
                    "missing from the database",
                    failures,
                )
                self.store_failures = 0
            with self._history("the retention pass"):
                self.maybe_apply_retention(now)
        self._remember(decision)
        return self._after_tick(decision, t_real)

    def _after_tick(self, decision: Decision, t_real: float) -> Decision:
        """Every tick's end, a held one's too: its duration, then the daemon's callbacks
        (watchdog, status, a SIGHUP reload)."""
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
        acc = obs.verified_accept_length if obs is not None else None
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

    def _record_decision(self, d: Decision, *, acted: bool) -> int:
        decision_id = self.store.record_decision(d, mode=self.mode, acted=acted)
        self.metrics.count_decision(d)
        changed = (
            self.last_decision is None
            or self.last_decision.reason is not d.reason
            or self.last_decision.action is not d.action
            or d.action is Action.SWITCH
        )
        # One summary line per decision that differs from the last; repeats go to debug.
        log.log(
            logging.INFO if changed else logging.DEBUG,
            "decision: %s%s",
            d.summary(),
            "" if acted or d.action is Action.HOLD else " (not acted)",
        )
        return decision_id

    # ----------------------------------------------------------------------------- acting
    async def _actuate(
        self, d: Decision, *, start: bool, manual: bool = False
    ) -> tuple[SwitchResult, int | None]:
        """One start or switch through the funnel. The decision (acted) and an open switch row
        are written right before the actuator is called, and the row is finished when it
        returns; a funnel that does not act (advisory, busy, blocked) leaves the decision
        recorded as not acted and no switch row. Returns the result and the switch's id (None: not
        acted; UNRECORDED_SWITCH: a start that went ahead unrecorded)."""
        from_profile = self.running
        rec: dict[str, int] = {}
        predicted = self._prediction(d.profile)

        def on_start() -> None:
            self._epoch += 1  # a scrape in flight now reads a server being stopped
            # A start (nothing serves) goes ahead unrecorded; a switch does not (module doc):
            # its StoreError leaves the funnel before the actuator is called.
            with self._history(f"the start of {d.profile}") if start else contextlib.nullcontext():
                record()
            rec["acted"] = 1

        def record() -> None:  # one commit: the decision, the open switch and its trial
            with self.store.batch():
                decision_id = self._record_decision(d, acted=True)
                sid = self.store.start_switch(
                    from_profile, d.profile, d.reason.value, self.clock.now(), decision_id
                )
                if not start and d.reason in (Reason.SWITCH_PREDICTED_GAIN, Reason.SWITCH_MANUAL):
                    # The trial exists from the decision on; it runs once the profile serves. A
                    # start (nothing served before it) is no trial: nothing would ever judge
                    # it, and its row stayed "pending" for good.
                    self.store.record_trial(
                        sid,
                        "pending",
                        self.clock.now(),
                        predicted_tok_s=predicted.mean if predicted else None,
                    )
            rec["switch_id"] = sid

        funnel_call = self.funnel.start if start else self.funnel.switch
        try:
            result = await funnel_call(d.profile, manual=manual, on_start=on_start)
        except StoreError as e:  # a switch's record failed: nothing was touched
            self._history_failed(f"the switch to {d.profile}", e)
            result = SwitchResult(
                SwitchOutcome.REFUSED_BUSY,
                self.running,
                d.profile,
                0.0,
                error=f"the switch could not be recorded, so it was not made ({e})",
            )
        if not rec:
            with self._history("a decision not acted on"):
                self._record_decision(d, acted=False)
            if result.outcome is SwitchOutcome.SKIPPED_ADVISORY:
                # The policy keeps its pending switch (it holds, as after a real one, instead of
                # repeating the advice every tick until the pending switch times out).
                log.info("advisory: not acting on %s %s", d.action.value, d.profile)
            else:
                # Refused (blocked, or another switch in flight): it never happened, so the
                # policy must not wait for it; it decides again on the next tick.
                if self.state is not None:
                    self.state.pending = None
                log.warning("not acting on %s %s: %s", d.action.value, d.profile, result.error)
            return result, None
        self._epoch += 1  # the server changed hands: scrapes begun during the switch are stale
        sid = rec.get("switch_id")
        with self._history(f"the end of the switch to {d.profile}"):
            self._finish_switch(sid, result, d.reason)
        return result, UNRECORDED_SWITCH if sid is None else sid

    @contextlib.contextmanager
    def _history(self, what: str) -> Iterator[None]:
        """Best-effort history (module doc): a StoreError inside is counted and logged
        (`_history_failed`) and the caller goes on."""
        try:
            yield
        except StoreError as e:
            self._history_failed(what, e)

    def _history_failed(self, what: str, e: StoreError) -> None:
        """Count a failed history write; the first of a run is an error line, the rest debug
        (the metric counts them all) until a tick's closing writes succeed again."""
        self.store_failures += 1
        self.metrics.store_write_errors.inc()
        log.log(
            logging.ERROR if self.store_failures == 1 else logging.DEBUG,
            "%s was not recorded (%s); the loop goes on from memory (further failures: "
            "specpilot_store_write_errors_total)",
            what,
            e,
        )

    def _finish_switch(self, sid: int | None, result: SwitchResult, reason: Reason) -> None:
        """Count the switch and close its row (None: a start whose row could not be written)."""
        self.metrics.switches.labels(reason.value, result.outcome.value).inc()
        if result.outcome is SwitchOutcome.OK:
            self.metrics.downtime.observe(result.downtime_s)
        if sid is None:
            return
        if result.outcome in _RECORDABLE:
            outcome, error = result.outcome.value, result.error
        else:
            # The actuator refused before touching anything (a server already holds the port).
            outcome, error = "start_failed", f"refused, nothing was touched: {result.error}"
        self.store.finish_switch(
            sid,
            ended_s=self.clock.now(),
            outcome=outcome,
            downtime_s=result.downtime_s,
            error=error,
        )

    def _prediction(self, profile: str) -> Estimate | None:
        return next((p.tok_s for p in self.predictions if p.profile == profile), None)

    async def _act(self, d: Decision, now: float) -> Decision:
        result, sid = await self._actuate(d, start=False)
        if sid is not None:
            self._after_switch(result, d.reason, now, sid)
        return d

    def _after_switch(
        self, result: SwitchResult, reason: Reason, now: float, switch_id: int
    ) -> None:
        assert self.state is not None
        self.prev = None  # counters restart with the server
        self.scrape_errors = 0  # a new server (or none): its own count starts
        if reason.value.startswith("rollback"):
            self.metrics.rollbacks.labels(reason.value).inc()
        pending_trial = reason in (Reason.SWITCH_PREDICTED_GAIN, Reason.SWITCH_MANUAL)
        if result.outcome is SwitchOutcome.REFUSED_BUSY:
            # Nothing was touched; the next tick adopts what holds the port.
            self.state.pending = None
            self.running = None
            if pending_trial:
                self._trial_row(switch_id, "inconclusive", {"refused": result.error})
        elif result.outcome is SwitchOutcome.UNKNOWN:
            # The policy's pending switch will never be reported: the shell lost it. What runs
            # is found (and adopted, never acted on) by the next ticks' probes.
            self.state.pending = None
            self.state.trial = None
            self.running = None
            self.overrides = replace(self.overrides, blocked_reason=self.funnel.blocked_reason)
            with self._history("the block"):
                self._save_overrides()
            if pending_trial:
                self._trial_row(switch_id, "inconclusive", {"unknown": result.error})
            log.error("switch outcome unknown: automatic switching stopped: %s", result.error)
        elif result.outcome is SwitchOutcome.OK:
            self.state = policy.on_switch_done(
                self.state, result.to_profile, True, result.downtime_s, self.clock.now()
            )
            self.running = result.to_profile
            self._serving(result.to_profile)
            self.served_since_s = self.clock.now()
            self.start_failures = 0
            self.restart_plan = None
            trial = self.state.trial
            if trial is not None and trial.get("profile") == result.to_profile:
                # The policy judges the new profile against its prediction (policies.trial).
                self.trial_switch_id = switch_id
                self._trial_row(switch_id, "running", None, trial)
            else:
                if pending_trial:
                    self._trial_row(switch_id, "inconclusive", {"no_prediction": True})
                if reason is not Reason.ROLLBACK_TRIAL_FAILED:
                    self.last_good = result.to_profile
        else:
            # START_FAILED: nothing serves now; the policy quarantines the profile and its next
            # decision rolls back (ROLLBACK_START_FAILED).
            self.state = policy.on_switch_done(
                self.state, result.to_profile, False, result.downtime_s, self.clock.now()
            )
            self.running = None
            if pending_trial:
                self._trial_row(switch_id, "failed", {"start_failed": result.error})
            log.error("switch to %s failed to start: %s", result.to_profile, result.error)
            if self.overrides.pin_profile == result.to_profile:
                self._drop_failed_pin(result)
            self._count_failed_start(result)
        self.metrics.set_profile(self.running)

    def _drop_failed_pin(self, result: SwitchResult) -> None:
        """A pinned profile that fails to start is unpinned (audit row by specpilot): kept, the
        pin would start it again at every tick, the server down in between, until the failure
        limit blocks everything; without it the next tick rolls back to what served."""
        first_line = (result.error or "no detail").splitlines()[0]
        why = f"{result.to_profile} failed to start: {first_line}"
        new = self._current_overrides(pin_profile=None, pin_until_s=None)
        try:
            self._operator_change("unpin", "specpilot", new, reason=why)
        except StoreError as e:
            self._history_failed("the unpin of a profile that failed to start", e)
            self.overrides = new
        log.error("pin on %s dropped: %s; pin it again once it can start", result.to_profile, why)

    def _count_failed_start(self, result: SwitchResult) -> None:
        """The failure limit: after start_failure_limit failed starts in a row, automatic
        actuation stops until a person clears it (restarting again cannot fix a broken host)."""
        self.start_failures += 1
        limit = self.settings.server.start_failure_limit
        if self.start_failures < limit or self.funnel.blocked_reason is not None:
            return
        first_line = (result.error or "no detail").splitlines()[0]
        self.funnel.block(
            f"{self.start_failures} failed starts in a row (last: {result.to_profile}: "
            f"{first_line}); start_failure_limit={limit}"
        )
        self.restart_plan = None
        self.overrides = replace(self.overrides, blocked_reason=self.funnel.blocked_reason)
        with self._history("the block"):
            self._save_overrides()
        log.error("automatic actuation stopped: %s", self.funnel.blocked_reason)

    def _trial_row(
        self,
        switch_id: int,
        state: str,
        detail: dict[str, Any] | None,
        trial: dict[str, Any] | None = None,
    ) -> None:
        """A trial state at the end of its switch (stamped now, after the switch's own rows)."""
        predicted = (trial or {}).get("predicted") or {}
        with self._history(f"the trial row of switch {switch_id}"):
            self.store.record_trial(
                switch_id,
                state,
                self.clock.now(),
                predicted_tok_s=predicted.get("mean"),
                detail=detail,
            )

    def _finish_trial(
        self, outcome: str, now: float, trial: dict[str, Any], detail: dict[str, Any]
    ) -> None:
        """Record the end of the running trial (the policy's or one the loop ended)."""
        sid = self.trial_switch_id
        self.trial_switch_id = None
        windows = list(trial.get("windows") or [])
        log.info("trial of %s: %s %s", trial.get("profile"), outcome, detail)
        if sid is None:
            return
        with self._history(f"the end of the trial of {trial.get('profile')}"):
            self.store.record_trial(
                sid,
                outcome,
                now,
                predicted_tok_s=(trial.get("predicted") or {}).get("mean"),
                observed_tok_s=sum(windows) / len(windows) if windows else None,
                detail={"windows": windows, **detail},
            )

    def _record_trial_end(self, before: dict[str, Any] | None, d: Decision, now: float) -> None:
        """Mirror the policy's trial into the store when it ends."""
        if before is None or self.state is None or self.state.trial is not None:
            return
        if d.reason is Reason.ROLLBACK_TRIAL_FAILED:
            outcome = "failed"
        else:
            outcome = str(d.diagnostics.get("trial_outcome") or "inconclusive")
            if outcome not in ("successful", "failed", "inconclusive"):
                outcome = "inconclusive"
        # A failed trial that still served more than the profile it left ends without a
        # rollback: the row says so, and what that profile was predicted to serve.
        kept = {
            k: d.diagnostics[k]
            for k in ("trial_kept_over", "trial_kept_over_tok_s")
            if k in d.diagnostics
        }
        self._finish_trial(outcome, now, before, kept)
        if outcome == "successful":
            self.last_good = str(before["profile"])

    def _record_findings(self, now: float) -> None:
        assert self.state is not None
        for f in self.state.new_findings:
            msg = (
                f"{f.kind}: {f.subject} moved from {f.before:.4g} to {f.after:.4g}"
                f"{' ' + f.unit if f.unit else ''}"
            )
            with self._history(f"a finding ({f.kind})"):
                self.store.record_finding(f.kind, now, msg, subject=f.subject, numbers=f.to_dict())
            self.metrics.findings.labels(f.kind).inc()
            # A change point comes with every traffic change (and the odd noisy one); drift
            # and acceptance far below history are what an operator is warned of.
            log.log(logging.INFO if f.kind == "change" else logging.WARNING, "finding: %s", msg)

    # ----------------------------------------------------------------------------- crashes
    def _backoff_s(self, n: int) -> float:
        srv = self.settings.server
        return float(
            min(srv.crash_backoff_max_s, srv.crash_backoff_s * 2 ** min(max(n - 1, 0), 30))
        )

    async def _check_server(self, now: float) -> Decision | None:
        """Outside a switch: notice a server that died and bring one back (see the module
        docstring). Returns the tick's decision when this handled the tick, else None."""
        assert self.state is not None
        if self.funnel.busy:
            return None
        if self.running is not None:
            alive = await self.actuator.alive()
            if self._switching():
                return None  # an operator switch began meanwhile: it stops this server
            if alive:
                max_s = self.settings.server.crash_backoff_max_s
                if self.served_since_s is not None and now - self.served_since_s >= max_s:
                    self.crash_restarts = 0  # served long enough: the next crash is a new story
                return None
            self._on_crash(now)
        elif (
            self.restart_plan is None
            and self.last_good is not None
            and self.mode is Mode.ACTIVE
            and self.funnel.blocked_reason is None
            and self.state.rollback_to is None
            and (self._manual is None or self._manual.done())
        ):
            # Nothing serves and the policy has no rollback left (it failed too): the last good
            # profile again (the pinned one under a pin), after a backoff.
            self.crash_restarts += 1
            self.restart_plan = (
                self._operator_start_profile(now) or self.last_good,
                Reason.ROLLBACK_START_FAILED,
                {"nothing_serves": True, "attempt": self.crash_restarts},
            )
            self.next_crash_restart_s = now + self._backoff_s(self.crash_restarts)
        if self.restart_plan is None:
            return None
        return await self._restart_when_due(now)

    def _on_crash(self, now: float) -> None:
        assert self.state is not None
        crashed = self.running
        assert crashed is not None
        served_since = self.served_since_s
        self.running = None
        self.prev = None
        self.served_since_s = None
        self.metrics.set_profile(None)
        self.metrics.target_up.set(0)
        trial = self.state.trial
        if self.mode is Mode.ADVISORY:
            log.error("server (%s) is down; advisory mode: not restarting it", crashed)
            return
        if trial is not None and trial.get("profile") == crashed:
            # Crashed on trial: back to the profile before it at once; the crashed one is
            # quarantined by the policy's failed-profile backoff.
            self.state.trial = None
            self.state.failed[crashed] = now
            self._finish_trial("failed", now, trial, {"crashed": True})
            back = str(trial["from"])
            self.restart_plan = (back, Reason.ROLLBACK_CRASH, {"crashed_profile": crashed})
            self.next_crash_restart_s = now
            log.error("server crashed on trial of %s: rolling back to %s", crashed, back)
            return
        back = self._crash_fallback(crashed, served_since, now)
        if back is not None:
            # It keeps dying: backed off like a profile that failed to start (the policy's
            # failed-profile quarantine), and the profile that served before it comes back.
            self.crash_restarts += 1
            self.state.failed[crashed] = now
            if self.last_good == crashed:
                self.last_good = back
            self.restart_plan = (
                back,
                Reason.ROLLBACK_CRASH,
                {"crashed_profile": crashed, "crash_restarts": self.crash_restarts},
            )
            self.next_crash_restart_s = now
            log.error(
                "server running %s died outside a switch (crash %d in a row, %s): quarantined, "
                "rolling back to %s",
                crashed,
                self.crash_restarts,
                "served for an unknown time"
                if served_since is None
                else f"served {now - served_since:.0f} s",
                back,
            )
            return
        self.crash_restarts += 1
        backoff = self._backoff_s(self.crash_restarts)
        self.restart_plan = (
            crashed,
            Reason.RESTART_CRASHED,
            {"crash_restarts": self.crash_restarts},
        )
        self.next_crash_restart_s = now + backoff
        log.error(
            "server running %s died outside a switch (crash %d in a row): restart in %.0f s",
            crashed,
            self.crash_restarts,
            backoff,
        )

    def _crash_fallback(self, crashed: str, served_since: float | None, now: float) -> str | None:
        """Where a crash outside a trial goes instead of a restart of the same profile: the
        profile that served before it, when the crash repeats (the start_failure_limit-th in a
        row, counting failed restarts) or came inside the policy's min_dwell_s of the crashed
        server's start (a profile that dies that soon is no better than one that failed to
        start), and that profile is not quarantined itself. None: restart the same one (also
        when an operator's pin holds the crashed profile: the pin beats a rollback)."""
        assert self.state is not None
        if self.overrides.pin_active(now) and self.overrides.pin_profile == crashed:
            return None
        soon = served_since is not None and now - served_since < self.psettings.min_dwell_s
        repeated = self.crash_restarts + 1 >= self.settings.server.start_failure_limit
        if not (soon or repeated):
            return None
        for back in (self.came_from, self.last_good):
            if back is None or back == crashed or back not in self.specs:
                continue
            failed_at = self.state.failed.get(back)
            if failed_at is not None and now - failed_at < self.psettings.failed_profile_backoff_s:
                continue
            return back
        return None

    async def _restart_when_due(self, now: float) -> Decision:
        assert self.state is not None and self.restart_plan is not None
        target, reason, diag = self.restart_plan
        if now < self.next_crash_restart_s:
            d = Decision(
                now,
                Action.HOLD,
                target,
                Reason.HOLD_INSUFFICIENT_DATA,
                {**diag, "server_down": True, "restart_in_s": self.next_crash_restart_s - now},
            )
            with self._history("the decision"):
                self._record_decision(d, acted=False)
            return d
        d = Decision(now, Action.SWITCH, target, reason, dict(diag))
        result, sid = await self._actuate(d, start=True)
        if sid is None:
            return d  # advisory, or blocked: nothing was touched
        if reason.value.startswith("rollback"):
            self.metrics.rollbacks.labels(reason.value).inc()
        self.prev = None
        self.scrape_errors = 0
        if result.outcome is SwitchOutcome.OK:
            self.restart_plan = None
            self.state = policy.on_switch_done(
                self.state, target, True, result.downtime_s, self.clock.now()
            )
            self.running = target
            self._serving(target)
            self.served_since_s = self.clock.now()
            self.start_failures = 0
            self.next_crash_restart_s = 0.0
        elif result.outcome is SwitchOutcome.START_FAILED:
            self.crash_restarts += 1
            self._count_failed_start(result)
            if self.restart_plan is not None:  # not blocked by the failure limit
                backoff = self._backoff_s(self.crash_restarts)
                self.next_crash_restart_s = self.clock.now() + backoff
                log.error(
                    "restart of %s failed (%s); next try in %.0f s",
                    target,
                    (result.error or "").splitlines()[0] if result.error else "no detail",
                    backoff,
                )
        else:
            # UNKNOWN (the funnel blocked) or refused (a server holds the port: adopted next).
            self.restart_plan = None
        self.metrics.set_profile(self.running)
        return d

    # ----------------------------------------------------------------------------- operator ops
    def _check_profile(self, profile: str) -> None:
        """A profile an operator names (pin, switch) must be one of the config (the policy
        state has the same profiles: startup reconciles them)."""
        if profile not in self.specs:
            raise UnknownProfileError(profile)

    def _current_overrides(self, **changes: Any) -> Overrides:
        """The overrides as they are now (mode and block included), with `changes`."""
        now = {"mode": self.mode, "blocked_reason": self.funnel.blocked_reason}
        return replace(self.overrides, **{**now, **changes})

    def pin(self, profile: str, ttl_s: float | None, reason: str, actor: str) -> None:
        self._check_profile(profile)
        until = None if ttl_s is None else self.clock.now() + ttl_s
        new = self._current_overrides(pin_profile=profile, pin_until_s=until)
        self._operator_change(
            "pin", actor, new, profile=profile, ttl_s=ttl_s, until_s=until, reason=reason
        )

    def unpin(self, reason: str, actor: str) -> None:
        """Remove the pin; with none set, nothing changes and no audit row is written (the
        request is idempotent, and the audit log lists only what changed)."""
        if self.overrides.pin_profile is None:
            log.info("unpin by %s: no pin was set", actor)
            return
        new = self._current_overrides(pin_profile=None, pin_until_s=None)
        self._operator_change("unpin", actor, new, reason=reason)

    def pause(self, ttl_s: float, reason: str, actor: str) -> None:
        until = self.clock.now() + ttl_s
        new = self._current_overrides(paused_until_s=until)
        self._operator_change("pause", actor, new, ttl_s=ttl_s, until_s=until, reason=reason)

    def resume(self, reason: str, actor: str) -> None:
        """End the pause; with none set, nothing changes and no audit row is written."""
        if self.overrides.paused_until_s is None:
            log.info("resume by %s: no pause was set", actor)
            return
        new = self._current_overrides(paused_until_s=None)
        self._operator_change("resume", actor, new, reason=reason)

    def set_mode(self, mode: Mode, reason: str, actor: str) -> None:
        self._operator_change(
            "mode", actor, self._current_overrides(mode=mode), mode=mode, reason=reason
        )
        leaving_advisory = self.mode is Mode.ADVISORY and mode is not Mode.ADVISORY
        self.mode = mode
        self.metrics.set_mode(mode)
        if leaving_advisory and self.state is not None and not self._switching():
            # Advice not acted on left the policy waiting for a switch that never began (it
            # holds instead of repeating the advice): active now, it decides again at once
            # rather than when that switch would have timed out.
            self.state.pending = None

    def clear_block(self, reason: str, actor: str) -> None:
        self._operator_change(
            "clear_block", actor, self._current_overrides(blocked_reason=None), reason=reason
        )
        self.funnel.clear_block()
        # A person looked: starts get a fresh failure count and the next one comes at once.
        self.start_failures = 0
        self.crash_restarts = 0
        self.next_crash_restart_s = 0.0

    def abort_trial(self, reason: str, actor: str) -> bool:
        """Judge the running trial failed now and roll back to the profile before it
        (ConflictError during the start-up, which is still loading the trial, and while a
        switch is in flight; False when no trial runs)."""
        trial = self.state.trial if self.state is not None else None
        if trial is None and not self.starting:
            return False
        self._refuse_switch_now()
        assert self.state is not None and trial is not None
        now = self.clock.now()
        self.store.record_override(
            "trial_abort", now, actor, profile=str(trial["profile"]), reason=reason
        )
        self.state.trial = None
        self._finish_trial("failed", now, trial, {"aborted_by": actor, "reason": reason})
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
        """A one-off switch asked by an operator; runs as a task (still a trial). Refused
        (ConflictError) while the start-up runs, while a switch is in flight, while a trial runs
        (its verdict or an abort ends it first: a switch under it would leave it unjudged), into
        the profile that already runs (a restart for nothing) and away from a pin in force (the
        pin would switch straight back)."""
        self._check_profile(profile)
        self._refuse_switch_now()
        trial = self.state.trial if self.state is not None else None
        if trial is not None:
            raise ConflictError(
                f"a trial of {trial['profile']} is running: wait for its verdict or "
                "POST /v1/trial/abort first"
            )
        if profile == self.running:
            raise ConflictError(f"{profile} is already running")
        now = self.clock.now()
        o = self.overrides
        if o.pin_active(now) and o.pin_profile != profile:
            # The pin beats every decision: the next tick would switch straight back.
            raise ConflictError(
                f"pinned to {o.pin_profile}: DELETE /v1/pin first (or pin {profile})"
            )
        d = Decision(
            now, Action.SWITCH, profile, Reason.SWITCH_MANUAL, {"actor": actor, "why": reason}
        )
        self.store.record_override(
            "switch", now, actor, profile=profile, ttl_s=None, until_s=None, reason=reason
        )
        self._manual = asyncio.create_task(self._manual_switch(d))

    async def _manual_switch(self, d: Decision) -> SwitchResult:
        if d.reason is Reason.SWITCH_MANUAL and self.state is not None:
            # Still a trial: judged against the model's prediction for the target, if it has one.
            policy.begin_manual_switch(self.state, d.profile, d.t_s)
        result, sid = await self._actuate(d, start=False, manual=True)
        if sid is not None:
            self._after_switch(result, d.reason, d.t_s, sid)
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
            "in_force": self._in_force(now),
        }

    def _in_force(self, now: float) -> str:
        """What decides the next tick, in words: the block, the pause (over a pin, which waits
        for it), the pin or the policy; in advisory mode, that nothing it decides is acted on."""
        o = self.overrides
        pinned = o.pin_profile if o.pin_active(now) else None
        if self.funnel.blocked_reason is not None:
            text = "blocked: nothing acts until POST /v1/block/clear"
        elif o.pause_active(now):
            text = "paused: nothing switches"
            if pinned is not None:
                text += f"; the pin on {pinned} acts when the pause ends"
        elif pinned is not None:
            text = f"pinned to {pinned}"
        else:
            text = "the policy"
        if self.mode is Mode.ADVISORY:
            text += " (advisory: decided, not acted on)"
        return text

    def status(self) -> dict[str, Any]:
        obs = self.last_obs
        d = self.last_decision
        return {
            "profile": self.running,
            "last_good_profile": self.last_good,
            "mode": self.mode.value,
            "switch_in_flight": self.switch_in_flight,
            "ready": self.ready,
            "overrides": self.override_view(),
            "trial": self._trial_view(),
            "observed": (
                {
                    "t_s": obs.t_s,
                    "window_s": obs.window_s,
                    "output_tok_s": obs.output_tok_s,
                    "running_reqs": obs.running_reqs,
                    "spec_accept_length": obs.verified_accept_length,
                }
                if obs
                else None
            ),
            "estimates": [prediction_view(p) for p in self.predictions],
            "last_decision": decision_view(d) if d else None,
            "target": self.target_view(),
            "adaptive_tables": adaptive_tables.status_view(self.state),
            "forward_cost": self.forward_cost_view(),
        }

    def forward_cost_view(self) -> dict[str, Any]:
        """The model's routing in force and the forward-cost roofline the estimator fitted over
        the served batch sizes (policies/forward_cost.py): milliseconds, its RMS relative
        residual, whether it fits well enough to centre predictions off the data, and the token
        count above which served forwards were compute-bound (inf, null in JSON: none was)."""
        ps = self.psettings
        view: dict[str, Any] = {
            "moe_experts": ps.moe_experts,
            "moe_topk": ps.moe_topk,
            "routing_from": routing_from(self.settings, ps.moe_experts),
            "roofline": None,
        }
        cycle = self.state.model.cycle if self.state is not None else None
        curve = cycle.forward_curve() if cycle is not None else None
        if cycle is not None and curve is not None:
            a, c, m0, m1, k, kv = curve.coef
            view["roofline"] = {
                "fixed_ms": a * 1e3,
                "speculative_ms": c * 1e3,
                "weights_ms": m0 * 1e3,
                "all_experts_ms": m1 * 1e3,
                "compute_ms_per_token": k * 1e3,
                "per_sequence_ms": kv * 1e3,
                "compute_bound_above_tokens": curve.kink_tokens,
                "rel_rms": curve.rel_rms,
                "points": curve.n_points,
                "used": cycle.usable_curve() is not None,
            }
        return view

    def target_view(self) -> dict[str, Any]:
        """The server's health as the loop sees it, and why it is not acting (if it is not)."""
        limit = self.settings.controller.scrape_error_limit
        down_reason = None
        if self.funnel.blocked_reason is not None:
            down_reason = f"automatic actuation blocked until cleared: {self.funnel.blocked_reason}"
        elif self.running is None and self.starting:
            down_reason = (
                f"start-up: starting {self.starting_profile}"
                if self.starting_profile is not None
                else "start-up: looking for a server to adopt"
            )
        elif self.running is None and self._switching():
            down_reason = "switch in flight"  # an operator's start of a server that was down
        elif self.running is None and self.restart_plan is not None:
            target, reason, _ = self.restart_plan
            wait = max(0.0, self.next_crash_restart_s - self.clock.now())
            down_reason = f"server down: {reason.value} of {target} in {wait:.0f} s"
        elif self.running is None:
            down_reason = "no server running"
        elif self.scrape_errors >= limit:
            down_reason = f"target down: {self.scrape_errors} consecutive failed scrapes"
        return {
            "up": self.running is not None and self.scrape_errors == 0 and self.ready,
            "consecutive_scrape_errors": self.scrape_errors,
            "scrape_error_limit": limit,
            "consecutive_failed_starts": self.start_failures,
            "start_failure_limit": self.settings.server.start_failure_limit,
            "crash_restarts": self.crash_restarts,
            "down_reason": down_reason,
        }

    def status_line(self) -> str:
        """One line for systemd's STATUS= (and `systemctl status`)."""
        d = self.last_decision
        last = f"{d.action.value} {d.profile} ({d.reason.value})" if d else "none"
        line = f"profile={self.running or '-'} mode={self.mode.value} last={last}"
        why = self.target_view()["down_reason"]
        return f"{line}; {why}" if why else line

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

    async def wait_for_operator_switch(self) -> None:
        """Wait for the operator switch (or trial abort's rollback) in flight, if any, to end
        and be recorded: a stop must not kill the server it is loading, nor leave its row open.
        `run` calls it before it returns, so the daemon stops the server only after it."""
        task = self._manual
        if task is None or task.done():
            return
        log.info("stopping: waiting for the operator's switch in flight to end")
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                raise  # this wait was cancelled, not the switch
            log.error("the operator's switch was cancelled")
        except Exception:
            log.exception("the operator's switch failed")

    async def run(
        self, stop: asyncio.Event, on_tick: Callable[[Controller], None] | None = None
    ) -> None:
        """Tick every poll_interval_s until `stop` is set (the tick in progress finishes, and
        an operator switch in flight runs to its end: wait_for_operator_switch)."""
        if on_tick is not None:
            self._on_tick.append(on_tick)
        failing: tuple[str, int] | None = None  # the failure repeating tick after tick, and count
        while not stop.is_set():
            interval = self.settings.controller.poll_interval_s  # a reload may change it
            started = self.clock.monotonic()
            try:
                await self.tick()
                failing = None
            except Exception as e:  # a bug in one tick must not kill the daemon: logged loudly,
                # with its traceback once; the same failure again (a full disk, every tick) is one
                # line each, not a journal of identical tracebacks.
                what = f"{type(e).__name__}: {e}"
                if failing is not None and failing[0] == what:
                    failing = (what, failing[1] + 1)
                    log.error("tick failed again (%d in a row): %s", failing[1], what)
                else:
                    failing = (what, 1)
                    log.exception("tick failed")
            elapsed = self.clock.monotonic() - started
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    stop.wait(),
                    timeout=self.clock.real_seconds(max(0.0, interval - elapsed))  # type: ignore[attr-defined]
                    or 0.001,
                )
        await self.wait_for_operator_switch()
        if self.state is not None:
            # What was learned since the last save survives a stop (a kill loses at most
            # POLICY_STATE_SAVE_EVERY_S of it).
            try:
                self.save_policy_state(self.clock.now(), force=True)
            except Exception:
                log.exception("could not save the policy state at stop")


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
