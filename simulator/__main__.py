"""`python -m simulator ...`: launch a simulated SGLang 0.5.23 server.

Owns the process lifecycle: resolve flags (exit 2 on argparse errors, exit 1 on what SGLang
refuses, both before any port is bound), load the profile, wait the profile's restart time
(weights, CUDA graphs) divided by --sim-speed with the port closed, bind, run the warmup with
/health answering 503, serve, and on SIGTERM drain as SGLang does (health 503, in-flight requests
finish while new ones are still accepted, then exit 0). Faults from --sim-fault-* hook in here.
Must not: hold simulation logic (simulator.server) or flag rules (simulator.flags).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import uvicorn

from simulator.engine import StepEngine
from simulator.faults import START_FAIL_EXIT_CODE, Faults, crash_after
from simulator.flags import FlagError, ServerArgs, parse_args, spec_config
from simulator.metrics import SimMetrics
from simulator.model import (
    CostScale,
    SimProfile,
    SpecConfig,
    Workload,
    builtin_workloads,
    startup_times,
)
from simulator.model import load_profile as load_sim_profile
from simulator.server import SIGTERM_POLL_S, Simulation, create_app

logger = logging.getLogger("simulator")

DEVICE_TIMER_ENV = "SGLANG_ENABLE_METRICS_DEVICE_TIMER"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: SIGTERM is ours (SGLang's drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_workloads(args: ServerArgs) -> dict[str, Workload]:
    """Built-in workloads plus --sim-workload definitions (missing fields from "default")."""
    workloads = dict(builtin_workloads())
    base = workloads["default"]
    for name, fields in args.sim_workloads.items():
        workloads[name] = replace(base, name=name, **fields)
    return workloads


def cuda_graph_split(spec: SpecConfig, graphs_s: float) -> dict[str, float]:
    """Capture time by graph phase: the target's decode graphs without speculation, its
    target_verify graphs with it (the draft's share is not modelled separately)."""
    phase = "target_verify" if spec.speculative else "decode"
    return {phase: graphs_s}


async def serve(
    args: ServerArgs,
    profile: SimProfile,
    spec: SpecConfig,
    workloads: Mapping[str, Workload],
    faults: Faults,
    *,
    device_timer: bool = False,
) -> int:
    phases = profile.restart_phases_s(spec)
    speed = args.sim_speed
    logger.info(
        "Load weight begin. profile=%s spec=%s restart phases (simulated s)=%s",
        profile.name,
        spec,
        phases,
    )
    if faults.hang_start:
        logger.warning("simulated fault: startup hangs (--sim-fault-hang-start)")
        await asyncio.Event().wait()
    await asyncio.sleep(phases["load"] / speed)
    if faults.start_fail:
        logger.error(
            "simulated fault: RuntimeError: CUDA out of memory while capturing CUDA graphs "
            "(--sim-fault-start-fail)"
        )
        return START_FAIL_EXIT_CODE
    await asyncio.sleep(phases["cuda_graph"] / speed)

    scale = CostScale(**args.sim_cost_scale)
    metrics = SimMetrics(args, device_timer=device_timer)
    max_running = (
        args.max_running_requests
        if args.max_running_requests is not None
        else profile.max_running_requests(spec)
    )

    def engine_for(dp_rank: int) -> StepEngine:
        return StepEngine(
            profile,
            spec,
            workloads,
            seed=args.sim_seed + dp_rank,
            max_running_requests=max_running,
            scale=scale,
        )

    startup = startup_times(phases)
    graphs = cuda_graph_split(spec, phases["cuda_graph"])
    sim = Simulation(
        args,
        profile,
        spec,
        engine_for,
        metrics,
        faults=faults,
        startup_phases={**startup, "cuda_graph": graphs},
    )
    if args.enable_metrics:
        metrics.emit_startup(startup, graphs)
        metrics.emit_constants(sim.kv_capacity, args.context_length)
    app = create_app(sim)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()

    async def drain() -> None:
        logger.warning("SIGTERM received. Draining requests and shutting down...")
        poll = min(max(SIGTERM_POLL_S / speed, 0.02), SIGTERM_POLL_S)
        while sim.in_flight > 0:
            logger.info("Gracefully exiting... Remaining number of requests %d.", sim.in_flight)
            await asyncio.sleep(poll)
        sim.close()
        server.should_exit = True

    drain_task: asyncio.Task[None] | None = None

    def on_sigterm() -> None:
        nonlocal drain_task
        if sim.draining:
            return
        sim.draining = True
        drain_task = asyncio.create_task(drain())

    def on_sigint() -> None:
        server.should_exit = True  # Ctrl-C: stop now, no drain

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    loop.add_signal_handler(signal.SIGINT, on_sigint)

    async def warmup() -> None:
        while not server.started:
            await asyncio.sleep(0.005)
        logger.info("The server is fired up and ready to roll! (warmup %.1f s)", phases["warmup"])
        await asyncio.sleep(phases["warmup"] / speed)
        sim.mark_up()
        logger.info("warmup done; serving")

    decode = asyncio.create_task(sim.run())
    warm = asyncio.create_task(warmup())
    crash = (
        asyncio.create_task(crash_after(faults.crash_after_s))
        if faults.crash_after_s is not None
        else None
    )
    try:
        await server.serve()
    finally:
        sim.stop()
        for task in (warm, crash, drain_task):
            if task is not None:
                task.cancel()
        await decode
    if not server.started:
        return 1  # bind failed (uvicorn logged why)
    logger.info("simulated %d decode cycles; exit", sim.steps_total)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"
    )
    try:
        args = parse_args(argv)
    except FlagError as e:
        print(f"ValueError: {e}", file=sys.stderr)
        return 1
    logging.getLogger().setLevel(args.log_level.upper())
    for warning in args.warnings:
        logger.warning(warning)
    try:
        profile = load_sim_profile(args.sim_profile, args.sim_overrides or None)
        spec = spec_config(args)
        workloads = build_workloads(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ValueError: {e}", file=sys.stderr)
        return 1
    device_timer = os.environ.get(DEVICE_TIMER_ENV, "").lower() in ("1", "true", "yes")
    faults = Faults.from_flags(args.faults, spec)
    return asyncio.run(serve(args, profile, spec, workloads, faults, device_timer=device_timer))


if __name__ == "__main__":
    sys.exit(main())
