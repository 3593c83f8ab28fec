"""Shared helpers of the operator-surface tests (API, metrics, CLI, status page, Prometheus).

A Controller without a real server: `FakeServer` answers /metrics and /v1/loads through an
httpx.MockTransport with SGLang 0.5.23-shaped, internally consistent counters (tokens = batch x
accept length x steps; step time per profile), integrated over a ManualClock; `FakeActuator`
follows the Actuator protocol, restarts the FakeServer in a set number of server seconds and can
be held mid-switch (to test 409s). Nothing here spawns a process or opens a port.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from controller.actuators.base import ServerState, SwitchOutcome, SwitchResult
from controller.clock import Clock, ManualClock, ScaledClock
from controller.demo_server import eagle_flags
from controller.loop import Controller
from controller.metrics import ControllerMetrics
from controller.settings import Settings, settings_from_dict
from store import Store

TOKEN = "s3cret-token"


def make_settings(
    tmp_path: Path, *, token: str = TOKEN, mode: str = "active", initial: str = "baseline"
) -> Settings:
    return settings_from_dict(
        {
            "controller": {
                "mode": mode,
                "poll_interval_s": 10.0,
                "database": str(tmp_path / "specpilot.db"),
            },
            "api": {"host": "127.0.0.1", "port": 0, "token": token},
            "server": {"actuator": "process", "port": 30999, "initial_profile": initial},
            "profiles": {
                "baseline": {"flags": [], "description": "no speculation"},
                "eagle3-2step": {"flags": eagle_flags(2), "env": {"NCCL_PROTO": "LL"}},
                "eagle3-5step": {"flags": eagle_flags(5)},
            },
        },
        source="test",
    )


@dataclass
class ProfileModel:
    """How a profile performs on the fake server: decode step time and accept length."""

    step_s: float
    accept_length: float  # tokens per sequence per decode step (1 for baseline)


DEFAULT_MODELS = {
    "baseline": ProfileModel(step_s=0.030, accept_length=1.0),
    "eagle3-2step": ProfileModel(step_s=0.040, accept_length=2.2),
    "eagle3-5step": ProfileModel(step_s=0.070, accept_length=2.9),
}


@dataclass
class FakeServer:
    """SGLang-shaped metrics for whichever profile runs; counters restart with the server."""

    clock: Clock
    models: dict[str, ProfileModel] = field(default_factory=lambda: dict(DEFAULT_MODELS))
    batch: float = 8.0
    profile: str | None = None
    fail_scrapes: bool = False
    _t: float = 0.0
    _c: dict[str, float] = field(default_factory=dict)

    def start(self, profile: str) -> None:
        self.profile = profile
        self._t = self.clock.now()
        self._c = dict.fromkeys(
            ("steps", "sum_bs", "step_s", "sum_bs2", "sum_bs_step_s", "tokens", "verify", "reqs"),
            0.0,
        )

    def _advance(self) -> None:
        assert self.profile is not None
        m = self.models[self.profile]
        dt = self.clock.now() - self._t
        self._t = self.clock.now()
        steps = dt / m.step_s
        c = self._c
        c["steps"] += steps
        c["sum_bs"] += steps * self.batch
        c["step_s"] += dt
        c["sum_bs2"] += steps * self.batch**2
        c["sum_bs_step_s"] += self.batch * dt
        c["tokens"] += steps * self.batch * m.accept_length
        c["verify"] += steps * self.batch
        c["reqs"] += steps * self.batch / 200.0  # 200-step requests

    def exposition(self) -> str:
        self._advance()
        assert self.profile is not None
        m = self.models[self.profile]
        c = self._c
        sched = 'model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
        tok = 'model_name="m",engine_type="unified",priority="",workload="chat"'
        lines = [
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{sched}}} {self.batch}",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{{{sched}}} 0",
            "# TYPE sglang:gen_throughput gauge",
            f"sglang:gen_throughput{{{sched}}} {self.batch * m.accept_length / m.step_s}",
            "# TYPE sglang:realtime_tokens counter",
            f'sglang:realtime_tokens_total{{{sched},mode="decode"}} {c["tokens"]}',
            "# TYPE sglang:cuda_graph_passes counter",
            f'sglang:cuda_graph_passes_total{{{sched},mode="decode_cuda_graph"}} {c["steps"]}',
            "# TYPE sglang:generation_tokens counter",
            f'sglang:generation_tokens_total{{{tok},is_streaming="false"}} {c["tokens"]}',
            "# TYPE sglang:num_requests counter",
            f'sglang:num_requests_total{{{tok},is_streaming="false"}} {c["reqs"]}',
        ]
        if self.profile != "baseline":
            lines += [
                "# TYPE sglang:spec_accept_length gauge",
                f"sglang:spec_accept_length{{{sched}}} {m.accept_length}",
                "# TYPE sglang:spec_verify_calls counter",
                f"sglang:spec_verify_calls_total{{{tok}}} {c['verify']}",
            ]
        return "\n".join(lines) + "\n"

    def loads(self) -> dict[str, Any]:
        self._advance()
        c = self._c
        us = 1e6
        return {
            "timestamp": self.clock.now(),
            "version": "0.5.23",
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": self.batch,
                    "num_waiting_reqs": 0,
                    "gen_throughput": 0.0,
                    "max_running_requests": 48,
                    "decode_moments": [
                        c["steps"],
                        c["sum_bs"],
                        c["step_s"] * us,
                        c["sum_bs2"],
                        c["sum_bs_step_s"] * us,
                        c["tokens"],
                    ],
                }
            ],
        }

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.profile is None or self.fail_scrapes:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=self.exposition())
        if request.url.path == "/v1/loads":
            return httpx.Response(200, content=json.dumps(self.loads()).encode())
        return httpx.Response(404)


class FakeActuator:
    """The Actuator protocol over a FakeServer. `hold` (an Event, cleared) keeps a switch in
    flight until set, `start_hold` a start (the daemon's cold start); a profile in `broken`
    fails to start (nothing serves after it)."""

    def __init__(self, server: FakeServer, clock: Clock, switch_s: float = 60.0) -> None:
        self.server = server
        self.clock = clock
        self.switch_s = switch_s
        self.hold: asyncio.Event | None = None
        self.start_hold: asyncio.Event | None = None
        self.calls: list[tuple[str, str]] = []
        self.broken: set[str] = set()

    def _failed(self, old: str | None, profile: str, down_s: float) -> SwitchResult:
        self.server.profile = None
        return SwitchResult(
            SwitchOutcome.START_FAILED, old, profile, down_s, error="server exited with status 1"
        )

    async def probe(self) -> ServerState:
        up = self.server.profile is not None
        return ServerState(up, self.server.profile, 4242 if up else None, None)

    async def start(self, profile: str) -> SwitchResult:
        self.calls.append(("start", profile))
        if self.start_hold is not None:
            await self.start_hold.wait()
        if profile in self.broken:
            return self._failed(None, profile, 0.0)
        self.server.start(profile)
        return SwitchResult(SwitchOutcome.OK, None, profile, 0.0)

    async def switch(self, profile: str) -> SwitchResult:
        self.calls.append(("switch", profile))
        if self.hold is not None:
            await self.hold.wait()
        old = self.server.profile
        self.server.profile = None  # down while restarting
        if isinstance(self.clock, ManualClock):
            self.clock.advance(self.switch_s)
        else:
            await self.clock.sleep(self.switch_s)
        if profile in self.broken:
            return self._failed(old, profile, self.switch_s)
        self.server.start(profile)
        return SwitchResult(SwitchOutcome.OK, old, profile, self.switch_s)

    async def alive(self) -> bool:
        return self.server.profile is not None

    async def shutdown(self) -> None:
        self.server.profile = None


@dataclass
class Rig:
    """A Controller on a FakeServer, its store in tmp_path, and the pieces tests poke."""

    controller: Controller
    server: FakeServer
    actuator: FakeActuator
    clock: ManualClock
    store: Store
    client: httpx.AsyncClient

    async def ticks(self, n: int, step_s: float | None = None) -> None:
        step = step_s or self.controller.settings.controller.poll_interval_s
        for _ in range(n):
            self.clock.advance(step)
            await self.controller.tick()

    async def close(self) -> None:
        await self.client.aclose()
        self.store.close()


async def make_rig(
    tmp_path: Path,
    *,
    settings: Settings | None = None,
    clock: ManualClock | None = None,
    broken: set[str] | None = None,
) -> Rig:
    """Build and start a Controller (startup() done: the initial profile runs); the profiles
    in `broken` fail to start."""
    settings = settings or make_settings(tmp_path)
    clock = clock or ManualClock()
    server = FakeServer(clock)
    actuator = FakeActuator(server, clock)
    actuator.broken = set(broken or ())
    client = httpx.AsyncClient(transport=httpx.MockTransport(server.handler))
    store = Store(Path(settings.controller.database))
    controller = Controller(
        settings,
        clock=clock,
        store=store,
        actuator=actuator,
        client=client,
        metrics=ControllerMetrics(settings.profiles),
    )
    await controller.startup()
    return Rig(controller, server, actuator, clock, store, client)


async def tick_until_trial(rig: Rig, max_ticks: int = 200) -> dict[str, Any]:
    """Both profiles measured (baseline, then 2-step under a pin), then 2-step's acceptance
    collapses: the policy switches back to baseline on a predicted gain, which starts a trial.
    Returns the trial (the policy's own dict)."""
    c = rig.controller
    await rig.ticks(40)
    c.pin("eagle3-2step", None, "measure 2-step", "test")
    await rig.ticks(40)
    c.unpin("", "test")
    rig.server.models["eagle3-2step"] = ProfileModel(step_s=0.040, accept_length=1.05)
    for _ in range(max_ticks):
        await rig.ticks(1)
        if c.state is not None and c.state.trial is not None:
            return dict(c.state.trial)
    raise AssertionError(f"no trial started within {max_ticks} ticks of the collapse")


class LiveDaemon:
    """The real daemon composition (controller.daemon.serve: loop, API on a free loopback port,
    watchdog) over a FakeServer, in a thread with its own event loop, in accelerated time.
    For tests that need a real HTTP endpoint (CLI, Chromium, Prometheus)."""

    def __init__(
        self, tmp_path: Path, *, time_scale: float = 20.0, token: str = TOKEN, mode: str = "active"
    ) -> None:
        self.settings = make_settings(tmp_path, token=token, mode=mode)
        self.time_scale = time_scale
        self.daemon: Any = None
        self.server: FakeServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.ticks = 0

    async def _main(self) -> None:
        from controller.daemon import Daemon, serve

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        clock = ScaledClock(self.time_scale)
        server = FakeServer(clock)
        self.server = server
        client = httpx.AsyncClient(transport=httpx.MockTransport(server.handler))
        store = Store(Path(self.settings.controller.database))
        controller = Controller(
            self.settings,
            clock=clock,
            store=store,
            actuator=FakeActuator(server, clock),
            client=client,
            metrics=ControllerMetrics(self.settings.profiles),
        )
        self.daemon = Daemon(None, self.settings, controller, store, client)

        def on_tick(_: Controller) -> None:
            self.ticks += 1

        await serve(self.daemon, stop=self._stop, on_tick=on_tick, install_signals=False)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced by __enter__/__exit__
            self._error = e

    def __enter__(self) -> LiveDaemon:
        self._thread = threading.Thread(target=self._run, name="live-daemon", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._error is not None:
                raise RuntimeError("the daemon failed to start") from self._error
            if self.daemon is not None and self.daemon.api_port and self.ticks >= 2:
                return self
            time.sleep(0.02)
        self.__exit__()
        raise TimeoutError("the daemon did not serve its API within 30 s")

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(15)
            assert not self._thread.is_alive(), "the daemon did not stop"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.daemon.api_port}"

    @property
    def controller(self) -> Controller:
        return self.daemon.controller

    def wait_ticks(self, n: int, timeout: float = 20.0) -> None:
        target = self.ticks + n
        deadline = time.monotonic() + timeout
        while self.ticks < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} ticks did not happen within {timeout} s")
            time.sleep(0.02)
