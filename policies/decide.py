"""The policy: PolicySettings, PolicyState, initial_state, decide, on_switch_done, predictions.

Owns the decision of one tick. The objective is output tokens over time, and a restart serves
nothing for its whole duration, so a switch must repay it: with C the running profile's
predicted tok/s, N the candidate's, R the candidate's measured restart time and H the expected
remaining duration of the current regime, switch only when

    (N - C - margin) x (H - R) > C x R,   margin = margin_frac x C + margin_z x sd(N - C)

and the minimum dwell, the restart budget, the no-flap rule (A -> B -> A inside the amortisation
horizon without a change point in between) and the burst rule (a regime younger than the restart
it would need is ridden out: ski rental, at most 2x the loss of an oracle on a burst) all allow
it. Profiles never run, or whose data predates the last change point, are explored when the
expected value of what a run reveals (for a chain, a deeper chain reveals every shallower one by
truncation) beats its expected cost. Re-exploration follows detected changes, never a timer.

Precedence (first match wins): pause > pin > blocked > rollback after a failed start > failed
scrape > switch in flight > trial > unusable window > no traffic > dwell > estimates.

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

import numpy as np
from scipy.special import ndtr

from policies.chain import Z90
from policies.changepoint import (
    ChangeMonitor,
    CusumEvent,
    Finding,
    RegimeDurations,
    acceptance_finding,
    drift_finding,
)
from policies.estimators import (
    ThroughputModel,
    comparable_step_s,
    cross_predictable,
    spec_from_dict,
    spec_to_dict,
)
from policies.trial import TrialOutcome, TrialSettings, assess_trial
from policies.types import (
    Action,
    Decision,
    Estimate,
    Observation,
    Overrides,
    ProfilePrediction,
    ProfileSpec,
    Reason,
)


@dataclass(frozen=True)
class PolicySettings:
    """Every knob of the policy, with the reason for its default."""

    # Minimum time on a profile after it started serving before an automatic switch: its own
    # estimates need ~10+ windows of 10 s, and a restart of minutes is only repaid by staying
    # several restart durations; 5 minutes also caps automatic restarts at 12/hour before the
    # budget below bites.
    min_dwell_s: float = 300.0
    # Automatic restarts (predicted gain + exploration) allowed per rolling hour: each costs
    # minutes of zero output, 3 bound the worst-case loss to ~15% of an hour at 3-minute restarts.
    # Pins and rollbacks are never refused by the budget, but they count against it.
    restart_budget_per_hour: int = 3
    # A -> B -> A inside this horizon (no change point in between) is refused: the second switch
    # undoes the first before it could have paid for its restart.
    amortisation_horizon_s: float = 3600.0
    # Restart time of a profile never restarted yet (seconds): "a restart of a large model costs
    # minutes" (FIELD.md); the simulator's field profile needs ~140 s (load + capture + warmup).
    restart_prior_s: float = 180.0
    # Weight of each measured restart in the learned restart time (EW mean): restarts vary with
    # page cache and graph capture, so one measurement moves the estimate halfway.
    restart_learning_rate: float = 0.5
    # Fixed part of the margin, as a fraction of the running profile's tok/s: the cycle model
    # leaves out prefill and scheduling, which predictions of other profiles cannot see.
    margin_frac: float = 0.02
    # Margin per standard deviation of the predicted difference: the margin grows with
    # uncertainty, so a switch on a wide prediction needs a larger predicted gain.
    margin_z: float = 1.0
    # Prior mean length of a traffic regime (seconds), worth `prior_regime_strength` regimes:
    # conservative (30 min) so early decisions assume traffic changes; real history replaces it.
    prior_regime_s: float = 1800.0
    prior_regime_strength: float = 1.0
    # A regime younger than this many restart times is treated as a possible burst (HOLD_BURST):
    # waiting as long as a restart costs bounds the loss on a burst at 2x (ski rental).
    burst_wait_factor: float = 1.0
    # Exploration of untried / stale profiles by expected value of information.
    explore: bool = True
    # Prior range of an unpredictable profile's tok/s relative to the running one: FIELD.md saw
    # 2-step between 0.73x and 1.26x of baseline, 5-step ~0.98x; 0.6-1.4 covers that with room.
    explore_prior_low_ratio: float = 0.6
    explore_prior_high_ratio: float = 1.4
    # Interval widening of a prediction whose data predates the last change point.
    stale_widen: float = 2.0
    # Minimum data before an estimate exists: windows, decode steps, verify calls, histogram
    # steps (three 10 s windows give a mean and a spread; the counts keep a nearly idle window
    # from speaking for a profile).
    min_windows: int = 3
    min_steps: float = 20.0
    min_verify: float = 200.0
    min_hist_steps: float = 200.0
    # Forgetting half-lives (seconds). Cycle time and acceptance: 30 min follows slow drift while
    # averaging out noise; detected changes discount old data at once (change_discount).
    cycle_half_life_s: float = 1800.0
    accept_half_life_s: float = 1800.0
    # Traffic describes "now": concurrency over ~30 s, the workload mix over ~2 min.
    concurrency_half_life_s: float = 30.0
    mix_half_life_s: float = 120.0
    observed_half_life_s: float = 60.0
    # Weight kept of a profile's old estimates when it boots again: the field's baseline moved
    # 89 -> 82 tok/s and verify 20 -> 30 ms across boots, so a new boot must dominate fast.
    boot_carryover: float = 0.25
    # Weight kept of a stream's estimates after a detected change in it: the old level is wrong
    # by definition, and with a 30 min half-life the forgotten sums hold ~260 windows, so even
    # 1% would still outweigh the first new windows; 0.1% leaves a trace (never an empty state).
    change_discount: float = 0.001
    # Change points closer than this are one regime boundary (streams react to one event).
    change_coalesce_s: float = 60.0
    # CUSUM (changepoint.py explains the calibration: k=1, h=6 -> ~8e5 windows per false alarm
    # per side, ~2-3 windows to detect a 4-5 sigma step).
    cusum_k: float = 1.0
    cusum_h: float = 6.0
    cusum_warmup: int = 6
    cusum_z_clip: float = 5.0
    # Changes below 0.5% of a level are noise for the decision (no restart repays them).
    cusum_rel_sigma_floor: float = 0.005
    # Findings: a level moving 5% against history is drift worth telling; accept rate below
    # 0.6x its history is "far below" (the field's wrong config: 47% -> 19%, 0.4x).
    drift_min_rel: float = 0.05
    acceptance_low_ratio: float = 0.6
    # A profile that failed to start is not chosen automatically again for this long.
    failed_profile_backoff_s: float = 3600.0
    # A SWITCH with no on_switch_done after this long is forgotten (the shell lost it).
    pending_switch_timeout_s: float = 1800.0
    # Trial thresholds, and windows skipped after a restart before the trial counts (clients
    # reconnect and prefill; the first window is not steady state).
    trial: TrialSettings = field(default_factory=TrialSettings)
    trial_warmup_windows: int = 1
    # Findings kept in the state (bounded JSON).
    max_findings: int = 50
    # A HOLD_BEST / HOLD_WITHIN_MARGIN is re-evaluated at least this often, and at once on a
    # change point, a finding, or a move of reeval_rel_change in concurrency or the mix: switch
    # decisions pay restarts of minutes, so a minute's delay costs nothing, while recomputing
    # every prediction on every 10 s tick would cost most of a replay's time budget.
    reeval_interval_s: float = 60.0
    reeval_rel_change: float = 0.05


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

    @property
    def specs(self) -> dict[str, ProfileSpec]:
        return {p.name: p for p in self.profiles}

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
        )


def settings_to_dict(s: PolicySettings) -> dict[str, Any]:
    return dataclasses.asdict(s)


def settings_from_dict(d: Mapping[str, Any]) -> PolicySettings:
    kw = dict(d)
    if isinstance(kw.get("trial"), Mapping):
        kw["trial"] = TrialSettings(**kw["trial"])
    return PolicySettings(**kw)


def _jsonable(x: Any) -> Any:
    """Deep copy of plain JSON data (dicts, lists, scalars)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def _new_model(profiles: Sequence[ProfileSpec], s: PolicySettings) -> ThroughputModel:
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
    )


