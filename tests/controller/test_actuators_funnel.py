"""The actuation funnel (advisory, one in flight, the unknown-outcome block) and profile
identification from /server_info, with an in-memory actuator."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.actuators import (
    Funnel,
    ServerState,
    SwitchOutcome,
    SwitchResult,
    UnknownProfileError,
    identify_profile,
    matching_profiles,
)
from controller.settings import ProfileSettings, profile_spec
from policies.types import Mode, ProfileSpec


class FakeActuator:
    """Records calls; each switch waits for `gate` when set and returns `next_outcome`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.gate: asyncio.Event | None = None
        self.next_outcome = SwitchOutcome.OK
        self.raises: BaseException | None = None

    async def _act(self, what: str, profile: str) -> SwitchResult:
        self.calls.append((what, profile))
        if self.gate is not None:
            await self.gate.wait()
        if self.raises is not None:
            raise self.raises
        err = None if self.next_outcome is SwitchOutcome.OK else "boom"
        return SwitchResult(self.next_outcome, "a", profile, 1.0, err)

    async def switch(self, profile: str) -> SwitchResult:
        return await self._act("switch", profile)

    async def start(self, profile: str) -> SwitchResult:
        return await self._act("start", profile)

    async def probe(self) -> ServerState:
        return ServerState(True, "a", 1, {})

    async def alive(self) -> bool:
        return True

    async def shutdown(self) -> None:
        return None


def test_fake_actuator_satisfies_the_protocol() -> None:
    from controller.actuators import Actuator

    assert isinstance(FakeActuator(), Actuator)


async def test_advisory_returns_early_and_touches_nothing() -> None:
    act = FakeActuator()
    mode = [Mode.ADVISORY]
    funnel = Funnel(act, lambda: mode[0])
    for manual in (False, True):
        r = await funnel.switch("b", manual=manual)
        assert r.outcome is SwitchOutcome.SKIPPED_ADVISORY
        assert (await funnel.start("b", manual=manual)).outcome is SwitchOutcome.SKIPPED_ADVISORY
    assert act.calls == []
    mode[0] = Mode.ACTIVE  # the mode is read at every call (SIGHUP / API can change it)
    assert (await funnel.switch("b")).outcome is SwitchOutcome.OK
    assert act.calls == [("switch", "b")]


async def test_one_switch_in_flight() -> None:
    act = FakeActuator()
    act.gate = asyncio.Event()
    funnel = Funnel(act, lambda: Mode.ACTIVE)
    first = asyncio.create_task(funnel.switch("b"))
    await asyncio.sleep(0)
    assert funnel.busy
    second = await funnel.switch("c", manual=True)
    assert second.outcome is SwitchOutcome.REFUSED_BUSY
    assert (await funnel.start("c")).outcome is SwitchOutcome.REFUSED_BUSY
    act.gate.set()
    assert (await first).outcome is SwitchOutcome.OK
    assert not funnel.busy
    assert act.calls == [("switch", "b")]


async def test_unknown_blocks_automatic_switches_until_cleared() -> None:
    act = FakeActuator()
    act.next_outcome = SwitchOutcome.UNKNOWN
    funnel = Funnel(act, lambda: Mode.ACTIVE)
    r = await funnel.switch("b")
    assert r.outcome is SwitchOutcome.UNKNOWN
    assert funnel.blocked_reason is not None and "boom" in funnel.blocked_reason
    act.next_outcome = SwitchOutcome.OK
    refused = await funnel.switch("c")
    assert refused.outcome is SwitchOutcome.REFUSED_BUSY
    assert "blocked" in (refused.error or "")
    assert len(act.calls) == 1
    # A person may still act.
    assert (await funnel.switch("c", manual=True)).outcome is SwitchOutcome.OK
    assert funnel.blocked_reason is not None  # only clear_block() clears it
    funnel.clear_block()
    assert funnel.blocked_reason is None
    assert (await funnel.switch("d")).outcome is SwitchOutcome.OK


