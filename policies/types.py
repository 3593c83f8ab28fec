"""Shared value types of the pure core: profiles, observations, estimates, overrides, decisions.

Owns the vocabulary every layer speaks (controller builds Observations, store persists Decisions,
the benchmark replays them). Plain frozen dataclasses and StrEnums, and ProfileSpec's JSON form
for persisted state: no I/O, no clock, no framework imports. Times are seconds (`*_s`), rates
tokens per second (`*_tok_s`); absolute times are whatever clock the caller passes in as `now_s`
(the daemon uses UTC epoch seconds, the benchmark virtual seconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# Workload key for requests that carry no `workload` custom label.
UNLABELLED = "_unlabelled"


class Mode(StrEnum):
    """Whether the controller acts on its decisions (active) or only records them (advisory)."""

    ACTIVE = "active"
    ADVISORY = "advisory"


class Action(StrEnum):
    """What a decision asks the actuator to do."""

    HOLD = "hold"
    SWITCH = "switch"


class Reason(StrEnum):
    """Closed set of reasons a decision can carry; the same value goes to SQLite, a metric label
    and the decision's log line."""

    HOLD_INSUFFICIENT_DATA = "hold_insufficient_data"
    HOLD_NO_TRAFFIC = "hold_no_traffic"
    HOLD_COOLDOWN = "hold_cooldown"  # inside the minimum dwell after a switch
    HOLD_WITHIN_MARGIN = "hold_within_margin"  # a better profile does not repay the restart
    HOLD_BEST = "hold_best"  # the running profile is predicted best
    HOLD_BUDGET = "hold_budget"  # restart budget per hour spent
    HOLD_NO_FLAP = "hold_no_flap"  # A -> B -> A inside the amortisation horizon refused
    HOLD_PINNED = "hold_pinned"
    HOLD_PAUSED = "hold_paused"
    HOLD_TRIAL = "hold_trial"  # a trial is running; judged before anything else moves
    HOLD_BLOCKED = "hold_blocked"  # unknown outcome: automatic switching stopped until cleared
    HOLD_SCRAPE_FAILED = "hold_scrape_failed"
    HOLD_BURST = "hold_burst"  # the change is expected to last less than a restart
    SWITCH_PREDICTED_GAIN = "switch_predicted_gain"
    SWITCH_PINNED = "switch_pinned"  # a pin names a profile other than the running one
    SWITCH_MANUAL = "switch_manual"  # one-off switch asked through the API
    EXPLORE = "explore"  # try an untried or stale profile for the information
    ROLLBACK_START_FAILED = "rollback_start_failed"
    ROLLBACK_TRIAL_FAILED = "rollback_trial_failed"
    ROLLBACK_CRASH = "rollback_crash"
    RESTART_CRASHED = "restart_crashed"  # the server died outside a switch: same profile again
    # The daemon started a server it found down: at its start, the initial profile (or the
    # interrupted switch's); no decision of the policy's or a person's.
    START = "start"


@dataclass(frozen=True)
class ProfileSpec:
    """What the pure core needs to know of a profile: its speculation shape, not its flags.

    `num_steps` 0 means no speculation (true baseline). `draft_tokens` is the tokens verified per
    sequence per cycle (steps + 1 for topk 1; 1 for baseline). An adaptive profile runs SGLang's
    in-process tier switching among `candidate_steps`. `max_running_requests` is the most
    requests its server runs at once (`--max-running-requests`; SGLang forces 48 with
    speculation when unset), None where the server picks it (from its KV pool): under more load
    than that the rest queue, so profiles with different caps serve different batch sizes.
    """

    name: str
    num_steps: int = 0
    draft_tokens: int = 1
    topk: int = 1
    algorithm: str | None = None
    adaptive: bool = False
    candidate_steps: tuple[int, ...] = ()
    max_running_requests: int | None = None

    @property
    def speculative(self) -> bool:
        return self.algorithm is not None

    @property
    def forward_tokens(self) -> int:
        """Tokens per sequence one forward of this profile carries (a verify's draft tokens, a
        decode's one): what the cost of a forward is read across."""
        return max(int(self.draft_tokens), 1)

    @property
    def max_steps(self) -> int:
        """The deepest chain the server may run: `num_steps`, or an adaptive profile's deepest
        candidate (an accept length is at most this + 1)."""
        return max(self.num_steps, max(self.candidate_steps, default=0))