def initial_state(
    profiles: Sequence[ProfileSpec], running: str, now_s: float, settings: PolicySettings
) -> PolicyState:
    """Fresh state for `profiles` with `running` serving since `now_s` (the dwell starts now:
    the policy has no estimates of it yet either)."""
    names = [p.name for p in profiles]
    if running not in names:
        raise ValueError(f"running profile {running!r} is not one of {names}")
    if not math.isfinite(now_s):
        raise ValueError(f"now_s must be finite, got {now_s!r}")
    return PolicyState(
        profiles=tuple(profiles),
        running=running,
        start_s=float(now_s),
        model=_new_model(profiles, settings),
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


def _on_event(
    state: PolicyState, key: str, ev: CusumEvent, obs: Observation, s: PolicySettings
) -> None:
    spec = state.specs[obs.profile]
    if ev.kind == "change":
        t_change = ev.t_s - max(ev.n - 1, 0) * obs.window_s
        _regime_boundary(state, t_change, s)
        _add_finding(state, Finding("change", key, ev.before, ev.after, ev.t_s), s)
        if key.startswith("accept:"):
            state.model.accept.discount(obs.profile, s.change_discount)
        elif key.startswith("cycle:"):
            # The stream is step time / prediction: report it in seconds at the batch now.
            b = state.model.concurrency.estimate()
            st = state.model.cycle.stats[obs.profile]
            ref = st.level if st.s0 > 0 else math.nan
            if b is not None and (e := state.model.cycle.estimate(obs.profile, b)) is not None:
                ref = e.mean
            _add_finding(
                state,
                drift_finding(key, ref * ev.before, ref * ev.after, ev.t_s, s.drift_min_rel, "s"),
                s,
            )
            state.model.cycle.discount(obs.profile, s.change_discount)
    elif ev.kind == "established" and key.startswith("accept:"):
        hist = state.monitor.history.get(key, [])[:-1]
        _add_finding(
            state,
            acceptance_finding(
                obs.profile, hist, ev.after, spec.num_steps, s.acceptance_low_ratio, ev.t_s
            ),
            s,
        )


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
    _add_finding(state, drift_finding(subject, old_s, new_s, obs.t_s, s.drift_min_rel, "s"), s)
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
    if obs.profile != state.running:
        # The server runs something else than the policy thought (a restart outside decide):
        # adopt it; this window straddles the change, so it is not evidence.
        _adopt(state, obs.profile, obs.t_s, s, learned_restart_s=None)
        return "adopted"
    if obs.counter_reset:
        return "reset"
    sig = state.model.observe(obs)
    _boot_check(state, obs, s)
    p = obs.profile
    for key, x in (
        ("batch", sig.batch),
        (f"accept:{p}", sig.accept_length),
        (f"cycle:{p}", sig.cycle_ratio),
    ):
        ev = state.monitor.update(key, x, obs.t_s)
        if ev is not None:
            _on_event(state, key, ev, obs, s)
    return "ok"


def _adopt(
    state: PolicyState,
    profile: str,
    now_s: float,
    s: PolicySettings,
    learned_restart_s: float | None,
) -> None:
    if learned_restart_s is not None and math.isfinite(learned_restart_s) and learned_restart_s > 0:
        old = state.restart_s.get(profile, s.restart_prior_s)
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
    # A new boot: old estimates of this profile become a weak prior (drift across boots).
    state.model.cycle.discount(profile, s.boot_carryover)
    state.model.accept.discount(profile, s.boot_carryover)
    state.monitor.reset(f"accept:{profile}")
    state.monitor.reset(f"cycle:{profile}")
    state.monitor.reset("batch")  # clients reconnect after a restart: not a traffic change
    state.running = profile
    state.last_switch_s = float(now_s)
    state.tried.add(profile)


# --------------------------------------------------------------------------------------------
# Decision helpers


def _sd(e: Estimate) -> float:
    if not (math.isfinite(e.high) and math.isfinite(e.low)):
        return math.inf
    return (e.high - e.low) / (2.0 * Z90)


def _restart(state: PolicyState, profile: str, s: PolicySettings) -> float:
    return state.restart_s.get(profile, s.restart_prior_s)


def _restarts_last_hour(state: PolicyState, now_s: float) -> int:
    return sum(1 for sw in state.switches if now_s - float(sw["t_s"]) < 3600.0)


def _record_switch(
    state: PolicyState,
    now_s: float,
    target: str,
    reason: Reason,
    predicted: Estimate | None,
) -> None:
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
    }


