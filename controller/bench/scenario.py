"""Benchmark scenario files: parse, validate and expand a documented TOML file into a Scenario.

Owns the scenario format (documented in scenarios/README.md), its validation with errors that
name the file and the key, the expansion of `repeat` and cost ramps into constant phases, the
`--hours-scale` shortening, and the names of the speculation profiles a scenario compares
(`baseline`, `eagle3-<N>step`, and the adaptive peer's `eagle3-adaptive`).
Must not: run engines or policies (harness.py does) or decide anything.

Format, in short (every key is documented in scenarios/README.md):

```toml
name = "code-chat-shift"          # required
description = "one line"          # optional
profile = "kimi-k2.5-pcie-tuned"  # required: a built-in simulator profile (or a profile file path)
seed = 7                          # optional, default 0
poll_interval_s = 10.0            # optional, default 10
initial_profile = "baseline"      # optional, default baseline: the profile running at t = 0
profiles = ["baseline", "eagle3-2step", "eagle3-5step"]   # optional, the candidates (default)
max_running_requests = 128        # optional, the same for every profile (default: the profile's)
repeat = 1                        # optional: play the phase list this many times
kind = "changing"                 # optional: stationary | changing | burst (which targets apply;
                                  #   default: stationary when every phase has the same conditions)

[profile_overrides]               # optional, passed to simulator.model.load_profile
restart_s = 120

[[phases]]
duration_s = 3600
concurrency = 1
workloads = { chat = 0.7, code = 0.3 }
verify_cost_scale = 1.0           # optional; [from, to] ramps linearly over the phase
base_cost_scale = 1.0             # optional; same
ramp_steps = 6                    # optional: constant sub-phases a ramp is played as

[workloads.chat]                  # optional: a new workload or an override of a built-in one
alpha = 0.8
output_tokens = 400
```

Size limits (a replay is virtual time, but every poll of every policy is real work, so a typo
such as `duration_s = 1e300` would otherwise run for ever): a scenario lasts at most
MAX_SCENARIO_S (30 days, phases x repeat, and after `--hours-scale`), so a phase too; a ramp
has at most MAX_RAMP_STEPS sub-phases; a scenario at most MAX_PHASES sub-phases in all and
MAX_POLLS polls (its duration / poll_interval_s); a workload's `output_tokens` is at most 1e6
and its `output_sigma` at most 4. `name` names the --png-dir file, so it may not hold a path
separator nor pass MAX_NAME_BYTES bytes.
"""

from __future__ import annotations

import functools
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from controller.settings import decode_problem, max_running_requests
from policies.types import ProfileSpec
from simulator.model import (
    CostScale,
    SimProfile,
    SpecConfig,
    Workload,
    builtin_profiles,
    builtin_workloads,
    load_profile,
)

# The candidate set when a scenario does not name one: the three profiles the shipped
# config.toml manages (no speculation, the field's tuned 2-step, the deeper 5-step).
DEFAULT_PROFILES: tuple[str, ...] = ("baseline", "eagle3-2step", "eagle3-5step")

# The SGLang in-process adaptive peer: EAGLE-3 with --speculative-adaptive and the default table,
# launched at 3 steps (SGLang's own choice when --speculative-num-steps is unset).
ADAPTIVE_PROFILE = "eagle3-adaptive"
ADAPTIVE_LAUNCH_STEPS = 3

# The specpilot_hybrid peer's extra profile: EAGLE-3 with --speculative-adaptive and a table
# specpilot generates (policies.hybrid), any of these steps allowed (the range SGLang's own
# default table spans, so its seed table is SGLang's default), launched at 1 step (SGLang
# needs --speculative-num-steps >= 1; a launch tier outside the table costs one more capture).
HYBRID_PROFILE = "eagle3-hybrid"
HYBRID_STEPS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)
HYBRID_LAUNCH_STEPS = 1

# Which of the targets a scenario is judged by: stationary (within 1% of the best static
# profile, no false switch), changing (>= 10% above it), burst (a change too short to repay a
# restart: only the oracle_dp and peer targets).
SCENARIO_KINDS = ("stationary", "changing", "burst")