@dataclass(frozen=True)
class DecodeMoments:
    """Deltas over one window of SGLang's `/v1/loads` decode_moments: sufficient statistics of a
    step-time-vs-batch-size regression (seconds, not microseconds)."""

    n_steps: float
    sum_bs: float
    sum_step_s: float
    sum_bs2: float
    sum_bs_step_s: float
    sum_generated: float


@dataclass(frozen=True)
class WorkloadWindow:
    """Per-workload tokenizer-side deltas over one window (finished requests only)."""

    workload: str
    generation_tokens: float | None = None
    verify_calls: float | None = None
    requests: float | None = None


def verified_accept_length(a: float | None) -> float | None:
    """An accept-length reading where the server verified anything, else None: SGLang's gauge
    reads 0 on a server without speculation and after an interval without a verify step, and
    a measured accept length counts the bonus token, so it is at least 1."""
    return a if a is not None and a >= 1.0 else None


@dataclass(frozen=True)
class Observation:
    """One poll window, reduced. Every field is a delta or a window mean; `None` means the
    source did not report it (never 0 for missing)."""

    t_s: float  # end of the window
    window_s: float
    profile: str  # the profile actually running (confirmed against /server_info)
    running_reqs: float | None = None
    queue_reqs: float | None = None
    max_running_reqs: float | None = None  # the server's cap on running requests (/v1/loads)
    gen_throughput_tok_s: float | None = None  # SGLang's own gauge
    spec_accept_length: float | None = None  # accepted drafts + bonus, per verify step
    spec_accept_rate: float | None = None
    spec_num_steps: float | None = None  # tier active now (moves under adaptive)
    generation_tokens: float | None = None  # tokenizer counter delta, all workloads
    verify_calls: float | None = None
    decode_tokens: float | None = None  # realtime_tokens_total{mode="decode"} delta
    decode_passes: float | None = None  # cuda_graph_passes_total delta, tp_rank 0
    moments: DecodeMoments | None = None
    workloads: tuple[WorkloadWindow, ...] = ()
    # verify steps that accepted exactly k drafts (bonus excluded), k = 0..draft_tokens-1, when a
    # source reports it (request meta_info probes, the simulator); None otherwise.
    accepted_drafts_hist: tuple[float, ...] | None = None
    counter_reset: bool = False  # a counter went backwards inside this window
    # The running server's own boot, launch to ready (seconds; Snapshot.startup_s): the part of
    # a restart of this deployment that SGLang timed itself.
    startup_s: float | None = None

    @property
    def verified_accept_length(self) -> float | None:
        """spec_accept_length where the server verified anything (verified_accept_length)."""
        return verified_accept_length(self.spec_accept_length)

    @property
    def output_tok_s(self) -> float | None:
        """Output tokens per second over the window, from the best source available."""
        if self.decode_tokens is not None and self.window_s > 0:
            return self.decode_tokens / self.window_s
        if self.generation_tokens is not None and self.window_s > 0:
            return self.generation_tokens / self.window_s
        return None


@dataclass(frozen=True)
class Estimate:
    """A point estimate with a central interval (default ~90%) and the amount of data behind it."""

    mean: float
    low: float
    high: float
    n: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> Estimate:
        return cls(float(d["mean"]), float(d["low"]), float(d["high"]), float(d.get("n", 0.0)))


@dataclass(frozen=True)
class ProfilePrediction:
    """What one profile is predicted to deliver for the traffic being served now."""

    profile: str
    tok_s: Estimate | None
    accept_length: Estimate | None = None  # accepted drafts + bonus per verify step
    cycle_s: Estimate | None = None
    breakeven_accept_length: float | None = None  # baseline_tok_s x cycle_s at this batch size
    observed_tok_s: float | None = None
    source: str = ""  # "observed", "truncation", "tail_model", "surface", "bound", ...

    @property
    def bound(self) -> bool:
        """Only the physical bound on a profile never run (a baseline bounded by a speculative
        profile's cycle): its tok/s interval is where the truth may lie, its mean no estimate."""
        return "bound" in self.source.split("+")

    @property
    def moved(self) -> bool:
        """Its cycle estimate predates a detected move of another profile's step time of the
        same forward kind (a change of system state moves them all): its mean is where that
        move takes it, its interval reaches back to what it did before the move."""
        return "moved" in self.source.split("+")

    @property
    def unseen(self) -> bool:
        """Its accept length is for a mix with a workload no chain of the drafter has served:
        anywhere in [1, steps + 1] there, which only a run of the chain narrows."""
        return "unseen" in self.source.split("+")

    @property
    def deeper_than_served(self) -> bool:
        """Its accept length is, for some workload of the mix, a shallower chain's read deeper
        by the tail model (no chain as deep has served it): a model's guess past the depth
        served, which only a run of the chain checks."""
        return "tail_model" in self.source.split("+")


