"""The policy's settings: every knob of decide(), with the reason for its default.

Owns `PolicySettings` (frozen; the controller builds it from config.toml's [policy] table, the
benchmark from its defaults) and its JSON form for persisted state (`settings_to_dict`,
`settings_from_dict`, which reads settings saved under names since renamed).

Must not: decide anything, read clocks, or do I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.trial import TrialSettings


@dataclass(frozen=True)
class PolicySettings:
    """Every knob of the policy, with the reason for its default."""

    # Minimum time on a profile after it started serving before an automatic switch: its own
    # estimates need ~10+ windows of 10 s, and a restart of minutes is only repaid by staying
    # several restart durations; 5 minutes also caps automatic restarts at 12/hour before the
    # budget below bites. A server found serving, with nothing restarted or changed since, has
    # no dwell once its traffic's detectors are past their warm-up (decide.found_serving).
    min_dwell_s: float = 300.0
    # Automatic restarts (predicted gain + exploration) allowed per rolling hour: each costs
    # minutes of zero output, 3 bound the worst-case loss to ~15% of an hour at 3-minute restarts.
    # Pins and rollbacks are never refused by the budget, but they count against it. An
    # exploration needs room for two (there and, most likely, back: budget_exhausted).
    restart_budget_per_hour: int = 3
    # A -> B -> A inside this horizon (no change point in between) is refused: the second switch
    # undoes the first before it could have paid for its restart.
    amortisation_horizon_s: float = 3600.0
    # Restart time of a profile never restarted yet (seconds): "a restart of a large model costs
    # minutes" (FIELD.md); the simulator's field profile needs ~230 s (load + capture + warmup).
    # A longer boot reported by a server of the deployment raises it (_restart).
    restart_prior_s: float = 180.0
    # What a restart takes beyond the boot a server reports (sglang:startup_time_seconds, from
    # the engine's launch until its schedulers are ready): stopping the old server, the process
    # start before the engine's clock, the warmup request and the health poll. Seconds, not
    # minutes; measured restarts replace the estimate it is part of.
    restart_overhead_s: float = 10.0
    # Weight of each measured restart in the learned restart time (EW mean): restarts vary with
    # page cache and graph capture, so one measurement moves the estimate halfway.
    restart_learning_rate: float = 0.5
    # Fixed part of the margin, as a fraction of the running profile's tok/s: what the model
    # cannot see from the running profile (a speculative server's draft prefill, scheduling
    # that differs between profiles).
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
    # Completed regimes that outlived the current one's age needed before their lengths may
    # lift that wait (RegimeDurations.switch_beats_waiting: ski rental with a learned
    # distribution); fewer, and the wait holds (a burst is not ruled out by one long regime).
    burst_history_min_regimes: int = 3
    # Exploration of untried / stale profiles by expected value of information.
    explore: bool = True
    # Prior range of an unpredictable profile's tok/s relative to the running one: FIELD.md saw
    # 2-step between 0.73x and 1.26x of baseline, 5-step ~0.98x; 0.6-1.4 covers that with room.
    explore_prior_low_ratio: float = 0.6
    explore_prior_high_ratio: float = 1.4
    # ... and of an unpredictable speculative profile's relative to the baseline's, where no
    # speculative profile has run (nothing of the drafter or the verify is known): speculation
    # over none reached 1.77x the throughput (GLM-4.7 MTP under SGLang's adaptive mode) and 3.2x
    # lower latency (SmartSpec) in FIELD.md, so the upper end is 3.2x, and never more than the
    # chain's steps + 1 (every draft accepted, a cycle no dearer than a decode step). The
    # FIELD.md Kimi deployment alone (the 1.4 above) let a 3-minute prior restart pay for
    # trying a chain, but a known 15-minute restart never (stress w6: a llama-8B day that
    # speculation triples, stuck on baseline).
    explore_prior_spec_high_ratio: float = 3.2
    # Information is valued over at most this long: traffic forecasts beyond an hour are not
    # evidence, and the expected remaining regime grows with its age without bound (Lindy), so
    # a value of information over the whole of it would in the end pay for any exploration
    # without anything having been learnt: a timer. A candidate declined at this full value
    # stays declined until its information state changes (a change point, a first prediction).
    explore_horizon_s: float = 3600.0
    # ... or this many restarts of the running profile, where that is longer: whether a run
    # repays its restarts is a question in units of the restart time, and the hour is 20 of
    # the 3-minute prior's. A 15-minute restart gets 5 hours, not an hour that is only 4 of
    # them, too few to repay any exploration short of a sure gain (stress a7: baseline, 47%
    # better in expectation across three replicas, never tried behind a 15-minute restart).
    explore_horizon_restarts: float = 20.0
    # The share of the serving capacity an exploration restarts before its candidate has shown
    # its rate: 1 on one server; 1 / N on a fleet of N replicas that tries a candidate on one
    # canary replica first (controller.fleet sets it from [fleet]; not a [policy] key). The
    # canary's restart, dwell and way back cost 1 / N of the whole fleet's; the other N - 1
    # restart only if the candidate wins. Priced as a restart of every replica, a fleet's
    # exploration needed about N times the gain (stress a7: baseline's canary, behind
    # 15-minute restarts, 36 minutes in where 20 now).
    explore_canary_share: float = 1.0
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
    # Non-decode seconds per decode token move with the mix (prompt and output lengths), so
    # they are forgotten on the mix's time scale.
    nondecode_half_life_s: float = 120.0
    # Weight kept of a profile's old estimates when it boots again: the field's baseline moved
    # 89 -> 82 tok/s and verify 20 -> 30 ms across boots, so a new boot must dominate fast.
    boot_carryover: float = 0.25
    # ... and at most as much as this many fresh windows of its step times: with a 30 min
    # half-life a profile that ran an hour holds ~250 forgotten windows, a quarter of which
    # would outweigh a new boot's first half hour (a drifted boot's trial, or an exploration,
    # would then be judged on the old boot's level).
    boot_carryover_max_windows: float = 3.0
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
    # A CUSUM statistic above this fraction of its threshold is a suspected change: a 4-5 sigma
    # step puts it there in one window, while in control it is there ~e^-(2 k h/2) ~ 0.25% of
    # the time per side; holding a decision for a few windows costs nothing, a switch on the
    # first window of a burst costs a restart.
    suspect_fraction: float = 0.5
    # Points of the per-workload acceptance streams hold at least `min_verify` verify steps
    # (accumulated over windows when a workload finishes few requests); points of the mix
    # streams at least this many finished requests: a token share from 8 requests has an sd
    # of at most ~0.18, so a full swing (0 <-> 1) is over 5 sd and found in about two points.
    mix_point_min_requests: float = 8.0
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
    # change point, a finding, or a profile tried or failed: switch decisions pay restarts of
    # minutes, so a minute's delay costs nothing, while recomputing every prediction on every
    # 10 s tick would cost most of a replay's time budget. A move of reeval_rel_change in
    # concurrency or the mix with no change point waits for the detectors or the interval; the
    # decisions in between say so (diagnostics traffic_moved_unconfirmed).
    reeval_interval_s: float = 60.0
    reeval_rel_change: float = 0.05
    # The long-run rule (policies/hybrid_decide.py), for every profile set: traffic flipping
    # faster than restarts pay is served by the profile best over the recent batch sizes.
    # The batch-size distribution it values profiles over forgets with this half-life: the hour
    # a restart has to pay back in (long_run_horizon_s).
    long_run_batch_half_life_s: float = 3600.0
    # Observed seconds in that distribution before the long-run rule acts (half an hour of
    # traffic shows whether regimes flip faster than restarts pay).
    long_run_min_history_s: float = 1800.0
    # The long-run rule expects the batch-size distribution to hold as long again as it has
    # (Lindy), at most this long: a switch or an exploration it makes must repay its restart
    # within it. 4 hours: a service's daily pattern lasts hours.
    long_run_horizon_s: float = 14400.0
    # Hybrid profiles (adaptive profiles whose table specpilot writes; policies/hybrid_decide.py).
    # The server's max running requests: batch sizes are padded to CUDA-graph sizes up to it
    # and tables get buckets up to it (SGLang forces 48 with speculation when unset).
    hybrid_max_running_requests: int = 48
    # Tables are regenerated at most this often, and only when their inputs moved (alpha by
    # 0.01, a tier's cycle time by 2%): costs drift over tens of minutes (FIELD.md's boots).
    hybrid_regen_interval_s: float = 600.0
    # A step is a candidate of a bucket within this fraction of the best tier (margin_frac).
    hybrid_table_margin: float = 0.02
    # The served model's routing: routed experts, and experts each token picks (Hugging Face
    # config: n_routed_experts, num_local_experts or num_experts; num_experts_per_tok). 0 and 0:
    # dense or not given. With them the cycle estimator's roofline knows how a forward's expert
    # reads saturate with its tokens (policies/forward_cost.py), which cycle times alone cannot
    # tell from a forward turning compute-bound.
    moe_experts: int = 0
    moe_topk: int = 0

    def __post_init__(self) -> None:
        e, k = self.moe_experts, self.moe_topk
        if e < 0 or k < 0 or (e == 0) != (k == 0) or k > e:
            raise ValueError(
                "moe_experts and moe_topk: both 0 (dense) or 1 <= moe_topk <= moe_experts "
                f"(got {e} and {k})"
            )

    @property
    def expert_share(self) -> float:
        """The share of routed experts each token reaches (0: dense or not given)."""
        return self.moe_topk / self.moe_experts if self.moe_experts > 1 else 0.0


def settings_to_dict(s: PolicySettings) -> dict[str, Any]:
    return dataclasses.asdict(s)


# Settings renamed since a state could have been saved: old name -> new name.
_RENAMED_SETTINGS = {
    "hybrid_batch_half_life_s": "long_run_batch_half_life_s",
    "hybrid_min_history_s": "long_run_min_history_s",
    "hybrid_horizon_s": "long_run_horizon_s",
}


def settings_from_dict(d: Mapping[str, Any]) -> PolicySettings:
    kw = {_RENAMED_SETTINGS.get(k, k): v for k, v in d.items()}
    if isinstance(kw.get("trial"), Mapping):
        kw["trial"] = TrialSettings(**kw["trial"])
    return PolicySettings(**kw)
