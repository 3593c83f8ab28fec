"""Fleet scenarios (controller/bench/fleet.py): the router's split, rolling switches that never
take the fleet to zero, the mean replica the policy sees, canaries, the fleet's oracles against a
brute force and the statics, determinism, and the JSON rows."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from controller.bench import fleet as fb
from controller.bench.harness import Replay, Segment, SwitchEvent
from controller.bench.metrics import JSON_KEYS
from controller.bench.oracles import Measurements, phase_rates
from controller.bench.peers import Specpilot, Static
from controller.bench.report import json_rows, plot_scenario, print_results
from controller.bench.runner import ScenarioResult, run_scenario
from controller.bench.scenario import (
    HYBRID_PROFILE,
    Scenario,
    ScenarioError,
    bench_profile,
    load_scenario,
)
from controller.bench.scenario import scenario_from_dict as from_dict
from controller.fleet.controller import plan_move
from policies.types import Action, Decision, Mode, Observation, ProfileSpec, Reason
from tests.bench.conftest import make_scenario


def fleet_scenario(**over: Any) -> Scenario:
    """3 replicas, one stream each for 30 min, then 16 each (fleet totals 3 and 48)."""
    raw: dict[str, Any] = {
        "replicas": 3,
        "phases": [
            {"duration_s": 1800, "concurrency": 3, "workloads": {"chat": 0.7, "code": 0.3}},
            {"duration_s": 1800, "concurrency": 48, "workloads": {"chat": 0.7, "code": 0.3}},
        ],
    }
    raw.update(over)
    return make_scenario(**raw)


# ------------------------------------------------------------------------------ format


def test_replicas_default_to_one_server() -> None:
    sc = make_scenario()
    assert sc.replicas == 1 and sc.canary is None and sc.max_unavailable_fraction is None


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": 2.5}, "replicas"),
        ({"canary": False}, "canary"),  # a canary needs a fleet
        ({"max_unavailable_fraction": 0.5}, "max_unavailable_fraction"),
        ({"replicas": 3, "canary": "yes"}, "canary"),
        ({"replicas": 3, "max_unavailable_fraction": 0}, "max_unavailable_fraction"),
        ({"replicas": 3, "max_unavailable_fraction": 1.5}, "max_unavailable_fraction"),
    ],
)
def test_bad_fleet_keys_name_the_key(over: dict[str, Any], key: str) -> None:
    raw: dict[str, Any] = {
        "name": "t",
        "profile": "kimi-k2.5-pcie-tuned",
        "phases": [{"duration_s": 60, "concurrency": 1, "workloads": {"chat": 1.0}}],
    }
    with pytest.raises(ScenarioError) as e:
        from_dict({**raw, **over}, source="f.toml")
    assert e.value.key == key and str(e.value).startswith(f"f.toml: {key}: ")


def test_fleet_settings_follow_the_scenario() -> None:
    sc = fleet_scenario(replicas=4, max_unavailable_fraction=0.5, canary=False)
    fs = fb.fleet_settings(sc)
    assert fs.replicas == 4 and fs.max_unavailable() == 2 and not fs.canary.enabled
    # Unset keys: [fleet]'s defaults (one replica out of 3, canaries on).
    fs = fb.fleet_settings(fleet_scenario())
    assert fs.max_unavailable() == 1 and fs.canary.enabled


def test_shipped_fleet_scenarios_load() -> None:
    from controller.bench.scenario import shipped_scenarios

    fleets = [load_scenario(p) for p in shipped_scenarios() if p.name.startswith("fleet-")]
    assert len(fleets) >= 2
    assert all(sc.replicas >= 2 and sc.duration_s == 86400 for sc in fleets)


# ------------------------------------------------------------------------------ the router


@pytest.mark.parametrize(("c", "k"), [(0, 3), (1, 3), (4, 4), (10, 3), (192, 4), (49, 3)])
def test_round_robin_split(c: int, k: int) -> None:
    s = fb.split_concurrency(c, k)
    assert len(s) == k and sum(s) == c and max(s) - min(s) <= (1 if c % k else 0)
    assert s == sorted(s, reverse=True)  # the remainder goes to the first replicas


def test_split_refuses_an_empty_router() -> None:
    with pytest.raises(ValueError, match="replicas in the router"):
        fb.split_concurrency(3, 0)


# ------------------------------------------------------------------------------ rolling switches


def _fleet(sc: Scenario, profile: str = "baseline") -> fb.VirtualFleet:
    rep = fb.FleetReplay(sc.name, "t", profile, sc.duration_s, replicas=sc.replicas)
    return fb.VirtualFleet(sc, sc.catalog(), sc.sim_profile(), profile, rep, fb.fleet_settings(sc))


@pytest.mark.parametrize(("replicas", "fraction", "per"), [(3, None, 1), (4, 0.5, 2), (5, 0.34, 1)])
def test_rolling_switch_keeps_at_most_max_unavailable_out(
    replicas: int, fraction: float | None, per: int
) -> None:
    over: dict[str, Any] = {"replicas": replicas}
    if fraction is not None:
        over["max_unavailable_fraction"] = fraction
    sc = fleet_scenario(**over)
    f = _fleet(sc)
    f.serve(0.0, 10.0)
    up, down = f.roll(10.0, list(range(replicas)), "eagle3-2step")
    restart = sc.sim_profile().restart_s(bench_profile("eagle3-2step").sim)
    assert down == pytest.approx(replicas * restart)
    assert up == pytest.approx(10.0 + math.ceil(replicas / per) * restart)
    assert all(r.profile == "eagle3-2step" for r in f.replicas)
    # Each replica's own record holds its downtime: never more than `per` down at once.
    downs = [(s.t0, s.t1) for r in f.replicas for s in r.replay.segments if s.profile is None]
    edges = sorted({t for d in downs for t in d})
    for a, b in itertools.pairwise(edges):
        mid = (a + b) / 2
        assert sum(1 for t0, t1 in downs if t0 <= mid < t1) <= per
    # The fleet served all along (the replicas in the router took the clients of those out).
    during = [s for s in f.replay.segments if 10.0 <= s.t0 < up]
    assert during and all(s.tokens > 0 for s in during)
    assert all(s.profile is None for s in during)  # the band shows the switch


def test_a_fleet_switch_never_takes_the_fleet_to_zero() -> None:
    """Every stretch of a replay with clients serves tokens, switches included; with every
    replica allowed out at once (max_unavailable_fraction = 1) the same switch does go to zero,
    so the check can fail."""
    for conc, canary in itertools.product((3, 48), (False, True)):
        sc = fleet_scenario(
            phases=[{"duration_s": 1800, "concurrency": conc, "workloads": {"chat": 1.0}}]
        )
        rep = fb.fleet_replay(sc, Static("eagle3-5step"), canary=canary)
        assert len(rep.switches) == 1
        assert all(s.tokens > 0 for s in rep.segments), (conc, canary)
    for conc in (3, 48):
        naive = fb.fleet_replay(
            fleet_scenario(
                max_unavailable_fraction=1.0,
                phases=[{"duration_s": 1800, "concurrency": conc, "workloads": {"chat": 1.0}}],
            ),
            Static("eagle3-5step"),
            canary=False,
        )
        assert any(s.tokens == 0 and s.t1 > s.t0 for s in naive.segments)


def test_clients_of_the_replica_out_go_to_the_others() -> None:
    """One stream per replica: while one restarts, its client runs on another at batch 2, so
    the fleet keeps well over (N - 1) / N of its rate (a batch of 2 costs little more than 1)."""
    sc = fleet_scenario(phases=[{"duration_s": 3600, "concurrency": 3, "workloads": {"chat": 1.0}}])
    f = _fleet(sc)
    before = f.serve(0.0, 600.0) / 600.0
    up, _ = f.roll(600.0, [0], "baseline")  # a restart into the same profile: only the cost
    during = sum(s.tokens for s in f.replay.segments if s.t0 >= 600.0) / (up - 600.0)
    assert during > before * (2 / 3) * 1.2
    assert during < before


# ------------------------------------------------------------------------------ the policy's view


class _Recorder:
    """Holds; records the observations it is shown."""

    name = "recorder"

    def __init__(self) -> None:
        self.obs: list[Observation] = []

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> None:
        pass

    def tick(self, obs: Observation, now_s: float) -> Decision:
        self.obs.append(obs)
        return Decision(now_s, Action.HOLD, obs.profile, Reason.HOLD_BEST, {})

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None:
        pass


def test_the_policy_sees_the_mean_replica() -> None:
    sc = fleet_scenario(
        replicas=4,
        phases=[{"duration_s": 600, "concurrency": 48, "workloads": {"chat": 1.0}}],
    )
    pol = _Recorder()
    rep = fb.fleet_replay(sc, pol)
    assert pol.obs and pol.obs[0].t_s == 10.0  # the first scrape has no window
    assert {o.running_reqs for o in pol.obs} == {12.0}  # one replica's batch, not the fleet's
    # Counters per replica: the fleet's tokens after the first (unobserved) window, / 4 (less
    # the first token of each request, which comes from its prefill).
    per_replica = sum(o.decode_tokens or 0.0 for o in pol.obs)
    observed = sum(s.tokens for s in rep.segments if s.t0 >= 10.0)
    assert per_replica == pytest.approx(observed / 4, rel=0.01)


@pytest.mark.parametrize("canary", [True, False])
def test_specpilot_prices_explorations_by_the_fleets_canary(canary: bool) -> None:
    """As FleetController: a fleet replay tells specpilot the share of the fleet an
    exploration restarts first (one replica of four with canaries on, all four without)."""
    sc = fleet_scenario(
        replicas=4,
        phases=[{"duration_s": 120, "concurrency": 48, "workloads": {"chat": 1.0}}],
    )
    pol = Specpilot()
    assert pol.settings.explore_canary_share == 1.0  # one server
    fb.fleet_replay(sc, pol, canary=canary)
    assert pol.settings.explore_canary_share == (0.25 if canary else 1.0)


class _SwitchOnce:
    """Asks for `target` at every window until it runs; records switch_done."""

    name = "switch-once"

    def __init__(self, target: str) -> None:
        self.target = target
        self.done: list[tuple[str, bool, float, float]] = []

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> None:
        pass

    def tick(self, obs: Observation, now_s: float) -> Decision:
        if obs.profile != self.target:
            return Decision(now_s, Action.SWITCH, self.target, Reason.SWITCH_PREDICTED_GAIN, {})
        return Decision(now_s, Action.HOLD, obs.profile, Reason.HOLD_BEST, {})

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None:
        self.done.append((profile, ok, downtime_s, now_s))


def test_rollout_reports_the_fleets_lost_capacity() -> None:
    sc = fleet_scenario()
    pol = _SwitchOnce("eagle3-2step")
    rep = fb.fleet_replay(sc, pol, canary=False)
    restart = sc.sim_profile().restart_s(bench_profile("eagle3-2step").sim)
    (sw,) = rep.switches
    assert (sw.t_s, sw.up_s) == (10.0, pytest.approx(10.0 + 3 * restart))
    # As FleetActuator: the sum of the replicas' restarts / replicas = one restart.
    assert pol.done == [("eagle3-2step", True, pytest.approx(restart), pytest.approx(sw.up_s))]


def test_canary_promotes_a_better_profile_and_rolls_back_a_worse_one() -> None:
    # Later boot, one stream per replica: baseline is ~27% faster than 2-step.
    sc = fleet_scenario(
        profile="kimi-k2.5-pcie-later-boot",
        phases=[{"duration_s": 3600, "concurrency": 3, "workloads": {"default": 1.0}}],
    )
    good = fb.fleet_replay(sc, _SwitchOnce("baseline"), initial_profile="eagle3-2step")
    (sw,) = good.switches
    assert sw.reason == fb.CANARY_PROMOTED and sw.to_profile == "baseline"
    assert [c.outcome for c in good.canaries] == ["promoted"]
    pol = _SwitchOnce("eagle3-2step")
    bad = fb.fleet_replay(sc, pol, initial_profile="baseline")
    assert bad.canaries and bad.canaries[0].outcome == "rolled_back"
    assert bad.switches[0].reason == fb.CANARY_ROLLED_BACK
    # The policy is told as for a failed start; the candidate is not retried for retry_after_s.
    assert pol.done[0][:3] == ("eagle3-2step", False, 0.0)
    retry = fb.fleet_settings(sc).canary.retry_after_s
    starts = [c.started_s for c in bad.canaries]
    assert all(b - a >= retry for a, b in itertools.pairwise(starts))
    # Only the canary replica ever ran the candidate: the fleet never went below 2/3.
    assert all(s.tokens > 0 for s in bad.segments)
    rates = phase_rates(sc, [bad])
    assert fb.fleet_false_switches(sc, rates, bad) == len(bad.switches)


def test_a_canary_on_a_replica_without_traffic_rolls_straight_through() -> None:
    """One stream on 3 replicas: the router's split leaves the canary replica (the last) idle,
    so a canary there could never be judged. The policy's switch rolls straight through, as
    with canaries off (before, the canary waited for traffic for the rest of the day and the
    policy was never asked again)."""
    sc = fleet_scenario(
        profile="kimi-k2.5-pcie-later-boot",
        phases=[{"duration_s": 3600, "concurrency": 1, "workloads": {"default": 1.0}}],
    )
    pol = _SwitchOnce("baseline")
    rep = fb.fleet_replay(sc, pol, initial_profile="eagle3-2step")
    assert rep.canaries == []
    (sw,) = rep.switches
    assert sw.to_profile == "baseline" and sw.reason == Reason.SWITCH_PREDICTED_GAIN.value
    assert pol.done[0][:2] == ("baseline", True)


def test_a_canary_whose_traffic_stops_runs_out_of_time() -> None:
    """Three streams while the canary starts, then one (its replica idle): the canary cannot
    collect min_windows pairs, and is rolled back once it has had its max_windows ticks (after
    its first scrape and warmup), not kept for the rest of the day."""
    sc = fleet_scenario(
        profile="kimi-k2.5-pcie-later-boot",
        phases=[
            {"duration_s": 300, "concurrency": 3, "workloads": {"default": 1.0}},
            {"duration_s": 3600, "concurrency": 1, "workloads": {"default": 1.0}},
        ],
    )
    fs = fb.fleet_settings(sc)
    pol = _SwitchOnce("baseline")
    rep = fb.fleet_replay(sc, pol, initial_profile="eagle3-2step")
    c = rep.canaries[0]
    assert c.outcome == "rolled_back" and "(insufficient_windows)" in c.verdict
    ticks = 1 + fs.canary.warmup_windows + fs.canary.max_windows
    restart = sc.sim_profile().restart_s
    up = c.started_s + restart(bench_profile("baseline").sim)
    decided = c.ended_s - restart(bench_profile("eagle3-2step").sim)  # then back to 2-step
    assert decided - up == pytest.approx(ticks * sc.poll_interval_s, abs=sc.poll_interval_s)
    assert pol.done[0][:3] == ("baseline", False, 0.0)  # told as for a failed start


class _SwitchOnceHooked(_SwitchOnce):
    """_SwitchOnce with the canary hook: records (profile, judged) of every rejection."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.rejected: list[tuple[str, bool]] = []

    def canary_rejected(self, profile: str, now_s: float, *, judged: bool = True) -> None:
        self.rejected.append((profile, judged))


