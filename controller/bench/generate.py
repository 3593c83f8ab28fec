"""Random benchmark days in the documented scenario format: the check on scenarios nobody tuned for.

Owns the generator behind `specpilot generate-scenarios`: from a seed, N scenario files a user
could have written (scenarios/README.md), each a day drawn from the built-in simulator profiles,
workloads and the ranges below, written as TOML for `specpilot bench --scenario DIR`. The same
seed writes the same files (stdlib `random.Random`, one stream per seed, drawn in a fixed order),
so a result measured on them is reproducible from the seed alone.
Must not: run a replay (the bench does) or read the policy's settings (the days are drawn
blind to them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from simulator.model import builtin_profiles

# The built-in workloads a phase's mix is drawn from (simulator.model.builtin_workloads), in the
# order draws index them: changing it changes every seed's days.
WORKLOADS: tuple[str, ...] = ("chat", "code", "math", "default")
# EAGLE-3 chains a day compares besides the baseline: two or three distinct step counts in 1-7.
CHAIN_STEPS = range(1, 8)
CHAINS_PER_DAY = (2, 3)
POLL_INTERVALS_S = (5.0, 10.0, 10.0, 15.0, 30.0)
FLEET_SHARE = 0.2  # days served by 2-4 replicas behind a router
FLEET_REPLICAS = (2, 3, 4)
RESTART_OVERRIDE_SHARE = 0.3  # days whose restart time is not the profile's own
RESTARTS_S = (30, 60, 120, 300, 600, 900)
PHASES = (1, 7)  # phases per day, inclusive
# A phase lasts one of these, times a factor in PHASE_JITTER: bursts of minutes to 12-hour shifts.
PHASE_S = (300, 900, 1800, 3600, 7200, 14400, 28800)
PHASE_JITTER = (0.5, 1.5)
CONCURRENCY = (1, 1, 2, 4, 8, 16, 32, 64)
WORKLOAD_SHARE = (0.2, 1.0)  # each workload's weight in a phase's mix (normalised when loaded)
# A phase's system state: a constant verify-cost scale (a later boot), or a ramp from 1.0 (a
# drift within the phase), or neither.
CONSTANT_SCALE_SHARE = 0.15
CONSTANT_SCALE = (1.1, 2.0)
RAMP_SHARE = 0.15
RAMP_TO = (0.6, 1.8)
# At most this many days per call: each is a file, and a replay of minutes.
MAX_COUNT = 10_000


@dataclass(frozen=True)
class GeneratedScenario:
    """One drawn day: its file name and the TOML document."""

    filename: str
    document: dict[str, Any]

    def toml(self) -> str:
        return tomli_w.dumps(self.document)


def generate(seed: int, count: int) -> list[GeneratedScenario]:
    """`count` days drawn from `seed`, named r<seed>-<i> (i zero-padded to two digits)."""
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"count must be at least 1 and at most {MAX_COUNT}, got {count}")
    rng = random.Random(seed)
    sims = builtin_profiles()
    return [_day(rng, sims, f"r{seed}-{i:02d}") for i in range(count)]


def _day(rng: random.Random, sims: list[str], name: str) -> GeneratedScenario:
    sim = rng.choice(sims)
    steps = sorted(rng.sample(CHAIN_STEPS, rng.choice(CHAINS_PER_DAY)))
    profiles = ["baseline", *(f"eagle3-{s}step" for s in steps)]
    initial = rng.choice(profiles)
    doc: dict[str, Any] = {
        "name": name,
        "profile": sim,
        "seed": rng.randint(1, 99999),
        "poll_interval_s": rng.choice(POLL_INTERVALS_S),
        "initial_profile": initial,
        "profiles": profiles,
    }
    if rng.random() < FLEET_SHARE:
        doc["replicas"] = rng.choice(FLEET_REPLICAS)
    if rng.random() < RESTART_OVERRIDE_SHARE:
        doc["profile_overrides"] = {"restart_s": rng.choice(RESTARTS_S)}
    doc["phases"] = [_phase(rng) for _ in range(rng.randint(*PHASES))]
    return GeneratedScenario(f"{name}.toml", doc)


def _phase(rng: random.Random) -> dict[str, Any]:
    duration = int(rng.choice(PHASE_S) * rng.uniform(*PHASE_JITTER))
    concurrency = rng.choice(CONCURRENCY)
    names = rng.sample(WORKLOADS, rng.randint(1, 2))
    phase: dict[str, Any] = {
        "duration_s": duration,
        "concurrency": concurrency,
        "workloads": {w: round(rng.uniform(*WORKLOAD_SHARE), 2) for w in names},
    }
    u = rng.random()
    if u < CONSTANT_SCALE_SHARE:
        phase["verify_cost_scale"] = round(rng.uniform(*CONSTANT_SCALE), 2)
    elif u < CONSTANT_SCALE_SHARE + RAMP_SHARE:
        phase["verify_cost_scale"] = [1.0, round(rng.uniform(*RAMP_TO), 2)]
    return phase


def write(scenarios: list[GeneratedScenario], out_dir: Path, *, force: bool = False) -> list[Path]:
    """Write each scenario to `out_dir` (created); refuses, before writing any, to replace an
    existing file unless `force`. Returns the paths written."""
    paths = [out_dir / sc.filename for sc in scenarios]
    if not force:
        existing = [p for p in paths if p.exists()]
        if existing:
            raise FileExistsError(
                f"{existing[0]} exists ({len(existing)} of the {len(paths)} files would be "
                "replaced); choose another directory or pass --force"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    for sc, p in zip(scenarios, paths, strict=True):
        p.write_text(sc.toml())
    return paths
