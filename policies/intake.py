"""Observation intake: how one window changes what the policy believes.

Owns `ingest` (a window into the estimators and the change detectors, with the boot check of a
profile that just started), what a detected change does (a regime boundary, a model change, a
system-wide cycle change, whose points are set aside and which estimators restart), `adopt` (a
profile starts serving: a switch done, a rollback, a restart seen from outside), and the fleet
canary's hooks (`on_canary_started`, `on_canary_rejected`, `observe_canary`).

Must not: decide anything, read clocks (times come in with the data), or do I/O.
"""

from __future__ import annotations

import math
from typing import Any

from policies import hybrid_decide
from policies.changepoint import CusumEvent, Finding, acceptance_finding, drift_finding
from policies.cycle_time import comparable_step_s
from policies.forgetting import batch_bucket
from policies.settings import PolicySettings
from policies.state import MAX_CYCLE_MOVES, PolicyState, restart_time
from policies.types import Observation


def has_traffic(obs: Observation) -> bool | None:
    """Whether the window served anything (decode steps, else output tokens, else running
    requests); None when it says none of them."""
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
    if ev.before > 0:
        _cycle_moved(state, p, t_change, ev.after / ev.before)


def _cycle_moved(state: PolicyState, p: str, t_change: float, ratio: float) -> None:
    """Profile `p`'s step time moved by `ratio` at `t_change` with the system: every other
    profile's cycle data made stale, and the move remembered for the profiles of its forward
    kind (cycle_moves)."""
    _model_change(state, t_change, "cycle")
    if ratio > 0 and math.isfinite(ratio):
        move = [t_change, ratio, 1.0 if state.specs[p].speculative else 0.0]
        state.cycle_moves = [*state.cycle_moves, move][-MAX_CYCLE_MOVES:]


def _contradicted_cycle(state: PolicyState, obs: Observation, s: PolicySettings) -> None:
    """The running profile's step time at the batch size of this window contradicts what its
    older data at other batch sizes allow (CycleTimeSurface.contradiction): the system moved
    while the batch did, which the step-time stream (like batch sizes only) cannot see. The
    older data describe another system: forgotten, drift reported, and the move (at least the
    contradiction's ratio) treated as a detected one (_cycle_moved)."""
    m, p = obs.moments, obs.profile
    if m is None or m.n_steps <= 0:
        return
    batch = m.sum_bs / m.n_steps
    c = state.model.cycle.contradiction(p, batch)
    if c is None:
        return
    after = state.model.cycle.estimate(p, batch)
    state.model.cycle.drop_buckets(p, c.buckets)
    if after is not None:
        f = drift_finding(
            f"cycle:{p}", after.mean / c.ratio, after.mean, obs.t_s, s.drift_min_rel, "s"
        )
        _add_finding(state, f, s)
    _cycle_moved(state, p, c.since_s - obs.window_s, c.ratio)


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
            # A concurrency change is new traffic: its mix is that of the windows since too
            # (the mix streams restart below and would not see a mix change that came with it).
            state.model.mix.rebase(t_change, s.change_discount)
            if key == "batch":
                state.model.concurrency.rebase(t_change, s.change_discount)
                # The acceptance streams' noise is set by the verify steps behind a point (a
                # window at 64 streams holds fifty times one at a single stream): after a
                # concurrency change they re-learn it, or the old scale raises false alarms.
                # So is the mix streams' (a point holds the requests one window finishes, at
                # least mix_point_min_requests: dozens at 64 streams, a few at one). A fixed
                # chain's accept length per workload keeps its level to compare the new one
                # with: new traffic under the same label (a batch job starting) often brings
                # both. An adaptive profile's moves with the batch (its table's tier) by design.
                for k, det in list(state.monitor.detectors.items()):
                    if k.startswith(per_workload) and not spec.adaptive:
                        det.relearn()
                    elif k.startswith("accept:") or k.startswith("mix:"):
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


def ingest(state: PolicyState, obs: Observation, s: PolicySettings) -> str:
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
        adopt(state, obs.profile, obs.t_s, s, learned_restart_s=None)
        return "adopted"
    if obs.counter_reset:
        return "reset"
    sig = state.model.observe(obs)
    _contradicted_cycle(state, obs, s)
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
    hybrid_decide.discount_self(
        state, profile, s.boot_carryover, max_windows=s.boot_carryover_max_windows
    )
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


def adopt(
    state: PolicyState,
    profile: str,
    now_s: float,
    s: PolicySettings,
    learned_restart_s: float | None,
) -> None:
    if learned_restart_s is not None and math.isfinite(learned_restart_s) and learned_restart_s > 0:
        old = restart_time(state, profile, s)
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