def test_a_canary_rolled_back_unjudged_is_rolled_straight_through_next_time() -> None:
    """Three streams while baseline's canary starts, then two for five minutes (the canary
    replica idle): the canary runs out of time unjudged, the policy is told so (nothing to back
    off), and its next ask for baseline, with six streams on every replica again, rolls every
    replica through with no second canary (a judged rejection would hold it for
    retry_after_s)."""
    sc = fleet_scenario(
        profile="kimi-k2.5-pcie-later-boot",
        phases=[
            {"duration_s": 300, "concurrency": 3, "workloads": {"default": 1.0}},
            {"duration_s": 300, "concurrency": 2, "workloads": {"default": 1.0}},
            {"duration_s": 3600, "concurrency": 6, "workloads": {"default": 1.0}},
        ],
    )
    pol = _SwitchOnceHooked("baseline")
    rep = fb.fleet_replay(sc, pol, initial_profile="eagle3-2step")
    (c,) = rep.canaries
    assert c.outcome == "rolled_back" and "(insufficient_windows)" in c.verdict
    assert pol.rejected == [("baseline", False)]
    rolled, promoted = rep.switches[0], rep.switches[1]
    assert rolled.reason == fb.CANARY_ROLLED_BACK
    assert promoted.to_profile == "baseline"
    assert promoted.reason == Reason.SWITCH_PREDICTED_GAIN.value
    assert promoted.t_s >= rolled.up_s > 600.0  # decided with traffic on every replica
    assert pol.done[0][:2] == ("baseline", True) and len(rep.switches) == 2