_STEP_NAME = re.compile(r"^eagle3-(\d+)step$")

# A ramp played without `ramp_steps` gets one constant sub-phase per this many seconds (at least
# two): fine enough that a policy sees the drift as a sequence of small changes.
DEFAULT_RAMP_STEP_S = 1800.0

# Size limits (see the module docstring): a month of virtual time, a thousand sub-phases per
# ramp, and half a million polls, about ten minutes of replay for every policy on one core.
MAX_SCENARIO_S = 30 * 86400.0
MAX_RAMP_STEPS = 1000
MAX_PHASES = 100_000
MAX_POLLS = 500_000
MAX_NAME_BYTES = 200  # file names stop at 255 bytes; the PNG adds ".png"

_TOP_KEYS = {
    "name",
    "description",
    "profile",
    "profile_overrides",
    "seed",
    "poll_interval_s",
    "initial_profile",
    "profiles",
    "max_running_requests",
    "repeat",
    "kind",
    "phases",
    "workloads",
    "replicas",
    "max_unavailable_fraction",
    "canary",
}
_PHASE_KEYS = {
    "duration_s",
    "concurrency",
    "workloads",
    "verify_cost_scale",
    "base_cost_scale",
    "ramp_steps",
    "label",
}
_WORKLOAD_KEYS = {"alpha", "output_tokens", "prompt_tokens", "output_sigma"}
# A request's length law is a table as long as its longest output (8 x the mean), so a typo of
# a million tokens would take gigabytes; a log-sd past 4 puts the mean in a tail the clip at
# 8 x the mean cuts off (lengths of 1 and nothing served). Prompts only cost prefill time.
_WORKLOAD_MAX = {"alpha": 1.0, "output_tokens": 1_000_000.0, "output_sigma": 4.0}


@dataclass(frozen=True)
class _BenchWorkload(Workload):
    """A Workload whose output-length pmf is computed once: the window engine asks for it on
    every window and it is a pure function of the frozen fields (a scipy lognormal CDF over
    thousands of lengths, ~80% of a window's cost otherwise)."""

    @functools.cache  # noqa: B019 - frozen, hashable instances; a handful per process
    def output_length_pmf(self) -> Any:
        return super().output_length_pmf()


def _bench_workload(w: Workload) -> Workload:
    return _BenchWorkload(
        name=w.name,
        alpha=w.alpha,
        output_tokens=w.output_tokens,
        prompt_tokens=w.prompt_tokens,
        output_sigma=w.output_sigma,
        max_output_factor=w.max_output_factor,
    )


class ScenarioError(ValueError):
    """A scenario file is invalid: the message names the file, the key and the problem."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        super().__init__(f"{source}: {key}: {problem}")
        self.source = source
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class BenchProfile:
    """One speculation profile as both sides see it: the policy's ProfileSpec and the
    simulator's SpecConfig (same shape, two vocabularies)."""

    spec: ProfileSpec
    sim: SpecConfig

    @property
    def name(self) -> str:
        return self.spec.name


def bench_profile(name: str) -> BenchProfile:
    """`baseline`, `eagle3-<N>step` (EAGLE-3, N steps, topk 1, N + 1 draft tokens) or
    `eagle3-adaptive` (the SGLang adaptive peer). Raises ValueError for anything else."""
    if name == "baseline":
        return BenchProfile(ProfileSpec(name=name), SpecConfig.baseline())
    if name == HYBRID_PROFILE:
        from policies.hybrid import seed_table

        sim = SpecConfig.eagle3(
            HYBRID_LAUNCH_STEPS, adaptive=True, adaptive_config=seed_table(HYBRID_STEPS)
        )
        spec = ProfileSpec(
            name=name,
            num_steps=HYBRID_LAUNCH_STEPS,
            draft_tokens=HYBRID_LAUNCH_STEPS + 1,
            algorithm="EAGLE3",
            adaptive=True,
            candidate_steps=HYBRID_STEPS,
        )
        return BenchProfile(spec, sim)
    if name == ADAPTIVE_PROFILE:
        sim = SpecConfig.eagle3(ADAPTIVE_LAUNCH_STEPS, adaptive=True)
        spec = ProfileSpec(
            name=name,
            num_steps=ADAPTIVE_LAUNCH_STEPS,
            draft_tokens=ADAPTIVE_LAUNCH_STEPS + 1,
            algorithm="EAGLE3",
            adaptive=True,
            candidate_steps=sim.tiers,
        )
        return BenchProfile(spec, sim)
    m = _STEP_NAME.match(name)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(
            f"unknown profile name {name!r}: use 'baseline' or 'eagle3-<N>step' with N >= 1"
        )
    n = int(m.group(1))
    spec = ProfileSpec(name=name, num_steps=n, draft_tokens=n + 1, algorithm="EAGLE3")
    return BenchProfile(spec, SpecConfig.eagle3(n))


