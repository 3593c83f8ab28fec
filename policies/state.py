"""What the policy remembers between ticks: `PolicyState`, JSON-serialisable with
to_dict/from_dict (the daemon persists it in SQLite and warm-starts from it), `initial_state` for
a server first seen running a profile, `new_model` (the estimators decide() runs, configured by
the settings), and `restart_time`, what a restart into a profile is expected to cost.

Must not: decide anything, read clocks, or do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies import hybrid_decide
from policies.changepoint import ChangeMonitor, Finding, RegimeDurations
from policies.estimators import ThroughputModel
from policies.hybrid_decide import HybridState, LongRunState
from policies.overhead import NonDecodeTime
from policies.settings import PolicySettings, settings_from_dict, settings_to_dict
from policies.types import ProfilePrediction, ProfileSpec, spec_from_dict, spec_to_dict

# Cycle changes remembered for the step-time moves of profiles not running (PolicyState):
# more than a day's worth at the CUSUM's false-alarm rate, bounded JSON.
MAX_CYCLE_MOVES = 20


@dataclass
class PolicyState:
    """Everything the policy remembers; JSON-serialisable with to_dict/from_dict."""

    profiles: tuple[ProfileSpec, ...]
    running: str
    start_s: float
    model: ThroughputModel
    monitor: ChangeMonitor
    regimes: RegimeDurations
    last_switch_s: float
    regime_start_s: float
    last_change_s: float | None = None
    # Whether the controller saw the running server's boot (its own start-up start: on_start_up)
    # rather than finding it serving: the dwell then follows that boot (decide.found_serving).
    boot_seen: bool = False
    switches: list[dict[str, Any]] = field(default_factory=list)
    restart_s: dict[str, float] = field(default_factory=dict)
    # Per profile, the boot its latest server reported (Observation.startup_s).
    startup_s: dict[str, float] = field(default_factory=dict)
    failed: dict[str, float] = field(default_factory=dict)
    pending: dict[str, Any] | None = None
    trial: dict[str, Any] | None = None
    rollback_to: str | None = None
    tried: set[str] = field(default_factory=set)
    findings: list[Finding] = field(default_factory=list)
    new_findings: list[Finding] = field(default_factory=list)
    boot_ref: dict[str, Any] | None = None
    last_window_t_s: float | None = None
    # The settings of the last decide (on_switch_done has no settings parameter).
    settings: PolicySettings = field(default_factory=PolicySettings)
    # The last full evaluation that ended in HOLD_BEST / HOLD_WITHIN_MARGIN (see reeval_*).
    eval_cache: dict[str, Any] | None = None
    # Non-decode seconds per decode token (prefill, scheduling): predictions over wall time.
    overhead: NonDecodeTime = field(default_factory=NonDecodeTime)
    # Time of the last detected change in acceptance or cycle time (an exploration weighed
    # and declined is weighed again after it; traffic changes in concurrency or mix are
    # regime boundaries but leave estimates valid).
    last_model_change_s: float | None = None
    # ... of which the last change in acceptance (what makes accept lengths stale: speculative
    # profiles only, a baseline's prediction holds none) and the last in cycle time (what
    # makes step times stale, every profile's). Each leaves the other kind's data fresh.
    last_accept_change_s: float | None = None
    last_cycle_change_s: float | None = None
    # Detected cycle changes as [time, step time after / before, 1 if the profile running then
    # was speculative else 0] (the newest MAX_CYCLE_MOVES): how far a change of system state
    # (FIELD.md's verify 20 -> 30 ms) may have taken the step times of the profiles of that
    # kind not running since (verify and decode forwards move apart: that reboot moved the
    # decode step only 89 -> 82 tok/s).
    cycle_moves: list[list[float]] = field(default_factory=list)
    # Time of the last detected traffic change (concurrency or mix): a cycle-time change at the
    # same time moved with the traffic, not with the system.
    last_traffic_change_s: float | None = None
    # Partial points of the per-workload streams: "accept:<profile>:<workload>" ->
    # [accepted tokens, verify steps]; "mix" -> {workload: tokens, "": requests}.
    stream_acc: dict[str, Any] = field(default_factory=dict)
    # Exploration weighed and declined, per profile: the information state it was weighed in.
    explore_declined: dict[str, str] = field(default_factory=dict)
    # Windows ingested since the running profile booted (traffic streams skip the first).
    boot_windows: int = 0
    # Adaptive profiles' tables (None without adaptive profiles).
    hybrid: HybridState | None = None
    # The batch sizes served and the flips of the traffic (the long-run rule, every profile set).
    long_run: LongRunState = field(default_factory=LongRunState)
    # The highest half-octave batch bucket each profile has served, ever (not forgotten with
    # the estimates: a batch size served once is not new again when its data fades).
    served_top: dict[str, int] = field(default_factory=dict)
    # The lowest such bucket each profile has served, ever.
    served_low: dict[str, int] = field(default_factory=dict)
    # Per profile, the digest of the definition its estimates were learned under (the shell's
    # hash of its flags and environment): a profile whose digest moved between runs is
    # re-measured (policies.reconcile). Empty in a state saved before digests were kept.
    digests: dict[str, str] = field(default_factory=dict)

    @property
    def specs(self) -> dict[str, ProfileSpec]:
        return {p.name: p for p in self.profiles}

    def model_prediction(
        self,
        name: str,
        stale_widen: float,
        batch: float | None = None,
        mix: Mapping[str, float] | None = None,
        cycle_moves: Sequence[tuple[float, float]] = (),
        verify_rise: float = 1.0,
    ) -> ProfilePrediction:
        """The cycle model's prediction of a fixed profile (decode tok/s), its accept lengths
        stale after the last change in acceptance and its step times after the last one in
        cycle time (see ThroughputModel.predict)."""
        return self.model.predict(
            name,
            batch=batch,
            mix=mix,
            fresh_since_s=self.last_accept_change_s,
            cycle_fresh_since_s=self.last_cycle_change_s,
            stale_widen=stale_widen,
            cycle_moves=cycle_moves,
            verify_rise=verify_rise,
        )

    def copy(self) -> PolicyState:
        return PolicyState.from_dict(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            "profiles": [spec_to_dict(p) for p in self.profiles],
            "running": self.running,
            "start_s": self.start_s,
            "model": self.model.to_dict(),
            "monitor": self.monitor.to_dict(),
            "regimes": self.regimes.to_dict(),
            "last_switch_s": self.last_switch_s,
            "boot_seen": self.boot_seen,
            "regime_start_s": self.regime_start_s,
            "last_change_s": self.last_change_s,
            "switches": [dict(s) for s in self.switches],
            "restart_s": dict(self.restart_s),
            "startup_s": dict(self.startup_s),
            "failed": dict(self.failed),
            "pending": _jsonable(self.pending),
            "trial": _jsonable(self.trial),
            "rollback_to": self.rollback_to,
            "tried": sorted(self.tried),
            "findings": [f.to_dict() for f in self.findings],
            "new_findings": [f.to_dict() for f in self.new_findings],
            "boot_ref": _jsonable(self.boot_ref),
            "last_window_t_s": self.last_window_t_s,
            "settings": settings_to_dict(self.settings),
            "eval_cache": _jsonable(self.eval_cache),
            "overhead": self.overhead.to_dict(),
            "last_model_change_s": self.last_model_change_s,
            "last_accept_change_s": self.last_accept_change_s,
            "last_cycle_change_s": self.last_cycle_change_s,
            "cycle_moves": [list(m) for m in self.cycle_moves],
            "last_traffic_change_s": self.last_traffic_change_s,
            "stream_acc": _jsonable(self.stream_acc),
            "explore_declined": dict(self.explore_declined),
            "boot_windows": self.boot_windows,
            "hybrid": self.hybrid.to_dict() if self.hybrid is not None else None,
            "long_run": self.long_run.to_dict(),
            "served_top": dict(self.served_top),
            "served_low": dict(self.served_low),
            "digests": dict(self.digests),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PolicyState:
        return cls(
            profiles=tuple(spec_from_dict(p) for p in d["profiles"]),
            running=str(d["running"]),
            start_s=float(d["start_s"]),
            model=ThroughputModel.from_dict(d["model"]),
            monitor=ChangeMonitor.from_dict(d["monitor"]),
            regimes=RegimeDurations.from_dict(d["regimes"]),
            last_switch_s=float(d["last_switch_s"]),
            # Saved before it was kept: taken as seen (the dwell holds, as it did then).
            boot_seen=bool(d.get("boot_seen", True)),
            regime_start_s=float(d["regime_start_s"]),
            last_change_s=d.get("last_change_s"),
            switches=[dict(s) for s in d.get("switches", [])],
            restart_s={k: float(v) for k, v in d.get("restart_s", {}).items()},
            startup_s={k: float(v) for k, v in d.get("startup_s", {}).items()},
            failed={k: float(v) for k, v in d.get("failed", {}).items()},
            pending=_jsonable(d.get("pending")),
            trial=_jsonable(d.get("trial")),
            rollback_to=d.get("rollback_to"),
            tried=set(d.get("tried", [])),
            findings=[Finding.from_dict(f) for f in d.get("findings", [])],
            new_findings=[Finding.from_dict(f) for f in d.get("new_findings", [])],
            boot_ref=_jsonable(d.get("boot_ref")),
            last_window_t_s=d.get("last_window_t_s"),
            settings=settings_from_dict(d["settings"]) if "settings" in d else PolicySettings(),
            eval_cache=_jsonable(d.get("eval_cache")),
            overhead=(
                NonDecodeTime.from_dict(d["overhead"]) if "overhead" in d else NonDecodeTime()
            ),
            last_model_change_s=d.get("last_model_change_s"),
            last_accept_change_s=d.get("last_accept_change_s"),
            last_cycle_change_s=d.get("last_cycle_change_s"),
            cycle_moves=[[float(x) for x in m] for m in d.get("cycle_moves", [])],
            last_traffic_change_s=d.get("last_traffic_change_s"),
            stream_acc=_jsonable(d.get("stream_acc", {})),
            explore_declined={str(k): str(v) for k, v in d.get("explore_declined", {}).items()},
            boot_windows=int(d.get("boot_windows", 0)),
            hybrid=HybridState.from_dict(d["hybrid"]) if d.get("hybrid") else None,
            # States saved before the long-run rule served every profile set kept the batch
            # history inside "hybrid".
            long_run=LongRunState.from_dict(d.get("long_run") or d.get("hybrid") or {}),
            served_top={str(k): int(v) for k, v in d.get("served_top", {}).items()},
            # States saved before served_low: the lowest bucket served is unknown, take the
            # highest (a lower size is then new only where the profile's own data say so too).
            served_low={
                str(k): int(v) for k, v in d.get("served_low", d.get("served_top", {})).items()
            },
            # States saved before digests: none known (policies.reconcile records them).
            digests={str(k): str(v) for k, v in d.get("digests", {}).items()},
        )


def _jsonable(x: Any) -> Any:
    """Deep copy of plain JSON data (dicts, lists, scalars)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def new_model(profiles: Sequence[ProfileSpec], s: PolicySettings) -> ThroughputModel:
    """The estimators decide() runs, configured by the policy settings (benchmarks reuse it)."""
    return ThroughputModel(
        profiles,
        cycle_half_life_s=s.cycle_half_life_s,
        accept_half_life_s=s.accept_half_life_s,
        concurrency_half_life_s=s.concurrency_half_life_s,
        mix_half_life_s=s.mix_half_life_s,
        observed_half_life_s=s.observed_half_life_s,
        min_windows=s.min_windows,
        min_steps=s.min_steps,
        min_verify=s.min_verify,
        min_hist_steps=s.min_hist_steps,
        expert_share=s.expert_share,
    )


