"""The policy: PolicyState, initial_state, decide, on_switch_done, predictions (its knobs are
policies/settings.py's PolicySettings, the value of an exploration policies/explore_value.py's).

Owns the decision of one tick. The objective is output tokens over time, and a restart serves
nothing for its whole duration, so a switch must repay it: with C the running profile's
predicted tok/s, N the candidate's, R the candidate's measured restart time and H the expected
remaining duration of the current regime (from the lengths of past regimes that outlived its
age once there are enough, else an exponential model: RegimeDurations.remaining_s), switch
only when

    (N - C - margin) x (H - R) > C x R,   margin = margin_frac x C + margin_z x sd(N - C)

and the minimum dwell, the restart budget, the no-flap rule (A -> B -> A inside the amortisation
horizon without a change point in between) and the burst rule (a regime younger than the restart
it would need is ridden out: ski rental, at most 2x the loss of an oracle on a burst, unless the
lengths of enough past regimes say switching now beats waiting) all allow it. Where the traffic
of the last long-run window (batch sizes and workload mix) values the candidate below the
running profile, the regimes that favour the running profile will come back and take the
switch back: its restart (R_back at C's long-run rate) is added to the cost
(hybrid_decide.return_cost), except on the way back from an exploration to the profile it
left, a restart the exploration's own cost already counted. Profiles never run, or whose data
predates the last detected change in acceptance or cycle time, and chains whose acceptance for
the mix served now is unknown (a workload in it that no chain of the drafter has served), are
explored when the expected value
of what a run reveals (for a chain, a deeper chain reveals every shallower one by truncation)
beats its expected cost, weighed once per regime and information state: re-exploration follows
detected changes, never a timer (the value of information grows with the expected remaining
regime, which grows with its age, so a value weighed again every tick would end up beating any
cost without anything having changed). A predicted gain that does not repay its restart (or
waits out a possible burst) holds only when no such exploration pays; past it only fixed
profiles are weighed.

Predicted tok/s are over wall time: the cycle model's decode rate r = B x E[L] / T(B) and the
non-decode seconds per decode token p learned from the windows (policies/overhead.py) give
1 / (1/r + p). Trials compare like with like: the decode rate a window observed against the
decode rate predicted (prefill after a restart does not count against a profile).

Change detection: acceptance is watched per workload (a mix shift moves a profile's overall
accept length while every workload's stays put; only a workload whose own level moved loses its
data), the workload mix and concurrency as traffic signals (regime boundaries that make no
estimate stale), cycle time per profile. A CUSUM halfway to its alarm is a suspected change:
nothing switches until it is confirmed (then the burst rule applies) or fades.

Traffic that flips faster than a restart pays (many regimes of minutes: the burst rule would
hold every one of them, and no regime's horizon would pay for an exploration) changes the
objective: the profile best over the recent distribution of batch sizes, explored and switched
to over the long-run horizon (policies/hybrid_decide.long_run, the same rule for fixed and
adaptive profile sets).

Precedence (first match wins): pause > pin > blocked > rollback after a failed start > failed
scrape > switch in flight > trial > unusable window > no traffic > dwell > suspected change >
long-run rule (flipping traffic; table rewrites) > estimates.

`decide` is deterministic and updates `state` in place (the estimators are O(1) sufficient
statistics; copying them every tick would cost more than the update). It returns the same object;
branch with `PolicyState.copy()`. Advisory mode is not the policy's business (the actuator
applies it): decisions are the same in both modes.

Must not: read clocks (`now_s` is a parameter), do I/O, or import anything outside
stdlib/numpy/scipy and policies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies import hybrid_decide
from policies.accept_length import cross_predictable
from policies.changepoint import (
    ChangeMonitor,
    CusumEvent,
    Finding,
    RegimeDurations,
    acceptance_finding,
    drift_finding,
)
from policies.cycle_time import comparable_step_s
from policies.estimators import ThroughputModel
from policies.explore_value import (
    breakeven_s,
    explore_gain,
    interval_sd,
    prior_dist,
    shortfall_below,
)
from policies.forgetting import batch_bucket
from policies.hybrid_decide import HybridState, LongRunState
from policies.overhead import NonDecodeTime, wall_estimate
from policies.settings import PolicySettings, settings_from_dict, settings_to_dict
from policies.trial import TrialOutcome, assess_trial, beats
from policies.types import (
    Action,
    Decision,
    Estimate,
    Observation,
    Overrides,
    ProfilePrediction,
    ProfileSpec,
    Reason,
    spec_from_dict,
    spec_to_dict,
)

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


# --------------------------------------------------------------------------------------------
# Observation intake


def _has_traffic(obs: Observation) -> bool | None:
    m = obs.moments
    if m is not None:
        return m.n_steps > 0
    tok = obs.output_tok_s
    if tok is not None:
        return tok > 0
    if obs.running_reqs is not None:
        return obs.running_reqs > 0
    return None


def _add_finding(state: PolicyState, f: Finding | None, s: PolicySettings) -> None:
    if f is None:
        return
    state.findings.append(f)
    state.new_findings.append(f)
    del state.findings[: -s.max_findings]


def _regime_boundary(state: PolicyState, t_change: float, s: PolicySettings) -> None:
    if state.last_change_s is not None and t_change - state.last_change_s < s.change_coalesce_s:
        return
    state.regimes.record(t_change - state.regime_start_s)
    state.regime_start_s = max(t_change, state.regime_start_s)
    state.last_change_s = t_change


def _later(a: float | None, b: float) -> float:
    return b if a is None else max(a, b)


def _model_change(state: PolicyState, t_change: float, what: str) -> None:
    """Estimates of acceptance or cycle time (`what`) moved: data older than this is stale."""
    state.last_model_change_s = _later(state.last_model_change_s, t_change)
    if what == "accept":
        state.last_accept_change_s = _later(state.last_accept_change_s, t_change)
    else:
        state.last_cycle_change_s = _later(state.last_cycle_change_s, t_change)


def _with_traffic(state: PolicyState, t_change: float, s: PolicySettings) -> bool:
    """Whether a change dated `t_change` coincides with a detected traffic change (concurrency
    or mix), within the time that makes two change points one."""
    t = state.last_traffic_change_s
    return t is not None and abs(t_change - t) <= s.change_coalesce_s


def _system_cycle_change(
    state: PolicyState, key: str, ev: CusumEvent, t_change: float, s: PolicySettings
) -> None:
    """A change of the running profile's step time (`key` "cycle:<profile>") that did not come
    with the traffic: drift reported, the profile's cycle data forgotten, every other profile's
    made stale, and the move remembered for the profiles of its forward kind (cycle_moves)."""
    p = key[len("cycle:") :]
    # The stream is step time / prediction: report it in seconds at the batch now.
    b = state.model.concurrency.estimate()
    st = state.model.cycle.stats[p]
    ref = st.level if st.s0 > 0 else math.nan
    if b is not None and (e := state.model.cycle.estimate(p, b)) is not None:
        ref = e.mean
    _add_finding(
        state,
        drift_finding(key, ref * ev.before, ref * ev.after, ev.t_s, s.drift_min_rel, "s"),
        s,
    )
    state.model.cycle.discount(p, s.change_discount)
    hybrid_decide.discount_self(state, p, s.change_discount, "cycle")
    _model_change(state, t_change, "cycle")
    if ev.before > 0 and ev.after > 0 and math.isfinite(ev.after / ev.before):
        move = [t_change, ev.after / ev.before, 1.0 if state.specs[p].speculative else 0.0]
        state.cycle_moves = [*state.cycle_moves, move][-MAX_CYCLE_MOVES:]


def _on_event(
    state: PolicyState, key: str, ev: CusumEvent, obs: Observation, s: PolicySettings
) -> None:
    p = obs.profile
    spec = state.specs[p]
    per_workload = f"accept:{p}:"
    if ev.kind == "change":
        # The first window of the points that raised it: n windows back for a stream with a
        # point per window, and further for one whose points gather several windows (a mix
        # point needs mix_point_min_requests finished requests).
        t_change = ev.t_s - max(ev.n - 1, 0) * obs.window_s
        if ev.since_s is not None:
            t_change = min(t_change, ev.since_s + obs.window_s)
        _regime_boundary(state, t_change, s)
        _add_finding(state, Finding("change", key, ev.before, ev.after, ev.t_s), s)
        if key.startswith(per_workload):
            # This workload's own accept length moved: forget its level (and the evidence
            # pooled over workloads, which holds it); the other workloads' levels did not move.
            state.model.accept.discount(p, s.change_discount, workload=key[len(per_workload) :])
            hybrid_decide.discount_self(state, p, s.change_discount, "accept")
            _model_change(state, t_change, "accept")
        elif key == f"cycle:{p}":
            # A step time that moved with the traffic (a new mix brings other context lengths,
            # whose KV reads cost more or less per step) is not the system's: no drift, no data
            # made stale, and the running profile keeps its estimates (forgetting them would
            # leave it with none once it stops, a few windows into the new traffic); they
            # follow the new level at their half-life.
            if not _with_traffic(state, t_change, s):
                _system_cycle_change(state, key, ev, t_change, s)
        elif key == "batch" or key.startswith("mix:"):
            state.last_traffic_change_s = _later(state.last_traffic_change_s, t_change)
            # The traffic now is that of the windows since (not a blend of two regimes).
            if key.startswith("mix:"):
                state.model.mix.rebase(t_change, s.change_discount)
            else:
                state.model.concurrency.rebase(t_change, s.change_discount)
                # The acceptance streams' noise is set by the verify steps behind a point (a
                # window at 64 streams holds fifty times one at a single stream): after a
                # concurrency change they re-learn it, or the old scale raises false alarms.
                for k in [k for k in state.monitor.detectors if k.startswith("accept:")]:
                    del state.monitor.detectors[k]
            if state.trial is not None:
                # A trial measures a profile against a prediction for the traffic of its switch.
                state.trial["traffic_change_s"] = t_change
        # "accept:<profile>" (all workloads: it moves with the mix as much as with acceptance),
        # "batch" and "mix:<workload>" mark a regime boundary and nothing else: whether any
        # acceptance moved is for the per-workload streams to say.
    elif ev.kind == "established" and key.startswith(per_workload):
        hist = state.monitor.history.get(key, [])[:-1]
        _add_finding(
            state,
            acceptance_finding(
                key[len("accept:") :],
                hist,
                ev.after,
                spec.num_steps,
                s.acceptance_low_ratio,
                ev.t_s,
            ),
            s,
        )


def _accept_points(state: PolicyState, obs: Observation, s: PolicySettings) -> list[Any]:
    """Per-workload accept length points, each over at least `min_verify` verify steps of
    finished requests (accumulated across windows: a window may finish one request of a
    workload, or none)."""
    spec = state.specs[obs.profile]
    if not spec.speculative or spec.num_steps < 1:
        return []
    g = spec.max_steps
    out: list[tuple[str, float | None]] = []
    for w in obs.workloads:
        gen, req, ver = w.generation_tokens, w.requests, w.verify_calls
        if gen is None or req is None or ver is None:
            continue
        if not (math.isfinite(gen) and math.isfinite(req) and math.isfinite(ver)):
            continue
        acc = gen - req
        if ver <= 0 or acc < 0:
            continue
        key = f"accept:{obs.profile}:{w.workload}"
        a = state.stream_acc.setdefault(key, [0.0, 0.0])
        a[0] += acc
        a[1] += ver
        if a[1] >= s.min_verify:
            L = a[0] / a[1]
            state.stream_acc[key] = [0.0, 0.0]
            if 1.0 - 1e-6 <= L <= g + 1.0 + 1e-6:  # else impossible: the estimators reject it
                out.append((key, L))
    return out


def _mix_points(state: PolicyState, obs: Observation, s: PolicySettings) -> list[Any]:
    """Token share of every workload seen, one point per `mix_point_min_requests` finished
    requests (the mix is a traffic signal of its own, independent of the profile)."""
    acc = state.stream_acc.setdefault("mix", {"tokens": {}, "requests": 0.0})
    tokens: dict[str, float] = acc["tokens"]
    for w in obs.workloads:
        gen, req = w.generation_tokens, w.requests
        if gen is None or req is None or not (math.isfinite(gen) and math.isfinite(req)):
            continue
        if gen < 0 or req < 0:
            continue
        tokens[w.workload] = tokens.get(w.workload, 0.0) + gen
        acc["requests"] += req
    if acc["requests"] < s.mix_point_min_requests:
        return []
    tot = sum(tokens.values())
    state.stream_acc["mix"] = {"tokens": {}, "requests": 0.0}
    if tot <= 0:
        return []
    # Workloads seen before and absent now are at share 0: their disappearance is the change.
    names = set(tokens) | {
        k[len("mix:") :] for k in state.monitor.detectors if k.startswith("mix:")
    }
    return [(f"mix:{w}", tokens.get(w, 0.0) / tot) for w in sorted(names)]


def _boot_check(state: PolicyState, obs: Observation, s: PolicySettings) -> None:
    """After a new boot has `cusum_warmup` windows at batch sizes the previous boot also served,
    compare their step times with the previous boot's at the same batch size (drift across
    boots, e.g. verify 20 -> 30 ms). Windows at batch sizes the previous boot never served are
    not comparable and wait: a batch-size change is not drift."""
    ref = state.boot_ref
    if ref is None or ref["profile"] != obs.profile or obs.moments is None:
        return
    m = obs.moments
    if m.n_steps <= 0 or "snap" not in ref:
        return
    old_w = comparable_step_s(ref["snap"], m.sum_bs / m.n_steps)
    if old_w is None:
        return
    ref["n"] += m.n_steps
    ref["sum_bs"] += m.sum_bs
    ref["sum_s"] += m.sum_step_s
    ref["sum_old_s"] += old_w * m.n_steps
    ref["windows"] += 1
    if ref["windows"] < s.cusum_warmup:
        return
    state.boot_ref = None
    new_s = ref["sum_s"] / ref["n"]
    old_s = ref["sum_old_s"] / ref["n"]
    if old_s <= 0 or new_s <= 0:
        return
    spec = state.specs[obs.profile]
    subject = f"cycle:{obs.profile}"
    drift = drift_finding(subject, old_s, new_s, obs.t_s, s.drift_min_rel, "s")
    _add_finding(state, drift, s)
    if drift is None:
        # No drift across the boots: the previous boot's other batch sizes still hold.
        state.model.cycle.restore_buckets(obs.profile, ref["snap"])
    if not spec.speculative:
        # One stream's tok/s (FIELD.md's "baseline 89 -> 82 tok/s"): a baseline step gives each
        # sequence one token, so it is 1 / step time at the batch size both boots served.
        _add_finding(
            state,
            drift_finding(
                "baseline_tok_s", 1.0 / old_s, 1.0 / new_s, obs.t_s, s.drift_min_rel, "tok/s"
            ),
            s,
        )


def _ingest(state: PolicyState, obs: Observation, s: PolicySettings) -> str:
    """Feed a usable window to the estimators and change detectors. Returns "ok", "reset",
    "unknown_profile", "stale" (not newer than the last window) or "adopted"."""
    specs = state.specs
    if obs.profile not in specs:
        return "unknown_profile"
    if state.last_window_t_s is not None and obs.t_s <= state.last_window_t_s:
        return "stale"
    state.last_window_t_s = obs.t_s
    if obs.startup_s is not None and math.isfinite(obs.startup_s) and obs.startup_s > 0:
        state.startup_s[obs.profile] = float(obs.startup_s)
    if obs.profile != state.running:
        # The server runs something else than the policy thought (a restart outside decide):
        # adopt it; this window straddles the change, so it is not evidence.
        _adopt(state, obs.profile, obs.t_s, s, learned_restart_s=None)
        return "adopted"
    if obs.counter_reset:
        return "reset"
    sig = state.model.observe(obs)
    if sig.batch is not None:
        k = batch_bucket(sig.batch)
        state.served_top[obs.profile] = max(k, state.served_top.get(obs.profile, k))
        state.served_low[obs.profile] = min(k, state.served_low.get(obs.profile, k))
    # A running adaptive profile's own windows correct its table-based prediction.
    hybrid_decide.observe_self(state, obs, s)
    state.overhead.update(obs)
    generated = {w.workload: w.generation_tokens or 0.0 for w in obs.workloads}
    hybrid_decide.observe(state.long_run, sig.load, obs.window_s, obs.t_s, s, generated)
    _boot_check(state, obs, s)
    p = obs.profile
    streams: list[tuple[str, float | None]] = []
    # Clients reconnect after a restart: the first windows of a boot are not the traffic.
    if state.boot_windows >= s.trial_warmup_windows:
        streams.append(("batch", sig.load))
    state.boot_windows += 1
    # Traffic first: a change in step time found in the same window is then known to have
    # come with the traffic (_with_traffic).
    streams += _mix_points(state, obs, s)
    streams += [(f"accept:{p}", sig.accept_length), (f"cycle:{p}", sig.cycle_ratio)]
    streams += _accept_points(state, obs, s)
    for key, x in streams:
        ev = state.monitor.update(key, x, obs.t_s)
        if ev is not None:
            _on_event(state, key, ev, obs, s)
    return "ok"


def _boot_discount(state: PolicyState, profile: str, s: PolicySettings) -> None:
    """A new boot of `profile`: its old estimates become a weak prior (drift across boots)."""
    state.model.cycle.discount(profile, s.boot_carryover, max_windows=s.boot_carryover_max_windows)
    hybrid_decide.discount_self(state, profile, s.boot_carryover)
    state.model.accept.discount(profile, s.boot_carryover, moved=False)


def on_canary_started(state: PolicyState, profile: str) -> PolicyState:
    """A fleet booted `profile` on one replica beside the running profile (a canary): a new boot
    of it, so its old estimates become the weak prior a boot makes of them, and its windows
    (observe_canary) judge it. The running profile, the switch history and the dwell are not
    touched: the deployment still runs what it ran. Updates `state` in place and returns it."""
    if profile not in state.specs:
        raise ValueError(f"unknown profile {profile!r}")
    if profile != state.running:
        _boot_discount(state, profile, state.settings)
    return state


def on_canary_rejected(
    state: PolicyState, profile: str, now_s: float, *, judged: bool = True
) -> PolicyState:
    """A fleet rolled its canary of `profile` back: a pending switch to it is over, and a
    judged rejection (worse, no gain, or a canary that did not start) backs the profile off as
    a failed start is. A canary rolled back unjudged (its time ran out before its replica, or
    every other, carried enough traffic to compare: `judged` False) is no evidence against the
    profile: nothing is backed off, and the estimates, holding whatever windows it served,
    decide (a random fleet day: 7-step's canary started at four streams on two replicas, the
    load fell to one stream, its replica idled out of time, and 7-step, predicted 30% above
    the profile the fleet then ran, was held back for the hour). Nothing is rolled back: the
    deployment kept running its profile, which did not restart (a failed start's rollback
    would take the next window of it for a new boot). Updates `state` in place and returns
    it."""
    if profile not in state.specs:
        raise ValueError(f"unknown profile {profile!r}")
    if state.pending is not None and state.pending["target"] == profile:
        state.pending = None
    if judged:
        state.failed[profile] = float(now_s)
    state.trial = None
    return state


def observe_canary(state: PolicyState, obs: Observation) -> bool:
    """One window of a canary replica (a profile served beside the running one, on the same
    traffic): evidence for that profile's cycle time and acceptance, as if it had run there, so
    a candidate the canary rejected is not predicted from the data that proposed it again. Not
    traffic (the deployment's windows are), not change detection (the streams are the running
    profile's). Returns whether the window was offered to the estimators (not for an unknown
    or the running profile, or a counter reset; impossible numbers the estimators reject and
    count as they do any window's)."""
    if obs.profile not in state.specs or obs.profile == state.running or obs.counter_reset:
        return False
    if obs.moments is not None:
        state.model.cycle.update(obs.profile, obs.moments, obs.t_s, obs.window_s)
    state.model.accept.update(obs)
    return True


def _adopt(
    state: PolicyState,
    profile: str,
    now_s: float,
    s: PolicySettings,
    learned_restart_s: float | None,
) -> None:
    if learned_restart_s is not None and math.isfinite(learned_restart_s) and learned_restart_s > 0:
        old = _restart(state, profile, s)
        lr = s.restart_learning_rate
        state.restart_s[profile] = (1.0 - lr) * old + lr * learned_restart_s
    state.boot_ref = {
        "profile": profile,
        "snap": state.model.cycle.profile_snapshot(profile),
        "n": 0.0,
        "sum_bs": 0.0,
        "sum_s": 0.0,
        "sum_old_s": 0.0,
        "windows": 0,
    }
    _boot_discount(state, profile, s)
    # The all-workload accept length and the cycle level start over with the boot (the mix
    # may have moved meanwhile; a boot may have drifted: _boot_check compares). Per-workload
    # acceptance keeps its detectors: a drafter's acceptance is not a property of a boot, and
    # a change that happened while another profile ran is then found on return. Concurrency
    # and mix keep theirs: a restart is not a traffic change (the first window is skipped).
    state.monitor.detectors.pop(f"accept:{profile}", None)
    state.monitor.detectors.pop(f"cycle:{profile}", None)
    for k in [k for k in state.stream_acc if k.startswith(f"accept:{profile}:")]:
        del state.stream_acc[k]  # a partial point does not straddle boots
    state.boot_windows = 0
    state.running = profile
    state.last_switch_s = float(now_s)
    state.tried.add(profile)


# --------------------------------------------------------------------------------------------
# Decision helpers


def _restart(state: PolicyState, profile: str, s: PolicySettings) -> float:
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


def _restarts_last_hour(state: PolicyState, now_s: float) -> int:
    return sum(1 for sw in state.switches if now_s - float(sw["t_s"]) < 3600.0)


def budget_exhausted(
    state: PolicyState, now_s: float, s: PolicySettings, *, round_trip: bool = False
) -> bool:
    """Whether the restart budget refuses an automatic restart now. An exploration is a round
    trip (`round_trip`): the run it buys is most likely followed by a restart back, so it needs
    room for both, or a disappointing profile would hold the server until the hour frees a
    restart (with a budget of one, every restart is a one-way trip and needs room for one)."""
    need = min(2, s.restart_budget_per_hour) if round_trip else 1
    return _restarts_last_hour(state, now_s) + need > s.restart_budget_per_hour


def _record_switch(
    state: PolicyState,
    now_s: float,
    target: str,
    reason: Reason,
    predicted: Estimate | None,
    predicted_wall: Estimate | None = None,
) -> None:
    """`predicted`: the target's decode rate (decode tokens per decode second), what its trial
    checks; `predicted_wall`: its tok/s over wall time, the trial's fallback. The profile left
    is priced alongside (what a rollback would return to: `_trial_beats_left`)."""
    left = left_wall = None
    if predicted is not None and target != state.running:
        left = hybrid_decide.now_prediction(
            state, state.running, state.model.batch_for(state.running), state.settings
        )
        left_wall = wall_estimate(left, state.overhead.per_token_s()) if left else None
    state.switches.append(
        {"t_s": float(now_s), "from": state.running, "to": target, "reason": reason.value}
    )
    # Bounded: the budget needs one hour, the flap rule one horizon; 100 covers both.
    del state.switches[:-100]
    state.pending = {
        "target": target,
        "t_s": float(now_s),
        "reason": reason.value,
        "from": state.running,
        "predicted": predicted.to_dict() if predicted is not None else None,
        "predicted_wall": predicted_wall.to_dict() if predicted_wall is not None else None,
        "left": left.to_dict() if left is not None else None,
        "left_wall": left_wall.to_dict() if left_wall is not None else None,
    }


def _hold(
    now_s: float, state: PolicyState, reason: Reason, diag: dict[str, Any]
) -> tuple[PolicyState, Decision]:
    return state, Decision(now_s, Action.HOLD, state.running, reason, diag)


def _switch(
    now_s: float,
    state: PolicyState,
    target: str,
    reason: Reason,
    diag: dict[str, Any],
    predicted: Estimate | None = None,
    predicted_wall: Estimate | None = None,
) -> tuple[PolicyState, Decision]:
    diag["from"] = state.running
    _record_switch(state, now_s, target, reason, predicted, predicted_wall)
    return state, Decision(now_s, Action.SWITCH, target, reason, diag)


def begin_manual_switch(state: PolicyState, target: str, now_s: float) -> Estimate | None:
    """An operator asked for a one-off switch to `target` (POST /v1/switch): record it as the
    pending switch, with the target's predicted rate when the model has one, so that the restart
    is judged as a trial like a switch the policy chose (no prediction: nothing to judge).
    Returns the predicted tok/s (wall time). Updates `state` in place."""
    if target not in state.specs:
        raise ValueError(f"unknown profile {target!r}")
    s = state.settings
    decode = {p.profile: p for p in _decode_predictions(state, s.stale_widen)}
    per_token_s = state.overhead.per_token_s()
    dec = decode.get(target)
    wall = _to_wall(dec, per_token_s) if dec is not None else None
    predicted = dec.tok_s if dec is not None else None
    predicted_wall = wall.tok_s if wall is not None else None
    _record_switch(state, now_s, target, Reason.SWITCH_MANUAL, predicted, predicted_wall)
    return predicted_wall


# --------------------------------------------------------------------------------------------
# The policy


def _decode_predictions(state: PolicyState, stale_widen: float) -> list[ProfilePrediction]:
    """The cycle model's predictions: decode tokens per decode second (B x E[L] / T(B))."""
    preds = [
        state.model_prediction(
            p.name,
            stale_widen,
            cycle_moves=[(t, r) for t, r, v in state.cycle_moves if bool(v) == p.speculative],
        )
        for p in state.profiles
    ]
    # Adaptive profiles: SGLang's rule on their table, priced like the fixed ones.
    return hybrid_decide.replace_predictions(state, preds, state.settings)


def _to_wall(pr: ProfilePrediction, per_token_s: float | None) -> ProfilePrediction:
    if pr.tok_s is None or per_token_s is None:
        return pr
    return dataclasses.replace(pr, tok_s=wall_estimate(pr.tok_s, per_token_s))


def predictions(state: PolicyState, stale_widen: float = 2.0) -> list[ProfilePrediction]:
    """What every profile is predicted to deliver for the traffic now (concurrency and mix), in
    tok/s over wall time (non-decode time per decode token included), with data older than the
    last detected change in acceptance or cycle time counted as stale."""
    p = state.overhead.per_token_s()
    return [_to_wall(pr, p) for pr in _decode_predictions(state, stale_widen)]


def decide(
    state: PolicyState,
    obs: Observation | None,
    now_s: float,
    settings: PolicySettings,
    overrides: Overrides,
) -> tuple[PolicyState, Decision]:
    """One tick: ingest `obs` (None: the scrape failed), then decide (see the module docstring
    for the rules and their precedence). Updates `state` in place and returns it."""
    s = settings
    state.settings = settings
    state.model.cycle.set_expert_share(s.expert_share)  # a state restored under older settings
    state.new_findings = []
    diag: dict[str, Any] = {}
    if (
        state.pending is not None
        and now_s - float(state.pending["t_s"]) > s.pending_switch_timeout_s
    ):
        diag["pending_expired"] = str(state.pending["target"])
        state.pending = None
    intake = "scrape_failed" if obs is None else _ingest(state, obs, s)
    diag["intake"] = intake
    for f in state.new_findings[-3:]:
        diag[f"finding.{f.kind}.{f.subject}"] = f.after

    # Operator overrides beat everything.
    if overrides.pause_active(now_s):
        diag["paused_until_s"] = overrides.paused_until_s
        return _hold(now_s, state, Reason.HOLD_PAUSED, diag)
    if overrides.pin_active(now_s):
        pin = overrides.pin_profile
        diag["pin"] = pin
        diag["pin_until_s"] = overrides.pin_until_s
        if pin not in state.specs:
            diag["pin_unknown_profile"] = True
            return _hold(now_s, state, Reason.HOLD_PINNED, diag)
        in_flight = state.pending is not None and state.pending["target"] == pin
        if pin == state.running or in_flight:
            return _hold(now_s, state, Reason.HOLD_PINNED, diag)
        assert pin is not None
        state.trial = None
        return _switch(now_s, state, pin, Reason.SWITCH_PINNED, diag)
    if overrides.blocked_reason is not None:
        diag["blocked_reason"] = overrides.blocked_reason
        return _hold(now_s, state, Reason.HOLD_BLOCKED, diag)

    # Safety: a failed start goes back to the last good profile.
    if state.rollback_to is not None:
        target = state.rollback_to
        if obs is not None and obs.profile == target:
            # The shell already restored it: a new boot of it, inside its dwell like any other
            # (the restart that failed and this one both just happened).
            state.rollback_to = None
            _adopt(state, target, now_s, s, learned_restart_s=None)
            diag["restored_by_shell"] = target
            return _hold(now_s, state, Reason.HOLD_COOLDOWN, diag)
        else:
            state.rollback_to = None
            diag["failed_profile"] = state.pending["target"] if state.pending else None
            return _switch(now_s, state, target, Reason.ROLLBACK_START_FAILED, diag)

    if obs is None:
        return _hold(now_s, state, Reason.HOLD_SCRAPE_FAILED, diag)
    if state.pending is not None:
        diag["pending_switch"] = str(state.pending["target"])
        return _hold(now_s, state, Reason.HOLD_COOLDOWN, diag)

    if state.trial is not None:
        out = _trial_step(state, obs, intake, s, diag)
        if out is TrialOutcome.FAILED and not _trial_beats_left(state.trial, diag, s):
            back = str(state.trial["from"])
            state.trial = None
            # A failed rewrite of the running adaptive table goes back to the table it replaced;
            # with none to go back to, there is nothing to roll back.
            if back != state.running or hybrid_decide.undo_rewrite(state, now_s, diag):
                return _switch(now_s, state, back, Reason.ROLLBACK_TRIAL_FAILED, diag)
        if out in (TrialOutcome.PENDING, TrialOutcome.RUNNING):
            return _hold(now_s, state, Reason.HOLD_TRIAL, diag)
        state.trial = None

    if intake == "unknown_profile":
        diag["unknown_profile"] = obs.profile
        return _hold(now_s, state, Reason.HOLD_INSUFFICIENT_DATA, diag)
    if intake in ("reset", "adopted", "stale"):
        return _hold(now_s, state, Reason.HOLD_INSUFFICIENT_DATA, diag)
    traffic = _has_traffic(obs)
    if traffic is False:
        return _hold(now_s, state, Reason.HOLD_NO_TRAFFIC, diag)
    dwell_left = s.min_dwell_s - (now_s - state.last_switch_s)
    if dwell_left > 0:
        diag["dwell_left_s"] = dwell_left
        return _hold(now_s, state, Reason.HOLD_COOLDOWN, diag)
    suspect = _suspected(state, s)
    if suspect is not None:
        # A change may be starting: no decision is made on a regime not yet known to exist
        # (the first window of a burst looks like a new regime of unknown length).
        diag["change_suspected"] = suspect
        return _hold(now_s, state, Reason.HOLD_BURST, diag)
    # Traffic flipping faster than restarts pay: value every profile over the batch sizes
    # served, explore over that horizon (and rewrite the running adaptive table when it pays).
    hd = hybrid_decide.long_run(state, now_s, s, diag)
    if hd is not None:
        return state, hd
    key = _eval_key(state)
    cache = state.eval_cache
    reuse = _reusable(cache, key, now_s, s) if cache is not None else "no"
    if cache is not None and reuse != "no" and not state.new_findings:
        diag.update(cache["diag"])
        diag["reevaluated_at_s"] = cache["t_s"]
        if reuse == "traffic":
            # The traffic the predictions follow moved, and no change point says a new regime
            # began: the first windows of a burst. Act on it once the detectors confirm it (a
            # change point: the burst rule then applies) or the re-evaluation interval is up.
            diag["traffic_moved_unconfirmed"] = True
            return _hold(now_s, state, Reason.HOLD_BURST, diag)
        return _hold(now_s, state, Reason(cache["reason"]), diag)
    state.eval_cache = None
    state, d = _choose(state, now_s, s, diag)
    if d.reason in (Reason.HOLD_BEST, Reason.HOLD_WITHIN_MARGIN):
        kept = {k: v for k, v in d.diagnostics.items() if k != "intake"}
        state.eval_cache = {"t_s": now_s, "reason": d.reason.value, "diag": kept, **key}
    return state, d


def _eval_key(state: PolicyState) -> dict[str, Any]:
    return {
        "running": state.running,
        "last_change_s": state.last_change_s,
        "last_model_change_s": state.last_model_change_s,
        "batch": state.model.concurrency.load(),
        "mix": state.model.mix.shares(),
        "tried": sorted(state.tried),
        "failed": sorted(state.failed),
    }


def _reusable(
    cache: Mapping[str, Any], key: Mapping[str, Any], now_s: float, s: PolicySettings
) -> str:
    """Returns "yes"; "no" (expired, or the state it was made in moved: a change point, a
    profile tried or failed); or "traffic": only concurrency or mix moved, no change point."""
    if now_s - float(cache["t_s"]) >= s.reeval_interval_s:
        return "no"
    for k in ("running", "last_change_s", "last_model_change_s", "tried", "failed"):
        if cache.get(k) != key[k]:
            return "no"
    b0, b1 = cache["batch"], key["batch"]
    if b0 is None or b1 is None:
        return "no"
    if abs(b1 - b0) > s.reeval_rel_change * b0:
        return "traffic"
    m0, m1 = cache["mix"], key["mix"]
    moved = sum(abs(m0.get(w, 0.0) - m1.get(w, 0.0)) for w in set(m0) | set(m1))
    return "yes" if moved <= s.reeval_rel_change else "traffic"


def _suspected(state: PolicyState, s: PolicySettings) -> str | None:
    """The first stream whose CUSUM is past `suspect_fraction` of its threshold on a young
    excursion, or None. A step of 2k sigma or more (the size worth a hold) alarms within h/k
    windows of leaving zero; a statistic still hovering under the threshold after that is a
    shift smaller than that, which no decision waits for (it would hold forever)."""
    bar = s.suspect_fraction * s.cusum_h
    young = math.ceil(s.cusum_h / max(s.cusum_k, 1e-9))
    for key, det in state.monitor.detectors.items():
        if (det.s_hi > bar and det.hi_n <= young) or (det.s_lo > bar and det.lo_n <= young):
            return key
    return None


def _decode_rate(obs: Observation) -> float | None:
    """Decode tokens per decode second of a window (what the cycle model predicts)."""
    m = obs.moments
    if m is None or m.n_steps <= 0 or not (m.sum_step_s > 0) or not math.isfinite(m.sum_generated):
        return None
    return m.sum_generated / m.sum_step_s if m.sum_generated >= 0 else None


def _decode_batch(obs: Observation) -> float | None:
    """A window's mean batch over its decode steps (None without decode moments)."""
    m = obs.moments
    if m is None or m.n_steps <= 0:
        return None
    return m.sum_bs / m.n_steps


def _ramping(obs: Observation, batch: float | None) -> bool:
    """Whether a window's mean batch is below the half-octave bucket of `batch` (a trial's
    prediction batch): the server is still filling up after its restart."""
    b = _decode_batch(obs)
    return batch is not None and b is not None and b < batch / math.sqrt(2.0)


def _batch_shortfall(obs: Observation, batch: float | None) -> float:
    """How many times smaller a window's mean batch is than `batch` (a trial's prediction
    batch), at least 1: a step takes no less time for more sequences, so the window's decode
    rate times this bounds the rate at `batch` from above."""
    b = _decode_batch(obs)
    if batch is None or b is None or not b > 0:
        return 1.0
    return max(1.0, batch / b)


def _trial_step(
    state: PolicyState, obs: Observation, intake: str, s: PolicySettings, diag: dict[str, Any]
) -> TrialOutcome:
    tr = state.trial
    assert tr is not None
    # Decode-rate trials compare the decode rate observed with the one predicted (like with
    # like: the prefill of clients reconnecting after the restart is no fault of the profile);
    # windows without decode moments fall back to tok/s over wall time against the wall
    # prediction. Trials persisted by older versions hold wall-time windows only.
    decode = tr.get("kind", "wall") == "decode"
    if intake == "ok" and obs.profile == tr["profile"]:
        if tr["skip"] > 0:
            tr["skip"] -= 1
        elif decode and _ramping(obs, tr.get("batch")):
            # Clients still reconnecting: a decode rate at a fraction of the batch the
            # prediction is for measures something else; wait for the batch to come back.
            tr["ramp_windows"] = int(tr.get("ramp_windows", 0)) + 1
            diag["trial_ramp_windows"] = tr["ramp_windows"]
        else:
            rate = _decode_rate(obs) if decode else None
            if rate is not None:
                tr["windows"].append(rate)
                tr.setdefault("upper", list(tr["windows"][:-1])).append(
                    rate * _batch_shortfall(obs, tr.get("batch"))
                )
            elif obs.output_tok_s is not None:
                tr.setdefault("wall_windows", []).append(float(obs.output_tok_s))
    if tr.get("traffic_change_s") is not None:
        # The traffic changed under the trial: its windows no longer measure the prediction
        # it was made against (the policy weighs the new regime on its own). A change in the
        # profile's own acceptance or cycle time is what the trial is there to catch: no exit.
        diag["trial_profile"] = tr["profile"]
        diag["trial_outcome"] = TrialOutcome.INCONCLUSIVE.value
        diag["trial_traffic_change_s"] = tr["traffic_change_s"]
        return TrialOutcome.INCONCLUSIVE
    _wall, windows, upper, pred = _trial_evidence(tr)
    out = assess_trial(pred, windows, s.trial, upper)
    diag["trial_profile"] = tr["profile"]
    diag["trial_outcome"] = out.value
    diag["trial_predicted_low"] = pred.low
    diag["trial_windows"] = len(windows)
    if windows:
        diag["trial_observed_mean"] = sum(windows) / len(windows)
    return out


def _trial_evidence(
    tr: Mapping[str, Any],
) -> tuple[bool, list[float], list[float] | None, Estimate]:
    """What a trial is judged on: (over wall time, windows, their upper ends, prediction).
    Decode windows against the decode prediction; where no window had decode moments, wall
    windows against the wall prediction; a trial persisted by an older version holds wall
    windows under "windows"."""
    decode = tr.get("kind", "wall") == "decode"
    if decode and not tr["windows"] and tr.get("wall_windows") and tr.get("predicted_wall"):
        return True, tr["wall_windows"], None, Estimate.from_dict(tr["predicted_wall"])
    return not decode, tr["windows"], tr.get("upper"), Estimate.from_dict(tr["predicted"])


def _trial_beats_left(tr: Mapping[str, Any], diag: dict[str, Any], s: PolicySettings) -> bool:
    """Whether a trial that failed its prediction still serves confidently more than the
    profile it left was predicted to (its high end), like with like (decode windows against a
    decode rate, wall windows against a wall rate): its prediction was wrong, but a rollback
    would pay a restart to serve less (a random day: 5-step's estimate lagged a verify cost
    that rose all day, and a trial at 0.89 of it went back to 1-step at 0.6 of what 5-step
    served). The trial ends there, and the estimates, now holding its windows, decide."""
    wall, windows, _upper, _pred = _trial_evidence(tr)
    left = tr.get("left_wall" if wall else "left")
    if left is None or not windows:
        return False
    high = Estimate.from_dict(left).high
    if not beats(windows, high, s.trial):
        return False
    diag["trial_kept_over"] = tr["from"]
    diag["trial_kept_over_tok_s"] = high
    return True


def _choose(
    state: PolicyState, now_s: float, s: PolicySettings, diag: dict[str, Any]
) -> tuple[PolicyState, Decision]:
    decode = {p.profile: p for p in _decode_predictions(state, s.stale_widen)}
    per_token_s = state.overhead.per_token_s()
    preds = {n: _to_wall(p, per_token_s) for n, p in decode.items()}
    diag["nondecode_s_per_token"] = per_token_s
    for name, pr in preds.items():
        diag[f"pred_tok_s.{name}"] = pr.tok_s.mean if pr.tok_s is not None else None
    cur_pred = preds[state.running]
    if cur_pred.tok_s is None:
        return _hold(now_s, state, Reason.HOLD_INSUFFICIENT_DATA, diag)
    cur = cur_pred.tok_s.mean
    age = now_s - state.regime_start_s
    horizon = state.regimes.remaining_s(age, s.burst_history_min_regimes)
    diag["regime_age_s"] = age
    diag["horizon_s"] = horizon
    diag["observed_tok_s"] = cur_pred.observed_tok_s
    blocked_profiles = {
        p for p, t in state.failed.items() if now_s - t < s.failed_profile_backoff_s
    }

    best: tuple[float, str, float, float, float] | None = None  # net, name, gain, margin, R
    for name, pr in preds.items():
        if name == state.running or pr.tok_s is None or name in blocked_profiles:
            continue
        if pr.bound:
            continue  # a bound is no prediction to switch on: only a run (exploration) says
        r = _restart(state, name, s)
        margin = s.margin_frac * cur + s.margin_z * math.hypot(
            interval_sd(pr.tok_s), interval_sd(cur_pred.tok_s)
        )
        # A profile whose cost may have moved with the system since it ran is switched to on
        # its pessimistic end only (what it delivers if it moved as far); the rest of its
        # interval is for exploration to weigh.
        gain = (pr.tok_s.low if pr.moved else pr.tok_s.mean) - cur
        net = (gain - margin) * max(horizon - r, 0.0) - cur * r
        if best is None or net > best[0]:
            best = (net, name, gain, margin, r)

    # A predicted gain that does not repay its restart (or waits out a possible burst) holds
    # with this reason unless an exploration pays: a small sure gain must not keep a larger
    # unknown one from being weighed (stress a12: 6-step's gain, short of a 10-minute restart,
    # ended the decision, and 3-step, never run and priced 27% higher, was never tried).
    held: Reason | None = None
    if best is not None:
        net, name, gain, margin, r = best
        diag.update(best=name, gain_tok_s=gain, margin_tok_s=margin, restart_s=r, net_tokens=net)
        if gain - margin > 0:
            young = age < s.burst_wait_factor * r and not state.regimes.switch_beats_waiting(
                age,
                s.burst_wait_factor * r - age,
                r,
                gain - margin,
                cur,
                s.burst_history_min_regimes,
            )
            if net > 0 and not young:
                # Traffic that alternates takes a switch back: the regime's gain pays for both.
                # Not on the way back from an exploration: its cost already counted that
                # restart, and the profile it left is where the traffic had put the server.
                back = (
                    0.0
                    if _undoes_exploration(state, name)
                    else hybrid_decide.return_cost(state, name, s)
                )
                if back > 0:
                    diag["return_cost_tokens"] = back
                if back > 0 and net - back <= 0:
                    held = Reason.HOLD_WITHIN_MARGIN
                elif _is_flap(state, name, now_s, s):
                    held = Reason.HOLD_NO_FLAP
                elif budget_exhausted(state, now_s, s):
                    return _hold(now_s, state, Reason.HOLD_BUDGET, diag)
                else:
                    target, target_decode = preds[name].tok_s, decode[name].tok_s
                    assert target is not None and target_decode is not None
                    return _switch(
                        now_s,
                        state,
                        name,
                        Reason.SWITCH_PREDICTED_GAIN,
                        diag,
                        target_decode,
                        target,
                    )
            elif young or horizon < 2.0 * r:
                held = Reason.HOLD_BURST
            else:
                held = Reason.HOLD_WITHIN_MARGIN

    if s.explore:
        # What a run reveals is worth something over the rest of the regime. A regime that began
        # at a detected change is as old as the evidence for it: expect it to last about as
        # long again (a burst just begun is worth nothing yet), at most what the history of
        # regimes says. The first regime's age is unknown (traffic predates the controller).
        h_explore = min(horizon, explore_cap_s(state, s))
        if state.last_change_s is not None:
            h_explore = min(h_explore, age)
        diag["explore_horizon_s"] = h_explore
        # Past a held gain, only fixed profiles: an adaptive profile explored there and found
        # worse keeps its model's spread, and the margin it sets held it for hours (shipped
        # reboot-midday, specpilot_hybrid -4.4%).
        skip = {p.name for p in state.profiles if p.adaptive} if held is not None else set()
        pick = _exploration(
            state, preds, cur, h_explore, age, blocked_profiles | skip, now_s, s, diag
        )
        if pick is not None:
            if budget_exhausted(state, now_s, s, round_trip=True):
                return _hold(now_s, state, Reason.HOLD_BUDGET, diag)
            return _switch(now_s, state, pick, Reason.EXPLORE, diag)
    if held is not None:
        return _hold(now_s, state, held, diag)

    best_name = max(
        (n for n, p in preds.items() if p.tok_s is not None and not p.bound),
        key=lambda n: (preds[n].tok_s.mean, n == state.running),  # type: ignore[union-attr]
    )
    if best_name == state.running:
        return _hold(now_s, state, Reason.HOLD_BEST, diag)
    return _hold(now_s, state, Reason.HOLD_WITHIN_MARGIN, diag)


def explore_cap_s(state: PolicyState, s: PolicySettings) -> float:
    """The longest horizon information is valued over: `explore_horizon_s`, or
    `explore_horizon_restarts` restarts of the running profile where that is longer."""
    return max(s.explore_horizon_s, s.explore_horizon_restarts * _restart(state, state.running, s))


def _undoes_exploration(state: PolicyState, target: str) -> bool:
    """Whether switching to `target` goes back to the profile the last switch, an exploration,
    left, with no change point since: the return the exploration's own cost provided for
    (`_exploration`: a run found worse is left again after its dwell)."""
    if not state.switches:
        return False
    last = state.switches[-1]
    if last["reason"] != Reason.EXPLORE.value or last["from"] != target:
        return False
    if last["to"] != state.running:
        return False
    return not (state.last_change_s is not None and state.last_change_s > float(last["t_s"]))


def _is_flap(state: PolicyState, target: str, now_s: float, s: PolicySettings) -> bool:
    """A -> B -> A: going back to the profile the last predicted-gain switch left, or to the one
    whose failed trial the last switch rolled back (stress a16, three replicas: 3-step's trial
    failed, the fleet went back to 5-step, and the same estimates sent it into 3-step again 20
    minutes later, 15 minutes of rolling restarts each way), inside the amortisation horizon,
    with no change point since that switch."""
    if not state.switches:
        return False
    last = state.switches[-1]
    undone = (Reason.SWITCH_PREDICTED_GAIN.value, Reason.ROLLBACK_TRIAL_FAILED.value)
    if last["reason"] not in undone or last["from"] != target:
        return False
    if now_s - float(last["t_s"]) >= s.amortisation_horizon_s:
        return False
    return not (state.last_change_s is not None and state.last_change_s > float(last["t_s"]))


def _exploration(
    state: PolicyState,
    preds: Mapping[str, ProfilePrediction],
    cur: float,
    horizon: float,
    age: float,
    blocked: set[str],
    now_s: float,
    s: PolicySettings,
    diag: dict[str, Any],
    *,
    scope: str | None = None,
    full: bool | None = None,
) -> str | None:
    """The untried or stale profile whose run has the highest positive expected value of
    information minus expected cost, or None.

    Stale = its data predates the last detected change in acceptance or cycle time (a traffic
    change leaves the estimates valid: the predictions already follow concurrency and mix,
    except for a workload no chain has served, whose accept length is unknown: `unseen`, or
    one only shallower chains have served, whose accept length at this depth is the tail
    model's guess: `deeper_than_served`).
    The value is taken over `horizon` (the caller's conservative expected remaining regime,
    at most `explore_cap_s`); once weighed at that full value and declined, a candidate is
    not weighed again until its information state changes (regime, last model change,
    predicted at all, tried): neither time alone nor the noise of a stationary regime's
    estimates brings an exploration about.

    `scope` names what the information is valued over (default: the current regime; the
    long-run rule passes "long_run": the batch-size distribution, whatever regime is current)
    and `full` whether `horizon` is the full value (default: horizon >= explore_cap_s)."""
    specs = state.specs
    scope = scope if scope is not None else f"regime={state.regime_start_s!r}"
    full = full if full is not None else horizon >= explore_cap_s(state, s)

    def before(t: float | None, change: float | None) -> bool:
        return change is not None and (t is None or t < change)

    top = max(state.served_top.values(), default=None)

    def unknown(name: str) -> bool:
        if name == state.running or name in blocked:
            return False
        if name not in state.tried:
            return True
        if before(state.model.cycle.last_t_s(name), state.last_cycle_change_s):
            return True
        # A profile tried, but never at a batch size like the one it would serve now: its price
        # here is its own data's extrapolation, a band only a run narrows (stress w8: MoE's
        # saturating cost made 5-step's guess at a larger batch pessimistic, and an adaptive
        # profile ran at 0.9 of it all day; a random MoE day: baseline, run only at 64 streams,
        # priced at 2 at 44% of its rate). Tried ever, not data kept: a batch size whose data
        # faded is not new again.
        b = state.model.batch_for(name)
        if b is not None and state.model.cycle.support(name, b) == "extrapolated":
            k = batch_bucket(b)
            if k > state.served_top.get(name, k) or k < state.served_low.get(name, k):
                return True
        # A profile that would run a larger batch under the load now than any profile ever served
        # (the load queued behind the running profile's cap: a higher cap runs it): no forward
        # served bounds its price there, a guess until it runs (stress a6: baseline, run at one
        # stream only, would run 96 where the chains run 48).
        if b is not None and top is not None and batch_bucket(b) > top:
            return True
        # A chain whose acceptance for the mix served now is a guess until it runs: a workload
        # in it that no chain of this drafter has served (`unseen`: its accept length anywhere
        # in [1, n + 1]), or only shallower chains have, read deeper by the tail model
        # (`deeper_than_served`; stress a8: a 1-step histogram priced 6-step on code at
        # 80-7700 tok/s, and 6-step, tried on chat, was never run).
        pq = preds.get(name)
        if specs[name].speculative and pq is not None and (pq.unseen or pq.deeper_than_served):
            return True
        return specs[name].speculative and before(
            state.model.accept.last_t_s(name), state.last_accept_change_s
        )

    cands = [p.name for p in state.profiles if unknown(p.name)]
    best: tuple[float, str] | None = None
    r_back = _restart(state, state.running, s)
    for q in cands:
        r_q = _restart(state, q, s)
        if age < s.burst_wait_factor * r_q:
            continue  # a young regime may be a burst: no restart for information either
        pq = preds.get(q)
        info = _info_key(state, scope, pq is None or pq.tok_s is None, q in state.tried)
        if state.explore_declined.get(q) == info:
            diag[f"explore_declined.{q}"] = True
            continue
        revealed = [q] + [
            r
            for r in cands
            if r != q
            and cross_predictable(specs[q], specs[r])
            and specs[r].num_steps < specs[q].num_steps
        ]
        dists = [prior_dist(preds.get(r), cur, s, specs[r], specs[state.running]) for r in revealed]
        useful_s = max(horizon - r_q - s.min_dwell_s, 0.0)
        gain = explore_gain(dists, cur, s, specs[q])
        value = gain * useful_s
        p_worse, shortfall = shortfall_below(dists[0], cur)
        # The candidate's own restart, its dwell below the running rate and, if worse, the way
        # back, on the share of the capacity it is tried on; the rest restarts only if it wins.
        f = s.explore_canary_share
        trial = cur * r_q + shortfall * s.min_dwell_s + p_worse * cur * r_back
        cost = f * trial + (1.0 - f) * (1.0 - p_worse) * cur * r_q
        net = value - cost
        diag[f"explore_net_tokens.{q}"] = net
        # The remaining regime over which this run would pay (value = cost): what a declined
        # candidate lacks, next to the horizon information is valued over.
        diag[f"explore_breakeven_s.{q}"] = breakeven_s(gain, cost, r_q, s)
        if net <= 0:
            if full:
                state.explore_declined[q] = info
        elif best is None or net > best[0]:
            best = (net, q)
    if best is None:
        return None
    diag["explore_value_net_tokens"] = best[0]
    return best[1]


def _info_key(state: PolicyState, scope: str, unpredicted: bool, tried: bool) -> str:
    return (
        f"{scope} model_change={state.last_model_change_s!r} "
        f"unpredicted={unpredicted} tried={tried}"
    )


def on_switch_done(
    state: PolicyState, profile: str, ok: bool, downtime_s: float, now_s: float
) -> PolicyState:
    """The shell reports the end of a restart into `profile`: ok (serving since `now_s`, after
    `downtime_s` without service: learned as that profile's restart time) or not (the profile is
    backed off, and the next decide rolls back to the profile that ran before). Updates `state`
    in place and returns it."""
    if profile not in state.specs:
        raise ValueError(f"unknown profile {profile!r}")
    pending = state.pending
    state.pending = None
    matched = pending is not None and pending["target"] == profile
    if not matched:
        state.switches.append(
            {"t_s": float(now_s), "from": state.running, "to": profile, "reason": "external"}
        )
        del state.switches[:-100]
    if not ok:
        state.failed[profile] = float(now_s)
        state.trial = None
        if profile != state.running:
            state.rollback_to = state.running
        return state
    state.failed.pop(profile, None)
    state.rollback_to = None
    state.long_run.cache = None
    if state.hybrid is not None:
        hybrid_decide.on_switch_done(state.hybrid, profile, ok)
    # on_switch_done's signature carries no settings: use those of the last decide.
    s = state.settings
    _adopt(state, profile, now_s, s, learned_restart_s=downtime_s)
    judged = (Reason.SWITCH_PREDICTED_GAIN.value, Reason.SWITCH_MANUAL.value)
    if matched and pending is not None and pending["reason"] in judged:
        if pending.get("predicted") is not None:
            state.trial = {
                "profile": profile,
                "from": pending["from"],
                "kind": "decode",
                # The batch size the prediction was made for (the profile's under the load
                # before the restart).
                "batch": state.model.batch_for(profile),
                "predicted": pending["predicted"],
                "predicted_wall": pending.get("predicted_wall"),
                "left": pending.get("left"),
                "left_wall": pending.get("left_wall"),
                "windows": [],
                "skip": s.trial_warmup_windows,
                "t_s": float(now_s),
            }
    else:
        state.trial = None
    return state