@dataclass(frozen=True)
class Phase:
    """A stretch of constant conditions (after expansion of `repeat` and ramps)."""

    index: int
    label: str  # "3" for the fourth phase of the file; "3.2" for a ramp's third sub-phase
    start_s: float
    duration_s: float
    concurrency: int
    mix: Mapping[str, float]  # workload -> share, summing to 1
    verify_cost_scale: float = 1.0
    base_cost_scale: float = 1.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    @functools.cached_property
    def scale(self) -> CostScale:
        return CostScale(verify=self.verify_cost_scale, base=self.base_cost_scale)

    def describe(self) -> str:
        mix = "+".join(f"{k}{v:.0%}" if len(self.mix) > 1 else k for k, v in self.mix.items())
        s = f"c={self.concurrency} {mix}"
        if self.verify_cost_scale != 1.0:
            s += f" verify x{self.verify_cost_scale:.2f}"
        if self.base_cost_scale != 1.0:
            s += f" base x{self.base_cost_scale:.2f}"
        return s


@dataclass(frozen=True)
class Scenario:
    """A validated scenario: a simulator profile, candidate profiles and a timeline of phases."""

    name: str
    description: str
    source: str
    profile: str
    profile_overrides: Mapping[str, Any]
    seed: int
    poll_interval_s: float
    initial_profile: str
    profiles: tuple[str, ...]
    phases: tuple[Phase, ...]
    workloads: Mapping[str, Workload]
    max_running_requests: int | None = None
    kind: str = "stationary"
    hours_scale: float = 1.0
    # Fleet mode (controller/bench/fleet.py): N replicas behind a round-robin router; `phases`
    # concurrency is then the fleet's. None: [fleet]'s default (controller/fleet/settings.py).
    replicas: int = 1
    max_unavailable_fraction: float | None = None
    canary: bool | None = None
    _sim: SimProfile | None = field(default=None, compare=False, repr=False)

    @property
    def duration_s(self) -> float:
        return self.phases[-1].end_s

    @property
    def boundaries_s(self) -> tuple[float, ...]:
        """Start of every phase after the first (the phase changes)."""
        return tuple(p.start_s for p in self.phases[1:])

    def sim_profile(self) -> SimProfile:
        if self._sim is not None:
            return self._sim
        return load_profile(self.profile, self.profile_overrides)

    def restart_times(self) -> dict[str, float]:
        """Seconds one restart into each candidate takes on this scenario's simulator profile
        (what the oracles pay per switch)."""
        sim = self.sim_profile()
        catalog = self.catalog()
        return {p: float(sim.restart_s(catalog[p].sim)) for p in self.profiles}

    def catalog(self) -> dict[str, BenchProfile]:
        """The candidates plus the adaptive peer's and the hybrid peer's profiles, by name, each
        with the max running requests the daemon reads off the same flags (`profile_spec`): the
        scenario's `max_running_requests`, else SGLang's 48 with speculation, else none known."""
        out = {}
        for n in dict.fromkeys([*self.profiles, ADAPTIVE_PROFILE, HYBRID_PROFILE]):
            bp = bench_profile(n)
            cap = max_running_requests(self.max_running_requests, bp.spec.speculative)
            out[n] = replace(bp, spec=replace(bp.spec, max_running_requests=cap))
        return out

    def phase_at(self, t_s: float) -> Phase:
        """The phase that contains t_s (the last one at or after the end)."""
        for p in self.phases:
            if t_s < p.end_s:
                return p
        return self.phases[-1]

    def scaled(self, hours_scale: float) -> Scenario:
        """Every phase duration multiplied by `hours_scale` (the CI-short mode); the poll
        interval and restart times are kept, so short runs are harsher on switching.
        ValueError for a scale that is not a positive number, or one that makes the scenario
        longer than the size limits allow."""
        if not (math.isfinite(hours_scale) and hours_scale > 0):
            raise ValueError(f"hours scale must be a positive number (got {hours_scale})")
        if hours_scale == 1.0:
            return self
        problem = _size_problem(self.duration_s * hours_scale, self.poll_interval_s)
        if problem is not None:
            raise ValueError(f"{self.source}: with hours scale {hours_scale:g}, {problem}")
        phases: list[Phase] = []
        t = 0.0
        for p in self.phases:
            d = p.duration_s * hours_scale
            phases.append(replace(p, start_s=t, duration_s=d))
            t += d
        return replace(self, phases=tuple(phases), hours_scale=self.hours_scale * hours_scale)


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def _duration_problem(total_s: float) -> str | None:
    """What is too long about a scenario of `total_s`, or None."""
    if total_s > MAX_SCENARIO_S:
        return (
            f"the scenario would last {total_s / 86400:.4g} days; at most "
            f"{MAX_SCENARIO_S / 86400:g} days (MAX_SCENARIO_S = {MAX_SCENARIO_S:g} s)"
        )
    return None


