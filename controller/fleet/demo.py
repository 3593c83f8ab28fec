"""`specpilot demo --fleet N`: a router, N simulated replicas, load through the router, a canary,
a rolling switch, and the count of failed client requests.

Owns the demo's script: settings equivalent to the shipped config.toml with a [fleet] table on
free ports (`fleet_sim_settings`, also used by the tests), the FleetController driving the
replicas, a closed-loop LoadGenerator pointed at the router's URL, two phases of chat traffic (one
stream per replica, where speculation pays; then many, where it does not), a live rich table, and a
summary (tokens, canaries and their verdicts, replica cycles, failed requests). When the policy
has not asked for a canary by a quarter of the first phase, the demo asks for one itself (as an
operator would), so that every run shows a canary and a rolling switch. Nothing demo-specific
inside the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from controller.actuators.endpoint import free_ports
from controller.clock import ScaledClock
from controller.demo_server import SIM_PROFILE, demo_profiles, sim_common_flags
from controller.fleet.controller import FleetController
from controller.fleet.settings import FleetSettings
from controller.numfmt import num
from controller.settings import Settings, settings_from_dict
from simulator.load import LoadGenerator


def fleet_sim_settings(
    *,
    replicas: int,
    speed: float,
    workdir: Path,
    restart_s: float | None = None,
    router_url: str = "",
    router_extra_args: list[str] | None = None,
    profiles: dict[str, dict[str, Any]] | None = None,
    fleet_overrides: dict[str, Any] | None = None,
    poll_interval_s: float = 10.0,
    policy: dict[str, Any] | None = None,
) -> tuple[Settings, FleetSettings]:
    """Settings for N simulator replicas on free loopback ports and a router (launched, or
    adopted at `router_url`). `restart_s` shortens the simulated restart (--sim-override)."""
    flags = sim_common_flags(speed)
    if restart_s is not None:
        flags += ["--sim-override", f"restart_s={restart_s:g}"]
    # Replica ports and the router's, distinct (picked at once: see free_ports).
    *ports, router_port = free_ports(replicas + 1)
    settings = settings_from_dict(
        {
            "controller": {
                "mode": "active",
                "poll_interval_s": poll_interval_s,
                "database": str(workdir / "fleet.db"),
                "log_level": "warning",
                "time_scale": speed,
            },
            "api": {"enabled": False},
            "server": {
                "actuator": "process",
                "host": "127.0.0.1",
                "port": ports[0],
                "launch": ["{python}", "-m", "simulator"],
                "common_flags": flags,
                "initial_profile": "baseline",
                "owns_server": True,
                "log_file": str(workdir / "server.log"),
                "drain_timeout_s": 120.0,
                "start_timeout_s": 900.0,
            },
            "policy": policy or {},
            "profiles": profiles or demo_profiles(),
        },
        source="fleet demo",
    )
    router: dict[str, Any] = {
        "log_file": str(workdir / "router.log"),
        "extra_args": list(router_extra_args or []),
        "health_check_interval_s": 5.0,
    }
    if router_url:
        router["url"] = router_url
    else:
        router["port"] = router_port
    fleet = FleetSettings.model_validate(
        {"replicas": replicas, "ports": ports, "router": router, **(fleet_overrides or {})}
    )
    return settings, fleet


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float  # simulated seconds since the load began
    streams_per_replica: int


def _table(c: FleetController, phase: Phase, el_s: float, load: LoadGenerator) -> Table:
    st = c.status()
    t = Table(
        title=f"specpilot fleet demo · t={el_s / 60:.0f} sim-min · {phase.name} · deployment on "
        f"[bold]{st['profile']}[/bold]"
        + (" · [yellow]switching[/yellow]" if st["switch_in_flight"] else ""),
        caption=f"router {st['router']} · client requests ok {load.stats.ok} / failed "
        f"{load.stats.failed}",
    )
    for col in ("replica", "profile", "in router", "tok/s"):
        t.add_column(col)
    for r in st["replicas"]:
        t.add_row(
            r["name"],
            r["profile"] or "–",
            "no" if r["out_of_router"] else "yes",
            num(r["output_tok_s"]),
        )
    can = st["canary"]
    if can:
        v = can["verdict"] or {}
        t.add_section()
        t.add_row(
            "canary",
            f"{can['candidate']} vs {can['current']}",
            f"{can['windows']} windows",
            f"ratio {num(v.get('ratio'))} p={num(v.get('p_value'))}",
        )
    last = c.record.ticks[-1] if c.record.ticks else None
    if last:
        t.add_section()
        t.add_row("last", last.action, "", last.detail[:90])
    return t


def _stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGHUP (a closed terminal) end the demo as its timer does: replicas and
    router stopped, summary printed. Their default action would end the process at once and
    leave the router and replicas, in sessions of their own, running. (SIGINT already unwinds
    through KeyboardInterrupt.)"""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)


