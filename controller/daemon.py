"""The daemon's composition root and lifecycle owner.

Owns wiring (settings -> store, clock, HTTP client, actuator, controller, API) and one asyncio
TaskGroup running the control loop, the embedded uvicorn server (its own signal handling off)
and the systemd watchdog. Signals: SIGTERM/SIGINT finish the tick and stop cleanly (the server
keeps running unless the config says the controller owns it); SIGHUP reloads config.toml between
ticks (an invalid file is rejected with a message and the old config stays). systemd: READY=1
after migrations, config and the first good scrape; WATCHDOG=1 per tick; STATUS= with the profile
and last decision; STOPPING=1 on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from controller import notify
from controller.actuators import make_actuator
from controller.api import create_app
from controller.clock import Clock, ScaledClock
from controller.loop import Controller
from controller.metrics import ControllerMetrics
from controller.settings import ConfigError, Settings, load_settings
from store import Store

log = logging.getLogger("specpilot.daemon")


def database_path(settings: Settings) -> Path:
    """Relative database paths live under $STATE_DIRECTORY when systemd provides it."""
    p = Path(settings.controller.database)
    state_dir = os.environ.get("STATE_DIRECTORY")
    if not p.is_absolute() and state_dir:
        p = Path(state_dir.split(":")[0]) / p
    return p


def setup_logging(level: str) -> None:
    """journald adds its own timestamps: under systemd (JOURNAL_STREAM set) print none."""
    under_journal = bool(os.environ.get("JOURNAL_STREAM"))
    fmt = (
        "%(levelname)s %(name)s: %(message)s"
        if under_journal
        else ("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


@dataclass
class Daemon:
    """A running specpilot: the pieces a test or the demo may want to reach."""

    config_path: Path | None
    settings: Settings
    controller: Controller
    store: Store
    client: httpx.AsyncClient
    api_server: uvicorn.Server | None = None

    @property
    def api_port(self) -> int | None:
        srv = self.api_server
        if srv is None or not srv.started:
            return None
        for s in srv.servers:
            for sock in s.sockets:
                return int(sock.getsockname()[1])
        return None


async def build(
    settings: Settings,
    *,
    config_path: Path | None = None,
    clock: Clock | None = None,
    db_path: Path | None = None,
) -> Daemon:
    clock = clock or ScaledClock(settings.controller.time_scale)
    store = Store(db_path or database_path(settings))
    client = httpx.AsyncClient(timeout=settings.controller.scrape_timeout_s, trust_env=False)
    actuator = make_actuator(settings, clock, client)
    controller = Controller(
        settings,
        clock=clock,
        store=store,
        actuator=actuator,
        client=client,
        metrics=ControllerMetrics(settings.profiles),
    )
    return Daemon(config_path, settings, controller, store, client)


def _status_line(c: Controller) -> str:
    d = c.last_decision
    last = f"{d.action.value} {d.profile} ({d.reason.value})" if d else "none"
    return f"profile={c.running} mode={c.mode.value} last={last}"


async def serve(
    daemon: Daemon,
    *,
    stop: asyncio.Event | None = None,
    on_tick: Callable[[Controller], None] | None = None,
    install_signals: bool = True,
) -> int:
    """Run until SIGTERM/SIGINT (or `stop`). Returns the exit code."""
    stop = stop or asyncio.Event()
    ctl = daemon.controller
    loop = asyncio.get_running_loop()
    reload_requested = asyncio.Event()
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload_requested.set)

    await ctl.startup()
    settings = daemon.settings
    if settings.api.enabled:
        app = create_app(ctl, settings.api_token())
        config = uvicorn.Config(
            app,
            host=settings.api.host,
            port=settings.api.port,
            log_level="warning",
            lifespan="off",
        )
        daemon.api_server = uvicorn.Server(config)
        # The TaskGroup owns signals; uvicorn must not install its own handlers.
        daemon.api_server.install_signal_handlers = lambda: None  # type: ignore[method-assign]

    ready_sent = False
    last_tick = [ctl.clock.monotonic()]
    poll_s = settings.controller.poll_interval_s

    def healthy() -> bool:
        # The loop ticked recently, or a switch (which holds a tick for minutes) is in flight.
        stale = (
            ctl.clock.monotonic() - last_tick[0] > 3 * poll_s + settings.controller.scrape_timeout_s
        )
        return ctl.funnel.busy or not stale

    def after_tick(c: Controller) -> None:
        nonlocal ready_sent
        if c.ready and not ready_sent:
            notify.notify("READY=1")
            ready_sent = True
        last_tick[0] = c.clock.monotonic()
        notify.notify(f"STATUS={_status_line(c)}")
        if reload_requested.is_set():
            reload_requested.clear()
            _reload(daemon)
        if on_tick is not None:
            on_tick(c)

    async def api_task() -> None:
        if daemon.api_server is not None:
            await daemon.api_server.serve()

    try:
        async with asyncio.TaskGroup() as tg:
            watchdog = tg.create_task(notify.watchdog_task(healthy))

            async def stopper() -> None:
                await stop.wait()
                watchdog.cancel()
                if daemon.api_server is not None:
                    daemon.api_server.should_exit = True

            tg.create_task(ctl.run(stop, after_tick))
            tg.create_task(api_task())
            tg.create_task(stopper())
    finally:
        notify.notify("STOPPING=1")
        with contextlib.suppress(Exception):
            if settings.server.owns_server:
                await ctl.actuator.shutdown()
        await daemon.client.aclose()
        daemon.store.close()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
    return 0


def _reload(daemon: Daemon) -> None:
    """SIGHUP: re-read config.toml; apply what can change between ticks, keep the old on error."""
    if daemon.config_path is None:
        return
    notify.notify("RELOADING=1")
    try:
        new = load_settings(daemon.config_path)
    except ConfigError as e:
        log.error("reload rejected, keeping the old configuration:\n%s", e)
        notify.notify("READY=1")
        return
    ctl = daemon.controller
    if set(new.profiles) != set(daemon.settings.profiles) or new.server != daemon.settings.server:
        log.warning(
            "reload: [server] and the profile set take effect at the next start of specpilot; "
            "applied: [controller].mode, poll_interval_s, [policy], profile flags/env"
        )
    from controller.settings import policy_settings

    ctl.psettings = policy_settings(new)
    ctl.settings = new.model_copy(update={"server": daemon.settings.server})
    daemon.settings = ctl.settings
    log.info("configuration reloaded from %s", daemon.config_path)
    notify.notify("READY=1")


def run_daemon(config_path: Path) -> int:
    """`specpilot run --config FILE`."""
    try:
        settings = load_settings(config_path)
    except ConfigError as e:
        print(f"specpilot: {e}", file=sys.stderr)
        from controller.settings import EXIT_CONFIG

        return EXIT_CONFIG
    setup_logging(settings.controller.log_level)

    async def main() -> int:
        daemon = await build(settings, config_path=config_path)
        return await serve(daemon)

    try:
        return asyncio.run(main())
    except RuntimeError as e:
        log.error("%s", e)
        return 1