@pytest.mark.parametrize("outcome", [SwitchOutcome.OK, SwitchOutcome.START_FAILED])
async def test_known_outcomes_do_not_block(outcome: SwitchOutcome) -> None:
    act = FakeActuator()
    act.next_outcome = outcome
    funnel = Funnel(act, lambda: Mode.ACTIVE)
    assert (await funnel.switch("b")).outcome is outcome
    assert funnel.blocked_reason is None
    assert funnel.last_result is not None and funnel.last_result.outcome is outcome


async def test_an_exception_is_an_unknown_outcome() -> None:
    act = FakeActuator()
    act.raises = RuntimeError("socket exploded")
    funnel = Funnel(act, lambda: Mode.ACTIVE)
    r = await funnel.switch("b")
    assert r.outcome is SwitchOutcome.UNKNOWN and "socket exploded" in (r.error or "")
    assert funnel.blocked_reason is not None and not funnel.busy


async def test_a_cancelled_switch_blocks() -> None:
    act = FakeActuator()
    act.gate = asyncio.Event()
    funnel = Funnel(act, lambda: Mode.ACTIVE)
    task = asyncio.create_task(funnel.switch("b"))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert funnel.blocked_reason is not None and "cancelled" in funnel.blocked_reason
    assert not funnel.busy


async def test_unknown_profile_propagates_without_blocking() -> None:
    act = FakeActuator()
    act.raises = UnknownProfileError("unknown profile 'x'")
    funnel = Funnel(act, lambda: Mode.ACTIVE)
    with pytest.raises(UnknownProfileError):
        await funnel.switch("x")
    assert funnel.blocked_reason is None


# ------------------------------------------------------------------ identify_profile

DRAFT = ["--speculative-draft-model-path", "d"]


def _spec(name: str, flags: list[str], **kw: Any) -> ProfileSpec:
    return profile_spec(name, ProfileSettings(flags=flags, **kw))


SPECS = [
    _spec("baseline", []),
    _spec(
        "eagle3-2step",
        ["--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-num-steps", "2"],
    ),
    _spec(
        "eagle3-5step",
        ["--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-num-steps", "5",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "6"],
    ),
    _spec("eagle-default", ["--speculative-algorithm", "NEXTN", *DRAFT]),
    _spec(
        "adaptive",
        ["--speculative-algorithm", "EAGLE3", *DRAFT, "--speculative-adaptive",
         "--speculative-num-steps", "3"],
        kind="adaptive",
    ),
]  # fmt: skip


def _args(algo: Any, steps: Any = None, topk: Any = None, tokens: Any = None, **kw: Any) -> dict:
    return {
        "speculative_algorithm": algo,
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": tokens,
        "model_path": "m",
        **kw,
    }


@pytest.mark.parametrize(
    ("server_args", "expected"),
    [
        (_args(None), "baseline"),
        ({"model_path": "m"}, "baseline"),  # older servers omit the keys
        (_args("EAGLE3", 2, 1, 3), "eagle3-2step"),
        (_args("eagle3", "2", "1", "3"), "eagle3-2step"),  # case and strings tolerated
        (_args("EAGLE3", 5, 1, 6, speculative_adaptive=False), "eagle3-5step"),
        (_args("EAGLE", 3, 1, 4), "eagle-default"),  # NEXTN resolved to EAGLE
        (_args("NEXTN", 3, 1, 4), "eagle-default"),
        (_args("EAGLE3", 3, 1, 4, speculative_adaptive=True), "adaptive"),
        (_args("EAGLE3", 5, 1, 6, speculative_adaptive=True), "adaptive"),  # initial tier moves
        (_args("EAGLE", 3, 1, 4, speculative_adaptive=True), None),
        (_args("EAGLE3", 3, 1, 4), None),  # adaptive switched off by SGLang: no match
        (_args("EAGLE3", 4, 1, 5), None),
        (_args("EAGLE3", 2, 2, 3), None),
        (_args("NGRAM", 2, 1, 3), None),
    ],
)
def test_identify_profile(server_args: dict, expected: str | None) -> None:
    assert identify_profile(server_args, SPECS) == expected


def test_identical_shapes_are_ambiguous() -> None:
    tuned = _spec("baseline-nccl", [], env={"NCCL_PROTO": "LL"})
    specs = [*SPECS, tuned]
    assert matching_profiles(_args(None), specs) == ["baseline", "baseline-nccl"]
    assert identify_profile(_args(None), specs) is None
