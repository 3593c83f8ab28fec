"""The daemon's composition root and lifecycle owner.

Owns wiring (settings -> store, clock, HTTP client, actuator, controller, API) and one asyncio
TaskGroup running the control loop, the embedded uvicorn server (its own signal handling off)
and the systemd watchdog. Start-up order: the database is opened first (build: the Store takes
the database's single-writer lock, store/db.py), then the API token is resolved and the API
socket bound, all before anything touches the server, so a daemon that cannot run (a bad
token_file: exit 78; a database that is damaged, newer, read-only or in use by another
specpilot, or an API address in use, e.g. by a daemon already running: exit 1, one line)
leaves every server as it was. The API then serves before the controller's start-up adopts or
starts the server (a cold start takes minutes): read endpoints answer during it (a switch in
flight, /healthz not ready) and an operator switch is a 409; a start-up that fails stops the API
and exits as before. A server is owned (stopped on the way out with owns_server) only once the
start-up finished, so a failed start-up never stops a server it adopted. Signals: SIGTERM/SIGINT
finish the tick and stop cleanly (the server keeps running unless the config says the controller
owns it); SIGHUP reloads config.toml between ticks (an invalid or unreadable file is rejected
with one log line and the old config stays; READY=1 always follows RELOADING=1). systemd:
READY=1 after migrations, config and the first good scrape; WATCHDOG=1 per tick; STATUS= with
the profile and last decision; STOPPING=1 on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import uvicorn

from controller import notify
from controller.actuators import make_actuator
from controller.api import create_app
from controller.clock import Clock, ScaledClock
from controller.loop import Controller
from controller.metrics import ControllerMetrics
from controller.settings import EXIT_CONFIG, ConfigError, Settings, load_settings, policy_settings
from policies.types import Mode
from store import Store, StoreError, writer_lock

log = logging.getLogger("specpilot.daemon")


def database_path(settings: Settings) -> Path:
    """Relative database paths live under $STATE_DIRECTORY when systemd provides it."""
    p = Path(settings.controller.database)
    state_dir = os.environ.get("STATE_DIRECTORY")
    if not p.is_absolute() and state_dir:
        p = Path(state_dir.split(":")[0]) / p
    return p


JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"
CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_format(env: Mapping[str, str] | None = None) -> str:
    """journald stamps every line itself: under systemd (JOURNAL_STREAM set) print no time."""
    env = os.environ if env is None else env
    return JOURNAL_FORMAT if env.get("JOURNAL_STREAM") else CONSOLE_FORMAT


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=log_format(), stream=sys.stderr, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


class ApiBindError(RuntimeError):
    """The API's [api] host and port cannot be listened on (in use, not an address here)."""


def bind_api(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Listening sockets for [api] host:port, bound as asyncio's create_server binds them (every
    address the host resolves to, SO_REUSEADDR, IPV6_V6ONLY on IPv6), for uvicorn to serve:
    binding first, the daemon knows it can serve before it touches the server. Raises
    ApiBindError with a one-line reason."""
    where = f"cannot serve the API on [api] host={host!r} port={port}"
    try:
        infos = socket.getaddrinfo(
            host, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, UnicodeError) as e:
        raise ApiBindError(f"{where}: cannot resolve the host: {e}") from None
    socks: list[socket.socket] = []
    try:
        for family, type_, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                raise ApiBindError(f"{where}: {addr[0]}:{addr[1]}: {e.strerror or e}") from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    if not socks:
        raise ApiBindError(f"{where}: the host resolves to no address")
    return socks


def _api_token(daemon: Daemon) -> str:
    """settings.api_token(), its ConfigError naming the config file too."""
    try:
        return daemon.settings.api_token()
    except ConfigError as e:
        if daemon.config_path is None:
            raise
        raise ConfigError(f"{daemon.config_path}: {e}") from None


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside our TaskGroup: its signal capture is off (the daemon owns SIGTERM/SIGINT;
    uvicorn >= 0.29 would otherwise replace our handlers for the time it serves)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


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


def daemon_clock(time_scale: float, store: Store) -> ScaledClock:
    """The daemon's clock. At time_scale 1 (a real server) it is the wall clock. Accelerated (a
    simulator), it starts no earlier than where the database's history ends: the last run wrote
    up to (time_scale - 1) x its length ahead of the wall clock, and a restart at the wall clock
    would date its rows before the last run's and put the policy's saved times (its last
    switch, its dwell, its quarantines) in the future."""
    if time_scale == 1.0:
        return ScaledClock()
    clock = ScaledClock(time_scale, not_before_s=store.latest_time_s())
    log.info("accelerated clock (x%g) starts at %.0f", time_scale, clock.now())
    return clock


async def build(
    settings: Settings,
    *,
    config_path: Path | None = None,
    clock: Clock | None = None,
    db_path: Path | None = None,
) -> Daemon:
    """Open the store (StoreError: the database cannot be used, or another specpilot writes it;
    nothing else was made) and wire the daemon's pieces; touches no server."""
    store = Store(db_path or database_path(settings))
    try:
        clock = clock or daemon_clock(settings.controller.time_scale, store)
        client = httpx.AsyncClient(timeout=settings.controller.scrape_timeout_s, trust_env=False)
        try:
            actuator = make_actuator(settings, clock, client)
            controller = Controller(
                settings,
                clock=clock,
                store=store,
                actuator=actuator,
                client=client,
                metrics=ControllerMetrics(settings.profiles),
            )
        except BaseException:
            await client.aclose()
            raise
    except BaseException:
        store.close()  # releases the database's writer lock
        raise
    return Daemon(config_path, settings, controller, store, client)