def _prior_dist(
    pred: ProfilePrediction | None, cur: float, s: PolicySettings
) -> tuple[str, float, float]:
    """("norm", mean, sd) from a prediction, else ("unif", low, high) around the running rate."""
    if pred is not None and pred.tok_s is not None and math.isfinite(_sd(pred.tok_s)):
        return "norm", pred.tok_s.mean, max(_sd(pred.tok_s), 1e-9 * max(cur, 1.0))
    return "unif", s.explore_prior_low_ratio * cur, s.explore_prior_high_ratio * cur


def _cdf(d: tuple[str, float, float], x: np.ndarray) -> np.ndarray:
    kind, a, b = d
    if kind == "norm":
        return np.asarray(ndtr((x - a) / b))
    return np.clip((x - a) / (b - a), 0.0, 1.0)


def _shortfall(d: tuple[str, float, float], c: float) -> tuple[float, float]:
    """(P(X < c), E[(c - X)+]) in closed form."""
    kind, a, b = d
    if kind == "norm":
        u = (c - a) / b
        p = float(ndtr(u))
        pdf = math.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
        return p, (c - a) * p + b * pdf
    if c <= a:
        return 0.0, 0.0
    hi = min(c, b)
    p = (hi - a) / (b - a)
    # integral over [a, hi] of (c - x) / (b - a)
    e = ((c - a) ** 2 - (c - hi) ** 2) / (2 * (b - a))
    return p, e


