"""Virtual-time replay of one scenario under one policy: the server model and the control loop.

Owns `VirtualServer` (one SGLang server under the scenario's closed-loop load: the simulator's
WindowEngine draws each poll window; a switch takes the server down for the target profile's
restart time, serving nothing, and it comes back with counters at 0, as a new SGLang process
does) and `replay` (the daemon's tick sequence, in virtual seconds: scrape -> Snapshot ->
policies.observation.diff -> Observation -> policy -> act). No HTTP, no sleeping, no wall clock
except to time the replay itself.
Must not: decide anything (peers.py holds the policies), compute oracles or metrics.

The tick sequence mirrors controller.loop.Controller: a tick scrapes; the first scrape of a
server (at t = 0 or right after a restart) has no previous snapshot, so it decides nothing
(HOLD_INSUFFICIENT_DATA, the policy is not called); a switch blocks the loop for the whole
restart, and the next tick runs the moment the server is back (so after a switch the tick grid
shifts, as the daemon's does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from controller.bench.counters import ServerCounters
from controller.bench.peers import BenchPolicy, first_decision
from controller.bench.scenario import BenchProfile, Scenario
from policies.hybrid_decide import rewrites_table
from policies.observation import diff
from policies.types import Action, Decision, Reason, Snapshot
from simulator.engine import WindowEngine
from simulator.model import SimProfile, startup_times


@dataclass(frozen=True)
class Segment:
    """A stretch of virtual time inside one phase: `profile` None means the server was down."""

    t0: float
    t1: float
    phase: int
    profile: str | None
    tokens: float


@dataclass(frozen=True)
class SwitchEvent:
    """A restart the policy asked for: decided at `t_s`, server back at `up_s`."""

    t_s: float
    up_s: float
    from_profile: str
    to_profile: str
    reason: str


@dataclass(frozen=True)
class Tick:
    """One tick's outcome (compact: the plot and the metrics need no more)."""

    t_s: float
    profile: str  # running when the tick decided
    tok_s: float | None  # the window that ended at this tick
    action: Action
    target: str
    reason: Reason


@dataclass
class Replay:
    """Everything one (scenario, policy) replay produced."""

    scenario: str
    policy: str
    initial_profile: str
    duration_s: float
    tokens: float = 0.0
    segments: list[Segment] = field(default_factory=list)
    switches: list[SwitchEvent] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    wall_s: float = 0.0

    def cumulative(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, cumulative tokens) at every segment edge, for interpolation."""
        t = [0.0]
        c = [0.0]
        for s in self.segments:
            t.append(s.t1)
            c.append(c[-1] + s.tokens)
        return np.asarray(t), np.asarray(c)

    def profile_at(self, t_s: float) -> str | None:
        for s in self.segments:
            if s.t0 <= t_s < s.t1:
                return s.profile
        return self.segments[-1].profile if self.segments else None


def engine_seed(scenario_seed: int, profile_index: int, start: int) -> int:
    """Engine seed of the `start`-th launch of a profile: independent of the policy, so every
    policy's first run of a profile sees the same draws (common random numbers)."""
    return int(np.random.SeedSequence([scenario_seed, profile_index, start]).generate_state(1)[0])