def _size_problem(total_s: float, poll_s: float) -> str | None:
    """What breaks the size limits for a scenario of `total_s` polled every `poll_s`, or None."""
    too_long = _duration_problem(total_s)
    if too_long is not None:
        return too_long
    polls = total_s / poll_s
    if polls > MAX_POLLS:
        return (
            f"{polls:.4g} polls ({total_s:g} s every {poll_s:g} s); at most {MAX_POLLS}: "
            "a longer poll_interval_s or a shorter scenario"
        )
    return None


def _num(
    source: str, key: str, v: Any, *, positive: bool = True, maximum: float | None = None
) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ScenarioError(source, key, f"must be a finite number (got {v!r})")
    if positive and v <= 0:
        raise ScenarioError(source, key, f"must be > 0 (got {v!r})")
    if maximum is not None and v > maximum:
        most = f"{maximum:.0f}" if maximum == int(maximum) else f"{maximum:g}"
        raise ScenarioError(source, key, f"must be <= {most} (got {v!r})")
    return float(v)


def _int(source: str, key: str, v: Any, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ScenarioError(source, key, f"must be an integer >= {minimum} (got {v!r})")
    if maximum is not None and v > maximum:
        raise ScenarioError(
            source, key, f"must be an integer between {minimum} and {maximum} (got {v!r})"
        )
    return int(v)


def _str(source: str, key: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ScenarioError(source, key, f"must be a non-empty string (got {v!r})")
    return v


def _unknown(source: str, prefix: str, data: Mapping[str, Any], known: set[str]) -> None:
    for k in data:
        if k not in known:
            raise ScenarioError(
                source, f"{prefix}{k}", f"unknown key (known: {', '.join(sorted(known))})"
            )


def _workloads(source: str, raw: Any) -> dict[str, Workload]:
    out = builtin_workloads()
    if raw is None:
        return out
    if not isinstance(raw, dict):
        raise ScenarioError(source, "workloads", "must be a table of [workloads.NAME] tables")
    for name, table in raw.items():
        key = f"workloads.{name}"
        if not isinstance(table, dict):
            raise ScenarioError(source, key, "must be a table")
        _unknown(source, f"{key}.", table, _WORKLOAD_KEYS)
        base = out.get(name)
        if base is None:
            for req in ("alpha", "output_tokens"):
                if req not in table:
                    raise ScenarioError(
                        source,
                        f"{key}.{req}",
                        "missing (required for a workload that is not built in)",
                    )
        kw: dict[str, float] = {}
        for k in _WORKLOAD_KEYS:
            if k in table:
                kw[k] = _num(
                    source,
                    f"{key}.{k}",
                    table[k],
                    positive=k not in ("alpha", "output_sigma"),
                    maximum=_WORKLOAD_MAX.get(k),
                )
        for k, lo in (("alpha", 0.0), ("output_sigma", 0.0)):
            if k in kw and kw[k] < lo:
                raise ScenarioError(source, f"{key}.{k}", f"must be >= {lo:g} (got {kw[k]:g})")
        try:
            out[name] = replace(base, **kw) if base is not None else Workload(name=name, **kw)
        except ValueError as exc:
            raise ScenarioError(source, key, str(exc)) from exc
    return out


def _scale_value(source: str, key: str, v: Any) -> tuple[float, float]:
    """A number (constant) or [from, to] (a linear ramp over the phase)."""
    if isinstance(v, list):
        if len(v) != 2:
            raise ScenarioError(source, key, f"a ramp is [from, to] (got {v!r})")
        return _num(source, f"{key}[0]", v[0]), _num(source, f"{key}[1]", v[1])
    x = _num(source, key, v)
    return x, x


def _phases(
    source: str, raw: Any, workloads: Mapping[str, Workload], repeat: int
) -> tuple[Phase, ...]:
    if not isinstance(raw, list) or not raw:
        raise ScenarioError(source, "phases", "at least one [[phases]] table is required")
    templates: list[dict[str, Any]] = []
    for i, ph in enumerate(raw):
        key = f"phases[{i}]"
        if not isinstance(ph, dict):
            raise ScenarioError(source, key, "must be a table")
        _unknown(source, f"{key}.", ph, _PHASE_KEYS)
        for req in ("duration_s", "concurrency", "workloads"):
            if req not in ph:
                raise ScenarioError(source, f"{key}.{req}", "missing")
        duration = _num(source, f"{key}.duration_s", ph["duration_s"], maximum=MAX_SCENARIO_S)
        conc = _int(source, f"{key}.concurrency", ph["concurrency"], minimum=0)
        mix_raw = ph["workloads"]
        if not isinstance(mix_raw, dict) or not mix_raw:
            raise ScenarioError(
                source, f"{key}.workloads", "must be a table such as { chat = 0.7, code = 0.3 }"
            )
        mix: dict[str, float] = {}
        for w, share in mix_raw.items():
            if w not in workloads:
                raise ScenarioError(
                    source,
                    f"{key}.workloads.{w}",
                    f"unknown workload (known: {', '.join(sorted(workloads))}; "
                    "define it in a [workloads.NAME] table)",
                )
            mix[w] = _num(source, f"{key}.workloads.{w}", share)
        total = sum(mix.values())
        mix = {k: v / total for k, v in mix.items()}
        verify = _scale_value(source, f"{key}.verify_cost_scale", ph.get("verify_cost_scale", 1.0))
        base = _scale_value(source, f"{key}.base_cost_scale", ph.get("base_cost_scale", 1.0))
        ramped = verify[0] != verify[1] or base[0] != base[1]
        if "ramp_steps" in ph:
            if not ramped:
                raise ScenarioError(
                    source, f"{key}.ramp_steps", "only with a [from, to] cost scale ramp"
                )
            steps = _int(
                source, f"{key}.ramp_steps", ph["ramp_steps"], minimum=2, maximum=MAX_RAMP_STEPS
            )
        else:
            steps = (
                min(MAX_RAMP_STEPS, max(2, round(duration / DEFAULT_RAMP_STEP_S))) if ramped else 1
            )
        label = ph.get("label")
        if label is not None:
            label = _str(source, f"{key}.label", label)
        templates.append(
            {
                "n": i,
                "label": label,
                "duration": duration,
                "conc": conc,
                "mix": mix,
                "verify": verify,
                "base": base,
                "steps": steps,
            }
        )
    where = "repeat" if repeat > 1 else "phases"
    total_s = repeat * math.fsum(tp["duration"] for tp in templates)
    too_long = _duration_problem(total_s)
    if too_long is not None:
        raise ScenarioError(source, where, too_long)
    n_phases = repeat * sum(tp["steps"] for tp in templates)
    if n_phases > MAX_PHASES:
        raise ScenarioError(
            source,
            where,
            f"{n_phases} sub-phases (phases x ramp steps x repeat); at most {MAX_PHASES}",
        )
    phases: list[Phase] = []
    t = 0.0
    for r in range(repeat):
        for tp in templates:
            steps = tp["steps"]
            for s in range(steps):
                # A ramp is played as `steps` constant sub-phases at their midpoints' scale.
                f = (s + 0.5) / steps
                v = tp["verify"][0] + (tp["verify"][1] - tp["verify"][0]) * f
                b = tp["base"][0] + (tp["base"][1] - tp["base"][0]) * f
                d = tp["duration"] / steps
                name = tp["label"] or str(tp["n"])
                if repeat > 1:
                    name = f"{name}#{r}"
                if steps > 1:
                    name = f"{name}.{s}"
                phases.append(
                    Phase(
                        index=len(phases),
                        label=name,
                        start_s=t,
                        duration_s=d,
                        concurrency=tp["conc"],
                        mix=tp["mix"],
                        verify_cost_scale=v,
                        base_cost_scale=b,
                    )
                )
                t += d
    return tuple(phases)


def _fleet_keys(source: str, raw: Mapping[str, Any]) -> tuple[int, float | None, bool | None]:
    """`replicas` (default 1: one server) and, only with replicas >= 2, the fleet's
    `max_unavailable_fraction` (in (0, 1], as [fleet]) and `canary` (true/false)."""
    replicas = _int(source, "replicas", raw.get("replicas", 1), minimum=1)
    frac, canary = raw.get("max_unavailable_fraction"), raw.get("canary")
    for key, v in (("max_unavailable_fraction", frac), ("canary", canary)):
        if v is not None and replicas < 2:
            raise ScenarioError(source, key, "only with replicas >= 2 (a fleet)")
    if frac is not None:
        frac = _num(source, "max_unavailable_fraction", frac)
        if frac > 1.0:
            raise ScenarioError(source, "max_unavailable_fraction", f"must be <= 1 (got {frac})")
    if canary is not None and not isinstance(canary, bool):
        raise ScenarioError(source, "canary", f"must be true or false (got {canary!r})")
    return replicas, frac, canary


def _is_path(profile: str) -> bool:
    """Whether `profile` names a profile file rather than a built-in profile."""
    p = Path(profile)
    return p.suffix == ".toml" or len(p.parts) > 1


def scenario_from_dict(
    raw: Mapping[str, Any], *, source: str = "<dict>", base_dir: Path | None = None
) -> Scenario:
    """Validate a parsed scenario document (see the module docstring). A relative profile
    file path is read from `base_dir` (the scenario file's directory) where it is there."""
    _unknown(source, "", raw, _TOP_KEYS)
    for req in ("name", "profile", "phases"):
        if req not in raw:
            raise ScenarioError(source, req, "missing")
    name = _str(source, "name", raw["name"])
    if any(c in name for c in ("/", "\\", "\0")):
        raise ScenarioError(
            source,
            "name",
            f"must not hold a path separator: it names the --png-dir file (got {name!r})",
        )
    if len(name.encode()) > MAX_NAME_BYTES:
        raise ScenarioError(
            source,
            "name",
            f"at most {MAX_NAME_BYTES} bytes: it names the --png-dir file "
            f"(got {len(name.encode())})",
        )
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise ScenarioError(source, "description", "must be a string")
    profile = _str(source, "profile", raw["profile"])
    overrides = raw.get("profile_overrides", {})
    if not isinstance(overrides, dict):
        raise ScenarioError(source, "profile_overrides", "must be a table")
    if base_dir is not None and _is_path(profile) and (base_dir / profile).is_file():
        profile = str(base_dir / profile)  # a profile file beside the scenario file
    try:
        load_profile(profile)
    except FileNotFoundError:
        raise ScenarioError(
            source,
            "profile",
            f"unknown simulator profile {profile!r} (built-in: {', '.join(builtin_profiles())})",
        ) from None
    except ValueError as exc:  # the profile file itself (its own file and key in the message)
        raise ScenarioError(source, "profile", str(exc)) from exc
    try:
        sim = load_profile(profile, overrides)
    except ValueError as exc:
        raise ScenarioError(source, "profile_overrides", str(exc)) from exc
    seed = _int(source, "seed", raw.get("seed", 0), minimum=0)
    poll = _num(source, "poll_interval_s", raw.get("poll_interval_s", 10.0))
    profiles_raw = raw.get("profiles", list(DEFAULT_PROFILES))
    if (
        not isinstance(profiles_raw, list)
        or not profiles_raw
        or not all(isinstance(p, str) for p in profiles_raw)
    ):
        raise ScenarioError(source, "profiles", "must be a non-empty list of profile names")
    if len(set(profiles_raw)) != len(profiles_raw):
        raise ScenarioError(source, "profiles", "names must be unique")
    for i, p in enumerate(profiles_raw):
        if p in (ADAPTIVE_PROFILE, HYBRID_PROFILE):
            raise ScenarioError(
                source,
                f"profiles[{i}]",
                f"{p} is a peer's own profile, not a candidate",
            )
        try:
            bench_profile(p)
        except ValueError as exc:
            raise ScenarioError(source, f"profiles[{i}]", str(exc)) from None
    initial = raw.get("initial_profile", "baseline")
    if initial not in profiles_raw:
        raise ScenarioError(
            source,
            "initial_profile",
            f"{initial!r} is not one of the profiles ({', '.join(profiles_raw)})",
        )
    mrr = raw.get("max_running_requests")
    if mrr is not None:
        mrr = _int(source, "max_running_requests", mrr, minimum=1)
    repeat = _int(source, "repeat", raw.get("repeat", 1), minimum=1, maximum=MAX_PHASES)
    kind = raw.get("kind")
    if kind is not None and kind not in SCENARIO_KINDS:
        raise ScenarioError(source, "kind", f"must be one of {', '.join(SCENARIO_KINDS)}")
    workloads = {k: _bench_workload(w) for k, w in _workloads(source, raw.get("workloads")).items()}
    phases = _phases(source, raw["phases"], workloads, repeat)
    polls = _size_problem(phases[-1].end_s, poll)
    if polls is not None:
        raise ScenarioError(source, "poll_interval_s", polls)
    replicas, max_unavailable, canary = _fleet_keys(source, raw)
    if kind is None:  # stationary where every phase has one set of conditions (repeat too)
        conditions = {
            (p.concurrency, tuple(sorted(p.mix.items())), p.verify_cost_scale, p.base_cost_scale)
            for p in phases
        }
        kind = "stationary" if len(conditions) == 1 else "changing"
    return Scenario(
        name=name,
        description=description,
        source=source,
        profile=profile,
        profile_overrides=dict(overrides),
        seed=seed,
        poll_interval_s=poll,
        initial_profile=initial,
        profiles=tuple(profiles_raw),
        phases=phases,
        workloads=workloads,
        max_running_requests=mrr,
        kind=kind,
        replicas=replicas,
        max_unavailable_fraction=max_unavailable,
        canary=canary,
        _sim=sim,
    )


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate one scenario file; ScenarioError names the file and the key."""
    p = Path(path)
    source = str(p)
    try:
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ScenarioError(source, "<file>", "not found") from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(
            source, "<file>", f"not UTF-8 text, so not TOML ({decode_problem(exc)})"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(source, "<file>", f"not valid TOML ({exc})") from exc
    except OSError as exc:
        raise ScenarioError(source, "<file>", f"cannot read it ({exc.strerror or exc})") from None
    return scenario_from_dict(raw, source=source, base_dir=p.parent)


def shipped_scenarios_dir() -> Path:
    """scenarios/ at the repository root (next to the controller package)."""
    return Path(__file__).resolve().parents[2] / "scenarios"


def scenario_files(directory: Path) -> list[Path]:
    """The scenario files (*.toml) in `directory`, sorted by name."""
    return sorted(directory.glob("*.toml"))


def shipped_scenarios() -> list[Path]:
    """The shipped scenario files, sorted by name."""
    return scenario_files(shipped_scenarios_dir())