async def serve(
    daemon: Daemon,
    *,
    stop: asyncio.Event | None = None,
    on_tick: Callable[[Controller], None] | None = None,
    install_signals: bool = True,
) -> int:
    """Run until SIGTERM/SIGINT (or `stop`). Returns the exit code.

    The API token and socket come first (ConfigError, ApiBindError: nothing was touched), then
    the API serves, then the controller's start-up runs (adopts or starts the server; a stop
    during it cancels it and returns 0 at once, not after a cold start of the server; its error
    propagates as it is); a start-up that does not finish stops the API before serve returns or
    raises. The tick in progress when the stop comes finishes (a switch in flight runs to its
    end and is recorded); STOPPING=1 goes out at once. The server is stopped only with
    owns_server, in active mode, and only once the start-up finished: a start-up that fails
    leaves an adopted server running (another daemon's, say) and, like a controller that died, a
    server it launched for the next one to adopt."""
    stop = stop or asyncio.Event()
    ctl = daemon.controller
    loop = asyncio.get_running_loop()
    reload_requested = asyncio.Event()

    def request_stop(signame: str) -> None:
        if not stop.is_set():
            log.info("%s: finishing the tick, then stopping", signame)
        stop.set()

    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, request_stop, sig.name)
        loop.add_signal_handler(signal.SIGHUP, reload_requested.set)

    stopping_sent = False

    def send_stopping() -> None:
        nonlocal stopping_sent
        if not stopping_sent:
            notify.notify("STOPPING=1", f"STATUS=stopping; {ctl.status_line()}")
            stopping_sent = True

    sockets: list[socket.socket] = []
    api: asyncio.Task[None] | None = None  # uvicorn, serving from before the start-up on
    owned = False  # the start-up finished: a stop with owns_server stops the server from here
    try:
        settings = daemon.settings
        if settings.api.enabled:
            token = _api_token(daemon)
            sockets = bind_api(settings.api.host, settings.api.port)
            app = create_app(ctl, token)
            config = uvicorn.Config(
                app,
                host=settings.api.host,
                port=settings.api.port,
                log_level="warning",
                log_config=None,  # our handlers and format (journald-friendly)
                lifespan="off",
            )
            daemon.api_server = EmbeddedServer(config)
            # The API answers during the start-up (a cold start takes minutes): health checks,
            # `specpilot status` and Prometheus see a daemon starting a server, not a dead one.
            api = asyncio.create_task(daemon.api_server.serve(sockets=sockets))

        if not await _started(ctl, stop):
            log.info("stop requested during start-up: stopping before the server is ready")
            return 0
        owned = True
        ready_sent = False
        last_tick = [ctl.clock.monotonic()]

        def healthy() -> bool:
            # The loop ticked recently, or a switch (which holds a tick for minutes) is in flight.
            poll_s = daemon.settings.controller.poll_interval_s
            limit = 3 * poll_s + daemon.settings.controller.scrape_timeout_s
            return ctl.funnel.busy or ctl.clock.monotonic() - last_tick[0] <= limit

        def after_tick(c: Controller) -> None:
            nonlocal ready_sent
            last_tick[0] = c.clock.monotonic()
            states = ["WATCHDOG=1", f"STATUS={c.status_line()}"]
            if c.ready and not ready_sent:
                # Migrations ran (Store), the config is valid, and a scrape succeeded.
                states.insert(0, "READY=1")
                ready_sent = True
                log.info("ready: %s", c.status_line())
            notify.notify(*states)
            if reload_requested.is_set():
                reload_requested.clear()
                reload_config(daemon, ready=ready_sent)
            if on_tick is not None:
                on_tick(c)

        async def api_task() -> None:
            # In the group: an API that fails ends the daemon; a group that ends cancels it.
            if api is not None:
                await api

        async with asyncio.TaskGroup() as tg:
            watchdog = tg.create_task(notify.watchdog_task(healthy))

            async def stopper() -> None:
                await stop.wait()
                send_stopping()
                watchdog.cancel()
                if daemon.api_server is not None:
                    daemon.api_server.should_exit = True

            tg.create_task(ctl.run(stop, after_tick))
            tg.create_task(api_task())
            tg.create_task(stopper())
    finally:
        send_stopping()
        if api is not None and not owned:  # the start-up failed or was stopped: no group ran
            await _stop_api(daemon.api_server, api)
        with contextlib.suppress(Exception):
            # Advisory mode never touches the server, not even on the way out.
            if owned and daemon.settings.server.owns_server and ctl.mode is Mode.ACTIVE:
                await ctl.actuator.shutdown()
        for sock in sockets:
            sock.close()  # uvicorn closed the ones it served; these never were, or are closed
        await daemon.client.aclose()
        daemon.store.close()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        log.info("stopped")
    return 0


