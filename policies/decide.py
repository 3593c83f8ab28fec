"""The policy: decide, on_switch_done, predictions, and the interface the daemon imports (`__all__`:
what the policy remembers is policies/state.py's, how a window changes it policies/intake.py's,
its knobs policies/settings.py's, what an exploration is worth policies/explore_value.py's).

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
lengths of enough past regimes say switching now beats waiting) all allow it. A server found
serving, nothing restarted or changed since, is no restart to dwell after and its traffic no
burst just begun: neither holds an exploration back there (found_serving). Where the traffic
of the last long-run window (batch sizes and workload mix) values the candidate below the
running profile, the regimes that favour the running profile will come back and take the
switch back: its restart (R_back at C's long-run rate) is added to the cost
(hybrid_decide.return_cost), except on the way back from an exploration to the profile it
left, a restart the exploration's own cost already counted. Where that traffic, over two or
more batch-size regimes, values the candidate above the running profile by more than the
margin, the regimes to come keep the gain: a switch the current regime alone does not repay
also counts that long-run gain for as long again as the window's history
(hybrid_decide.carry_values, at most long_run_horizon_s). Profiles never run, or whose data
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

Precedence (first match wins): blocked > rollback after a failed start > pause > pin > failed
scrape > switch in flight > trial > unusable window > no traffic > dwell > suspected change >
long-run rule (flipping traffic; table rewrites) > estimates. The operator's pause and pin beat
every decision of the policy; the two safety rules before them act only after a failure (a
pause must not leave the server down, and nothing acts while blocked).

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
from collections.abc import Mapping
from typing import Any, NamedTuple

from policies import hybrid_decide
from policies.accept_length import cross_predictable
from policies.explore_value import (
    breakeven_s,
    explore_gain,
    prior_dist,
    shortfall_below,
    switch_margin,
)
from policies.forgetting import batch_bucket
from policies.intake import (
    adopt,
    has_traffic,
    ingest,
    observe_canary,
    on_canary_rejected,
    on_canary_started,
)
from policies.overhead import wall_estimate
from policies.settings import PolicySettings
from policies.state import PolicyState, initial_state, new_model, restart_time
from policies.trial import TrialOutcome, assess_trial, beats
from policies.types import (
    Action,
    Decision,
    Estimate,
    Observation,
    Overrides,
    ProfilePrediction,
    Reason,
)

# The policy's public interface, for the daemon, the fleet controller and the benchmark (state,
# intake and settings live in their own modules; this is the one import they need).
__all__ = [
    "PolicySettings",
    "PolicyState",
    "begin_manual_switch",
    "budget_exhausted",
    "decide",
    "explore_cap_s",
    "initial_state",
    "new_model",
    "observe_canary",
    "on_canary_rejected",
    "on_canary_started",
    "on_start_up",
    "on_switch_done",
    "predictions",
]


# --------------------------------------------------------------------------------------------
# Decision helpers


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
    verify_rise = math.prod(r for _, r, v in state.cycle_moves if v)
    preds = [
        state.model_prediction(
            p.name,
            stale_widen,
            cycle_moves=[(t, r) for t, r, v in state.cycle_moves if bool(v) == p.speculative],
            verify_rise=verify_rise,
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
    intake = "scrape_failed" if obs is None else ingest(state, obs, s)
    diag["intake"] = intake
    for f in state.new_findings[-3:]:
        diag[f"finding.{f.kind}.{f.subject}"] = f.after

    # Two safety rules first: a block (nothing acts until a person clears it) and the way back
    # from a failed start (a pause or a pin must not leave the server down); then the operator's
    # overrides beat every decision of the policy.
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
            adopt(state, target, now_s, s, learned_restart_s=None)
            diag["restored_by_shell"] = target
            return _hold(now_s, state, Reason.HOLD_COOLDOWN, diag)
        else:
            state.rollback_to = None
            # The profile that failed last (on_switch_done cleared the pending switch).
            diag["failed_profile"] = max(state.failed, key=state.failed.__getitem__, default=None)
            return _switch(now_s, state, target, Reason.ROLLBACK_START_FAILED, diag)

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
    traffic = has_traffic(obs)
    if traffic is False:
        return _hold(now_s, state, Reason.HOLD_NO_TRAFFIC, diag)
    dwell_left = s.min_dwell_s - (now_s - state.last_switch_s)
    if dwell_left > 0 and not found_serving(state):
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
            # began: window-to-window scatter, or the first windows of a burst. Acted on once
            # the detectors confirm it (a change point: HOLD_BURST while it may be a burst) or
            # the re-evaluation interval is up; until then the last evaluation stands, and its
            # reason with it (a hold_burst here would flicker on every noisy window of a
            # stationary day).
            diag["traffic_moved_unconfirmed"] = True
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


class _Option(NamedTuple):
    """A switch `_choose` weighs: tokens it nets over the horizon, and the numbers behind it."""

    net: float
    name: str
    gain: float
    margin: float
    restart_s: float


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

    options: list[_Option] = []
    for name, pr in preds.items():
        if name == state.running or pr.tok_s is None or name in blocked_profiles:
            continue
        if pr.bound:
            continue  # a bound is no prediction to switch on: only a run (exploration) says
        r = restart_time(state, name, s)
        margin = switch_margin(cur_pred.tok_s, pr.tok_s, s.margin_frac, s.margin_z)
        # A profile whose cost may have moved with the system since it ran is switched to on
        # its pessimistic end only (what it delivers if it moved as far); the rest of its
        # interval is for exploration to weigh.
        gain = (pr.tok_s.low if pr.moved else pr.tok_s.mean) - cur
        net = (gain - margin) * max(horizon - r, 0.0) - cur * r
        options.append(_Option(net, name, gain, margin, r))
    # A gain the regime alone does not repay may be kept by the regimes to come.
    carry = hybrid_decide.carry_values(
        state, [o.name for o in options if o.gain - o.margin > 0 and o.net <= 0], s
    )
    options = [o._replace(net=o.net + carry.get(o.name, 0.0)) for o in options]
    best = max(options, key=lambda o: o.net) if options else None

    # A predicted gain that does not repay its restart (or waits out a possible burst) holds
    # with this reason unless an exploration pays: a small sure gain must not keep a larger
    # unknown one from being weighed (stress a12: 6-step's gain, short of a 10-minute restart,
    # ended the decision, and 3-step, never run and priced 27% higher, was never tried).
    held: Reason | None = None
    if best is not None:
        net, name, gain, margin, r = best
        diag.update(best=name, gain_tok_s=gain, margin_tok_s=margin, restart_s=r, net_tokens=net)
        if name in carry:
            diag["carry_tokens"] = carry[name]
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


def found_serving(state: PolicyState) -> bool:
    """The server was found serving when the policy began, nothing has changed or restarted
    since (no start, switch or external restart on record), and the traffic's change detectors
    (concurrency, mix) are past their warm-up. Its traffic predates the controller: the regime
    is of unknown age, not a burst just begun, and no boot's first windows are being judged, so
    neither the burst wait nor the dwell holds an exploration back. Until the detectors may
    alarm, a restart could hide a move of the traffic inside their warm-up, which would absorb
    it. A server the controller started itself (on_start_up) is not found serving: the dwell
    follows its boot."""
    if state.boot_seen or state.last_change_s is not None or state.switches:
        return False
    dets = state.monitor.detectors
    traffic = [d for k, d in dets.items() if k == "batch" or k.startswith("mix:")]
    return "batch" in dets and all(d.armed for d in traffic)


def explore_cap_s(state: PolicyState, s: PolicySettings) -> float:
    """The longest horizon information is valued over: `explore_horizon_s`, or
    `explore_horizon_restarts` restarts of the running profile where that is longer."""
    return max(
        s.explore_horizon_s, s.explore_horizon_restarts * restart_time(state, state.running, s)
    )


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
    r_back = restart_time(state, state.running, s)
    burst_wait = not found_serving(state)
    for q in cands:
        r_q = restart_time(state, q, s)
        if burst_wait and age < s.burst_wait_factor * r_q:
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


def on_start_up(state: PolicyState, now_s: float) -> PolicyState:
    """The shell reports that it started the server itself at start-up (nothing served before,
    nothing was adopted), serving since `now_s`: the dwell runs from then, as after any
    restart. Updates `state` in place and returns it."""
    state.boot_seen = True
    state.last_switch_s = float(now_s)
    return state


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
    adopt(state, profile, now_s, s, learned_restart_s=downtime_s)
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
