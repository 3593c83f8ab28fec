"""The loop's safety rules on a manual clock with a scripted actuator (no process, no port):
the failure limit, the unknown-outcome block (status says why, a person clears it), that the
switch is recorded before the actuator runs (so a controller killed mid-switch leaves an open
row), and that advisory mode reaches the actuator for nothing, crashes included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.actuators import ServerState, SwitchOutcome, SwitchResult
from controller.clock import ManualClock
from controller.loop import Controller
from controller.settings import settings_from_dict
from policies.types import Action, Mode, Reason
from store import Reader, Store
from tests.controller.daemon_support import ALL_PROFILES
from tests.controller.ops_support import make_rig


class ScriptedActuator:
    """Every call is recorded; `outcomes[profile]` says how a switch/start into it ends; `gate`
    (when set) holds a switch in flight; `up` is what runs."""

    def __init__(self, up: str | None = "baseline") -> None:
        self.up = up
        self.calls: list[tuple[str, str]] = []
        self.outcomes: dict[str, SwitchOutcome] = {}
        self.gate: asyncio.Event | None = None
        self.is_alive = True
        self.in_flight = asyncio.Event()

    async def probe(self) -> ServerState:
        return ServerState(self.up is not None, self.up, 4242 if self.up else None, None)

    async def _act(self, what: str, profile: str) -> SwitchResult:
        self.calls.append((what, profile))
        self.in_flight.set()
        if self.gate is not None:
            await self.gate.wait()
        outcome = self.outcomes.get(profile, SwitchOutcome.OK)
        before = self.up
        if outcome is SwitchOutcome.OK:
            self.up, self.is_alive = profile, True
        elif outcome is SwitchOutcome.START_FAILED:
            self.up = None
        err = None if outcome is SwitchOutcome.OK else f"{profile}: scripted {outcome.value}"
        return SwitchResult(outcome, before, profile, 60.0, err)

    async def start(self, profile: str) -> SwitchResult:
        return await self._act("start", profile)

    async def switch(self, profile: str) -> SwitchResult:
        return await self._act("switch", profile)

    async def alive(self) -> bool:
        return self.is_alive

    async def shutdown(self) -> None:
        self.calls.append(("shutdown", ""))


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Any]:
    made: list[tuple[Controller, httpx.AsyncClient]] = []

    async def factory(
        actuator: ScriptedActuator, mode: str = "active", **server: Any
    ) -> Controller:
        s = settings_from_dict(
            {
                "controller": {"mode": mode, "database": str(tmp_path / "db.sqlite")},
                "server": {"port": 30999, **server},
                "profiles": ALL_PROFILES,
            }
        )
        client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
        c = Controller(
            s, clock=ManualClock(), store=Store(s.controller.database), actuator=actuator,
            client=client,
        )  # fmt: skip
        made.append((c, client))
        await c.startup()
        return c

    yield factory
    for c, client in made:
        await client.aclose()
        c.store.close()


async def tick(c: Controller, n: int = 1) -> None:
    for _ in range(n):
        assert isinstance(c.clock, ManualClock)
        c.clock.advance(c.settings.controller.poll_interval_s)
        await c.tick()


async def test_failure_limit_blocks_automatic_starts_until_a_person_clears_it(make: Any) -> None:
    act = ScriptedActuator()
    act.outcomes["eagle3-2step"] = SwitchOutcome.START_FAILED
    act.outcomes["baseline"] = SwitchOutcome.START_FAILED  # the host is broken: nothing starts
    c = await make(act, start_failure_limit=2)
    c.pin("eagle3-2step", None, "try it", "test")
    await tick(c)
    assert act.calls == [("switch", "eagle3-2step")] and c.funnel.blocked_reason is None
    assert c.start_failures == 1 and c.running is None
    assert c.overrides.pin_profile is None  # a pin that cannot start is dropped
    await tick(c)  # the rollback to what served fails too
    assert act.calls == [("switch", "eagle3-2step"), ("switch", "baseline")]
    assert c.funnel.blocked_reason is not None
    assert "2 failed starts in a row" in c.funnel.blocked_reason
    assert "start_failure_limit=2" in c.funnel.blocked_reason
    # The status says why nothing happens; the block survives in the store (a restart keeps it).
    st = c.status()
    assert "blocked" in st["target"]["down_reason"] and st["overrides"]["blocked_reason"]
    assert "blocked" in c.status_line()
    assert c.store.load_state("overrides")["blocked_reason"] == c.funnel.blocked_reason
    assert st["overrides"]["in_force"] == "blocked: nothing acts until POST /v1/block/clear"
    c.pin("eagle3-5step", None, "maybe this one", "test")  # a pin is automatic actuation too
    await tick(c, 3)
    assert len(act.calls) == 2, "a blocked controller acted"
    with Reader(c.settings.controller.database) as r:
        last = r.recent_decisions(limit=1)[0]
    assert last["reason"] == "hold_blocked" and last["acted"] is False
    c.clear_block("looked at it", "test")
    assert c.start_failures == 0
    await tick(c, 4)  # nothing serves: after a backoff, the pinned profile starts
    assert act.calls[2:] == [("start", "eagle3-5step")] and c.running == "eagle3-5step"


async def test_unknown_outcome_blocks_until_cleared_and_status_says_why(make: Any) -> None:
    act = ScriptedActuator()
    act.outcomes["eagle3-5step"] = SwitchOutcome.UNKNOWN
    c = await make(act)
    c.start_manual_switch("eagle3-5step", "try", "test")
    assert c._manual is not None
    await c._manual
    reason = c.funnel.blocked_reason
    assert reason is not None and "unknown state" in reason and "scripted unknown" in reason
    assert c.running is None  # what runs is not known: the next probe finds it (no acting)
    act.up = "baseline"
    await tick(c)
    assert c.running == "baseline"
    assert c.last_decision is not None and c.last_decision.reason is Reason.HOLD_BLOCKED
    assert c.status()["target"]["down_reason"].startswith("automatic actuation blocked")
    with Reader(c.settings.controller.database) as r:
        sw = r.switches(limit=1)[0]
    assert sw["outcome"] == "unknown" and sw["to_profile"] == "eagle3-5step"
    # A pin is automatic actuation too: refused while blocked.
    c.pin("eagle3-2step", None, "x", "test")
    await tick(c, 2)
    assert act.calls == [("switch", "eagle3-5step")]
    c.clear_block("checked the server", "test")
    await tick(c)
    assert act.calls[-1] == ("switch", "eagle3-2step") and c.running == "eagle3-2step"


async def test_a_switch_is_recorded_before_the_actuator_runs(make: Any) -> None:
    act = ScriptedActuator()
    c = await make(act)
    act.gate = asyncio.Event()
    c.start_manual_switch("eagle3-2step", "now", "test")
    await asyncio.wait_for(act.in_flight.wait(), 5)
    # Mid-switch: the decision (acted) and an open switch row are already in the database, so a
    # controller killed here leaves a record the next start closes as unknown.
    with Reader(c.settings.controller.database) as r:
        open_ = r.open_switch()
        d = r.recent_decisions(limit=1)[0]
    assert open_ is not None and open_["to_profile"] == "eagle3-2step"
    assert open_["from_profile"] == "baseline" and open_["decision_id"] == d["id"]
    assert d["acted"] is True and d["reason"] == "switch_manual"
    act.gate.set()
    assert c._manual is not None
    await c._manual
    with Reader(c.settings.controller.database) as r:
        assert r.open_switch() is None
        assert r.switches(limit=1)[0]["outcome"] == "ok"


async def test_the_start_is_recorded_as_a_switch_but_not_as_a_trial(tmp_path: Path) -> None:
    """The launch at start-up (from nothing) is a switch row, and no trial: nothing would ever
    judge it, and its trial row stayed "pending" for good. A one-off switch later has one."""
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        assert rig.actuator.calls == [("start", "baseline")]
        (start,) = rig.store.switches()
        assert start["from_profile"] is None and start["outcome"] == "ok"
        assert rig.store.trials(start["id"]) == []
        await rig.ticks(3)
        c.start_manual_switch("eagle3-2step", "now", "test")
        assert c._manual is not None
        await c._manual
        switch = rig.store.switches(limit=1)[0]
        assert switch["to_profile"] == "eagle3-2step"
        states = [t["state"] for t in rig.store.trials(switch["id"])]  # newest first
        assert states and states[-1] == "pending"
    finally:
        await rig.close()


async def test_advisory_mode_never_calls_the_actuator(make: Any) -> None:
    act = ScriptedActuator()
    c = await make(act, mode="advisory")
    assert c.mode is Mode.ADVISORY and c.running == "baseline"  # adopted, not started
    c.pin("eagle3-2step", None, "would switch", "test")
    await tick(c, 2)
    c.unpin("a manual switch next", "test")  # (one away from a pin is refused)
    c.start_manual_switch("eagle3-5step", "manual", "test")
    assert c._manual is not None
    await c._manual
    act.is_alive, act.up = False, None  # a crash: advisory does not restart either
    await tick(c, 3)
    assert act.calls == []
    with Reader(c.settings.controller.database) as r:
        switches = r.switches()
        decisions = r.recent_decisions(limit=100)
    assert switches == []
    acted = [d for d in decisions if d["action"] == Action.SWITCH.value]
    assert {d["profile"] for d in acted} == {"eagle3-2step", "eagle3-5step"}
    assert not any(d["acted"] for d in acted)
    assert all(d["mode"] == "advisory" for d in decisions)
    assert c.running is None


async def test_funnel_calls_on_start_only_when_it_really_acts() -> None:
    from controller.actuators import Funnel

    act = ScriptedActuator()
    mode = [Mode.ADVISORY]
    funnel = Funnel(act, lambda: mode[0])  # type: ignore[arg-type]
    started: list[int] = []

    def on_start() -> None:
        started.append(len(act.calls))  # how many actuator calls had run before it

    r = await funnel.switch("eagle3-2step", on_start=on_start)
    assert r.outcome is SwitchOutcome.SKIPPED_ADVISORY and started == [] and act.calls == []
    mode[0] = Mode.ACTIVE
    funnel.block("person must look")
    r = await funnel.start("eagle3-2step", on_start=on_start)
    assert r.outcome is SwitchOutcome.REFUSED_BUSY and started == []
    funnel.clear_block()
    act.gate = asyncio.Event()
    first = asyncio.create_task(funnel.switch("eagle3-2step", on_start=on_start))
    await asyncio.wait_for(act.in_flight.wait(), 5)
    r = await funnel.switch("eagle3-5step", on_start=on_start)  # one in flight: refused
    assert r.outcome is SwitchOutcome.REFUSED_BUSY
    act.gate.set()
    assert (await first).ok
    assert started == [0] and act.calls == [("switch", "eagle3-2step")]


async def test_a_restart_keeps_the_operators_mode_and_block(make: Any) -> None:
    first = ScriptedActuator()
    first.outcomes["eagle3-5step"] = SwitchOutcome.UNKNOWN
    c1 = await make(first)
    c1.start_manual_switch("eagle3-5step", "try", "test")
    assert c1._manual is not None
    await c1._manual
    assert c1.funnel.blocked_reason is not None
    # The next controller finds nothing running: the block still stands, so it starts nothing
    # and says why; once a person clears it, the last good profile comes back.
    second = ScriptedActuator(up=None)
    c2 = await make(second)
    assert second.calls == [] and c2.running is None
    assert c2.funnel.blocked_reason == c1.funnel.blocked_reason
    assert "blocked" in c2.status()["target"]["down_reason"]
    await tick(c2, 2)
    assert second.calls == []
    c2.clear_block("checked", "test")
    for _ in range(10):
        await tick(c2)
        if second.calls:
            break
    assert second.calls == [("start", "baseline")] and c2.running == "baseline"
    # An advisory mode set through the API holds across a restart too (the config says active).
    c2.set_mode(Mode.ADVISORY, "hands off", "test")
    third = ScriptedActuator(up=None)
    c3 = await make(third)
    assert c3.mode is Mode.ADVISORY and third.calls == []