async def _stop_api(server: uvicorn.Server | None, api: asyncio.Task[None]) -> None:
    """Stop the API that served during a start-up that failed or was stopped: uvicorn closes its
    sockets and connections, then its task ends. Its own failure is logged, not raised: the
    start-up's error (or the clean stop) is what the daemon exits with; one that had already
    failed is logged here too (nothing else awaits it)."""
    if server is not None:
        server.should_exit = True
    try:
        await api
    except Exception:
        log.exception("the API server failed")


class _StartsUp(Protocol):
    async def startup(self) -> None: ...


async def _started(ctl: _StartsUp, stop: asyncio.Event) -> bool:
    """The controller's (or the fleet controller's) start-up, or a stop that comes first: a
    start-up that launches SGLang waits for its cold start (up to start_timeout_s, 15 minutes by
    default), and a SIGTERM then must not wait that long (systemd's TimeoutStopSec would kill
    everything anyway).
    False: the stop won and the start-up was cancelled (its open start row is closed as
    interrupted by the next controller, which adopts or waits for the server it finds).
    The start-up's own errors propagate."""
    startup = asyncio.ensure_future(ctl.startup())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({startup, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not startup.done():
            startup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await startup
    if startup.cancelled():
        return False
    startup.result()
    return True


def reload_config(daemon: Daemon, *, ready: bool = True) -> bool:
    """SIGHUP, between ticks: re-read config.toml and apply what can change while running
    ([controller] mode, poll_interval_s, scrape_error_limit, log_level; [policy]). [server],
    [api], [profiles] and the database take effect at the next start (the actuator, the API
    socket and the policy's profile set were built from them); the old values stay and a warning
    says so. An invalid or unreadable file is rejected with one log line and the old
    configuration stays. With `ready` (READY=1 was sent) RELOADING=1 goes out first and READY=1
    always follows, whatever happens in between (systemd would otherwise stay "reloading");
    before that, neither (the first READY=1 is still to come). Returns whether the new file was
    applied."""
    if daemon.config_path is None:
        return False
    if ready:
        notify.notify("RELOADING=1")
    applied = False
    try:
        applied = _apply_reload(daemon, daemon.config_path)
    except Exception:  # a bug here must not leave systemd "reloading" (READY=1 below)
        log.exception("reload of %s failed; keeping the old configuration", daemon.config_path)
    finally:
        if ready:
            notify.notify("READY=1", f"STATUS={daemon.controller.status_line()}")
    return applied


def _apply_reload(daemon: Daemon, path: Path) -> bool:
    try:
        new = load_settings(path)
    except ConfigError as e:
        why = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        log.error("reload rejected, keeping the old configuration: %s", why)
        return False
    old = daemon.settings
    ctl = daemon.controller
    kept = [
        name
        for name, same in (
            ("[server]", new.server == old.server),
            ("[api]", new.api == old.api),
            ("[profiles]", new.profiles == old.profiles),
            ("[controller].database", new.controller.database == old.controller.database),
            ("[controller].time_scale", new.controller.time_scale == old.controller.time_scale),
            (
                "[controller].scrape_timeout_s",
                new.controller.scrape_timeout_s == old.controller.scrape_timeout_s,
            ),
        )
        if not same
    ]
    if kept:
        log.warning("reload: %s changed; that takes effect at the next start", ", ".join(kept))
    controller_settings = new.controller.model_copy(
        update={
            "database": old.controller.database,
            "time_scale": old.controller.time_scale,
            "scrape_timeout_s": old.controller.scrape_timeout_s,
        }
    )
    effective = old.model_copy(update={"controller": controller_settings, "policy": new.policy})
    ctl.psettings = policy_settings(effective)
    ctl.settings = effective
    daemon.settings = effective
    logging.getLogger().setLevel(effective.controller.log_level.upper())
    if new.controller.mode != old.controller.mode:
        ctl.set_mode(new.controller.mode, f"config reloaded from {path}", "sighup")
    log.info("configuration reloaded from %s", path)
    return True


async def serve_fleet(settings: Settings) -> int:
    """Fleet mode ([fleet] replicas > 0, docs/FLEET.md): the fleet loop (router, replicas,
    canaries, rolling switches) until SIGTERM/SIGINT. Its state lives in the fleet controller; the
    single-server REST API and database are not served in this mode, but the database's
    single-writer lock is held as in single-server mode (StoreError, exit 1, before anything is
    touched): a second specpilot on the same config would adopt the first one's replicas and
    stop them all on its way out. A start-up that fails, or that a SIGTERM/SIGINT cuts short
    (it does not wait for the replicas' cold starts), stops the router it launched (the next
    controller launches its own; adopted, nobody would ever stop it) and, like a single
    server's, leaves the replicas for the next controller to adopt. SIGHUP is logged and
    ignored: fleet mode does not reload its configuration."""
    lock = writer_lock(database_path(settings))
    try:
        return await _serve_fleet(settings)
    finally:
        lock.release()


async def _serve_fleet(settings: Settings) -> int:
    from controller.fleet.controller import FleetController

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # SIGHUP (systemctl reload) must not end the daemon, which would leave the replicas and the
    # router without a controller (or, under systemd, have them all killed with it).
    loop.add_signal_handler(signal.SIGHUP, _fleet_reload_refused)
    async with httpx.AsyncClient(
        timeout=settings.controller.scrape_timeout_s, trust_env=False
    ) as client:
        ctl = FleetController(
            settings,
            settings.fleet,
            clock=ScaledClock(settings.controller.time_scale),
            client=client,
        )
        try:
            started = await _started(ctl, stop)
        except BaseException:
            await ctl.actuator.stop_router()
            raise
        if not started:
            log.info("stop requested during start-up: stopping before the replicas are ready")
            await ctl.actuator.stop_router()
            return 0
        notify.notify("READY=1")
        try:
            await ctl.run(stop, lambda c: notify.notify("WATCHDOG=1"))
        finally:
            notify.notify("STOPPING=1")
            await ctl.shutdown()
    return 0


def _fleet_reload_refused() -> None:
    log.warning("SIGHUP: fleet mode does not reload config.toml; restart specpilot to apply it")


def run_daemon(config_path: Path) -> int:
    """`specpilot run --config FILE`: exit 78 for a bad file (a bad api.token_file too), 1 when
    the database cannot be used (not a database, damaged, written by a newer specpilot,
    read-only, or in use by another specpilot: StoreError, found before the server is touched)
    or the API cannot be bound (nothing else was touched) or the server cannot be started or
    adopted, 0 after a clean stop. Errors are one line, without a traceback.

    A bad database exits 1, not 78: the configuration is valid (78 means "fix config.toml",
    and systemd does not restart on it); the problem is the state of a file or of another
    process, like an API address in use (1), and one a restart may clear (the other daemon
    stopped)."""
    try:
        settings = load_settings(config_path)
    except ConfigError as e:
        print(f"specpilot: {e}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(settings.controller.log_level)

    async def main() -> int:
        if settings.fleet.enabled:
            return await serve_fleet(settings)
        daemon = await build(settings, config_path=config_path)
        return await serve(daemon)

    try:
        return asyncio.run(main())
    except ConfigError as e:
        print(f"specpilot: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except StoreError as e:  # every message names the database
        log.error("%s", _one_line(e))
        return 1
    except RuntimeError as e:  # ApiBindError too
        log.error("%s", e)
        return 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