def _expected_excess(dists: Sequence[tuple[str, float, float]], c: float) -> float:
    """E[(max_i X_i - c)+] for independent X_i: the integral over x > c of 1 - prod F_i(x)."""
    hi = c
    for kind, a, b in dists:
        hi = max(hi, a + 6.0 * b if kind == "norm" else b)
    if hi <= c:
        return 0.0
    x = np.linspace(c, hi, 65)
    f = np.ones_like(x)
    for d in dists:
        f *= _cdf(d, x)
    y = 1.0 - f
    return float(np.sum((y[1:] + y[:-1]) * 0.5 * np.diff(x)))


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
) -> tuple[PolicyState, Decision]:
    diag["from"] = state.running
    _record_switch(state, now_s, target, reason, predicted)
    return state, Decision(now_s, Action.SWITCH, target, reason, diag)


# --------------------------------------------------------------------------------------------
# The policy


def predictions(state: PolicyState, stale_widen: float = 2.0) -> list[ProfilePrediction]:
    """What every profile is predicted to deliver for the traffic now (concurrency and mix),
    with data older than the last change point counted as stale."""
    return [
        state.model.predict(p.name, fresh_since_s=state.last_change_s, stale_widen=stale_widen)
        for p in state.profiles
    ]


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
            state.rollback_to = None  # the shell already restored it
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
        if out is TrialOutcome.FAILED:
            back = str(state.trial["from"])
            state.trial = None
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
    key = _eval_key(state)
    cache = state.eval_cache
    if cache is not None and _reusable(cache, key, now_s, s) and not state.new_findings:
        diag.update(cache["diag"])
        diag["reevaluated_at_s"] = cache["t_s"]
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
        "batch": state.model.concurrency.estimate(),
        "mix": state.model.mix.shares(),
        "tried": sorted(state.tried),
        "failed": sorted(state.failed),
    }


