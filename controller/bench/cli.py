"""The `specpilot bench` and `specpilot generate-scenarios` commands (typer command functions
the main CLI registers).

Owns argument handling and friendly errors: a bad scenario file names the file and the key and
exits 2; a --scenario directory expands to its *.toml files; an unknown --policy lists the
known ones; generate-scenarios never replaces a file unasked. Everything else is delegated:
runner (the work), report (tables, JSON, PNG), generate (the random days).
Must not: contain bench logic.

Register it with `app.command("bench")(controller.bench.cli.bench)`; `python -m controller.bench`
runs it stand-alone.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from controller.bench.generate import MAX_COUNT
from controller.bench.outputs import check_output_dir, check_output_file
from controller.bench.report import plot_scenario, print_results, write_json
from controller.bench.runner import ScenarioResult, run_scenario
from controller.bench.scenario import (
    Scenario,
    ScenarioError,
    load_scenario,
    scenario_files,
    shipped_scenarios,
)

# CI-short mode without a flag: every phase duration is multiplied by this (e.g. 0.1).
HOURS_SCALE_ENV = "SPECPILOT_BENCH_HOURS_SCALE"


def scenario_paths(given: list[Path]) -> list[Path]:
    """The scenario files `--scenario` names: a file as given, a directory as every *.toml in
    it (sorted), each file once. ScenarioError for a path that is neither, or a directory
    without one."""
    out: list[Path] = []
    for p in given:
        if p.is_dir():
            found = scenario_files(p)
            if not found:
                raise ScenarioError(str(p), "--scenario", "directory holds no *.toml file")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise ScenarioError(str(p), "--scenario", "no such file or directory")
    seen: set[Path] = set()
    return [p for p in out if not (p.resolve() in seen or seen.add(p.resolve()))]


def check_unique_names(scenarios: list[Scenario]) -> None:
    """ScenarioError when two files give the same `name`: it keys their rows and PNG files."""
    first: dict[str, str] = {}
    for sc in scenarios:
        if sc.name in first:
            raise ScenarioError(
                sc.source,
                "name",
                f"{sc.name!r} is also the name of {first[sc.name]}: a name keys the results "
                "(JSON rows, the PNG file); rename one",
            )
        first[sc.name] = sc.source


def generate_scenarios(
    out_dir: Annotated[Path, typer.Argument(help="Directory the files are written to.")],
    seed: Annotated[int, typer.Option(help="Seed: the same seed writes the same days.")] = 0,
    count: Annotated[
        int, typer.Option(min=1, max=MAX_COUNT, help=f"How many days (at most {MAX_COUNT}).")
    ] = 30,
    force: Annotated[
        bool, typer.Option("--force", help="Replace files of the same names.")
    ] = False,
) -> None:
    """Write COUNT random days in the scenario format (r<seed>-<i>.toml): built-in simulator
    profiles, 2-3 EAGLE-3 chains and baseline, fleets, restart times, traffic and verify-cost
    changes, drawn blind to specpilot's settings. Replay them with
    `specpilot bench --scenario OUT_DIR`."""
    from controller.bench.generate import generate, write

    err = Console(stderr=True, soft_wrap=True)
    try:
        paths = write(generate(seed, count), out_dir, force=force)
    except OSError as e:  # a file in the way (then nothing was written), or no permission
        err.print(f"[red]specpilot generate-scenarios:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    typer.echo(f"wrote {len(paths)} scenarios to {out_dir}")


def png_name(scenario: Scenario) -> str:
    """The PNG file name of a scenario in --png-dir: `<name>.png` (the loader refuses names with
    a path separator; one built in code has them replaced, so it cannot write outside the
    directory either)."""
    name = scenario.name
    for sep in ("/", "\\", "\0"):
        name = name.replace(sep, "_")
    return f"{name}.png"


def _run_one(args: tuple[Scenario, list[str] | None]) -> ScenarioResult:
    scenario, policies = args
    return run_scenario(scenario, policies)


def bench(
    scenario: Annotated[
        list[Path] | None,
        typer.Option(
            "--scenario",
            "-s",
            help="Scenario TOML file, or a directory: every *.toml in it (repeatable). "
            "Default: every shipped scenario in scenarios/.",
        ),
    ] = None,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="Write the results: one object per scenario and policy."),
    ] = None,
    png_dir: Annotated[
        Path | None,
        typer.Option("--png-dir", help="Write one PNG per scenario (tok/s, profiles, phases)."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            "-p",
            help="Only these rows (repeatable): specpilot, specpilot_hybrid, oracle_dp, "
            "oracle_free, best_static, static:<profile>, sglang_adaptive, vllm_batch_threshold, "
            "greedy, ucb. The oracles and static profiles are always computed (the ratios need "
            "them).",
        ),
    ] = None,
    hours_scale: Annotated[
        float | None,
        typer.Option(
            "--hours-scale",
            help=f"Multiply every phase duration (CI-short mode, e.g. 0.1). Default: "
            f"${HOURS_SCALE_ENV} or 1.",
        ),
    ] = None,
    timing: Annotated[
        bool, typer.Option("--timing", help="Print the wall time of every replay.")
    ] = False,
    jobs: Annotated[
        int, typer.Option("--jobs", "-j", min=1, help="Scenarios run in parallel processes.")
    ] = 1,
    check: Annotated[
        bool,
        typer.Option("--check", help="Exit 1 when specpilot misses any of the issue's targets."),
    ] = False,
) -> None:
    """Replay scenarios in virtual time: specpilot against every static profile, the best static
    in hindsight, SGLang adaptive, a vLLM-style batch threshold, greedy, UCB and the two oracles."""
    # Wide enough for the table when stdout is not a terminal (CI logs, pipes).
    console = Console(width=None if Console().is_terminal else 132)
    err = Console(stderr=True, soft_wrap=True)
    try:
        paths = scenario_paths(scenario) if scenario else shipped_scenarios()
    except ScenarioError as e:
        err.print(f"[red]specpilot bench:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    if not paths:
        err.print("[red]specpilot bench:[/red] no scenario files given and none shipped")
        raise typer.Exit(2)
    scale = hours_scale
    if scale is None:
        env = os.environ.get(HOURS_SCALE_ENV)
        try:
            scale = float(env) if env else 1.0
        except ValueError:
            err.print(f"[red]specpilot bench:[/red] ${HOURS_SCALE_ENV}={env!r} is not a number")
            raise typer.Exit(2) from None
    try:
        scenarios = [load_scenario(p).scaled(scale) for p in paths]
        check_unique_names(scenarios)
    except ScenarioError as e:
        err.print(f"[red]specpilot bench:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    except ValueError as e:  # a bad --hours-scale
        err.print(f"[red]specpilot bench:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    policies = list(policy) if policy else None
    work: list[tuple[Scenario, list[str] | None]] = [(sc, policies) for sc in scenarios]
    if policies is not None:
        from controller.bench.runner import policy_names

        names = {sc.name: policy_names(sc) for sc in scenarios}
        anywhere = {n for ns in names.values() for n in ns}
        unknown = [p for p in policies if p not in anywhere]
        if unknown:
            known = sorted(anywhere)
            err.print(
                f"[red]specpilot bench:[/red] unknown policy {unknown[0]!r} "
                f"(known: {', '.join(known)})"
            )
            raise typer.Exit(2)
        # A row some scenarios do not have (a static:<profile> of another profile set) is left
        # out there.
        work = []
        for sc in scenarios:
            mine = [p for p in policies if p in names[sc.name]]
            for p in policies:
                if p not in mine:
                    err.print(
                        f"specpilot bench: {escape(sc.name)} has no {escape(repr(p))} row; "
                        "left out there"
                    )
            work.append((sc, mine))
    scenarios = [sc for sc, _ in work]
    # Before minutes of replay: an output that cannot be written would lose them.
    for problem in (
        check_output_file(json_out, "--json") if json_out is not None else None,
        check_output_dir(png_dir, "--png-dir") if png_dir is not None else None,
    ):
        if problem is not None:
            err.print(f"[red]specpilot bench:[/red] {escape(problem)}")
            raise typer.Exit(2)
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_run_one, work))
    else:
        results = []
        for sc, wanted in work:
            with console.status(f"replaying {escape(sc.name)}"):
                results.append(run_scenario(sc, wanted))
    missed = print_results(results, console, timing=timing)
    try:
        if json_out is not None:
            write_json(results, json_out)
            console.print(f"wrote {escape(str(json_out))}")
        if png_dir is not None:
            for res in results:
                out = png_dir / png_name(res.scenario)
                plot_scenario(res, out)
                console.print(f"wrote {escape(str(out))}")
    except OSError as e:  # checked above; the disk filled up or the path changed since
        err.print(f"[red]specpilot bench:[/red] cannot write the results: {escape(str(e))}")
        raise typer.Exit(1) from None
    if check and missed:
        raise typer.Exit(1)


def main() -> None:
    typer.run(bench)