def test_plan_move_rolls_through_a_candidate_whose_canary_ran_out_unjudged() -> None:
    fs = fb.fleet_settings(fleet_scenario())
    d = Decision(100.0, Action.SWITCH, "baseline", Reason.SWITCH_PREDICTED_GAIN, {})
    yes = lambda: True  # noqa: E731
    unjudged = {"baseline": 50.0}
    move = plan_move(d, "eagle3-2step", None, {}, 100.0, fs, 3, Mode.ACTIVE, yes, unjudged)
    assert move[:2] == ("rollout", "baseline") and "unjudged" in move[2]
    # Past retry_after_s it gets a canary again; another candidate is not affected.
    later = 50.0 + fs.canary.retry_after_s
    assert plan_move(d, "eagle3-2step", None, {}, later, fs, 3, Mode.ACTIVE, yes, unjudged)[0] == (
        "canary"
    )
    other = {"eagle3-5step": 50.0}
    assert plan_move(d, "eagle3-2step", None, {}, 100.0, fs, 3, Mode.ACTIVE, yes, other)[0] == (
        "canary"
    )
    # An operator's forced canary runs anyway; a judged rejection still holds.
    forced = plan_move(d, "eagle3-2step", "baseline", {}, 100.0, fs, 3, Mode.ACTIVE, yes, unjudged)
    assert forced[:2] == ("canary", "baseline")
    held = plan_move(d, "eagle3-2step", None, unjudged, 100.0, fs, 3, Mode.ACTIVE, yes, {})
    assert held[0] == "hold"


