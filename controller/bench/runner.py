"""One bench run of one scenario: measurements, oracles, every policy's replay, the result rows.

Owns the order of work and which replays are shared (a static policy on the initial profile is
exactly the measurement replay of that profile: same seeds, no restart) and the policy names of
the report: `specpilot`, `oracle_dp`, `oracle_free`, `best_static`, `static:<profile>`,
`sglang_adaptive`, `vllm_batch_threshold`, `greedy`, `ucb`.
Must not: render (report.py) or parse arguments (cli.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from controller.bench import peers
from controller.bench.harness import Replay, replay
from controller.bench.metrics import Row, make_row
from controller.bench.oracles import Measurements, measure, oracle_dp, oracle_free, phase_rates
from controller.bench.scenario import Scenario

ORACLES = ("oracle_dp", "oracle_free")
PEERS = ("sglang_adaptive", "vllm_batch_threshold", "greedy", "ucb")
# specpilot with a hybrid profile (an adaptive profile whose table it writes): its own row,
# compared with specpilot and sglang_adaptive (issue 10), not one of specpilot's targets.
HYBRID = "specpilot_hybrid"
# The rows that replay a policy (the others are measured or computed).
ADAPTIVE = ("specpilot", HYBRID, *PEERS)


def policy_names(scenario: Scenario) -> list[str]:
    """Every row name this scenario has, in report order."""
    return [
        "specpilot",
        HYBRID,
        *ORACLES,
        "best_static",
        *(f"static:{p}" for p in scenario.profiles),
        *PEERS,
    ]


def make_policy(name: str, scenario: Scenario) -> peers.BenchPolicy:
    """A fresh policy of row `name` for `scenario` (one server or a fleet)."""
    factories: dict[str, Callable[[], peers.BenchPolicy]] = {
        "specpilot": lambda: peers.Specpilot(peers.user_settings(scenario.sim_profile())),
        HYBRID: lambda: peers.SpecpilotHybrid(
            scenario.max_running_requests, scenario.sim_profile()
        ),
        "sglang_adaptive": peers.sglang_adaptive,
        "vllm_batch_threshold": peers.BatchThreshold,
        "greedy": peers.Greedy,
        "ucb": peers.UCB,
    }
    return factories[name]()


@dataclass
class ScenarioResult:
    scenario: Scenario
    rows: list[Row]
    replays: dict[str, Replay]  # row name -> replay (oracles synthesised)
    measurements: Measurements
    wall_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # replay name -> seconds


def add_statics(
    scenario: Scenario,
    m: Measurements,
    reps: dict[str, Replay],
    timings: dict[str, float],
    say: Callable[[str], None],
    run_static: Callable[[str], Replay],
) -> None:
    """The `static:<profile>` replays (the initial profile's is its measurement replay: same
    seeds, no restart) and `best_static`, the one with the most tokens."""
    for p in scenario.profiles:
        name = f"static:{p}"
        if p == scenario.initial_profile:
            reps[name] = m.replays[p]
        else:
            say(f"{scenario.name}: {name}")
            reps[name] = run_static(p)
            timings[name] = reps[name].wall_s
    statics = [f"static:{p}" for p in scenario.profiles]
    best_static_name = max(statics, key=lambda n: reps[n].tokens)
    reps["best_static"] = reps[best_static_name]


def merge_rates(
    scenario: Scenario, m: Measurements, reps: Mapping[str, Replay], adaptive: Sequence[str]
) -> dict[str, np.ndarray]:
    """Measured rates: the candidates from their measurement runs, any other profile (an
    adaptive peer's) from the replays of the `adaptive` policies that ran it. Also set on `m`."""
    rates = dict(m.rates)
    extra = phase_rates(scenario, [r for n, r in reps.items() if n in adaptive])
    for p, r in extra.items():
        rates.setdefault(p, r)
    m.rates = rates
    return rates


def check_policies(
    scenario: Scenario, policies: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """(every row name of `scenario`, the rows asked for: all by default); ValueError naming
    an unknown one."""
    known = policy_names(scenario)
    wanted = list(known) if policies is None else list(policies)
    for w in wanted:
        if w not in known:
            raise ValueError(f"unknown policy {w!r} (known: {', '.join(known)})")
    return known, wanted


def make_rows(
    scenario: Scenario,
    known: Sequence[str],
    wanted: Sequence[str],
    reps: Mapping[str, Replay],
    rates: Mapping[str, np.ndarray],
    oracle_dp_tokens: float,
    finish: Callable[[Row, Replay], Row] = lambda row, _rep: row,
) -> list[Row]:
    """One row per wanted policy that ran, in report order; `finish` amends a row."""
    rows = []
    for name in known:
        if name not in wanted or name not in reps:
            continue
        rep = reps[name]
        row = make_row(
            scenario,
            rates,
            rep,
            policy=name,
            oracle_dp_tokens=oracle_dp_tokens,
            best_static_tokens=reps["best_static"].tokens,
            wall_s=rep.wall_s,
        )
        rows.append(finish(row, rep))
    return rows


def run_scenario(
    scenario: Scenario,
    policies: Sequence[str] | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> ScenarioResult:
    """Measure, compute the oracles, replay the selected policies (all by default; the static
    profiles and the oracles always, since every ratio needs them) and build the rows."""
    if scenario.replicas > 1:  # a fleet: the same rows, from fleet replays (bench/fleet.py)
        from controller.bench.fleet import run_fleet_scenario

        return run_fleet_scenario(scenario, policies, progress=progress)
    t0 = time.perf_counter()
    known, wanted = check_policies(scenario, policies)
    say = progress or (lambda _m: None)

    say(f"{scenario.name}: measuring {len(scenario.profiles)} profiles")
    m = measure(scenario)
    timings = {f"measure:{p}": r.wall_s for p, r in m.replays.items()}
    restart = scenario.restart_times()
    reps: dict[str, Replay] = {}
    free, dp = oracle_free(m), oracle_dp(m, restart)
    reps["oracle_free"], reps["oracle_dp"] = free.replay, dp.replay

    add_statics(scenario, m, reps, timings, say, lambda p: replay(scenario, peers.Static(p)))

    for name in ADAPTIVE:
        if name in wanted:
            say(f"{scenario.name}: {name}")
            reps[name] = replay(scenario, make_policy(name, scenario))
            timings[name] = reps[name].wall_s

    rates = merge_rates(scenario, m, reps, ADAPTIVE)
    rows = make_rows(scenario, known, wanted, reps, rates, dp.tokens)
    return ScenarioResult(
        scenario=scenario,
        rows=rows,
        replays=reps,
        measurements=m,
        wall_s=time.perf_counter() - t0,
        timings=timings,
    )
