"""`specpilot demo`: the whole loop against the built-in simulator, in accelerated time.

Owns the demo's script: a config equivalent to the shipped config.toml on free ports, the
simulator as the managed server, a closed-loop load through its HTTP API, two phases (one stream
of chat-like traffic where 2-step speculation pays, then 48 concurrent streams where it does not),
a live rich table, and a closing summary (tokens, switches, downtime, time per profile). It uses
the daemon's own composition (controller.daemon), nothing demo-specific inside the loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from controller.actuators.endpoint import free_port
from controller.daemon import build, database_path, serve
from controller.demo_server import SIM_PROFILE, demo_profiles, sim_common_flags
from controller.loop import Controller
from controller.numfmt import num
from controller.settings import Settings, settings_from_dict
from simulator.load import LoadGenerator
from store import Reader, StoreError


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float  # simulated seconds since the demo started
    concurrency: int
    mix: dict[str, float]


@dataclass
class DemoTrace:
    """What the demo saw, tick by tick, for the summary."""

    ticks: list[dict[str, Any]] = field(default_factory=list)


def demo_settings(*, speed: float, sim_port: int, db: Path, log_file: Path) -> Settings:
    """The shipped config.toml's shape, on the given port and speed."""
    base = {
        "controller": {
            "mode": "active",
            "poll_interval_s": 10.0,
            "database": str(db),
            "log_level": "warning",
            "time_scale": speed,
        },
        "api": {"enabled": True, "host": "127.0.0.1", "port": 0},
        "server": {
            "actuator": "process",
            "host": "127.0.0.1",
            "port": sim_port,
            "launch": ["{python}", "-m", "simulator"],
            "common_flags": sim_common_flags(speed),
            "initial_profile": "baseline",
            "owns_server": True,
            "log_file": str(log_file),
        },
        "profiles": demo_profiles(),
    }
    return settings_from_dict(base, source="demo")


def demo_phases(total_sim_s: float) -> list[Phase]:
    return [
        Phase("1 stream, chat", 0.0, 1, {"default": 1.0}),
        Phase("48 streams, chat", total_sim_s * 0.5, 48, {"default": 1.0}),
    ]


def _table(c: Controller, phase: Phase, elapsed_sim_s: float) -> Table:
    st = c.status()
    obs = st["observed"] or {}
    t = Table(
        title=f"specpilot demo · t={elapsed_sim_s / 60:.0f} sim-min · phase: {phase.name} · "
        f"running [bold]{st['profile']}[/bold]"
        + (" · [yellow]switching[/yellow]" if st["switch_in_flight"] else ""),
        caption=(
            f"observed {num(obs.get('output_tok_s'))} tok/s · batch {num(obs.get('running_reqs'))}"
            f" · accept len {num(obs.get('spec_accept_length'))}"
        ),
    )
    # Names and numbers are never cut (80 columns in a pipe): the source wraps instead.
    for col in ("profile", "pred\ntok/s", "interval", "accept\nlen", "break-\neven"):
        t.add_column(col, no_wrap=True)
    t.add_column("source", overflow="fold")
    for e in st["estimates"]:
        tok = e["tok_s"] or {}
        acc = e["accept_length"] or {}
        t.add_row(
            ("▶ " if e["profile"] == st["profile"] else "  ") + e["profile"],
            num(tok.get("mean")),
            f"{num(tok.get('low'))}–{num(tok.get('high'))}",
            num(acc.get("mean")),
            num(e["breakeven_accept_length"]),
            e["source"] or "",
        )
    d = st["last_decision"]
    if d:
        t.add_section()
        t.add_row("decision", d["action"], d["profile"], d["reason"], "", "")
    return t


async def _demo(
    duration_s: float, speed: float, port: int, db: Path | None, console: Console
) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="specpilot-demo-"))
    sim_port = port or free_port()
    settings = demo_settings(
        speed=speed, sim_port=sim_port, db=db or tmp / "demo.db", log_file=tmp / "server.log"
    )
    daemon = await build(settings)
    clock = daemon.controller.clock
    total_sim_s = duration_s * speed
    phases = demo_phases(total_sim_s)
    stop = asyncio.Event()
    trace = DemoTrace()
    t0 = clock.monotonic()
    load = LoadGenerator(
        settings.server.base_url, concurrency=phases[0].concurrency, mix=phases[0].mix
    )
    console.print(
        f"[bold]specpilot demo[/bold]: simulator profile {SIM_PROFILE} on :{sim_port}, "
        f"{speed:g}x time, {duration_s:g} s real = {total_sim_s / 3600:.1f} simulated hours; "
        f"database {settings.controller.database}; server log {settings.server.log_file}",
        soft_wrap=True,  # paths whole, to copy
    )
    live = Live(console=console, refresh_per_second=4, transient=False)

    def current_phase() -> Phase:
        el = clock.monotonic() - t0
        return [p for p in phases if p.start_s <= el][-1]

    def on_tick(c: Controller) -> None:
        ph = current_phase()
        obs = c.last_obs
        trace.ticks.append(
            {
                "t": clock.monotonic() - t0,
                "profile": c.running,
                "tok": obs.decode_tokens if obs and obs.t_s == c.last_decision.t_s else None,
                "phase": ph.name,
                "reason": c.last_decision.reason.value if c.last_decision else "",
            }
        )
        live.update(_table(c, ph, clock.monotonic() - t0))

    async def phase_driver() -> None:
        for ph in phases[1:]:
            while clock.monotonic() - t0 < ph.start_s and not stop.is_set():
                await asyncio.sleep(0.05)
            if stop.is_set():
                return
            load.set_concurrency(ph.concurrency)
            load.set_mix(ph.mix)
            console.log(f"phase change: {ph.name}")

    async def timer() -> None:
        await asyncio.sleep(duration_s)
        stop.set()

    with live:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(serve(daemon, stop=stop, on_tick=on_tick, install_signals=False))
            tg.create_task(_run_load_when_up(load, daemon.controller, stop))
            tg.create_task(phase_driver())
            tg.create_task(timer())
    console.line()  # the live table's last frame ends without one where output is not a terminal
    _summary(console, daemon, trace, load)
    return 0