def test_plan_move_skips_a_canary_that_could_not_be_judged() -> None:
    fs = fb.fleet_settings(fleet_scenario())
    d = Decision(0.0, Action.SWITCH, "baseline", Reason.SWITCH_PREDICTED_GAIN, {})
    assert plan_move(d, "eagle3-2step", None, {}, 0.0, fs, 3, Mode.ACTIVE)[0] == "canary"
    no = lambda: False  # noqa: E731
    move, target, why = plan_move(d, "eagle3-2step", None, {}, 0.0, fs, 3, Mode.ACTIVE, no)
    assert (move, target) == ("rollout", "baseline") and "no canary" in why
    # An operator's forced canary runs anyway.
    forced = plan_move(d, "eagle3-2step", "baseline", {}, 0.0, fs, 3, Mode.ACTIVE, no)
    assert forced[:2] == ("canary", "baseline")


class _Learning(_SwitchOnce):
    """_SwitchOnce with the canary hooks Specpilot has (as FleetController calls them)."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.started: list[str] = []
        self.seen: list[str] = []

    def canary_started(self, profile: str) -> None:
        self.started.append(profile)

    def canary_window(self, obs: Observation) -> None:
        self.seen.append(obs.profile)


def test_a_policy_learns_from_its_canarys_windows() -> None:
    """The fleet replay tells a policy that has the hooks when a canary boots and gives it every
    window of the canary replica serving the candidate; specpilot feeds them to its estimates
    (policies.decide.observe_canary), so a rolled-back candidate is predicted from what the
    canary measured, and is not proposed again while the traffic holds."""
    sc = fleet_scenario(
        profile="kimi-k2.5-pcie-later-boot",
        phases=[{"duration_s": 3600, "concurrency": 3, "workloads": {"default": 1.0}}],
    )
    pol = _Learning("eagle3-2step")
    bad = fb.fleet_replay(sc, pol, initial_profile="baseline")
    assert pol.started == [c.candidate for c in bad.canaries] and pol.started
    assert pol.seen and set(pol.seen) == {"eagle3-2step"}
    assert len(pol.seen) >= fb.fleet_settings(sc).canary.min_windows
    # specpilot explores both speculative profiles there, one canary each: both rolled back,
    # both measured (their step times), neither tried again.
    sp = Specpilot()
    rep = fb.fleet_replay(sc, sp, initial_profile="baseline")
    assert sorted(c.candidate for c in rep.canaries) == ["eagle3-2step", "eagle3-5step"]
    assert {c.outcome for c in rep.canaries} == {"rolled_back"}
    for p in ("eagle3-2step", "eagle3-5step"):
        assert sp.state.model.cycle.has_data(p), p


# ------------------------------------------------------------------------------ oracles


def _synthetic(
    fleet_rates: dict[str, list[float]], phase_s: float, dt: float, replicas: int
) -> Measurements:
    n = len(next(iter(fleet_rates.values())))
    sc = make_scenario(
        poll_interval_s=dt,
        profiles=list(fleet_rates),
        replicas=replicas,
        phases=[
            {"duration_s": phase_s, "concurrency": replicas, "workloads": {"chat": 1.0}}
            for _ in range(n)
        ],
    )
    reps = {}
    for p, rs in fleet_rates.items():
        r = Replay(sc.name, p, p, sc.duration_s)
        for ph, rate in zip(sc.phases, rs, strict=True):
            r.segments.append(Segment(ph.start_s, ph.end_s, ph.index, p, rate * ph.duration_s))
        r.tokens = sum(s.tokens for s in r.segments)
        reps[p] = r
    m = Measurements(sc, reps)
    m.rates = phase_rates(sc, list(reps.values()))
    return m


def _brute_fleet(
    m: Measurements, restart: dict[str, float], rr: dict[tuple[str, int, int], float]
) -> float:
    """Every per-tick plan for two profiles, the rollout integrated phase by phase."""
    sc = m.scenario
    names = list(sc.profiles)
    dt, end = sc.poll_interval_s, sc.duration_s
    grid = np.append(np.arange(0.0, end, dt), end)
    K = len(grid) - 1
    fs = fb.fleet_settings(sc)

    def fleet(p: str, a: float, b: float) -> float:
        return sum(
            m.rates[p][ph.index] * max(0.0, min(b, ph.end_s) - max(a, ph.start_s))
            for ph in sc.phases
        )

    def rolled(p: str, q: str, t: float) -> tuple[float, float]:
        per = fs.max_unavailable()
        tok, s = 0.0, t
        for k in range(0, sc.replicas, per):
            out = set(range(k, min(k + per, sc.replicas)))
            inside = [i for i in range(sc.replicas) if i not in out]
            z = min(s + restart[q], end)
            for ph in sc.phases:
                d = max(0.0, min(z, ph.end_s) - max(s, ph.start_s))
                conc = fb.split_concurrency(ph.concurrency, len(inside))
                rate = sum(
                    rr[(q if i < k else p, ph.index, c)] for i, c in zip(inside, conc, strict=True)
                )
                tok += rate * d
            s += restart[q]
        return tok, s

    best = -1.0
    for plan in itertools.product([False, True], repeat=K):
        p, k, total = sc.initial_profile, 0, 0.0
        while k < K:
            q = names[1 - names.index(p)]
            if not plan[k]:
                total += fleet(p, grid[k], grid[k + 1])
                k += 1
                continue
            tok, up = rolled(p, q, float(grid[k]))
            total += tok
            if up >= end:
                break
            j = int(np.searchsorted(grid, up - 1e-9))
            total += fleet(q, up, grid[j])
            p, k = q, j
        best = max(best, total)
    return best


@pytest.mark.parametrize(
    ("rates", "restart_s"),
    [
        ({"baseline": [30.0, 3.0], "eagle3-2step": [3.0, 30.0]}, 12.0),  # a switch pays
        ({"baseline": [30.0, 27.0], "eagle3-2step": [27.0, 30.0]}, 25.0),  # it does not
        ({"baseline": [15.0, 15.0, 15.0], "eagle3-2step": [6.0, 40.0, 6.0]}, 7.0),  # out, back
    ],
)
def test_fleet_oracle_dp_matches_brute_force(
    rates: dict[str, list[float]], restart_s: float
) -> None:
    n = len(rates["baseline"])
    m = _synthetic(rates, phase_s=60.0 if n == 2 else 40.0, dt=10.0, replicas=3)
    sc = m.scenario
    # A replica with c clients serves c x (fleet rate / 3) x 0.9^(c - 1): a batch costs more.
    rr = {
        (p, ph.index, c): c * rates[p][ph.index] / 3 * 0.9 ** max(0, c - 1)
        for p in rates
        for ph in sc.phases
        for c in range(0, 4)
    }
    restart = dict.fromkeys(rates, restart_s)
    dp = fb.fleet_oracle_dp(m, restart, fb.fleet_settings(sc), rr)
    assert dp.tokens == pytest.approx(_brute_fleet(m, restart, rr), rel=1e-9)
    assert sum(s.tokens for s in dp.replay.segments) == pytest.approx(dp.tokens, rel=1e-9)


def test_fleet_rollout_is_cheaper_than_a_whole_fleet_restart() -> None:
    """Where one server's oracle would not switch (the restart costs more than it gains), the
    fleet's does: a rolling switch loses only what the replica out would have served."""
    m = _synthetic({"baseline": [30.0, 27.0], "eagle3-2step": [27.0, 30.0]}, 60.0, 10.0, 3)
    sc = m.scenario
    rr = {(p, ph.index, c): 0.0 for p in sc.profiles for ph in sc.phases for c in range(4)}
    for p, rs in {"baseline": [30.0, 27.0], "eagle3-2step": [27.0, 30.0]}.items():
        for ph in sc.phases:
            for c in range(4):
                rr[(p, ph.index, c)] = c * rs[ph.index] / 3  # a replica is linear in clients
    restart = dict.fromkeys(sc.profiles, 25.0)
    dp = fb.fleet_oracle_dp(m, restart, fb.fleet_settings(sc), rr)
    assert [s.to_profile for s in dp.replay.switches] == ["eagle3-2step"]
    assert dp.tokens > m.replays["baseline"].tokens