def _reusable(
    cache: Mapping[str, Any], key: Mapping[str, Any], now_s: float, s: PolicySettings
) -> bool:
    if now_s - float(cache["t_s"]) >= s.reeval_interval_s:
        return False
    for k in ("running", "last_change_s", "tried", "failed"):
        if cache[k] != key[k]:
            return False
    b0, b1 = cache["batch"], key["batch"]
    if b0 is None or b1 is None or abs(b1 - b0) > s.reeval_rel_change * b0:
        return False
    m0, m1 = cache["mix"], key["mix"]
    moved = sum(abs(m0.get(w, 0.0) - m1.get(w, 0.0)) for w in set(m0) | set(m1))
    return moved <= s.reeval_rel_change


def _trial_step(
    state: PolicyState, obs: Observation, intake: str, s: PolicySettings, diag: dict[str, Any]
) -> TrialOutcome:
    tr = state.trial
    assert tr is not None
    if intake == "ok" and obs.profile == tr["profile"]:
        if tr["skip"] > 0:
            tr["skip"] -= 1
        elif obs.output_tok_s is not None:
            tr["windows"].append(float(obs.output_tok_s))
    pred = Estimate.from_dict(tr["predicted"])
    out = assess_trial(pred, tr["windows"], s.trial)
    diag["trial_profile"] = tr["profile"]
    diag["trial_outcome"] = out.value
    diag["trial_predicted_low"] = pred.low
    diag["trial_windows"] = len(tr["windows"])
    if tr["windows"]:
        diag["trial_observed_mean"] = sum(tr["windows"]) / len(tr["windows"])
    return out


def _choose(
    state: PolicyState, now_s: float, s: PolicySettings, diag: dict[str, Any]
) -> tuple[PolicyState, Decision]:
    preds = {p.profile: p for p in predictions(state, s.stale_widen)}
    for name, pr in preds.items():
        diag[f"pred_tok_s.{name}"] = pr.tok_s.mean if pr.tok_s is not None else None
    cur_pred = preds[state.running]
    if cur_pred.tok_s is None:
        return _hold(now_s, state, Reason.HOLD_INSUFFICIENT_DATA, diag)
    cur = cur_pred.tok_s.mean
    age = now_s - state.regime_start_s
    horizon = state.regimes.expected_remaining_s(age)
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
        r = _restart(state, name, s)
        margin = s.margin_frac * cur + s.margin_z * math.hypot(_sd(pr.tok_s), _sd(cur_pred.tok_s))
        gain = pr.tok_s.mean - cur
        net = (gain - margin) * max(horizon - r, 0.0) - cur * r
        if best is None or net > best[0]:
            best = (net, name, gain, margin, r)

    if best is not None:
        net, name, gain, margin, r = best
        diag.update(best=name, gain_tok_s=gain, margin_tok_s=margin, restart_s=r, net_tokens=net)
        if gain - margin > 0:
            young = age < s.burst_wait_factor * r
            if net > 0 and not young:
                if _is_flap(state, name, now_s, s):
                    return _hold(now_s, state, Reason.HOLD_NO_FLAP, diag)
                if _restarts_last_hour(state, now_s) >= s.restart_budget_per_hour:
                    return _hold(now_s, state, Reason.HOLD_BUDGET, diag)
                target = preds[name].tok_s
                assert target is not None
                return _switch(
                    now_s,
                    state,
                    name,
                    Reason.SWITCH_PREDICTED_GAIN,
                    diag,
                    _calibrated(target, cur_pred),
                )
            if young or horizon < 2.0 * r:
                return _hold(now_s, state, Reason.HOLD_BURST, diag)
            return _hold(now_s, state, Reason.HOLD_WITHIN_MARGIN, diag)

    if s.explore:
        pick = _exploration(state, preds, cur, horizon, age, blocked_profiles, now_s, s, diag)
        if pick is not None:
            if _restarts_last_hour(state, now_s) >= s.restart_budget_per_hour:
                return _hold(now_s, state, Reason.HOLD_BUDGET, diag)
            return _switch(now_s, state, pick, Reason.EXPLORE, diag)

    best_name = max(
        (n for n, p in preds.items() if p.tok_s is not None),
        key=lambda n: (preds[n].tok_s.mean, n == state.running),  # type: ignore[union-attr]
    )
    if best_name == state.running:
        return _hold(now_s, state, Reason.HOLD_BEST, diag)
    return _hold(now_s, state, Reason.HOLD_WITHIN_MARGIN, diag)