def initial_state(
    profiles: Sequence[ProfileSpec],
    running: str,
    now_s: float,
    settings: PolicySettings,
    adaptive_tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> PolicyState:
    """Fresh state for `profiles` with `running` serving since `now_s` (the dwell starts now:
    the policy has no estimates of it yet either). `adaptive_tables`: per adaptive profile
    {"table": JSON, "managed": bool} (hybrid_decide.new_state; default: managed, seed table)."""
    names = [p.name for p in profiles]
    if running not in names:
        raise ValueError(f"running profile {running!r} is not one of {names}")
    if not math.isfinite(now_s):
        raise ValueError(f"now_s must be finite, got {now_s!r}")
    return PolicyState(
        profiles=tuple(profiles),
        running=running,
        start_s=float(now_s),
        model=new_model(profiles, settings),
        monitor=ChangeMonitor(
            settings.cusum_k,
            settings.cusum_h,
            settings.cusum_warmup,
            settings.cusum_z_clip,
            settings.cusum_rel_sigma_floor,
        ),
        regimes=RegimeDurations(settings.prior_regime_s, settings.prior_regime_strength),
        last_switch_s=float(now_s),
        regime_start_s=float(now_s),
        tried={running},
        settings=settings,
        overhead=NonDecodeTime(half_life_s=settings.nondecode_half_life_s),
        hybrid=hybrid_decide.new_state(tuple(profiles), adaptive_tables, float(now_s)),
    )


def restart_time(state: PolicyState, profile: str, s: PolicySettings) -> float:
    """The profile's learned restart time; for one never restarted, the longest learned for
    another (restarts of one model differ mostly by the CUDA graphs captured, and an adaptive
    profile captures a graph per tier: the cautious guess), else the prior, raised to the boot
    a server reported (`startup_s`: its own, else the longest of another's) plus
    `restart_overhead_s`. A reported boot is a lower bound, not an estimate: a restart also
    stops the old server, starts the process and warms up, which the engine's clock does not
    see, so it raises the prior where it is longer and leaves it where it is shorter (stress
    a12: a 10-minute restart priced at the 3-minute prior was paid inside an 8-stream start
    where it cost five times what it would have later)."""
    if profile in state.restart_s:
        return state.restart_s[profile]
    estimate = max(state.restart_s.values(), default=s.restart_prior_s)
    boot = state.startup_s.get(profile, max(state.startup_s.values(), default=None))
    return estimate if boot is None else max(estimate, boot + s.restart_overhead_s)