def test_fleet_oracles_bound_the_statics_on_a_real_replay() -> None:
    res = run_scenario(fleet_scenario(), ["oracle_dp", "oracle_free", "best_static"])
    tokens = {r.policy: r.tokens for r in res.rows}
    statics = {n: res.replays[n].tokens for n in res.replays if n.startswith("static:")}
    assert len(statics) == 3
    assert tokens["oracle_dp"] <= tokens["oracle_free"]
    # The oracle can do what every static does (a rollout at t = 0); the statics' replays draw
    # their own noise and the oracle's rollouts use measured mean rates: 0.2%.
    for name, t in statics.items():
        assert tokens["oracle_dp"] >= t * (1 - 0.002), name
    assert tokens["best_static"] == max(statics.values())


# ------------------------------------------------------------------------------ determinism, rows


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    a = fb.fleet_replay(fleet_scenario(), Specpilot())
    b = fb.fleet_replay(fleet_scenario(), Specpilot())
    c = fb.fleet_replay(fleet_scenario(seed=4), Specpilot())
    assert a.tokens == b.tokens and a.switches == b.switches and a.canaries == b.canaries
    assert c.tokens != a.tokens
    # Replicas draw independently: not N copies of one server.
    f = _fleet(fleet_scenario(), "eagle3-2step")
    f.serve(0.0, 60.0)
    assert len({tuple(r.hist) for r in f.replicas}) == 3