def _calibrated(target: Estimate, cur_pred: ProfilePrediction) -> Estimate:
    """The candidate's prediction in observed units: scaled by observed / predicted of the
    running profile (prefill and scheduling cost the same share on either side). Only ever
    scaled down, and at most to half: the observed rate is a smoothed past, and right after a
    change it still carries the old regime (scaling up on it would set the trial's bar too high).
    """
    cur = cur_pred.tok_s
    obs = cur_pred.observed_tok_s
    if cur is None or obs is None or cur.mean <= 0 or obs <= 0:
        return target
    f = min(max(obs / cur.mean, 0.5), 1.0)
    return Estimate(target.mean * f, target.low * f, target.high * f, target.n)


def _is_flap(state: PolicyState, target: str, now_s: float, s: PolicySettings) -> bool:
    """A -> B -> A: going back to the profile the last predicted-gain switch left, inside the
    amortisation horizon, with no change point since that switch."""
    if not state.switches:
        return False
    last = state.switches[-1]
    if last["reason"] != Reason.SWITCH_PREDICTED_GAIN.value or last["from"] != target:
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
) -> str | None:
    """The untried or stale profile whose run has the highest positive expected value of
    information minus expected cost, or None."""
    specs = state.specs

    def unknown(name: str) -> bool:
        if name == state.running or name in blocked:
            return False
        if name not in state.tried:
            return True
        t = state.model.cycle.last_t_s(name)
        return state.last_change_s is not None and (t is None or t < state.last_change_s)

    cands = [p.name for p in state.profiles if unknown(p.name)]
    best: tuple[float, str] | None = None
    r_back = _restart(state, state.running, s)
    for q in cands:
        r_q = _restart(state, q, s)
        if age < s.burst_wait_factor * r_q:
            continue  # a young regime may be a burst: no restart for information either
        revealed = [q] + [
            r
            for r in cands
            if r != q
            and cross_predictable(specs[q], specs[r])
            and specs[r].num_steps < specs[q].num_steps
        ]
        dists = [_prior_dist(preds.get(r), cur, s) for r in revealed]
        useful_s = max(horizon - r_q - s.min_dwell_s, 0.0)
        value = _expected_excess(dists, cur) * useful_s
        p_worse, shortfall = _shortfall(dists[0], cur)
        cost = cur * r_q + shortfall * s.min_dwell_s + p_worse * cur * r_back
        net = value - cost
        diag[f"explore_net_tokens.{q}"] = net
        if net > 0 and (best is None or net > best[0]):
            best = (net, q)
    if best is None:
        return None
    diag["explore_value_net_tokens"] = best[0]
    return best[1]


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
    # on_switch_done's signature carries no settings: use those of the last decide.
    s = state.settings
    _adopt(state, profile, now_s, s, learned_restart_s=downtime_s)
    if matched and pending is not None and pending["reason"] == Reason.SWITCH_PREDICTED_GAIN.value:
        if pending.get("predicted") is not None:
            state.trial = {
                "profile": profile,
                "from": pending["from"],
                "predicted": pending["predicted"],
                "windows": [],
                "skip": s.trial_warmup_windows,
                "t_s": float(now_s),
            }
    else:
        state.trial = None
    return state