@dataclass(frozen=True)
class Overrides:
    """Operator state the policy must obey: a pin (with expiry), a pause (with expiry), a mode,
    and whether automatic switching is blocked by an unknown outcome."""

    pin_profile: str | None = None
    pin_until_s: float | None = None
    paused_until_s: float | None = None
    mode: Mode = Mode.ACTIVE
    blocked_reason: str | None = None

    def pin_active(self, now_s: float) -> bool:
        if self.pin_profile is None:
            return False
        return self.pin_until_s is None or now_s < self.pin_until_s

    def pause_active(self, now_s: float) -> bool:
        return self.paused_until_s is not None and now_s < self.paused_until_s


@dataclass(frozen=True)
class Decision:
    """The policy's output for one tick. `profile` is the target for SWITCH, the running profile
    for HOLD. `diagnostics` holds the numbers behind the reason (JSON-serialisable)."""

    t_s: float
    action: Action
    profile: str
    reason: Reason
    diagnostics: Mapping[str, float | int | str | bool | None] = field(default_factory=dict)

    def summary(self) -> str:
        """One log line."""
        nums = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in self.diagnostics.items()
        )
        return f"{self.action.value} {self.profile} reason={self.reason.value} {nums}".rstrip()


@dataclass(frozen=True)
class Snapshot:
    """Cumulative server state read at one instant (one scrape of /metrics and /v1/loads), keyed
    by meaning rather than metric name. Counters are cumulative since server start; gauges are
    instantaneous. `None` (or an absent key) means the source did not report it.

    The controller builds it from Prometheus text (controller.observe), the benchmark from the
    simulator's virtual-time engine; both turn two of them into an Observation with
    policies.observation.diff, so deltas and reset detection are one piece of code.
    """

    t_s: float
    profile: str
    # gauges (SGLang's last interval values)
    running_reqs: float | None = None
    queue_reqs: float | None = None
    max_running_reqs: float | None = None  # /v1/loads max_running_requests (summed over DP)
    gen_throughput_tok_s: float | None = None
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    spec_num_steps: float | None = None
    # counters, per workload (UNLABELLED for requests without the label)
    generation_tokens: Mapping[str, float] = field(default_factory=dict)
    verify_calls: Mapping[str, float] = field(default_factory=dict)
    requests: Mapping[str, float] = field(default_factory=dict)
    # scheduler counters (tp_rank 0, summed over dp ranks)
    decode_tokens: float | None = None
    decode_passes: float | None = None
    # cumulative decode_moments: n_steps, sum_bs, sum_step_s, sum_bs2, sum_bs_step_s, sum_generated
    # (SGLang reports microseconds; the scraper converts to seconds)
    moments: tuple[float, float, float, float, float, float] | None = None
    accepted_drafts_hist: tuple[float, ...] | None = None
    # gauge: the server's engine startup, launch until its schedulers were ready
    # (sglang:startup_time_seconds{phase="tokenizer_e2e"}, else phase="scheduler_e2e")
    startup_s: float | None = None


def spec_to_dict(p: ProfileSpec) -> dict[str, Any]:
    """`p` as JSON, as persisted state stores it (the inverse of spec_from_dict)."""
    return {
        "name": p.name,
        "num_steps": p.num_steps,
        "draft_tokens": p.draft_tokens,
        "topk": p.topk,
        "algorithm": p.algorithm,
        "adaptive": p.adaptive,
        "candidate_steps": list(p.candidate_steps),
        "max_running_requests": p.max_running_requests,
    }


def spec_from_dict(d: Mapping[str, Any]) -> ProfileSpec:
    """A ProfileSpec from spec_to_dict's JSON (fields added since default as before them)."""
    return ProfileSpec(
        name=d["name"],
        num_steps=int(d["num_steps"]),
        draft_tokens=int(d["draft_tokens"]),
        topk=int(d["topk"]),
        algorithm=d.get("algorithm"),
        adaptive=bool(d.get("adaptive", False)),
        candidate_steps=tuple(int(x) for x in d.get("candidate_steps", ())),
        max_running_requests=(
            None if d.get("max_running_requests") is None else int(d["max_running_requests"])
        ),
    )