async def _demo(replicas: int, duration_s: float, speed: float, console: Console) -> int:
    stop = asyncio.Event()
    _stop_on_signals(stop)
    workdir = Path(tempfile.mkdtemp(prefix="specpilot-fleet-demo-"))
    settings, fleet = fleet_sim_settings(replicas=replicas, speed=speed, workdir=workdir)
    clock = ScaledClock(speed)
    total_sim_s = duration_s * speed
    phases = [
        Phase("1 stream per replica", 0.0, 1),
        Phase("24 streams per replica", total_sim_s * 0.6, 24),
    ]
    console.print(
        f"[bold]specpilot fleet demo[/bold]: sglang-router on {fleet.router.base_url}, "
        f"{replicas} simulator replicas ({SIM_PROFILE}) on ports {fleet.replica_ports()}, "
        f"{speed:g}x time, {duration_s:g} s real; files in {workdir}",
        soft_wrap=True,  # paths whole, to copy
    )
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        ctl = FleetController(settings, fleet, clock=clock, client=client)
        try:
            await ctl.startup()
        except RuntimeError as e:
            console.print(f"[red]fleet did not start: {e}[/red]")
            await ctl.shutdown()
            return 1
        load = LoadGenerator(
            fleet.router.base_url,
            concurrency=phases[0].streams_per_replica * replicas,
            mix={"chat": 1.0},
        )
        t0 = clock.monotonic()
        failed_during_switch = [0]

        def phase() -> Phase:
            el = clock.monotonic() - t0
            return [p for p in phases if p.start_s <= el][-1]

        live = Live(console=console, refresh_per_second=4, transient=False)

        def on_tick(c: FleetController) -> None:
            live.update(_table(c, phase(), clock.monotonic() - t0, load))

        async def driver() -> None:
            asked = False
            for ph in phases[1:]:
                while clock.monotonic() - t0 < ph.start_s and not stop.is_set():
                    await asyncio.sleep(0.05)
                    el = clock.monotonic() - t0
                    if (
                        not asked
                        and el > ph.start_s / 2
                        and not ctl.record.canaries
                        and ctl.canary is None
                    ):
                        # No canary yet: ask for one, as an operator would.
                        target = "eagle3-2step" if ctl.running != "eagle3-2step" else "baseline"
                        console.log(f"asking for a canary of {target}")
                        ctl.request_canary(target)
                        asked = True
                if stop.is_set():
                    return
                load.set_concurrency(ph.streams_per_replica * replicas)
                console.log(f"phase: {ph.name}")

        async def watch_failures() -> None:
            # Client failures while any replica is out of the router (a switch in progress).
            last = load.stats.failed
            while not stop.is_set():
                await asyncio.sleep(0.02)
                if load.stats.failed > last and ctl.busy:
                    failed_during_switch[0] += load.stats.failed - last
                last = load.stats.failed

        async def timer() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=duration_s)
            stop.set()

        async def run_load() -> None:
            if stop.is_set():
                return  # stopped during the start-up: no load to run
            task = asyncio.create_task(load.run())
            # Let run() begin: it clears its stop flag on entry, so a stop() before that (a
            # signal now) would be lost and run() would never end.
            await asyncio.sleep(0)
            await stop.wait()
            await load.stop()
            await task

        try:
            with live:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(ctl.run(stop, on_tick))
                    tg.create_task(run_load())
                    tg.create_task(driver())
                    tg.create_task(watch_failures())
                    tg.create_task(timer())
        finally:
            await ctl.shutdown()
        console.line()  # the live table's last frame ends without one off a terminal
        _summary(console, ctl, load, failed_during_switch[0])
    return 0


def _summary(console: Console, c: FleetController, load: LoadGenerator, failed_switch: int) -> None:
    t = Table(title="fleet demo summary")
    t.add_column("what")
    t.add_column("value")
    t.add_row("output tokens (client side)", f"{load.stats.output_tokens:,}")
    t.add_row("client requests ok / failed", f"{num(load.stats.ok)} / {num(load.stats.failed)}")
    t.add_row("failed while a replica was out", str(failed_switch))
    t.add_row("deployment profile at the end", str(c.running))
    for can in c.record.canaries:
        v = can.verdict
        t.add_row(
            f"canary {can.candidate} vs {can.current}",
            f"{can.outcome}: {v.summary() if v else '-'}",
        )
    cycles = c.actuator.log.cycles
    t.add_row("replica restarts", str(len(cycles)))
    if cycles:
        t.add_row(
            "longest time out of the router (sim s)",
            f"{max(cy.out_of_router_s for cy in cycles):.0f}",
        )
    console.print(t)
    for cy in cycles:
        console.print(
            f"  {cy.replica}: {cy.from_profile} -> {cy.to_profile} {cy.outcome}, out of the router "
            f"{cy.out_of_router_s:.0f} s (drain {cy.drain_s:.0f} s, restart {cy.downtime_s:.0f} s)"
        )


def run_fleet_demo(replicas: int, duration_s: float, speed: float) -> int:
    """`specpilot demo --fleet N`: exit status 0, 2 for bad arguments."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    if replicas < 2:
        console.print("[red]--fleet needs at least 2 replicas (a canary and a control)[/red]")
        return 2
    if duration_s <= 0 or speed <= 0:
        console.print("[red]--duration-s and --speed must be > 0[/red]")
        return 2
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        console.print("[red]fleet mode needs sglang-router: pip install 'specpilot[fleet]'[/red]")
        return 2
    return asyncio.run(_demo(replicas, duration_s, speed, console))