def test_a_static_profile_rolls_out_at_the_start() -> None:
    rep = fb.fleet_replay(fleet_scenario(), Static("eagle3-2step"))
    (s,) = rep.switches
    assert s.t_s == 0.0 and s.to_profile == "eagle3-2step"
    assert fb.fleet_replay(fleet_scenario(), Static("baseline")).switches == []


def test_a_fleet_replay_needs_a_fleet() -> None:
    with pytest.raises(ValueError, match="replicas >= 2"):
        fb.fleet_replay(make_scenario(), Static("baseline"))


@pytest.fixture(scope="module")
def fleet_result() -> ScenarioResult:
    return run_scenario(fleet_scenario())


def test_fleet_rows_have_the_json_keys_and_every_policy(fleet_result: ScenarioResult) -> None:
    rows = json_rows([fleet_result])
    assert rows and all(tuple(r) == JSON_KEYS for r in rows)
    names = [r["policy"] for r in rows]
    assert names[:5] == ["specpilot", "specpilot_hybrid", "oracle_dp", "oracle_free", "best_static"]
    assert {"specpilot_hybrid", "sglang_adaptive", "vllm_batch_threshold", "greedy", "ucb"} <= set(
        names
    )
    by = {r["policy"]: r for r in rows}
    assert by["oracle_dp"]["ratio_oracle_dp"] == 1.0
    assert all(isinstance(r["false_switches"], int) for r in rows)