async def _run_load_when_up(load: LoadGenerator, c: Controller, stop: asyncio.Event) -> None:
    while c.running is None and not stop.is_set():
        await asyncio.sleep(0.05)
    task = asyncio.create_task(load.run())
    await stop.wait()
    await load.stop()
    await task


def _summary(console: Console, daemon: Any, trace: DemoTrace, load: LoadGenerator) -> None:
    with Reader(database_path(daemon.settings)) as store:
        switches = list(reversed(store.switches(since_s=None, limit=1000)))
    tokens = sum(t["tok"] or 0.0 for t in trace.ticks)
    poll = daemon.settings.controller.poll_interval_s
    per_profile = Counter(t["profile"] for t in trace.ticks)
    t = Table(title="demo summary")
    t.add_column("what")
    t.add_column("value")
    t.add_row("output tokens (observed windows)", f"{tokens:,.0f}")
    t.add_row("switches", str(sum(1 for s in switches if s.get("from_profile"))))
    t.add_row(
        "downtime (sim s)",
        f"{sum(s.get('downtime_s') or 0.0 for s in switches if s.get('from_profile')):.0f}",
    )
    for p, n in sorted(per_profile.items(), key=lambda kv: -kv[1]):
        t.add_row(f"time in {p} (sim min)", f"{n * poll / 60:.1f}")
    stats = load.stats
    t.add_row("client requests ok / failed attempts", f"{stats.ok} / {stats.failed}")
    console.print(t)
    if stats.failed:
        console.print(
            "  failed attempts: requests refused or cut off while the one server restarted,"
            " retried by the clients (the fleet demo's rolling switch fails none)"
        )
    for s in switches:
        console.print(
            f"  switch {s.get('from_profile') or '(start)'} -> {s['to_profile']}: "
            f"{s['reason']} ({s['outcome']}, {s.get('downtime_s') or 0:.0f} s down)"
        )


def argument_problem(*, duration_s: float, speed: float, port: int, db: Path | None) -> str | None:
    """What is wrong with the demo's arguments, in one line, or None: checked before anything
    starts, so a bad one is a message, not a traceback from deep inside the daemon."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        return f"--duration-s must be > 0 and finite (got {duration_s})"
    if not (math.isfinite(speed) and speed > 0):
        return f"--speed must be > 0 and finite (got {speed})"
    if not 0 <= port <= 65535:
        return f"--port must be 0 (a free one) or a port in 1-65535 (got {port})"
    if port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                return (
                    f"--port {port}: cannot listen on 127.0.0.1:{port} ({e.strerror or e}); "
                    "pick a free port or 0"
                )
    if db is not None:
        if db.is_dir():
            return f"--db {db} is a directory, not a database file"
        parent = db.parent
        if parent.exists() and not parent.is_dir():
            return f"--db {db}: {parent} is not a directory"
        if not parent.is_dir():
            return f"--db {db}: directory {parent} does not exist"
        try:
            with tempfile.TemporaryFile(dir=parent, prefix=".specpilot-probe-"):
                pass
        except OSError as e:
            return f"--db {db}: cannot write in {parent} ({e.strerror or e})"
    return None


def run_demo(*, duration_s: float, speed: float, port: int, db: Path | None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    problem = argument_problem(duration_s=duration_s, speed=speed, port=port, db=db)
    if problem is not None:
        Console(stderr=True, soft_wrap=True).print(f"[red]specpilot demo:[/red] {escape(problem)}")
        return 2
    try:
        return asyncio.run(_demo(duration_s, speed, port, db, console))
    except StoreError as e:  # the database cannot be opened or written (checked above)
        Console(stderr=True, soft_wrap=True).print(f"[red]specpilot demo:[/red] {escape(str(e))}")
        return 1
