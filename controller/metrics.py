"""specpilot's own Prometheus metrics, on a dedicated registry (never the global one).

Owns the metric names (prefix `specpilot_`, base units, `_total` counters, `_seconds`), their
help texts and the one function that refreshes them from a tick's results. Formatting is
prometheus_client's: nothing here writes exposition text by hand. Must not decide anything.

Label cardinality is bounded. Every label value comes from the configuration (profiles), from
closed enums (mode, action, reason, outcome, bound, finding kind) or, for one label, from
clients: `specpilot_accept_length{workload}` carries the workload label SGLang takes from each
request's custom labels, so any client can mint new values. It keeps its own series for at most
MAX_WORKLOAD_SERIES workloads, those with the most generation tokens recently (a per-window
decayed sum, WORKLOAD_DECAY); the others, and a client workload named "other" itself, are
folded into one `workload="other"` series (their accept length pooled: their tokens over their
verify steps). A workload that drops out of the top loses its series at once. Workload names
and their scores are tracked for at most MAX_TRACKED_WORKLOADS names, so memory is bounded too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from policies.changepoint import FindingKind
from policies.types import Decision, Mode, Observation, ProfilePrediction, Reason

# At most this many workloads have their own specpilot_accept_length series (per profile; only
# the running profile's series are exported); the rest share OTHER_WORKLOAD.
MAX_WORKLOAD_SERIES = 32
# The label value of the series the other workloads are folded into.
OTHER_WORKLOAD = "other"
# Per window, a workload's score (generation tokens) is multiplied by this before the window's
# tokens are added: about the last 10 windows count (half-life ~6.6 windows).
WORKLOAD_DECAY = 0.9
# Scores are kept for at most this many workload names (the highest); below the floor a score
# is forgotten.
MAX_TRACKED_WORKLOADS = 8 * MAX_WORKLOAD_SERIES
_SCORE_FLOOR = 1e-3


class ControllerMetrics:
    """All specpilot_* series. One instance per daemon (tests make their own)."""

    def __init__(self, profiles: Iterable[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.profiles = list(profiles)
        self._accept_labels: set[tuple[str, str]] = set()
        self._workload_scores: dict[str, float] = {}  # workload -> decayed generation tokens
        self.info_profile = Gauge(
            "specpilot_current_profile",
            "1 for the profile the server runs now, 0 for the others.",
            ["profile"],
            registry=r,
        )
        self.predicted_tok_s = Gauge(
            "specpilot_predicted_output_tokens_per_second",
            "Predicted output tokens/s of each profile for the traffic served now.",
            ["profile", "bound"],
            registry=r,
        )
        self.observed_tok_s = Gauge(
            "specpilot_observed_output_tokens_per_second",
            "Output tokens/s measured over the last window, for the profile running.",
            ["profile"],
            registry=r,
        )
        self.accept_length = Gauge(
            "specpilot_accept_length",
            "Accepted drafts + bonus per verify step, per workload, last window (the "
            f"{MAX_WORKLOAD_SERIES} workloads with the most tokens recently; the others pooled "
            f'as workload="{OTHER_WORKLOAD}").',
            ["profile", "workload"],
            registry=r,
        )
        self.predicted_accept_length = Gauge(
            "specpilot_predicted_accept_length",
            "Predicted accept length (accepted drafts + bonus per verify step) of each "
            "speculative profile for the traffic served now.",
            ["profile"],
            registry=r,
        )
        self.breakeven = Gauge(
            "specpilot_breakeven_accept_length",
            "Accept length a speculative profile needs to match baseline at this batch size.",
            ["profile"],
            registry=r,
        )
        self.cycle_seconds = Gauge(
            "specpilot_cycle_seconds",
            "Estimated decode cycle time per profile at the batch size it would serve now.",
            ["profile"],
            registry=r,
        )
        self.batch_size = Gauge(
            "specpilot_batch_size", "Mean running requests over the last window.", registry=r
        )
        self.decisions = Counter(
            "specpilot_decisions",
            "Decisions by action and reason.",
            ["action", "reason"],
            registry=r,
        )
        self.switches = Counter(
            "specpilot_switches",
            "Switches attempted, by reason and outcome.",
            ["reason", "outcome"],
            registry=r,
        )
        self.rollbacks = Counter(
            "specpilot_rollbacks",
            "Rollbacks to the last good profile, by reason.",
            ["reason"],
            registry=r,
        )
        self.downtime = Histogram(
            "specpilot_restart_downtime_seconds",
            "Server downtime per switch (server time).",
            buckets=(5, 15, 30, 60, 120, 180, 300, 600, 1200, float("inf")),
            registry=r,
        )
        self.mode = Gauge(
            "specpilot_mode", "1 for the mode in force (active|advisory).", ["mode"], registry=r
        )
        self.pinned = Gauge(
            "specpilot_override_pin",
            "1 while a pin is in force, per pinned profile.",
            ["profile"],
            registry=r,
        )
        self.pin_expiry = Gauge(
            "specpilot_override_pin_expiry_timestamp_seconds",
            "When the pin expires (0: no pin, +Inf: no expiry).",
            registry=r,
        )
        self.paused = Gauge("specpilot_override_paused", "1 while paused.", registry=r)
        self.pause_expiry = Gauge(
            "specpilot_override_pause_expiry_timestamp_seconds",
            "When the pause expires (0: not paused).",
            registry=r,
        )
        self.blocked = Gauge(
            "specpilot_blocked",
            "1 while automatic switching is stopped by an unknown outcome.",
            registry=r,
        )
        self.switch_in_flight = Gauge(
            "specpilot_switch_in_flight",
            "1 while a restart of the server is in progress.",
            registry=r,
        )
        self.trial = Gauge(
            "specpilot_trial_running",
            "1 for the profile on trial (judged against its prediction), per profile.",
            ["profile"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "specpilot_scrape_errors", "Failed scrapes of the server.", registry=r
        )
        self.store_write_errors = Counter(
            "specpilot_store_write_errors",
            "History writes that failed (a full disk, a database gone read-only); the loop "
            "goes on from memory, and a switch away from a serving profile is not made "
            "unrecorded.",
            registry=r,
        )
        self.target_up = Gauge(
            "specpilot_target_up", "1 if the last scrape of the server succeeded.", registry=r
        )
        self.tick_seconds = Histogram(
            "specpilot_tick_duration_seconds",
            "Wall time of one control tick (observe, estimate, decide, record).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, float("inf")),
            registry=r,
        )
        self.findings = Counter(
            "specpilot_findings",
            "Findings reported (drift, low acceptance...).",
            ["kind"],
            registry=r,
        )
        # Initialise labelled children so the series exist from the first scrape.
        for p in self.profiles:
            self.info_profile.labels(p).set(0)
        for m in Mode:
            self.mode.labels(m.value).set(0)
        for reason in Reason:
            self.decisions.labels("hold" if reason.name.startswith("HOLD") else "switch", reason)
            if reason.name.startswith("ROLLBACK"):
                self.rollbacks.labels(reason.value)  # rate() over zero, not over no series
        for kind in get_args(FindingKind):
            self.findings.labels(kind)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def set_profile(self, running: str | None) -> None:
        for p in self.profiles:
            self.info_profile.labels(p).set(1 if p == running else 0)

    def set_mode(self, mode: Mode) -> None:
        for m in Mode:
            self.mode.labels(m.value).set(1 if m is mode else 0)

    def observe_window(self, obs: Observation) -> None:
        """Observed series belong to the profile that runs: the others' last values are
        dropped, so that a dashboard never shows a stale rate as current. Per-workload accept
        lengths are bounded (module doc): the top workloads by recent tokens, the rest pooled
        as OTHER_WORKLOAD."""
        for p in self.profiles:
            if p != obs.profile:
                with contextlib.suppress(KeyError):
                    self.observed_tok_s.remove(p)
        for labels in [k for k in self._accept_labels if k[0] != obs.profile]:
            self.accept_length.remove(*labels)
            self._accept_labels.discard(labels)
        rate = obs.output_tok_s
        if rate is not None:
            self.observed_tok_s.labels(obs.profile).set(rate)
        if obs.running_reqs is not None:
            self.batch_size.set(obs.running_reqs)
        kept = self._rank_workloads(obs)  # never OTHER_WORKLOAD: a client's "other" is pooled
        for labels in [k for k in self._accept_labels if k[1] not in kept | {OTHER_WORKLOAD}]:
            self.accept_length.remove(*labels)  # fell out of the top: now part of "other"
            self._accept_labels.discard(labels)
        other_gen = other_verify = 0.0
        for w in obs.workloads:
            if w.generation_tokens and w.verify_calls:
                gen = w.generation_tokens - (w.requests or 0.0)
                if w.workload in kept:
                    self.accept_length.labels(obs.profile, w.workload).set(gen / w.verify_calls)
                    self._accept_labels.add((obs.profile, w.workload))
                else:
                    other_gen += gen
                    other_verify += w.verify_calls
        if other_verify > 0:
            self.accept_length.labels(obs.profile, OTHER_WORKLOAD).set(other_gen / other_verify)
            self._accept_labels.add((obs.profile, OTHER_WORKLOAD))

    def _rank_workloads(self, obs: Observation) -> set[str]:
        """Update the workloads' decayed token scores with this window and return the label
        values allowed their own series now: the MAX_WORKLOAD_SERIES best scores (ties by
        name). A client workload named OTHER_WORKLOAD is never scored: it is always pooled."""
        scores = self._workload_scores
        for name in list(scores):
            scores[name] *= WORKLOAD_DECAY
        for w in obs.workloads:
            tokens = w.generation_tokens
            if w.workload != OTHER_WORKLOAD and tokens and math.isfinite(tokens) and tokens > 0:
                scores[w.workload] = scores.get(w.workload, 0.0) + tokens
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
        self._workload_scores = {
            name: score for name, score in ranked[:MAX_TRACKED_WORKLOADS] if score >= _SCORE_FLOOR
        }
        return {name for name, _ in ranked[:MAX_WORKLOAD_SERIES]}

    def set_predictions(self, preds: Iterable[ProfilePrediction]) -> None:
        for p in preds:
            if p.tok_s is not None:
                self.predicted_tok_s.labels(p.profile, "mean").set(p.tok_s.mean)
                self.predicted_tok_s.labels(p.profile, "low").set(p.tok_s.low)
                self.predicted_tok_s.labels(p.profile, "high").set(p.tok_s.high)
            if p.cycle_s is not None:
                self.cycle_seconds.labels(p.profile).set(p.cycle_s.mean)
            if p.accept_length is not None:
                self.predicted_accept_length.labels(p.profile).set(p.accept_length.mean)
            if p.breakeven_accept_length is not None:
                self.breakeven.labels(p.profile).set(p.breakeven_accept_length)

    def count_decision(self, d: Decision) -> None:
        self.decisions.labels(d.action.value, d.reason.value).inc()

    def set_overrides(self, state: Mapping[str, object]) -> None:
        """`state` is Controller.override_view(): pin/pause/blocked with their expiries."""
        self.pinned.clear()
        pin = state.get("pin")
        if isinstance(pin, Mapping):
            self.pinned.labels(str(pin["profile"])).set(1)
            until = pin.get("until_s")
            self.pin_expiry.set(float("inf") if until is None else float(until))  # type: ignore[arg-type]
        else:
            self.pin_expiry.set(0)
        pause = state.get("pause")
        if isinstance(pause, Mapping):
            self.paused.set(1)
            self.pause_expiry.set(float(pause["until_s"]))  # type: ignore[arg-type]
        else:
            self.paused.set(0)
            self.pause_expiry.set(0)
        self.blocked.set(1 if state.get("blocked_reason") else 0)

    def set_activity(self, switch_in_flight: bool, trial_profile: str | None) -> None:
        """What is going on now (refreshed at scrape time)."""
        self.switch_in_flight.set(1 if switch_in_flight else 0)
        self.trial.clear()
        if trial_profile is not None:
            self.trial.labels(trial_profile).set(1)