def test_report_shows_the_fleet(fleet_result: ScenarioResult, tmp_path: Path) -> None:
    console = Console(record=True, width=140)
    print_results([fleet_result], console)
    text = console.export_text()
    assert "(3 replicas)" in text
    assert "fleet: 3 replicas, at most 1 out of the router at once, specpilot's canary on" in text
    # specpilot tries 5-step on one replica at one stream each, and promotes it.
    canaries = fleet_result.replays["specpilot"].canaries  # type: ignore[attr-defined]
    assert canaries and canaries[0].outcome == "promoted"
    assert f"specpilot canaries: {len(canaries)} (1 promoted" in text
    png = tmp_path / "f.png"
    plot_scenario(fleet_result, png)
    assert png.stat().st_size > 10_000


def test_unknown_rows_are_refused_in_a_fleet() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'nope'"):
        fb.run_fleet_scenario(fleet_scenario(), ["nope"])


def _rewrite(running: str, **diag: Any) -> Decision:
    return Decision(0.0, Action.SWITCH, running, Reason.SWITCH_PREDICTED_GAIN, diag)


def test_a_table_rewrite_restarts_every_replica_without_a_canary() -> None:
    """A switch to the running adaptive profile that rewrites its table rolls every replica on
    the same profile (a canary compares two profiles; the table is the same profile's); with
    no rewrite flag it is nothing; advisory mode says what it would do."""
    fs = fb.fleet_settings(fleet_scenario())
    assert fs.canary.enabled
    hyb = "eagle3-hybrid"
    d = _rewrite(hyb, adaptive_table_rewrite=True)
    assert plan_move(d, hyb, None, {}, 0.0, fs, 3, Mode.ACTIVE) == ("rewrite", hyb, d.reason.value)
    move, target, why = plan_move(d, hyb, None, {}, 0.0, fs, 3, Mode.ADVISORY)
    assert (move, target) == ("hold", None) and "rewrite eagle3-hybrid's adaptive table" in why
    assert plan_move(_rewrite(hyb), hyb, None, {}, 0.0, fs, 3, Mode.ACTIVE)[0] == "hold"
    # An operator's forced canary of the running profile is nothing to do either.
    assert plan_move(d, hyb, hyb, {}, 0.0, fs, 3, Mode.ACTIVE)[0] == "hold"


