"""The long-run rule (traffic that flips faster than a restart pays, for every profile set) and
hybrid profiles inside the decision (adaptive profiles predicted like fixed ones, their tables
kept current).

Owns `LongRunState` (a forgotten histogram of the batch sizes served, the flips of the traffic,
the last long-run evaluation; every PolicyState has one), `HybridState` (per adaptive profile:
the table its next launch gets, the table the running server has, a newer table not yet worth a
restart; table events for the shell to record; None without adaptive profiles) and the hooks
policies.decide calls:
- `observe`: one window's batch size into the histogram, and a flip when it moved by 2x;
- `predict`: an adaptive profile's prediction at a batch size (policies.hybrid.predict_adaptive
  on the fixed profiles' cycle estimates and acceptance, wall time as decide converts it),
  corrected by what its own windows said, and no wider than their measurement where they
  measured it (`+measured`);
- `replace_predictions`: decide's predictions with the adaptive profiles' from `predict`, and a
  fixed chain never run priced by the tier of its steps an adaptive profile ran (`+tier`);
- `observe_self` / `discount_self`: a running adaptive profile's windows against its
  uncorrected prediction (forgotten log ratios per batch bucket and tier: the self-correction
  that `inputs` applies to the tier cycle times and `predict` to the accept length), and their
  discount at a detected change in its cycle time or acceptance or a new boot;
- `refresh_tables`: generate each managed profile's table from the estimates now (at most every
  `hybrid_regen_interval_s`, or at once after a change in acceptance or cycle time, and only
  once two of its tiers are priced: `_tiers_identified`); a profile not running takes the new
  table for free, the running one keeps it as a candidate;
- `long_run`: when the traffic flips faster than a restart repays (MIN_FLIPS flips within
  `long_run_batch_half_life_s`: regimes of minutes, so the batch size now says little about the
  next hour and the burst rule would hold every one of them) and the histogram holds at least
  `long_run_min_history_s`, the objective is the profile that is best over the recent
  distribution of batch sizes, not over the regime now: every profile (true baseline, fixed
  profiles and adaptive ones alike, each at its predicted tok/s per batch size) is valued over
  that distribution; profiles never run (or stale) are explored by decide's value-of-information
  rule over the long-run horizon (the current regime's few minutes would never pay for one, so
  without this a fixed profile set never leaves where it started); and a switch, or a restart of
  the running adaptive profile with its candidate table, happens only when the switch rule's
  economics say it pays over that horizon: (N - C - margin) x (H - R) > C x R. Exploration
  ends: a run makes the profile tried, and a candidate declined at the full horizon stays
  declined until its information state changes. Without flipping traffic only a hybrid profile
  has a long-run part: a rewrite of its table at the current batch size with the regime's
  horizon; everything else is decide's ordinary rule.

Must not: read clocks, do I/O, or import anything outside stdlib/numpy/scipy and policies.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policies.chain import Z90
from policies.explore_value import switch_margin
from policies.forgetting import AGGREGATE, batch_bucket, carryover, decay
from policies.hybrid import (
    DEFAULT_BUCKETS,
    AcceptModel,
    AdaptiveBreakdown,
    CycleFn,
    LogRatio,
    SlotRule,
    accept_model_from,
    adaptive_breakdown,
    corrected_cycle,
    generate_table,
    parse_table,
    rewrite_pays,
    route,
    scale_estimate,
    seed_table,
    table_distance,
    tier_cycle_from,
)
from policies.overhead import wall_estimate
from policies.settings import PolicySettings
from policies.types import (
    Decision,
    Estimate,
    Observation,
    ProfilePrediction,
    ProfileSpec,
    Reason,
)

if TYPE_CHECKING:
    from policies.state import PolicyState

# Candidate steps of an adaptive profile whose flags name none (SGLang's default table's union).
DEFAULT_CANDIDATES = (0, 1, 3, 5, 7)
# Table events kept for the shell (it drains them every tick).
MAX_EVENTS = 20
# The diagnostics key of a switch to the running adaptive profile that restarts it only to
# rewrite its table (read through rewrites_table).
REWRITE_KEY = "adaptive_table_rewrite"
# Failed rewrite trials remembered per adaptive profile (the rules refused until a model change).
MAX_FAILED_TABLES = 8
# A bucket of the batch-size histogram counts as a regime of its own from this share of the
# observed time: below it, the traffic is one regime with noise and decide's own rule applies.
MIN_REGIME_SHARE = 0.1
# A window batch size 2x the last one's is a flip of the traffic (half-octave buckets move by
# two); MIN_FLIPS of them within the batch half-life (an hour: regimes of 15 minutes or less,
# shorter than a few restarts) make the traffic "flipping": the long-run rule applies.
FLIP_FACTOR = 2.0
MIN_FLIPS = 4
MAX_FLIPS = 500


@dataclass
class LongRunState:
    """The batch sizes served and the flips of the traffic (JSON-serialisable)."""

    batch_w: dict[str, float] = field(default_factory=dict)  # str(batch) -> forgotten seconds
    # workload -> forgotten generated tokens: the mix (token shares) over the same window.
    mix_w: dict[str, float] = field(default_factory=dict)
    # Times the window batch size moved by a factor of 2 or more from the window before (a
    # regime flip), and the last window's batch size.
    flips: list[float] = field(default_factory=list)
    last_batch: float | None = None
    # The last long-run evaluation: {"key", "t_s", "reason" (None: decide's own rule), "diag"}.
    cache: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_w": dict(self.batch_w),
            "mix_w": dict(self.mix_w),
            "flips": list(self.flips),
            "last_batch": self.last_batch,
            "cache": _copy(self.cache),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LongRunState:
        return cls(
            batch_w={str(k): float(v) for k, v in d.get("batch_w", {}).items()},
            mix_w={str(k): float(v) for k, v in d.get("mix_w", {}).items()},
            flips=[float(x) for x in d.get("flips", [])],
            last_batch=d.get("last_batch"),
            cache=_copy(d.get("cache")),
        )


@dataclass
class HybridState:
    """Tables of the adaptive profiles (JSON-serialisable)."""

    # profile -> {"table", "managed", "running_table", "candidate", "t_s", "reason"; after a
    # rewrite also "previous" (the table it replaced) and "rewritten_s"; after a failed rewrite
    # trial also "failed": [{"t_s", "batch", "table"}], the last MAX_FAILED_TABLES of them}
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_regen_s: float | None = None
    regen_key: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    # The last look at the tables' inputs (pricing every tier at every bucket costs
    # milliseconds: once per regen interval, or at once after a change in acceptance or
    # cycle time) and the last model change it saw.
    last_look_s: float | None = None
    look_model_change_s: float | None = None
    # What each adaptive profile's own windows say of its prediction (observe_self): profile ->
    # key -> LogRatio of observed / predicted. "T:<bucket>:<tier>": mean cycle time at a
    # half-octave batch bucket, attributed to the tiers by their predicted shares; "L:<bucket>":
    # tokens per sequence per cycle; "<bucket>" "*" pools every bucket.
    corr: dict[str, dict[str, LogRatio]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "corr": {p: {k: r.to_json() for k, r in c.items()} for p, c in self.corr.items()},
            "tables": _copy(self.tables),
            "last_regen_s": self.last_regen_s,
            "regen_key": self.regen_key,
            "events": _copy(self.events),
            "last_look_s": self.last_look_s,
            "look_model_change_s": self.look_model_change_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HybridState:
        return cls(
            tables=_copy(d.get("tables", {})),
            last_regen_s=d.get("last_regen_s"),
            regen_key=d.get("regen_key"),
            events=_copy(d.get("events", [])),
            last_look_s=d.get("last_look_s"),
            look_model_change_s=d.get("look_model_change_s"),
            corr={
                str(p): {str(k): LogRatio.from_json(v) for k, v in c.items()}
                for p, c in d.get("corr", {}).items()
            },
        )

    def launch_table(self, profile: str) -> dict[str, Any] | None:
        """The table the next launch of `profile` gets (what the shell writes to its file)."""
        t = self.tables.get(profile)
        return None if t is None else t["table"]

    def drain_events(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out


def _copy(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _copy(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_copy(v) for v in x]
    return x


def new_state(
    profiles: tuple[ProfileSpec, ...],
    tables: Mapping[str, Mapping[str, Any]] | None,
    now_s: float,
) -> HybridState | None:
    """A HybridState for the adaptive profiles (None without any). `tables` may give a profile
    {"table": JSON, "managed": bool}: managed tables are specpilot's to rewrite; an unmanaged
    one (the user's own --speculative-adaptive-config, or SGLang's default) is only predicted.
    An adaptive profile not in `tables` is managed and starts from seed_table."""
    adaptive = [p for p in profiles if p.adaptive]
    if not adaptive:
        return None
    hs = HybridState()
    given = tables or {}
    for p in adaptive:
        g = given.get(p.name)
        managed = True if g is None else bool(g.get("managed", True))
        table = (
            dict(g["table"])
            if g is not None and g.get("table") is not None
            else seed_table(p.candidate_steps or DEFAULT_CANDIDATES)
        )
        hs.tables[p.name] = {
            "table": table,
            "managed": managed,
            "running_table": None,
            "candidate": None,
            "t_s": float(now_s),
            "reason": "seed" if g is None else "given",
        }
    return hs


def observe(
    lr: LongRunState,
    batch: float | None,
    window_s: float,
    t_s: float,
    s: PolicySettings,
    tokens: Mapping[str, float] | None = None,
) -> None:
    """One window's load (the batch size from decode moments or running requests, plus the
    requests queued behind a binding cap: ThroughputModel.observe) into the histogram,
    its generated tokens per workload (`tokens`) into the long-run mix (token shares, as the
    mix estimator's: a busy phase weighs by what it produced, not by its length), and a flip
    when the batch size moved by a factor of 2 or more since the window before."""
    lam = decay(window_s, s.long_run_batch_half_life_s)
    lr.batch_w = {k: v * lam for k, v in lr.batch_w.items() if v * lam > 1e-3}
    lr.mix_w = {k: v * lam for k, v in lr.mix_w.items() if v * lam > 1e-3}
    if batch is None or not math.isfinite(batch) or batch < 1 or window_s <= 0:
        return
    for w, g in (tokens or {}).items():
        if math.isfinite(g) and g > 0:
            lr.mix_w[w] = lr.mix_w.get(w, 0.0) + g
    k = str(round(batch))
    lr.batch_w[k] = lr.batch_w.get(k, 0.0) + window_s
    last = lr.last_batch
    if last is not None and max(batch, last) >= FLIP_FACTOR * min(batch, last):
        lr.flips.append(float(t_s))
    lr.last_batch = float(batch)
    lr.flips = [t for t in lr.flips if t_s - t <= 2.0 * s.long_run_batch_half_life_s][-MAX_FLIPS:]


def _flipping(lr: LongRunState, now_s: float, s: PolicySettings) -> float | None:
    """How long the traffic has been flipping (seconds since the first flip of an unbroken run
    of flips, each within `long_run_batch_half_life_s` of the next, the last one too), when the
    last half-life holds at least MIN_FLIPS of them; None otherwise."""
    hl = s.long_run_batch_half_life_s
    recent = [t for t in lr.flips if now_s - t <= hl]
    if len(recent) < MIN_FLIPS:
        return None
    start = lr.flips[-1]
    for t in reversed(lr.flips[:-1]):
        if start - t > hl:
            break
        start = t
    return now_s - start


def on_switch_done(hs: HybridState, profile: str, ok: bool) -> None:
    """A launch of `profile` came up with its launch table."""
    t = hs.tables.get(profile)
    if t is not None and ok:
        t["running_table"] = t["table"]
        t["candidate"] = None


# --------------------------------------------------------------------------------------------
# Inputs from the estimators


def _fixed_specs(state: PolicyState, spec: ProfileSpec) -> list[ProfileSpec]:
    return [
        p
        for p in state.profiles
        if p.speculative
        and not p.adaptive
        and p.topk == 1
        and p.algorithm == spec.algorithm
        and p.num_steps >= 1
    ]


def _chains(fixed: list[ProfileSpec]) -> dict[int, str]:
    """Steps -> the fixed profile whose cycle prices that tier (the first by name)."""
    chains: dict[int, str] = {}
    for p in sorted(fixed, key=lambda p: p.name):
        chains.setdefault(p.num_steps, p.name)
    return chains


def _baseline(state: PolicyState) -> str | None:
    return next((p.name for p in state.profiles if not p.speculative), None)


def inputs(
    state: PolicyState,
    spec: ProfileSpec,
    mix: Mapping[str, float] | None = None,
    *,
    corrected: bool = True,
) -> tuple[AcceptModel, CycleFn] | None:
    """Acceptance and tier cycle times for `spec`'s tiers, read off the fixed profiles of the
    same drafter (their accept lengths per workload; their cycle estimates; the baseline's for
    tier 0), the tier cycle times corrected by what `spec`'s own windows said of them
    (`corrected`, see observe_self). None without a speculative profile with an accept
    prediction."""
    fixed = _fixed_specs(state, spec)
    fresh = state.last_accept_change_s
    model = state.model

    def acc(p: str, w: str) -> Estimate | None:
        ap = model.accept.predict(p, w, fresh)
        return None if ap is None else ap.estimate

    mx = dict(mix) if mix is not None else model.mix.shares()
    am = accept_model_from(acc, fixed, mx) if mx else None
    if am is None:
        am = accept_model_from(acc, fixed, {AGGREGATE: 1.0})
    if am is None:
        return None
    chains = _chains(fixed)
    by_steps = {g: (lambda b, n=n: model.cycle.estimate(n, b)) for g, n in chains.items()}
    base = _baseline(state)
    cyc = tier_cycle_from(
        by_steps, (lambda b: model.cycle.estimate(base, b)) if base is not None else None
    )
    hs = state.hybrid
    corr = hs.corr.get(spec.name) if hs is not None and corrected else None
    if corr:
        min_w = float(state.settings.min_windows)
        shift, source = _reference(state, chains, base, corr, cyc)
        cyc = corrected_cycle(cyc, lambda b, g: _cycle_factor(corr, b, g, min_w, shift, source))
    return am, cyc


def _reference(
    state: PolicyState,
    chains: Mapping[int, str],
    base: str | None,
    corr: Mapping[str, LogRatio],
    model: CycleFn | None,
) -> tuple[ShiftFn, SourceFn]:
    """What an adaptive profile's correction cells are read against now (its tiers priced by
    `chains` and the baseline `base`): each cell's shift to the uncorrected `model` (none
    without it) and whether it may transfer (_cycle_factor)."""
    shift = _shift_fn(corr, model) if model is not None else (lambda b, g: 0.0)
    return shift, _source_fn(corr, _continued_fn(state, chains, base))


def _continued_fn(
    state: PolicyState, chains: Mapping[int, str], base: str | None
) -> Callable[[float, int], bool]:
    """Whether tier g's cycle at a batch size is a fixed profile's line continued past every
    batch size it served (its chain's; the baseline's for tier 0; any chain's, or the
    baseline's with one chain, for a tier between them): a band, not data."""

    def continued(batch: float, g: int) -> bool:
        if g == 0:
            srcs = [base]
        elif g in chains:
            srcs = [chains[g]]
        else:
            srcs = [*chains.values()] + ([base] if len(chains) == 1 else [])
        return any(
            n is not None and state.model.cycle.support(n, batch) == "extrapolated" for n in srcs
        )

    return continued


# --------------------------------------------------------------------------------------------
# Self-correction: an adaptive profile's own windows against its prediction
#
# Its prediction is built from the fixed profiles' estimates (their cycle times per batch size,
# their acceptance) and an emulation of SGLang's rule: model error (the emulated tier shares,
# the draft-extend tax) and drift since the fixed profiles last ran (verify cost rising over a
# day) are invisible to it. While the adaptive profile runs, each window's mean cycle time and
# tokens per sequence per cycle are compared with what the uncorrected model predicted for the
# window's batch size, mix and running table; the forgotten mean log ratio (half-life of the
# cycle surface, discounted with it at a detected change or a new boot) scales the tier cycle
# times (the tiers that ran, by their predicted shares; the other drafting tiers share the
# drafting tiers' correction: a verify or draft forward that drifts does so for every tier)
# and the accept length. Table generation reads the same corrected tier costs, so a rewrite
# is priced at current costs.

# Below this standard error a correction's mean is not trusted further: changes under 0.5% are
# noise to the decision (the CUSUM's relative floor).
SELF_SE_FLOOR = 0.005
# A correction learned at other batch sizes transfers with this much doubt (a fraction of its
# own size as one standard deviation): drift of the verify forward weighs differently at other
# batch sizes.
SELF_TRANSFER_DOUBT = 0.5


def _pooled(cells: list[LogRatio]) -> LogRatio:
    """One LogRatio of several cells' windows (at least one cell)."""
    pooled = cells[0]
    for c in cells[1:]:
        pooled = pooled.merged(c)
    return pooled


def _usable(r: LogRatio | None, min_w: float, other_bucket: bool) -> tuple[float, float] | None:
    if r is None or r.count < min_w or r.w <= 0:
        return None
    mean = r.mean()
    se = r.se(SELF_SE_FLOOR)
    if other_bucket:
        se = math.hypot(se, SELF_TRANSFER_DOUBT * mean)
    return mean, se


def _cycle_factor(
    corr: Mapping[str, LogRatio],
    batch: float,
    g: int,
    min_w: float,
    shift: ShiftFn,
    source: SourceFn,
) -> tuple[float, float] | None:
    """(log factor, standard error) of tier g's cycle time at `batch`: the tier's own ratio at
    the batch's bucket, else the drafting tiers' there (g >= 1), else the same at the other
    buckets (with the transfer doubt); tier 0 (the baseline forward plus the draft-extend pass,
    priced from the baseline's own data) only by its own ratios. Each (bucket, tier) ratio is
    re-referenced to the model now (`shift`): where the fixed profiles' estimates moved since
    the windows were compared with them (a fixed profile ran again and measured the drift), the
    correction moves back by as much, so the adaptive profile's own level is counted once.
    A ratio transfers to other tiers or buckets only where `source` says the model it is
    against is no fixed profile's line continued past the batch sizes it served: against such a
    line it measures the line's error, which says nothing of the tiers and buckets the fixed
    profiles served (stress a15: the adaptive profile ran at 48 streams where 2-step's cost was
    a line from one stream; the line moved 3.6x with 2-step's later windows, and the correction
    that kept the adaptive profile's measured level there, carried to 4 streams, priced it at
    1023 tok/s against the 240 it served there)."""
    k = str(batch_bucket(batch))
    cells: dict[str, list[int]] = {}
    for key in corr:
        if key.startswith("T:"):
            _, b, tier = key.split(":")
            t = int(tier)
            if (b, t) == (k, g) or source(b, t):
                cells.setdefault(b, []).append(t)
    others = [b for b in cells if b != k]
    options: list[tuple[list[tuple[str, int]], bool]] = [([(k, g)], False)]
    if g >= 1:
        options.append(([(k, t) for t in cells.get(k, []) if t >= 1], False))
    options.append(([(b, g) for b in others if g in cells[b]], True))
    if g >= 1:
        options.append(([(b, t) for b in others for t in cells[b] if t >= 1], True))
    for cellset, other in options:
        parts = [
            (x, shift(b, t))
            for b, t in cellset
            if (x := corr.get(f"T:{b}:{t}")) is not None and x.w > 0
        ]
        if not parts:
            continue
        pooled = _pooled([x for x, _ in parts])
        f = _usable(pooled, min_w, other)
        if f is None:
            continue
        mean = sum(x.w * (x.mean() - d) for x, d in parts) / pooled.w
        se = pooled.se(SELF_SE_FLOOR)
        if other:
            se = math.hypot(se, SELF_TRANSFER_DOUBT * mean)
        return mean, se
    return None


# (bucket, tier) -> log of the uncorrected model's tier cycle now minus its mean when the
# bucket's windows were compared with it.
ShiftFn = Callable[[str, int], float]
# (bucket, tier) -> whether the bucket's ratio may transfer (its model is no line continued).
SourceFn = Callable[[str, int], bool]


def _source_fn(corr: Mapping[str, LogRatio], continued: Callable[[float, int], bool]) -> SourceFn:
    @functools.lru_cache(maxsize=256)
    def source(b: str, g: int) -> bool:
        nb = corr.get(f"N:{b}")
        return nb is not None and nb.w > 0 and not continued(max(nb.mean(), 1.0), g)

    return source


def _shift_fn(corr: Mapping[str, LogRatio], base: CycleFn) -> ShiftFn:
    @functools.lru_cache(maxsize=256)
    def shift(b: str, g: int) -> float:
        ref, nb = corr.get(f"R:{b}:{g}"), corr.get(f"N:{b}")
        if ref is None or nb is None or ref.w <= 0 or nb.w <= 0:
            return 0.0
        e = base(max(nb.mean(), 1.0), g)
        if e is None or not e.mean > 0:
            return 0.0
        return math.log(e.mean) - ref.mean()

    return shift


def _accept_factor(
    corr: Mapping[str, LogRatio], batch: float, min_w: float
) -> tuple[float, float] | None:
    k = str(batch_bucket(batch))
    return _usable(corr.get(f"L:{k}"), min_w, False) or _usable(corr.get("L:*"), min_w, True)


def observe_self(state: PolicyState, obs: Observation, s: PolicySettings) -> None:
    """One window of a running adaptive profile against its uncorrected prediction for the
    window's batch size and the running table (called after the estimators took the window:
    the mix is the one now). Windows without decode moments say nothing."""
    hs = state.hybrid
    name = obs.profile
    if hs is None or name not in hs.tables:
        return
    corr = hs.corr.setdefault(name, {})
    lam = decay(obs.window_s, s.cycle_half_life_s)
    for r in corr.values():
        r.scale(lam)  # forgotten with the profile's observed time, as its cycle statistics
    m = obs.moments
    if m is None or m.n_steps <= 0:
        return
    vals = (m.n_steps, m.sum_bs, m.sum_step_s, m.sum_generated)
    if not all(math.isfinite(v) and v > 0 for v in vals):
        return
    batch = m.sum_bs / m.n_steps
    if batch < 1.0:
        return
    t = hs.tables[name]
    table = t["running_table"] or t["table"]
    spec = state.specs[name]
    ins = inputs(state, spec, corrected=False)
    if ins is None:
        return
    am, cyc = ins
    try:
        br = adaptive_breakdown(
            table, am, cyc, batch, launch_steps=spec.num_steps, max_bs=s.hybrid_max_running_requests
        )
    except ValueError:
        return
    if br is None or not (br.cycle_s > 0 and br.accept_length > 0):
        return
    x_t = math.log((m.sum_step_s / m.n_steps) / br.cycle_s)
    x_l = math.log((m.sum_generated / m.sum_bs) / br.accept_length)
    k = str(batch_bucket(batch))
    corr.setdefault(f"N:{k}", LogRatio()).add(batch)
    for g, share in br.shares.items():
        corr.setdefault(f"T:{k}:{g}", LogRatio()).add(x_t, share)
        e = cyc(batch, g)
        if e is not None and e.mean > 0:
            corr.setdefault(f"R:{k}:{g}", LogRatio()).add(math.log(e.mean), share)
    for b in (k, "*"):
        corr.setdefault(f"L:{b}", LogRatio()).add(x_l)


# The self-correction cells of cycle time: per (bucket, tier) ratio and model, and per bucket
# the windows' batch size (observe_self).
CYCLE_CELLS = ("T:", "R:", "N:")


def discount_self(
    state: PolicyState,
    profile: str,
    factor: float,
    what: str = "all",
    max_windows: float | None = None,
) -> None:
    """Keep `factor` of an adaptive profile's self-correction evidence ("cycle": its cycle
    ratios, at a detected change in its cycle time; "accept": its accept ratios, at one in its
    acceptance; "all": both, at a new boot), as the estimators discount their own: its cycle
    ratios at a batch bucket, like a profile's step times at a new boot, at most `max_windows`
    windows' worth (the bucket's cells scaled alike, so the tiers keep their shares), and its
    accept ratios, like accept lengths, `factor` of theirs."""
    hs = state.hybrid
    corr = hs.corr.get(profile) if hs is not None else None
    if not corr:
        return
    f = min(max(factor, 0.0), 1.0)
    prefix = {"cycle": CYCLE_CELLS, "accept": ("L:",), "all": (*CYCLE_CELLS, "L:")}[what]
    # Per bucket: N:<bucket> counts its windows (one each), which the T and R cells share out.
    cap = {k[2:]: carryover(f, r.w, max_windows) for k, r in corr.items() if k.startswith("N:")}
    for k, r in corr.items():
        if k.startswith(prefix):
            r.scale(cap.get(k.split(":")[1], f) if k.startswith(CYCLE_CELLS) else f)
            r.count = 0.0


def self_correction(
    state: PolicyState, profile: str, batch: float
) -> dict[str, tuple[float, float] | None]:
    """The corrections that apply to `profile` at `batch` (for diagnostics and tests): per tier
    "T:<g>" and "L" -> (log factor, standard error) or None."""
    hs = state.hybrid
    corr = hs.corr.get(profile) if hs is not None else None
    if not corr:
        return {}
    min_w = float(state.settings.min_windows)
    tiers = {int(k.split(":")[2]) for k in corr if k.startswith("T:")}
    ins = inputs(state, state.specs[profile], corrected=False)
    chains = _chains(_fixed_specs(state, state.specs[profile]))
    model = ins[1] if ins else None
    shift, source = _reference(state, chains, _baseline(state), corr, model)
    out: dict[str, tuple[float, float] | None] = {
        f"T:{g}": _cycle_factor(corr, batch, g, min_w, shift, source) for g in sorted(tiers)
    }
    out["L"] = _accept_factor(corr, batch, min_w)
    return out


def predict(
    state: PolicyState,
    spec: ProfileSpec,
    batch: float | None,
    s: PolicySettings,
    table: Mapping[str, Any] | None = None,
    mix: Mapping[str, float] | None = None,
    ins: tuple[AcceptModel, CycleFn] | None = None,
) -> ProfilePrediction | None:
    """Decode tok/s of adaptive `spec` at `batch` with `table` (default: the running table if it
    runs, else its launch table) and `mix` (default: the mix now). `ins`: inputs(state, spec,
    mix) when the caller already has them (one per decision, for every batch size it prices).
    None when the estimates cannot price it."""
    hs = state.hybrid
    if hs is None or spec.name not in hs.tables or batch is None or batch < 1:
        return None
    t = hs.tables[spec.name]
    if table is None:
        table = t["running_table"] if state.running == spec.name and t["running_table"] else None
        table = table or t["table"]
    ins = ins or inputs(state, spec, mix)
    if ins is None:
        return None
    am, cyc = ins
    br = adaptive_breakdown(
        table, am, cyc, batch, launch_steps=spec.num_steps, max_bs=s.hybrid_max_running_requests
    )
    if br is None:
        return None
    tok = br.tok_s
    L = br.accept_length
    source = "adaptive_model"
    corr = hs.corr.get(spec.name)
    fl = _accept_factor(corr, batch, float(state.settings.min_windows)) if corr else None
    if fl is not None:
        tok = scale_estimate(tok, fl[0], fl[1])
        L *= math.exp(fl[0])
    if corr and any(r.count >= state.settings.min_windows for r in corr.values()):
        source += "+self"
    se = _measured_se(corr, br, batch, float(state.settings.min_windows)) if corr else None
    if se is not None:
        # Its own windows at this batch measured the tiers it runs here: what it serves is a
        # measurement, and the emulation's spread (acceptance paired with slow cycles, shares
        # of the rule's tiers) is in doubt no further than the measurement is.
        band = math.exp(Z90 * se)
        low, high = max(tok.low, tok.mean / band), min(tok.high, tok.mean * band)
        tok = Estimate(tok.mean, min(low, tok.mean), max(high, tok.mean), tok.n)
        source += "+measured"
    return ProfilePrediction(
        spec.name,
        tok,
        accept_length=Estimate(L, L * tok.low / tok.mean, L * tok.high / tok.mean, tok.n),
        cycle_s=Estimate(br.cycle_s, br.cycle_s, br.cycle_s, tok.n),
        observed_tok_s=state.model.observed_tok_s(spec.name),
        source=source,
    )


def _measured_se(
    corr: Mapping[str, LogRatio], br: AdaptiveBreakdown, batch: float, min_w: float
) -> float | None:
    """The standard error (log) of an adaptive profile's prediction at `batch` where its own
    windows measured it: cells of their own at the batch's bucket for the tiers carrying at
    least TIER_MEASURED_MIN_SHARE of its verify batches there, and for its tokens per cycle;
    None otherwise."""
    k = str(batch_bucket(batch))
    cells = {
        g: c
        for g in br.shares
        if (c := corr.get(f"T:{k}:{g}")) is not None and _usable(c, min_w, False) is not None
    }
    acc = corr.get(f"L:{k}")
    if acc is None or _usable(acc, min_w, False) is None:
        return None
    if sum(br.shares[g] for g in cells) < TIER_MEASURED_MIN_SHARE:
        return None
    return math.hypot(_pooled(list(cells.values())).se(SELF_SE_FLOOR), acc.se(SELF_SE_FLOOR))


def replace_predictions(
    state: PolicyState, preds: list[ProfilePrediction], s: PolicySettings
) -> list[ProfilePrediction]:
    """decide's decode predictions with every adaptive profile's from its table, where the
    estimates can price it (else the profile's own-data prediction stays), and every fixed
    chain never run priced by what an adaptive profile measured running its tier
    (`_tier_measured`)."""
    if state.hybrid is None:
        return preds
    specs = state.specs
    out = []
    for pr in preds:
        spec = specs[pr.profile]
        hp = predict(state, spec, state.model.batch_for(spec.name), s) if spec.adaptive else None
        out.append(hp if hp is not None else _tier_measured(state, spec, pr))
    return out


# A tier's cell speaks for the chain of its steps only where the tier carried at least this
# share of the adaptive profile's windows at the bucket (a table of one candidate there, or a
# bucket settled on the tier): a cell of windows spread over several tiers holds an attribution
# by predicted shares, not a measurement of the tier.
TIER_MEASURED_MIN_SHARE = 0.9


def _tier_measured(
    state: PolicyState, spec: ProfileSpec, pr: ProfilePrediction
) -> ProfilePrediction:
    """`pr` for a fixed chain with no step times of its own (its cycle read off the other
    profiles': "surface"), re-priced where an adaptive profile of its drafter ran its step count
    at the batch size it would serve now: that tier is the chain's very forward (the table's
    tier g is priced by this chain: `_chains`), so the tier's mean observed cycle time there
    (its model then times its correction, both in its (bucket, tier) cells) is the chain's, and
    the prediction moves by its ratio to the chain's estimate at the bucket's mean batch, with
    the cell's standard error (tuned-one-stream: a table of 2 steps ran 50 minutes at 90.7
    tok/s while 2-step, never run, was priced off 5-step and the baseline at 100.9 and
    explored, to serve 90.9). `pr` unchanged otherwise."""
    hs = state.hybrid
    if (
        hs is None
        or not hs.corr
        or spec.adaptive
        or not spec.speculative
        or pr.tok_s is None
        or pr.cycle_s is None
        or pr.accept_length is None
        or "surface" not in pr.source.split("+")
    ):
        return pr
    b = state.model.batch_for(spec.name)
    if b is None or b < 1.0:
        return pr
    k, g, L = str(batch_bucket(b)), spec.num_steps, pr.accept_length
    min_w = float(state.settings.min_windows)
    for a in state.profiles:
        corr = hs.corr.get(a.name) if a.adaptive else None
        if not corr or _chains(_fixed_specs(state, a)).get(g) != spec.name:
            continue
        t, r, nb = corr.get(f"T:{k}:{g}"), corr.get(f"R:{k}:{g}"), corr.get(f"N:{k}")
        if t is None or r is None or nb is None or not (nb.w > 0 and r.w > 0):
            continue
        if t.w < TIER_MEASURED_MIN_SHARE * nb.w:
            continue
        u = _usable(t, min_w, False)
        own = state.model.cycle.estimate(spec.name, max(nb.mean(), 1.0))
        if u is None or own is None or not own.mean > 0:
            continue
        # Log of the tier's observed cycle at the bucket minus the chain's estimate there now:
        # the measurement replaces the surface, its interval the cell's standard error.
        f = u[0] + r.mean() - math.log(own.mean)
        c0 = pr.cycle_s.mean
        cyc = scale_estimate(Estimate(c0, c0, c0, t.w), f, u[1])
        tok = Estimate(
            b * L.mean / cyc.mean, b * L.low / cyc.high, b * L.high / cyc.low, min(L.n, t.w)
        )
        return ProfilePrediction(
            pr.profile,
            tok,
            accept_length=L,
            cycle_s=cyc,
            breakeven_accept_length=pr.breakeven_accept_length,
            observed_tok_s=pr.observed_tok_s,
            source=f"{pr.source}+tier",
        )
    return pr


# --------------------------------------------------------------------------------------------
# Tables


# A table's inputs moved when a workload's alpha or the mix-weighted alpha moved by this much,
# or a tier's cycle time at a bucket by this fraction (log difference), since the last
# generation. The mix enters through the weighted alpha: the mix estimate follows the last two
# minutes and its shares move by several percent between looks, which moves what the table
# sees only by that share times the difference between the workloads' alphas.
REGEN_ALPHA_MOVE = 0.01
REGEN_CYCLE_MOVE = 0.02


def _inputs(
    am: AcceptModel, cyc: CycleFn, steps: tuple[int, ...], max_bs: int
) -> dict[str, float | None]:
    """The inputs of a table: the alpha of every workload and the mix-weighted alpha, log cycle
    time of every tier at every bucket's lower bound (None where unpriced)."""
    al, sh = am.values_of("mean")
    out: dict[str, float | None] = {}
    for i, a in enumerate(al):
        out[f"alpha:{i}"] = a
    tot = float(sum(sh))
    out["alpha:mix"] = float(sum(a * x for a, x in zip(al, sh, strict=True)) / tot) if tot else None
    for b in DEFAULT_BUCKETS:
        if b > max_bs:
            break
        for g in steps:
            e = cyc(float(b), g)
            out[f"cycle:{b}:{g}"] = None if e is None or e.mean <= 0 else math.log(e.mean)
    return out


def _tiers_identified(ins: Mapping[str, float | None], steps: tuple[int, ...]) -> bool:
    """Whether a table generated from these inputs could choose: two of its tiers priced at
    every bucket (every one it allows, when it allows fewer). With one priced tier (one chain
    run, and no baseline data for tier 0) the cost of the others is unidentified
    (tier_cycle_from: one chain says nothing of how the cycle grows with steps), and the table
    would hold that tier alone: the fixed profile under another name, predicted as exactly
    that, so neither a switch nor an exploration would ever try the tiers SGLang's rule could
    use. Until then the launch table stays as it is (the seed: SGLang's own default within the
    allowed steps) and, unpriced, is explored like any profile never run."""
    want = min(2, len(steps))
    priced: dict[str, int] = {}
    for k, v in ins.items():
        if k.startswith("cycle:"):
            _, b, _g = k.split(":")
            priced[b] = priced.get(b, 0) + (v is not None)
    return all(n >= want for n in priced.values())


def _moved(old: Mapping[str, float | None] | None, new: Mapping[str, float | None]) -> bool:
    """Whether the inputs moved enough to regenerate: a distance from the last generation's
    inputs, not a rounding of them (with tens of inputs, some rounding boundary is crossed by
    noise at almost every look, and a generation costs a few hundred milliseconds)."""
    if old is None or set(old) != set(new):
        return True
    for k, v in new.items():
        o = old[k]
        if (o is None) != (v is None):
            return True
        if o is None or v is None:
            continue
        bar = REGEN_CYCLE_MOVE if k.startswith("cycle:") else REGEN_ALPHA_MOVE
        if abs(v - o) >= bar:
            return True
    return False


def refresh_tables(state: PolicyState, now_s: float, s: PolicySettings) -> None:
    """Regenerate the managed tables from the estimates now: looked at once every
    `hybrid_regen_interval_s` and at once after a change in acceptance or cycle time, and
    regenerated only when their inputs moved (_moved)."""
    hs = state.hybrid
    if hs is None:
        return
    changed = state.last_model_change_s != hs.look_model_change_s
    if (
        hs.last_look_s is not None
        and now_s - hs.last_look_s < s.hybrid_regen_interval_s
        and not changed
    ):
        return
    for name, t in hs.tables.items():
        if not t["managed"]:
            continue
        spec = state.specs[name]
        ins = inputs(state, spec)
        if ins is None:
            continue
        am, cyc = ins
        steps = tuple(spec.candidate_steps or DEFAULT_CANDIDATES)
        ins = _inputs(am, cyc, steps, s.hybrid_max_running_requests)
        hs.last_look_s, hs.look_model_change_s = float(now_s), state.last_model_change_s
        if not _moved(t.get("inputs"), ins) or not _tiers_identified(ins, steps):
            continue
        t["inputs"] = ins
        t.pop("fingerprint", None)  # states saved with the rounded fingerprint
        hs.last_regen_s = float(now_s)

        def means(b: float, g: int, cyc: CycleFn = cyc) -> Estimate | None:
            e = cyc(b, g)
            return None if e is None else Estimate(e.mean, e.mean, e.mean, e.n)

        try:
            table, choices = generate_table(
                means,
                am,
                steps,
                DEFAULT_BUCKETS,
                max_bs=s.hybrid_max_running_requests,
                launch_steps=spec.num_steps,
                margin=s.hybrid_table_margin,
            )
        except ValueError:
            continue  # no tier priced at some batch size yet
        current = t["candidate"] if t["candidate"] is not None else t["table"]
        if state.running == name and t["running_table"] is not None and t["candidate"] is None:
            current = t["running_table"]
        if table_distance(current, table, s.hybrid_max_running_requests) == 0.0:
            continue
        estimates = {
            "alphas": {w: a.to_dict() for w, a in am.alphas.items()},
            "mix": dict(am.shares),
            "buckets": [
                {
                    "bucket": c.lower,
                    "points": list(c.points),
                    "fixed_score": {str(g): v for g, v in c.fixed_score.items()},
                    "kept": list(c.kept),
                    "score": c.score,
                    "cycle_s": {
                        str(g): e.mean
                        for g in c.fixed_score
                        if (e := cyc(float(c.points[len(c.points) // 2]), g)) is not None
                    },
                }
                for c in choices
            ],
        }
        if state.running == name and t["running_table"] is not None:
            t["candidate"] = table
            reason = "candidate"
        else:
            t["table"] = table
            reason = "generated"
        t["t_s"], t["reason"] = float(now_s), reason
        hs.events.append(
            {
                "t_s": float(now_s),
                "profile": name,
                "table": table,
                "estimates": estimates,
                "reason": reason,
            }
        )
        del hs.events[:-MAX_EVENTS]
        state.long_run.cache = None


# --------------------------------------------------------------------------------------------
# The long-run rule


def _points(lr: LongRunState) -> list[tuple[float, float]]:
    """(mean load, weight) per half-octave bucket of the load histogram (the batch sizes a
    profile without a binding cap serves)."""
    acc: dict[int, list[float]] = {}
    for k, w in lr.batch_w.items():
        b = float(k)
        a = acc.setdefault(batch_bucket(b), [0.0, 0.0])
        a[0] += w
        a[1] += w * b
    return sorted((a[1] / a[0], a[0]) for a in acc.values() if a[0] > 0)


def _long_run_mix(lr: LongRunState) -> dict[str, float] | None:
    """The workload mix over the long-run window (token shares; None before any)."""
    tot = sum(lr.mix_w.values())
    return {w: v / tot for w, v in lr.mix_w.items()} if tot > 0 else None


def _value(
    state: PolicyState,
    name: str,
    pts: list[tuple[float, float]],
    s: PolicySettings,
    table: Mapping[str, Any] | None = None,
) -> tuple[Estimate, Estimate] | None:
    """(wall tok/s, decode tok/s) of `name` averaged over the batch-size distribution, at the
    long-run workload mix."""
    spec = state.specs[name]
    mix = _long_run_mix(state.long_run)
    per_tok = state.overhead.per_token_s()
    tot = sum(w for _, w in pts)
    acc = [0.0, 0.0, 0.0, 0.0]
    n = math.inf
    # An adaptive profile's inputs are read once for every batch size.
    ins = inputs(state, spec, mix) if spec.adaptive else None
    for load, w in pts:
        b = state.model.batch_for(name, load)
        if spec.adaptive:
            pr = predict(state, spec, b, s, table, mix, ins)
        else:
            pr = state.model_prediction(name, s.stale_widen, batch=b, mix=mix)
        if pr is None or pr.tok_s is None or pr.bound:
            return None  # a bound prices nothing: exploration's prior covers it
        wall = wall_estimate(pr.tok_s, per_tok)
        acc[0] += w * wall.mean
        acc[1] += w * wall.low
        acc[2] += w * (wall.high if math.isfinite(wall.high) else wall.mean * 10)
        acc[3] += w * pr.tok_s.mean
        n = min(n, pr.tok_s.n)
    mean = acc[0] / tot
    dec = acc[3] / tot
    return Estimate(mean, acc[1] / tot, acc[2] / tot, n), Estimate(dec, dec, dec, n)


def _regimes_observed_s(pts: list[tuple[float, float]], s: PolicySettings) -> float | None:
    """The seconds of traffic the long-run points `pts` were observed over, when they are at
    least `long_run_min_history_s` and hold two or more batch-size regimes (buckets of at
    least MIN_REGIME_SHARE of them); None otherwise (one regime with noise)."""
    observed = sum(w for _, w in pts)
    if observed < s.long_run_min_history_s:
        return None
    if sum(1 for _, w in pts if w >= MIN_REGIME_SHARE * observed) < 2:
        return None
    return observed


def active_horizon(state: PolicyState, now_s: float, s: PolicySettings) -> float | None:
    """The long-run horizon when the long-run rule applies (the traffic flips faster than a
    restart repays, over at least `long_run_min_history_s` of history spread over two or more
    batch-size regimes), else None. The distribution is expected to hold about as long again as
    it has held (Lindy), at least the history it was measured over, at most
    `long_run_horizon_s`."""
    lr = state.long_run
    if _regimes_observed_s(_points(lr), s) is None:
        return None
    flipping = _flipping(lr, now_s, s)
    if flipping is None:
        return None
    return min(s.long_run_horizon_s, max(flipping, s.long_run_min_history_s))


def return_cost(state: PolicyState, target: str, s: PolicySettings) -> float:
    """Tokens a switch from the running profile to `target` is expected to cost on the way back
    (0 when none is expected). Over the traffic of the long-run window (at least
    `long_run_min_history_s` of it: batch sizes and workload mix, as the long-run rule values
    profiles), a target worth less than the running profile is one the traffic will take back
    from when the regimes that favoured the running profile return (traffic alternating over
    tens of minutes, below the long-run rule's flipping): that restart back costs its restart
    time at the running profile's long-run rate. A regime's own gain then has to pay for both
    restarts. Without such history, or with a target at least as good over it, nothing."""
    pts = _points(state.long_run)
    if sum(w for _, w in pts) < s.long_run_min_history_s:
        return 0.0
    cur = _value(state, state.running, pts, s)
    tgt = _value(state, target, pts, s)
    if cur is None or tgt is None or tgt[0].mean >= cur[0].mean:
        return 0.0
    from policies import decide as D

    return cur[0].mean * D.restart_time(state, state.running, s)


def carry_values(state: PolicyState, targets: list[str], s: PolicySettings) -> dict[str, float]:
    """Tokens a switch from the running profile to each of `targets` is expected to keep
    gaining after the current regime ends (0 when none is expected). Over the traffic of the
    long-run window (at least `long_run_min_history_s` of it, spread over two or more
    batch-size regimes), a target worth more than the running profile by more than the switch
    margin is one the regimes to come keep: that long-run gain counts for as long again as the
    history it was measured over (Lindy), at most `long_run_horizon_s`. The mirror of
    `return_cost`."""
    out = dict.fromkeys(targets, 0.0)
    if not targets:
        return out
    pts = _points(state.long_run)
    if (observed := _regimes_observed_s(pts, s)) is None:
        return out
    cur = _value(state, state.running, pts, s)
    if cur is None:
        return out
    c = cur[0]
    for target in targets:
        tgt = _value(state, target, pts, s)
        if tgt is None:
            continue
        t = tgt[0]
        gain = t.mean - c.mean - switch_margin(c, t, s.margin_frac, s.margin_z)
        if gain > 0:
            out[target] = gain * min(s.long_run_horizon_s, observed)
    return out


def long_run(
    state: PolicyState, now_s: float, s: PolicySettings, diag: dict[str, Any]
) -> Decision | None:
    """The long-run part of a decision (see the module docstring); None: decide's own rule."""
    from policies import decide as D

    lr, hs = state.long_run, state.hybrid
    if hs is not None:
        refresh_tables(state, now_s, s)
    lr_h = active_horizon(state, now_s, s)
    active = lr_h is not None
    run = hs.tables.get(state.running) if hs is not None else None
    rewrite = (
        run is not None
        and run["managed"]
        and run["candidate"] is not None
        and not _rewrite_failed_here(state, run, diag)
    )
    if not active and not rewrite:
        lr.cache = None
        return None
    key = (
        f"{state.running}|{state.last_model_change_s!r}|{sorted(state.tried)}|"
        f"{sorted(state.failed)}|{active}|{rewrite}|{round(lr_h or 0.0, -2)}"
    )
    c = lr.cache
    if c is not None and c["key"] == key and now_s - c["t_s"] < s.reeval_interval_s:
        if c["reason"] is None:
            return None
        diag.update(c["diag"])
        return _hold(now_s, state, Reason(c["reason"]), diag)
    if lr_h is None:
        assert run is not None
        return _rewrite_now(state, run, key, now_s, s, diag)

    pts = _points(lr)
    blocked = {p for p, t in state.failed.items() if now_s - t < s.failed_profile_backoff_s}
    values: dict[str, tuple[Estimate, Estimate]] = {}
    for p in state.profiles:
        if p.name in blocked and p.name != state.running:
            continue
        v = _value(state, p.name, pts, s)
        if v is not None:
            values[p.name] = v
    cur_v = values.get(state.running)
    if cur_v is None:
        return None
    diag["long_run"] = True
    diag["long_run_horizon_s"] = lr_h
    for name, (v, _) in values.items():
        diag[f"long_run_tok_s.{name}"] = v.mean
    if s.explore:
        # What a run would reveal is worth something over the long-run horizon, not over the
        # few minutes left of a regime (decide's own weighing, which never explores here):
        # the candidates are priced by their long-run values, an unpriced one by the prior.
        preds = {n: ProfilePrediction(n, v) for n, (v, _) in values.items()}
        pick = D._exploration(
            state,
            preds,
            cur_v[0].mean,
            lr_h,
            math.inf,
            blocked,
            now_s,
            s,
            diag,
            scope="long_run",
            full=lr_h >= s.long_run_horizon_s,
        )
        if pick is not None:
            if D.budget_exhausted(state, now_s, s, round_trip=True):
                return _hold(now_s, state, Reason.HOLD_BUDGET, diag)
            return _switch(now_s, state, pick, Reason.EXPLORE, diag)
    options: list[tuple[float, str, bool]] = []
    for name, (v, _) in values.items():
        if name == state.running:
            continue
        pays, net = rewrite_pays(
            cur_v[0],
            v,
            horizon_s=lr_h,
            restart_s=D.restart_time(state, name, s),
            margin_frac=s.margin_frac,
            margin_z=s.margin_z,
        )
        diag[f"long_run_net_tokens.{name}"] = net
        if pays:
            options.append((net, name, False))
    if rewrite and run is not None:
        nv = _value(state, state.running, pts, s, run["candidate"])
        if nv is not None:
            diag["long_run_tok_s.candidate_table"] = nv[0].mean
            pays, net = rewrite_pays(
                cur_v[0],
                nv[0],
                horizon_s=lr_h,
                restart_s=D.restart_time(state, state.running, s),
                margin_frac=s.margin_frac,
                margin_z=s.margin_z,
            )
            diag["long_run_net_tokens.candidate_table"] = net
            if pays:
                options.append((net, state.running, True))
    if options:
        net, name, is_rewrite = max(options)
        diag["long_run_net_tokens"] = net
        if D.budget_exhausted(state, now_s, s):
            return _hold(now_s, state, Reason.HOLD_BUDGET, diag)
        b = state.model.batch_for(name)
        if is_rewrite:
            assert run is not None
            pr = predict(state, state.specs[name], b, s, run["candidate"])
            return _rewrite(state, now_s, s, diag, pr.tok_s if pr else None)
        if D._is_flap(state, name, now_s, s):
            return _hold(now_s, state, Reason.HOLD_NO_FLAP, diag)
        target = now_prediction(state, name, b, s)
        return _switch(
            now_s,
            state,
            name,
            Reason.SWITCH_PREDICTED_GAIN,
            diag,
            target,
            wall_estimate(target, state.overhead.per_token_s()) if target else None,
        )
    best = max(values, key=lambda n: (values[n][0].mean, n == state.running))
    reason = Reason.HOLD_BEST if best == state.running else Reason.HOLD_WITHIN_MARGIN
    kept = {k: v for k, v in diag.items() if k != "intake"}
    lr.cache = {"key": key, "t_s": now_s, "reason": reason.value, "diag": kept}
    return _hold(now_s, state, reason, diag)


def _rewrite_now(
    state: PolicyState,
    run: Mapping[str, Any],
    key: str,
    now_s: float,
    s: PolicySettings,
    diag: dict[str, Any],
) -> Decision | None:
    """Long regimes: a rewrite of the running adaptive table priced at the batch size now over
    decide's horizon (the regime's), after the burst wait; None: decide's own rule."""
    from policies import decide as D

    lr = state.long_run
    age = now_s - state.regime_start_s
    horizon = state.regimes.expected_remaining_s(age)
    b = state.model.batch_for(state.running)
    spec = state.specs[state.running]
    cur = predict(state, spec, b, s)
    new = predict(state, spec, b, s, run["candidate"])
    if cur is None or new is None or cur.tok_s is None or new.tok_s is None:
        lr.cache = {"key": key, "t_s": now_s, "reason": None, "diag": {}}
        return None
    r = D.restart_time(state, state.running, s)
    pays, net = rewrite_pays(
        cur.tok_s,
        new.tok_s,
        horizon_s=horizon,
        restart_s=r,
        margin_frac=s.margin_frac,
        margin_z=s.margin_z,
    )
    diag.update(
        table_rewrite_net_tokens=net, table_rewrite_gain_tok_s=new.tok_s.mean - cur.tok_s.mean
    )
    if pays and age >= s.burst_wait_factor * r:
        return _rewrite(state, now_s, s, diag, new.tok_s)
    lr.cache = {"key": key, "t_s": now_s, "reason": None, "diag": {}}
    return None


def _rewrite_flaps(
    state: PolicyState, run: Mapping[str, Any], now_s: float, s: PolicySettings
) -> bool:
    """decide's no-flap rule for a table: a rewrite back to the rule the last rewrite (or the
    rollback of a failed one) replaced at the batch size now, inside the amortisation horizon
    and without a change point since, undoes that rewrite before it could have paid for its
    restart (each table's tiers look worse while it runs: its own windows price them, the other
    table's are priced from the fixed profiles). The rule at the batch size now, not the whole
    table: a rewrite is priced there, and candidates written minutes apart differ at other
    batch sizes (a random MoE day: one stream's tier went 7 -> 5 -> 7 -> 5 within the hour,
    each rewrite priced 7-13% up, in tables that differed elsewhere)."""
    t = run.get("rewritten_s")
    if t is None or run.get("previous") is None or run.get("candidate") is None:
        return False
    if now_s - float(t) >= s.amortisation_horizon_s:
        return False
    if state.last_change_s is not None and state.last_change_s > float(t):
        return False
    b = state.model.batch_for(state.running)
    if b is None:
        return run["candidate"] == run["previous"]
    return bool(_rule_at(run["candidate"], b) == _rule_at(run["previous"], b))


def _rule_at(table: Mapping[str, Any], batch: float) -> SlotRule:
    """The rule `table` runs a batch of `batch` sequences with."""
    slots = parse_table(table)
    return slots[route(slots, max(round(batch), 1), None)]


def _rewrite_failed_here(state: PolicyState, run: Mapping[str, Any], diag: dict[str, Any]) -> bool:
    """Whether the candidate runs, at the batch size now, the rule of a table whose trial failed
    at this batch size (its bucket) with no change in acceptance or cycle time since. The trial
    measured that rule here, and a trial fails in a few windows, too few for the self-correction
    to hold what it measured: without this, the same rewrite was priced up again once the no-flap
    horizon passed and failed again, by the hour (stress a17: three failed trials in one night,
    two of them of the same rule). A failed rule is tried again after a change in the model,
    never on a timer."""
    b = state.model.batch_for(state.running)
    cand = run.get("candidate")
    changed = state.last_model_change_s
    here = [
        f["table"]
        for f in run.get("failed", [])
        if (changed is None or changed <= float(f["t_s"]))
        and b is not None
        and batch_bucket(float(f["batch"])) == batch_bucket(b)
    ]
    if not here or cand is None or b is None:
        return False  # checked every tick: tables are parsed only where a trial failed here
    rule = _rule_at(cand, b)
    if any(_rule_at(table, b) == rule for table in here):
        diag["rewrite_failed_here"] = True
        return True
    return False


def undo_rewrite(state: PolicyState, now_s: float, diag: dict[str, Any]) -> bool:
    """The trial of a rewritten table failed: the rollback relaunches the running profile with
    the table that rewrite replaced, marked in `diag` as a rewrite (the shells restart the
    running profile only for one: without it the failed table went on serving, and the
    rollback's switch only expired), and the failed table becomes the one a rewrite would flap
    back to. A failed trial of the running profile is always a rewrite's (only a rewrite
    restarts it with a trial), so `previous` is its table; `reason` is not read, as a candidate
    written during the trial overwrites it. False with no table to go back to."""
    hs = state.hybrid
    if hs is None:
        return False
    t = hs.tables.get(state.running)
    if t is None or t.get("previous") is None:
        return False
    b = state.model.batch_for(state.running)
    if b is not None:
        failed = [*t.get("failed", []), {"t_s": float(now_s), "batch": b, "table": t["table"]}]
        t["failed"] = failed[-MAX_FAILED_TABLES:]
    _relaunch(state, hs, t, t["previous"], now_s, "rollback", diag)
    return True


def _relaunch(
    state: PolicyState,
    hs: HybridState,
    t: dict[str, Any],
    table: dict[str, Any],
    now_s: float,
    reason: str,
    diag: dict[str, Any],
) -> None:
    """The running adaptive profile's next launch gets `table` (the table it has now becomes
    `previous`), recorded as an event with `reason`, and `diag` carries the rewrite mark that
    makes the shells restart the running profile."""
    t["previous"], t["table"], t["candidate"] = t["table"], table, None
    t["t_s"], t["reason"], t["rewritten_s"] = float(now_s), reason, float(now_s)
    hs.events.append(
        {
            "t_s": float(now_s),
            "profile": state.running,
            "table": table,
            "estimates": {},
            "reason": reason,
        }
    )
    del hs.events[:-MAX_EVENTS]
    state.long_run.cache = None
    diag[REWRITE_KEY] = True


def _hold(now_s: float, state: PolicyState, reason: Reason, diag: dict[str, Any]) -> Decision:
    from policies import decide as D

    return D._hold(now_s, state, reason, diag)[1]


def _switch(
    now_s: float,
    state: PolicyState,
    target: str,
    reason: Reason,
    diag: dict[str, Any],
    predicted: Estimate | None = None,
    predicted_wall: Estimate | None = None,
) -> Decision:
    from policies import decide as D

    return D._switch(now_s, state, target, reason, diag, predicted, predicted_wall)[1]


def now_prediction(
    state: PolicyState, name: str, batch: float | None, s: PolicySettings
) -> Estimate | None:
    """A profile's decode rate at `batch`: a switch's target (what its trial checks) and the
    profile it leaves (what a rollback would return to)."""
    spec = state.specs[name]
    if spec.adaptive:
        pr = predict(state, spec, batch, s)
    else:
        pr = state.model_prediction(name, s.stale_widen, batch=batch)
    return None if pr is None else pr.tok_s


def rewrites_table(d: Decision) -> bool:
    """Whether `d` restarts the running adaptive profile to launch it with a rewritten table
    (every replica of it, in a fleet), rather than switching profiles."""
    return bool(d.diagnostics.get(REWRITE_KEY))


def _rewrite(
    state: PolicyState,
    now_s: float,
    s: PolicySettings,
    diag: dict[str, Any],
    predicted: Estimate | None,
) -> Decision:
    """Restart the running adaptive profile with its candidate table, unless that undoes the
    last rewrite (_rewrite_flaps: HOLD_NO_FLAP)."""

    hs = state.hybrid
    assert hs is not None
    t = hs.tables[state.running]
    if _rewrite_flaps(state, t, now_s, s):
        return _hold(now_s, state, Reason.HOLD_NO_FLAP, diag)
    _relaunch(state, hs, t, t["candidate"], now_s, "rewrite", diag)
    wall = wall_estimate(predicted, state.overhead.per_token_s()) if predicted else None
    return _switch(now_s, state, state.running, Reason.SWITCH_PREDICTED_GAIN, diag, predicted, wall)