class VirtualServer(ServerCounters):
    """One SGLang server in virtual time: cumulative counters since its last start, gauges of
    its last window, and a down interval during restarts."""

    def __init__(
        self,
        scenario: Scenario,
        catalog: Mapping[str, BenchProfile],
        sim: SimProfile,
        profile: str,
        replay: Replay,
        table_for: Callable[[str], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.scenario = scenario
        # The adaptive table a launch of a profile gets (specpilot_hybrid writes its own).
        self.table_for = table_for
        self.catalog = catalog
        self.sim = sim
        self.replay = replay
        self._index = {name: i for i, name in enumerate(sorted(catalog))}
        self._starts: dict[str, int] = {}
        self._boundaries = np.asarray(scenario.boundaries_s)
        self.profile = profile
        self._launch(profile)

    # -- lifecycle ----------------------------------------------------------------------------
    def _spec(self, profile: str) -> Any:
        """The SpecConfig a launch of `profile` runs: an adaptive profile with the table the
        policy holds for it now (its --speculative-adaptive-config file), if any."""
        sim = self.catalog[profile].sim
        if sim.adaptive and self.table_for is not None:
            table = self.table_for(profile)
            if table is not None:
                sim = dataclasses.replace(sim, adaptive_config=dict(table))
        return sim

    def _launch(self, profile: str) -> None:
        n = self._starts.get(profile, 0)
        self._starts[profile] = n + 1
        self.profile = profile
        self.spec = self._spec(profile)
        # What the launch's sglang:startup_time_seconds reports, set once at its boot.
        self.startup_s = startup_times(self.sim.restart_phases_s(self.spec))["tokenizer_e2e"]
        self.engine = WindowEngine(
            self.sim,
            self.spec,
            self.scenario.workloads,
            seed=engine_seed(self.scenario.seed, self._index[profile], n),
            max_running_requests=self.scenario.max_running_requests,
        )
        # The accepted-drafts histogram exists (all zeros) from the start, as the simulator
        # reports it; per-workload series appear on first use, as Prometheus labels do.
        self._reset_counters(max(self.spec.tiers) + 1 if self.spec.speculative else 0)

    def restart_s(self, profile: str) -> float:
        """One CUDA-graph capture per tier: an adaptive launch pays for its table's steps."""
        return float(self.sim.restart_s(self._spec(profile)))

    def restart(self, profile: str, t_s: float) -> float:
        """Stop, relaunch `profile`; the server serves nothing until t_s + restart time.
        Returns the downtime (what the actuator reports to the policy)."""
        down = self.restart_s(profile)
        self._record_down(t_s, min(t_s + down, self.scenario.duration_s))
        self._launch(profile)
        return down

    # -- running ------------------------------------------------------------------------------
    def _pieces(self, t0: float, t1: float) -> list[tuple[float, float, int]]:
        """[t0, t1) split at phase boundaries: (start, end, phase index)."""
        out = []
        i = int(np.searchsorted(self._boundaries, t0, side="right"))
        t = t0
        while t < t1 - 1e-9:
            end = t1 if i >= len(self._boundaries) else min(t1, float(self._boundaries[i]))
            out.append((t, end, i))
            t = end
            i += 1
        return out

    def _record_down(self, t0: float, t1: float) -> None:
        for a, b, ph in self._pieces(t0, t1):
            self.replay.segments.append(Segment(a, b, ph, None, 0.0))

    def advance(self, t0: float, t1: float) -> float:
        """Serve [t0, t1): one engine window per phase piece; returns the tokens."""
        total = 0.0
        for a, b, ph in self._pieces(t0, t1):
            phase = self.scenario.phases[ph]
            r = self.engine.run_window(b - a, phase.concurrency, phase.mix, phase.scale)
            self._accumulate(r)
            total += r.output_tokens
            self.replay.segments.append(Segment(a, b, ph, self.profile, r.output_tokens))
        self.replay.tokens += total
        return total

    def snapshot(self, t_s: float) -> Snapshot:
        """What a scrape of /metrics and /v1/loads would read now."""
        spec = self.spec
        r = self.last
        running, queued, gen_tp, mean_acc = self._window_gauges(spec.speculative)
        accept_len = accept_rate = num_steps = None
        if r is not None and mean_acc is not None:
            accept_len = 1.0 + mean_acc
            if r.tiers_used:
                num_steps = float(max(r.tiers_used, key=lambda g: r.tiers_used[g]))
            else:
                num_steps = float(spec.num_steps)
            accept_rate = mean_acc / num_steps if num_steps > 0 else 0.0
        return Snapshot(
            t_s=t_s,
            profile=self.profile,
            running_reqs=running,
            queue_reqs=queued,
            max_running_reqs=float(self.engine.max_running_requests),
            gen_throughput_tok_s=gen_tp,
            spec_accept_length=accept_len,
            spec_accept_rate=accept_rate,
            spec_num_steps=num_steps,
            startup_s=self.startup_s,
            **self._counter_fields(spec.speculative),
        )


def replay(
    scenario: Scenario, policy: BenchPolicy, *, initial_profile: str | None = None
) -> Replay:
    """Run the whole scenario under `policy`; the server starts already running
    `initial_profile` (default: the scenario's) with no restart."""
    wall0 = time.perf_counter()
    catalog = scenario.catalog()
    initial = initial_profile or scenario.initial_profile
    if initial not in catalog:
        raise ValueError(f"initial profile {initial!r} is not in the catalog")
    end = scenario.duration_s
    out = Replay(scenario.name, policy.name, initial, end)
    specs = [catalog[n].spec for n in scenario.profiles]
    first = first_decision(policy.start(specs, initial, 0.0), initial)
    server = VirtualServer(
        scenario,
        catalog,
        scenario.sim_profile(),
        initial,
        out,
        table_for=getattr(policy, "adaptive_table", None),
    )
    dt = scenario.poll_interval_s
    t = 0.0
    prev: Snapshot | None = None
    last_tok_s: float | None = None
    while t < end - 1e-9:
        snap = server.snapshot(t)
        obs = diff(prev, snap) if prev is not None and prev.profile == snap.profile else None
        prev = snap
        if t == 0.0:
            d = first  # the first scrape: no window yet; a static profile's launch
        elif obs is None:
            # The daemon's first scrape after a start: no window yet, the policy is not asked.
            d = Decision(t, Action.HOLD, server.profile, Reason.HOLD_INSUFFICIENT_DATA, {})
        else:
            d = policy.tick(obs, t)
        out.ticks.append(Tick(t, server.profile, last_tok_s, d.action, d.profile, d.reason))
        # A switch to the running profile restarts it only to rewrite its adaptive table.
        rewrite = rewrites_table(d)
        if d.action is Action.SWITCH and (d.profile != server.profile or rewrite):
            if d.profile not in catalog:
                raise ValueError(f"policy {policy.name} asked for unknown profile {d.profile!r}")
            frm = server.profile
            down = server.restart(d.profile, t)
            up = t + down
            out.switches.append(SwitchEvent(t, up, frm, d.profile, d.reason.value))
            policy.switch_done(d.profile, True, down, min(up, end))
            prev = None
            last_tok_s = None
            t = up  # the loop ticks again the moment the switch returns
            continue
        t1 = min(t + dt, end)
        tokens = server.advance(t, t1)
        last_tok_s = tokens / (t1 - t)
        t = t1
    out.wall_s = time.perf_counter() - wall0
    return out