class _Tables:
    """Switches to the hybrid profile, then asks (once) for its table to be rewritten; the
    table it holds for a launch moves from `first` to `second` at the rewrite."""

    name = "tables"

    def __init__(self) -> None:
        self.second = {"1": {"candidate_steps": [0, 3]}, "8": {"candidate_steps": [0, 1]}}
        self.table: dict[str, Any] = {"1": {"candidate_steps": [0, 1, 3]}}
        self.rewrite_at: float | None = None

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> None:
        pass

    def adaptive_table(self, profile: str) -> dict[str, Any] | None:
        return self.table if profile == HYBRID_PROFILE else None

    def tick(self, obs: Observation, now_s: float) -> Decision:
        if obs.profile != HYBRID_PROFILE:
            return Decision(now_s, Action.SWITCH, HYBRID_PROFILE, Reason.EXPLORE, {})
        if self.rewrite_at is None and now_s >= 600.0:
            self.rewrite_at, self.table = now_s, self.second
            diag = {"adaptive_table_rewrite": True}
            return Decision(
                now_s, Action.SWITCH, HYBRID_PROFILE, Reason.SWITCH_PREDICTED_GAIN, diag
            )
        return Decision(now_s, Action.HOLD, obs.profile, Reason.HOLD_BEST, {})

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None:
        pass


def test_a_fleet_launches_the_hybrid_on_its_table_and_rolls_a_rewrite() -> None:
    """Every replica of the hybrid profile launches with the table the policy holds for it; a
    rewrite is one rolling restart of all of them onto the new table, the others serving."""
    sc = fleet_scenario(
        phases=[{"duration_s": 3600, "concurrency": 3, "workloads": {"chat": 1.0}}],
    )
    pol = _Tables()
    fleet_seen: list[fb.VirtualFleet] = []
    real_init = fb.VirtualFleet.__init__

    def init(self: fb.VirtualFleet, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        fleet_seen.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fb.VirtualFleet, "__init__", init)
        rep = fb.fleet_replay(sc, pol, canary=False)
    (fleet,) = fleet_seen
    to_hybrid, rewrite = rep.switches
    assert to_hybrid.to_profile == HYBRID_PROFILE and to_hybrid.from_profile == "baseline"
    assert (rewrite.from_profile, rewrite.to_profile) == (HYBRID_PROFILE, HYBRID_PROFILE)
    assert rewrite.t_s == pol.rewrite_at
    restart = fleet.replicas[0].restart_s(HYBRID_PROFILE)
    assert rewrite.up_s == pytest.approx(rewrite.t_s + 3 * restart)  # one at a time
    assert all(r.spec.adaptive_config == pol.second for r in fleet.replicas)
    # Each replica launched three times: at 0 (baseline), onto the hybrid, for the rewrite.
    assert [sum(r._starts.values()) for r in fleet.replicas] == [3, 3, 3]
    # While one replica restarted the other two served.
    assert all(s.tokens > 0 for s in rep.segments if rewrite.t_s <= s.t0 < rewrite.up_s)


def test_fleet_false_switch_rules() -> None:
    sc = fleet_scenario()
    rates = {
        "baseline": np.array([10.0, 20.0]),
        "eagle3-2step": np.array([20.0, 10.0]),
    }
    rep = Replay(sc.name, "x", "baseline", sc.duration_s)
    rep.segments = [Segment(0.0, 1800.0, 0, "baseline", 18000.0)]
    # A rolled-back canary is false; a switch into the better profile is not; the way back
    # in the next phase (where baseline is better again) is not either.
    rep.switches = [
        SwitchEvent(100.0, 400.0, "baseline", "eagle3-2step", fb.CANARY_ROLLED_BACK),
        SwitchEvent(500.0, 900.0, "baseline", "eagle3-2step", fb.CANARY_PROMOTED),
        SwitchEvent(1900.0, 2300.0, "eagle3-2step", "baseline", "switch_predicted_gain"),
    ]
    assert fb.fleet_false_switches(sc, rates, rep) == 1
    # Going back inside the same phase, before the gain repays the rollout, is false.
    rep.segments = [
        Segment(500.0, 900.0, 0, None, 0.0),  # nothing served: lost 10 x 400 tokens
        Segment(900.0, 1000.0, 0, "eagle3-2step", 2000.0),
    ]
    rep.switches = [
        SwitchEvent(500.0, 900.0, "baseline", "eagle3-2step", "explore"),
        SwitchEvent(1000.0, 1100.0, "eagle3-2step", "baseline", "explore"),
    ]
    # (gain 10 x 100 = 1000 < lost 4000) and the way back is not better in phase 0: 2 false.
    assert fb.fleet_false_switches(sc, rates, rep) == 2
