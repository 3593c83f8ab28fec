"""The policies the benchmark compares, behind one small interface (`BenchPolicy`).

Owns: static profiles, SGLang's in-process adaptive rule as a peer (a static launch of an
adaptive profile: the simulator models the rule), a vLLM-style batch-size threshold, a greedy
switcher without switching costs, UCB over profiles with a switching epoch (BanditSpec-style),
and `Specpilot`, the adapter that runs policies.decide as controller.loop does. Every peer's
constants are fixed, documented rules: none is tuned to a scenario.
Must not: touch the server (harness.py does), know the scenario's future (only the oracles may),
or change policies/.

Interface, called by harness.replay in the daemon's order:
    start(profiles, running, now_s)            once, the server already up
    tick(obs, now_s) -> Decision               every tick that has a poll window
    switch_done(profile, ok, downtime_s, now_s) after each restart the policy asked for
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from controller import sglang_names as sg
from controller.bench.scenario import ADAPTIVE_PROFILE, HYBRID_PROFILE, bench_profile
from policies.settings import PolicySettings
from policies.types import (
    Action,
    Decision,
    Observation,
    Overrides,
    ProfileSpec,
    Reason,
)
from simulator.model import SimProfile

if TYPE_CHECKING:
    from controller.fleet.settings import FleetSettings


class BenchPolicy(Protocol):
    name: str

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> str | None:
        """Reset for a replay whose server runs `running`; return the profile to launch instead
        at once (a static profile's one restart at the start), or None to keep it. The first
        scrape has no window, so a policy is first asked one poll later."""
        ...

    def tick(self, obs: Observation, now_s: float) -> Decision: ...

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None: ...


def first_decision(launch: str | None, running: str) -> Decision:
    """What a replay does at its first scrape (t = 0, no window yet): launch the profile that
    `BenchPolicy.start` asked for, else hold for data."""
    if launch is not None and launch != running:
        return _switch(0.0, launch, Reason.SWITCH_PINNED)
    return _hold(0.0, running, Reason.HOLD_INSUFFICIENT_DATA)


def _hold(now_s: float, profile: str, reason: Reason, **diag: Any) -> Decision:
    return Decision(now_s, Action.HOLD, profile, reason, diag)


def _switch(now_s: float, profile: str, reason: Reason, **diag: Any) -> Decision:
    return Decision(now_s, Action.SWITCH, profile, reason, diag)


def _offered(obs: Observation) -> float | None:
    """Requests the clients keep open: running plus queued (the batch alone is capped by
    max_running_requests)."""
    if obs.running_reqs is None:
        return None
    return obs.running_reqs + (obs.queue_reqs or 0.0)


# --------------------------------------------------------------------------------------------
# Static profiles and the SGLang adaptive peer
# --------------------------------------------------------------------------------------------


class Static:
    """Always the same profile; if the server runs another one, one restart into it."""

    def __init__(self, profile: str, name: str | None = None) -> None:
        self.profile = profile
        self.name = name or f"static:{profile}"

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> str | None:
        return self.profile if running != self.profile else None

    def tick(self, obs: Observation, now_s: float) -> Decision:
        if obs.profile != self.profile:
            return _switch(now_s, self.profile, Reason.SWITCH_PINNED)
        return _hold(now_s, self.profile, Reason.HOLD_PINNED)

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None:
        pass


def sglang_adaptive() -> Static:
    """SGLang's --speculative-adaptive with its default table: launched once, then its in-process
    EMA rule (simulator.adaptive, inside the window engine) moves the tier per batch-size bucket
    without restarts."""
    return Static(ADAPTIVE_PROFILE, name="sglang_adaptive")


# --------------------------------------------------------------------------------------------
# vLLM-style batch-size threshold
# --------------------------------------------------------------------------------------------

# Speculation on below this batch size, off at or above it. The rule is SGLang's own default
# adaptive table, where batches of 32 and more keep at most one draft step (and 64+ none): past
# it both in-tree dynamic rules treat speculation as marginal. Not tuned per scenario.
BATCH_THRESHOLD = 32
# The speculative profile used below the threshold: the one whose step count is nearest to 3
# (vLLM's usual num_speculative_tokens and SGLang's default steps), fewer steps on a tie.
THRESHOLD_SPEC_STEPS = 3
# Consecutive windows on the other side of the threshold before a restart: one window is noise.
THRESHOLD_CONFIRM_WINDOWS = 2


class BatchThreshold:
    """vLLM Dynamic-SD style: a batch-size rule with no cost model, played as restarts."""

    name = "vllm_batch_threshold"

    def __init__(self) -> None:
        self.spec_profile: str | None = None
        self.base_profile: str | None = None
        self.streak = 0

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> None:
        spec = [p for p in profiles if p.speculative and not p.adaptive]
        base = [p for p in profiles if not p.speculative]
        self.spec_profile = (
            min(spec, key=lambda p: (abs(p.num_steps - THRESHOLD_SPEC_STEPS), p.num_steps)).name
            if spec
            else None
        )
        self.base_profile = base[0].name if base else None
        self.streak = 0

    def tick(self, obs: Observation, now_s: float) -> Decision:
        batch = obs.running_reqs
        if batch is None or self.spec_profile is None or self.base_profile is None:
            return _hold(now_s, obs.profile, Reason.HOLD_INSUFFICIENT_DATA)
        if batch <= 0:
            self.streak = 0
            return _hold(now_s, obs.profile, Reason.HOLD_NO_TRAFFIC)
        want = self.base_profile if batch >= BATCH_THRESHOLD else self.spec_profile
        if want == obs.profile:
            self.streak = 0
            return _hold(now_s, obs.profile, Reason.HOLD_BEST, batch=batch)
        self.streak += 1
        if self.streak < THRESHOLD_CONFIRM_WINDOWS:
            return _hold(now_s, obs.profile, Reason.HOLD_INSUFFICIENT_DATA, batch=batch)
        self.streak = 0
        return _switch(now_s, want, Reason.SWITCH_PREDICTED_GAIN, batch=batch)

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None:
        self.streak = 0


# --------------------------------------------------------------------------------------------
# Greedy without switching costs
# --------------------------------------------------------------------------------------------

# Weight of the newest window in a profile's tok/s estimate: smooths one window's noise while
# following a change within a few windows.
GREEDY_EMA = 0.5


class Greedy:
    """Best observed tok/s per load level, no switching cost: an untried profile at this load is
    tried at once; otherwise it moves whenever another profile's last estimate beats the running
    one's. Load level = round(log2(running + queued)) (throughput depends mostly on it)."""

    name = "greedy"

    def __init__(self) -> None:
        self.profiles: list[str] = []
        self.est: dict[tuple[int, str], float] = {}

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> None:
        self.profiles = [p.name for p in profiles]
        self.est = {}

    def tick(self, obs: Observation, now_s: float) -> Decision:
        load = _offered(obs)
        rate = obs.output_tok_s
        if load is None or rate is None:
            return _hold(now_s, obs.profile, Reason.HOLD_INSUFFICIENT_DATA)
        if load <= 0:
            return _hold(now_s, obs.profile, Reason.HOLD_NO_TRAFFIC)
        level = round(math.log2(max(1.0, load)))
        key = (level, obs.profile)
        old = self.est.get(key)
        self.est[key] = rate if old is None else (1 - GREEDY_EMA) * old + GREEDY_EMA * rate
        untried = [p for p in self.profiles if (level, p) not in self.est]
        if untried:
            return _switch(now_s, untried[0], Reason.EXPLORE, level=level)
        best = max(self.profiles, key=lambda p: self.est[(level, p)])
        if best != obs.profile and self.est[(level, best)] > self.est[key]:
            return _switch(now_s, best, Reason.SWITCH_PREDICTED_GAIN, level=level)
        return _hold(now_s, obs.profile, Reason.HOLD_BEST, level=level)

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None:
        pass


# --------------------------------------------------------------------------------------------
# UCB over profiles with a switching epoch
# --------------------------------------------------------------------------------------------

# An epoch is long enough that one restart costs at most ~10% of it: epoch >= 9 x restart.
UCB_EPOCH_RESTART_FACTOR = 9.0
# ... and never shorter than this many windows (a mean needs a few).
UCB_MIN_EPOCH_WINDOWS = 6
# Restart time assumed before the first one is measured: restarts of large models take minutes.
UCB_PRIOR_RESTART_S = 300.0
# UCB1 exploration weight on rewards normalised to [0, 1] by the best arm's mean.
UCB_C = 1.0


class UCB:
    """BanditSpec-style UCB1 over profiles: each epoch plays one arm; the reward of an epoch is
    its mean tok/s (normalised by the best arm's mean); untried arms first, then the arm with
    the highest mean + C sqrt(2 ln N / n). Stationary: it never forgets."""

    name = "ucb"

    def __init__(self) -> None:
        self.profiles: list[str] = []
        self.sum: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.epoch_rates: list[float] = []
        self.restart_s = UCB_PRIOR_RESTART_S

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> None:
        self.profiles = [p.name for p in profiles]
        self.sum = {p: 0.0 for p in self.profiles}
        self.n = {p: 0 for p in self.profiles}
        self.epoch_rates = []

    def _epoch_windows(self, window_s: float) -> int:
        need = math.ceil(UCB_EPOCH_RESTART_FACTOR * self.restart_s / max(window_s, 1e-9))
        return max(UCB_MIN_EPOCH_WINDOWS, need)

    def tick(self, obs: Observation, now_s: float) -> Decision:
        rate = obs.output_tok_s
        if rate is not None:
            self.epoch_rates.append(rate)
        if len(self.epoch_rates) < self._epoch_windows(obs.window_s):
            return _hold(now_s, obs.profile, Reason.HOLD_COOLDOWN, epoch=len(self.epoch_rates))
        arm = obs.profile
        if arm in self.sum:
            self.sum[arm] += sum(self.epoch_rates) / len(self.epoch_rates)
            self.n[arm] += 1
        self.epoch_rates = []
        untried = [p for p in self.profiles if self.n[p] == 0]
        if untried:
            choice, reason = untried[0], Reason.EXPLORE
        else:
            means = {p: self.sum[p] / self.n[p] for p in self.profiles}
            top = max(means.values()) or 1.0
            total = sum(self.n.values())
            ucb = {
                p: means[p] / top + UCB_C * math.sqrt(2.0 * math.log(total) / self.n[p])
                for p in self.profiles
            }
            choice, reason = max(self.profiles, key=lambda p: ucb[p]), Reason.SWITCH_PREDICTED_GAIN
        if choice == obs.profile:
            return _hold(now_s, obs.profile, Reason.HOLD_BEST)
        return _switch(now_s, choice, reason)

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None:
        self.restart_s = downtime_s
        self.epoch_rates = []


# --------------------------------------------------------------------------------------------
# specpilot
# --------------------------------------------------------------------------------------------


def user_settings(sim: SimProfile | None = None, **overrides: Any) -> PolicySettings:
    """policies.settings.PolicySettings as a user serving the simulated model writes them: its
    routing ([policy] moe_experts, moe_topk: facts of the model, in its Hugging Face config)
    from the profile, every knob at its default unless `overrides` sets it."""
    if sim is not None and sim.target.moe_experts > 1:
        overrides = {
            "moe_experts": sim.target.moe_experts,
            "moe_topk": sim.target.moe_topk,
            **overrides,
        }
    return PolicySettings(**overrides)


class Specpilot:
    """policies.decide with PolicySettings defaults and Overrides(), driven as controller.loop
    drives it: decide on every poll window, on_switch_done after every restart. Trials and their
    rollbacks are judged inside decide (ROLLBACK_TRIAL_FAILED), so the adapter adds nothing."""

    name = "specpilot"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        from policies import decide as policy

        self.policy = policy
        self.settings = settings if settings is not None else PolicySettings()
        self.overrides = Overrides()
        self.state: Any = None

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> None:
        self.state = self.policy.initial_state(list(profiles), running, now_s, self.settings)

    def tick(self, obs: Observation, now_s: float) -> Decision:
        self.state, d = self.policy.decide(self.state, obs, now_s, self.settings, self.overrides)
        return d

    def switch_done(self, profile: str, ok: bool, downtime_s: float, now_s: float) -> None:
        self.state = self.policy.on_switch_done(self.state, profile, ok, downtime_s, now_s)

    def on_fleet(self, fleet: FleetSettings) -> None:
        """A fleet replay runs this policy over `fleet` (as controller.fleet.FleetController):
        an exploration restarts its canary share of the replicas before the candidate wins."""
        self.settings = fleet.policy_settings(self.settings)

    # A fleet replay's canary (as controller.fleet.FleetController): a new boot of the
    # candidate beside the running profile, whose windows are evidence for its estimates.
    def canary_started(self, profile: str) -> None:
        self.state = self.policy.on_canary_started(self.state, profile)

    def canary_rejected(self, profile: str, now_s: float, *, judged: bool = True) -> None:
        self.state = self.policy.on_canary_rejected(self.state, profile, now_s, judged=judged)

    def canary_window(self, obs: Observation) -> None:
        self.policy.observe_canary(self.state, obs)


class SpecpilotHybrid(Specpilot):
    """specpilot with one more profile: EAGLE-3 in SGLang's adaptive mode with a table specpilot
    generates from its estimates and rewrites when a restart pays (policies.hybrid_decide). The
    harness launches that profile with `adaptive_table(profile)` (what the daemon writes to its
    --speculative-adaptive-config file) and restarts it when a decision rewrites the table."""

    name = "specpilot_hybrid"

    def __init__(
        self, max_running_requests: int | None = None, sim: SimProfile | None = None
    ) -> None:
        # The server's max running requests pads batch sizes and bounds the table's buckets
        # (SGLang forces 48 with speculation when the flags do not set it).
        mrr = (
            max_running_requests
            if max_running_requests is not None
            else sg.SPEC_DEFAULT_MAX_RUNNING_REQUESTS
        )
        self.max_running_requests = mrr
        super().__init__(user_settings(sim, hybrid_max_running_requests=mrr))

    def start(self, profiles: Sequence[ProfileSpec], running: str, now_s: float) -> None:
        extra = bench_profile(HYBRID_PROFILE).spec
        extra = dataclasses.replace(extra, max_running_requests=self.max_running_requests)
        super().start([*profiles, extra], running, now_s)

    def adaptive_table(self, profile: str) -> dict[str, Any] | None:
        hs = self.state.hybrid if self.state is not None else None
        return hs.launch_table(profile) if hs is not None else None
