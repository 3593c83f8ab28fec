"""REST API: reads, bearer-token writes, field-level 422s, 404/409, expiry, warm start, and
junk that must never crash the daemon or corrupt the store.

The app runs over a Controller on a fake server (tests/controller/ops_support.py) in the test's
own event loop (httpx ASGITransport), as it does in the daemon: operator operations and the
loop share one loop.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.api import create_app
from policies.types import Action, Decision, Reason
from tests.controller.ops_support import TOKEN, Rig, make_rig, make_settings, tick_until_trial

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _client(rig: Rig, token: str = TOKEN) -> httpx.AsyncClient:
    app = create_app(rig.controller, token)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = await make_rig(tmp_path)
    yield r
    manual = r.controller._manual
    if manual is not None and not manual.done():
        if r.actuator.hold is not None:
            r.actuator.hold.set()
        await manual
    await r.close()


@pytest.fixture
async def api(rig: Rig) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(rig) as c:
        yield c


async def test_reads(rig: Rig, api: httpx.AsyncClient) -> None:
    await rig.ticks(8)
    r = await api.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"ok": True, "ready": True, "profile": "baseline"}
    r = await api.head("/healthz")
    assert r.status_code == 200 and r.content == b""

    st_ = (await api.get("/v1/status")).json()
    assert st_["profile"] == "baseline"
    assert st_["mode"] == "active"
    assert st_["observed"]["output_tok_s"] == pytest.approx(8 * 1.0 / 0.030, rel=1e-6)
    names = [e["profile"] for e in st_["estimates"]]
    assert names == ["baseline", "eagle3-2step", "eagle3-5step"]
    base = st_["estimates"][0]
    assert base["tok_s"]["low"] <= base["tok_s"]["mean"] <= base["tok_s"]["high"]
    assert st_["last_decision"]["profile"] == "baseline"

    est = (await api.get("/v1/estimates", params={"profile": "baseline"})).json()
    assert len(est["current"]) == 3
    assert est["history"] and {h["profile"] for h in est["history"]} == {"baseline"}

    decisions = (await api.get("/v1/decisions", params={"limit": 3})).json()
    assert len(decisions) == 3
    assert decisions[0]["t_s"] >= decisions[1]["t_s"] >= decisions[2]["t_s"]
    since = rig.clock.now() - 25
    recent = (await api.get("/v1/decisions", params={"since_s": since})).json()
    assert recent and all(d["t_s"] >= since for d in recent)

    switches = (await api.get("/v1/switches")).json()
    assert [(s["from_profile"], s["to_profile"], s["outcome"]) for s in switches] == [
        (None, "baseline", "ok")
    ]
    assert (await api.get("/v1/findings")).json() == []

    profiles = (await api.get("/v1/profiles")).json()
    by_name = {p["name"]: p for p in profiles}
    assert by_name["baseline"]["running"] is True
    assert by_name["eagle3-2step"]["num_steps"] == 2
    assert by_name["eagle3-2step"]["env"] == ["NCCL_PROTO"]  # names only, never values
    assert "LL" not in json.dumps(profiles)

    openapi = (await api.get("/openapi.json")).json()
    for path in ("/v1/status", "/v1/pin", "/v1/pause", "/v1/mode", "/v1/switch", "/healthz"):
        assert path in openapi["paths"]
    assert (await api.get("/docs")).status_code == 200


async def test_bad_query_parameters_are_422(api: httpx.AsyncClient) -> None:
    for params in ({"limit": 0}, {"limit": "many"}, {"since_s": "nan"}, {"since_s": "inf"}):
        r = await api.get("/v1/decisions", params=params)
        assert r.status_code == 422, params
        assert r.json()["detail"][0]["loc"][-1] in params
    # A finding kind is one of a closed set: a typo is not an empty list.
    assert (await api.get("/v1/findings", params={"kind": "drift"})).status_code == 200
    r = await api.get("/v1/findings", params={"kind": "drfit"})
    assert r.status_code == 422
    assert "'drift', 'acceptance_low' or 'change'" in r.json()["detail"][0]["msg"]


@pytest.mark.parametrize(
    ("path", "accepted"),
    [
        ("/v1/estimates", "since_s, profile, limit"),
        ("/v1/decisions", "since_s, limit"),
        ("/v1/switches", "since_s, limit"),
        ("/v1/findings", "since_s, kind, limit"),
    ],
)
async def test_unknown_query_parameters_are_422(
    rig: Rig, api: httpx.AsyncClient, path: str, accepted: str
) -> None:
    await rig.ticks(3)
    # `since` for `since_s` used to answer 200 with every row.
    r = await api.get(path, params={"since": "garbage", "limit": 5})
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"] == ["query", "since"]
    assert err["msg"] == f"unknown query parameter 'since'; accepted: {accepted}"
    assert err["input"] == "garbage"
    r = await api.get(path, params={"since_s": rig.clock.now() - 25, "limit": 5})
    assert r.status_code == 200, r.text
    # GETs that take no parameters still ignore a query string (cache-busters, probes).
    for bare in ("/v1/status", "/healthz", "/metrics", "/v1/profiles", "/"):
        assert (await api.get(bare, params={"_": "1"})).status_code == 200, bare


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/v1/pin", {"profile": "eagle3-2step", "ttl_s": 60}),
        ("DELETE", "/v1/pin", None),
        ("PUT", "/v1/pause", {"ttl_s": 60}),
        ("DELETE", "/v1/pause", None),
        ("PUT", "/v1/mode", {"mode": "advisory"}),
        ("POST", "/v1/trial/abort", None),
        ("POST", "/v1/switch", {"profile": "eagle3-2step"}),
        ("POST", "/v1/block/clear", None),
    ],
)
async def test_auth(rig: Rig, method: str, path: str, body: Any) -> None:
    before = rig.store.counts()["overrides"]
    async with _client(rig) as api:
        r = await api.request(method, path, json=body)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        # Auth is checked before the body: junk without a token is still 401.
        r = await api.request(method, path, content=b"{junk", headers={})
        assert r.status_code == 401
        r = await api.request(
            method, path, json=body, headers={"Authorization": "Bearer wrong-token"}
        )
        assert r.status_code == 403
        assert r.json()["detail"] == "wrong token"
        r = await api.request(method, path, json=body, headers={"Authorization": "Basic eDp5"})
        assert r.status_code == 401
    async with _client(rig, token="") as api:
        r = await api.request(method, path, json=body, headers=AUTH)
        assert r.status_code == 403
        assert "no API token is configured" in r.json()["detail"]
    assert rig.store.counts()["overrides"] == before  # nothing was recorded
    assert rig.actuator.calls == [("start", "baseline")]


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("PUT", "/v1/pin", {"ttl_s": 60}, "profile"),
        ("PUT", "/v1/pin", {"profile": "baseline", "ttl_s": -5}, "ttl_s"),
        ("PUT", "/v1/pin", {"profile": "baseline", "ttl_s": "soon"}, "ttl_s"),
        ("PUT", "/v1/pin", {"profile": "", "ttl_s": 5}, "profile"),
        ("PUT", "/v1/pin", {"profile": "baseline", "colour": "red"}, "colour"),
        ("PUT", "/v1/pin", {"profile": "baseline", "reason": "x" * 501}, "reason"),
        ("PUT", "/v1/pin", {"profile": "baseline", "ttl_s": 1e12}, "ttl_s"),
        # Strict numbers: a bool or a numeric string is not a ttl (true was a 1-second pin).
        ("PUT", "/v1/pin", {"profile": "baseline", "ttl_s": True}, "ttl_s"),
        ("PUT", "/v1/pin", {"profile": "baseline", "ttl_s": "60"}, "ttl_s"),
        ("PUT", "/v1/pause", {}, "ttl_s"),
        ("PUT", "/v1/pause", {"ttl_s": 0}, "ttl_s"),
        ("PUT", "/v1/pause", {"ttl_s": True}, "ttl_s"),
        ("PUT", "/v1/pause", {"ttl_s": "60"}, "ttl_s"),
        ("PUT", "/v1/mode", {"mode": "aggressive"}, "mode"),
        ("PUT", "/v1/mode", {}, "mode"),
        ("POST", "/v1/switch", {"profile": 5}, "profile"),
        ("POST", "/v1/switch", {}, "profile"),
        ("POST", "/v1/trial/abort", {"reason": ["a"]}, "reason"),
    ],
)
async def test_bad_bodies_are_422_naming_the_field(
    rig: Rig, api: httpx.AsyncClient, method: str, path: str, body: Any, field: str
) -> None:
    r = await api.request(method, path, json=body, headers=AUTH)
    assert r.status_code == 422, r.text
    locs = [e["loc"] for e in r.json()["detail"]]
    assert any(loc[-1] == field for loc in locs), locs
    assert rig.controller.overrides.pin_profile is None
    assert rig.controller.overrides.paused_until_s is None
    assert rig.controller.mode.value == "active"


async def test_ttl_takes_json_integers_and_floats(rig: Rig, api: httpx.AsyncClient) -> None:
    for ttl in (60, 60.5):
        r = await api.put("/v1/pause", json={"ttl_s": ttl}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["pause"] == {"until_s": rig.clock.now() + ttl}
        r = await api.put("/v1/pin", json={"profile": "baseline", "ttl_s": ttl}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["pin"]["until_s"] == rig.clock.now() + ttl


async def test_actor_header_is_utf8(rig: Rig, api: httpx.AsyncClient) -> None:
    for sent, stored in (
        ("José Müller 山田".encode(), "José Müller 山田"),
        ("é".encode() * 150, "é" * 100),  # the 100-character limit counts characters
    ):
        headers = {**AUTH, "x-specpilot-actor": sent}
        r = await api.put("/v1/pause", json={"ttl_s": 60}, headers=headers)
        assert r.status_code == 200, r.text
        assert rig.store.overrides_history()[0]["actor"] == stored
    before = rig.store.counts()["overrides"]
    r = await api.put(
        "/v1/pause", json={"ttl_s": 60}, headers={**AUTH, "x-specpilot-actor": b"caf\xe9"}
    )
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["header", "x-specpilot-actor"]
    assert rig.store.counts()["overrides"] == before


async def test_nan_and_lone_surrogates_are_422(rig: Rig, api: httpx.AsyncClient) -> None:
    # Python's JSON parser accepts NaN/Infinity; SQLite cannot store lone surrogates.
    for raw, field in (
        (b'{"profile": "baseline", "ttl_s": NaN}', "ttl_s"),
        (b'{"ttl_s": Infinity}', "ttl_s"),
        (b'{"profile": "baseline", "reason": "\\ud800"}', "reason"),
    ):
        path = "/v1/pause" if b"profile" not in raw else "/v1/pin"
        r = await api.put(path, content=raw, headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 422, (raw, r.text)
        assert r.json()["detail"][0]["loc"][-1] == field
    # A query string that percent-decodes to a surrogate (CESU-8 bytes) is not a 500 either.
    r = await api.delete("/v1/pin?reason=%ED%A0%80", headers=AUTH)
    assert r.status_code in (200, 400, 422)
    assert rig.controller.overrides.pin_profile is None


async def test_unknown_profile_is_404(rig: Rig, api: httpx.AsyncClient) -> None:
    for path, method in (("/v1/pin", "PUT"), ("/v1/switch", "POST")):
        r = await api.request(method, path, json={"profile": "eagle9-step"}, headers=AUTH)
        assert r.status_code == 404
        assert "eagle9-step" in r.json()["detail"]
        assert "eagle3-2step" in r.json()["detail"]  # lists the known ones
    assert rig.store.counts()["overrides"] == 0


async def test_pin_and_pause_expire(rig: Rig, api: httpx.AsyncClient) -> None:
    r = await api.put(
        "/v1/pin",
        json={"profile": "eagle3-5step", "ttl_s": 120, "reason": "test pin"},
        headers={**AUTH, "x-specpilot-actor": "alice"},
    )
    assert r.status_code == 200
    assert r.json()["pin"] == {"profile": "eagle3-5step", "until_s": rig.clock.now() + 120}
    assert r.json()["in_force"] == "pinned to eagle3-5step"
    r = await api.put("/v1/pause", json={"ttl_s": 30}, headers=AUTH)
    assert r.json()["pause"] == {"until_s": rig.clock.now() + 30}
    # The answer says the pause holds the pin back (a pin that seems to do nothing).
    assert r.json()["in_force"] == (
        "paused: nothing switches; the pin on eagle3-5step acts when the pause ends"
    )
    metrics = (await api.get("/metrics")).text
    assert 'specpilot_override_pin{profile="eagle3-5step"} 1.0' in metrics
    assert "specpilot_override_paused 1.0" in metrics

    audit = rig.store.overrides_history()
    assert [(a["kind"], a["actor"]) for a in audit][-1] == ("pin", "alice")
    assert audit[-1]["reason"] == "test pin"

    rig.clock.advance(31)
    st_ = (await api.get("/v1/status")).json()
    assert st_["overrides"]["pause"] is None
    assert st_["overrides"]["pin"]["profile"] == "eagle3-5step"
    assert st_["overrides"]["in_force"] == "pinned to eagle3-5step"
    rig.clock.advance(90)
    st_ = (await api.get("/v1/status")).json()
    assert st_["overrides"]["pin"] is None
    await api.put("/v1/mode", json={"mode": "advisory"}, headers=AUTH)
    st_ = (await api.get("/v1/status")).json()
    assert st_["overrides"]["in_force"] == "the policy (advisory: decided, not acted on)"
    metrics = (await api.get("/metrics")).text
    assert "specpilot_override_paused 0.0" in metrics
    assert "specpilot_override_pin_expiry_timestamp_seconds 0.0" in metrics


async def test_pin_acts_and_unpin(rig: Rig, api: httpx.AsyncClient) -> None:
    await rig.ticks(3)
    r = await api.put("/v1/pin", json={"profile": "eagle3-2step"}, headers=AUTH)
    assert r.json()["pin"] == {"profile": "eagle3-2step", "until_s": None}
    await rig.ticks(2)
    assert rig.controller.running == "eagle3-2step"
    assert ("switch", "eagle3-2step") in rig.actuator.calls
    switches = (await api.get("/v1/switches")).json()
    assert switches[0]["to_profile"] == "eagle3-2step"
    assert switches[0]["reason"] == "switch_pinned"
    assert switches[0]["downtime_s"] == pytest.approx(60.0)
    r = await api.delete("/v1/pin", params={"reason": "done & dusted"}, headers=AUTH)
    assert r.json()["pin"] is None
    assert rig.store.overrides_history()[0]["reason"] == "done & dusted"
    # Removing what is not there is fine (idempotent) and leaves no audit row behind: the
    # audit log lists changes only.
    before = rig.store.counts()["overrides"]
    for path in ("/v1/pin", "/v1/pause"):
        r = await api.delete(path, headers=AUTH)
        assert r.status_code == 200
        assert r.json()["pin"] is None and r.json()["pause"] is None
    assert rig.store.counts()["overrides"] == before
    assert rig.store.overrides_history()[0]["kind"] == "unpin"


async def test_mode_change(rig: Rig, api: httpx.AsyncClient) -> None:
    r = await api.put("/v1/mode", json={"mode": "advisory", "reason": "look only"}, headers=AUTH)
    assert r.status_code == 200
    assert r.json()["mode"] == "advisory"
    assert (await api.get("/v1/status")).json()["mode"] == "advisory"
    assert 'specpilot_mode{mode="advisory"} 1.0' in (await api.get("/metrics")).text
    # Advisory: the switch is accepted and recorded, but the server is never touched.
    r = await api.post("/v1/switch", json={"profile": "eagle3-5step"}, headers=AUTH)
    assert r.status_code == 202
    assert r.json() == {"accepted": True, "profile": "eagle3-5step", "mode": "advisory"}
    assert rig.controller._manual is not None
    await rig.controller._manual
    assert rig.actuator.calls == [("start", "baseline")]
    assert rig.controller.running == "baseline"
    d = (await api.get("/v1/decisions")).json()[0]
    assert (d["reason"], d["acted"], d["mode"]) == ("switch_manual", False, "advisory")
    r = await api.put("/v1/mode", json={"mode": "active"}, headers=AUTH)
    assert r.json()["mode"] == "active"


async def test_switch_in_flight_is_409(rig: Rig, api: httpx.AsyncClient) -> None:
    await rig.ticks(3)
    r = await api.post("/v1/trial/abort", headers=AUTH)
    assert r.status_code == 409
    assert r.json()["detail"] == "no trial is running"

    rig.actuator.hold = asyncio.Event()
    r = await api.post(
        "/v1/switch", json={"profile": "eagle3-2step", "reason": "try it"}, headers=AUTH
    )
    assert r.status_code == 202
    for _ in range(5):
        await asyncio.sleep(0)
    assert rig.controller.funnel.busy
    assert (await api.get("/v1/status")).json()["switch_in_flight"] is True
    r = await api.post("/v1/switch", json={"profile": "eagle3-5step"}, headers=AUTH)
    assert r.status_code == 409
    assert "in flight" in r.json()["detail"]
    rig.actuator.hold.set()
    assert rig.controller._manual is not None
    await rig.controller._manual
    assert rig.controller.running == "eagle3-2step"
    assert rig.actuator.calls == [("start", "baseline"), ("switch", "eagle3-2step")]
    s = (await api.get("/v1/switches")).json()[0]
    assert (s["from_profile"], s["to_profile"], s["reason"]) == (
        "baseline",
        "eagle3-2step",
        "switch_manual",
    )
    assert rig.store.overrides_history()[0]["reason"] == "try it"


async def test_switch_to_the_running_profile_is_409(rig: Rig, api: httpx.AsyncClient) -> None:
    await rig.ticks(3)
    for mode in ("active", "advisory"):
        await api.put("/v1/mode", json={"mode": mode}, headers=AUTH)
        before = rig.store.counts()["overrides"]
        r = await api.post("/v1/switch", json={"profile": "baseline"}, headers=AUTH)
        assert r.status_code == 409, r.text
        assert r.json()["detail"] == "baseline is already running"
        assert rig.store.counts()["overrides"] == before  # not recorded as a switch either
    assert rig.controller._manual is None
    await rig.ticks(2)
    assert rig.actuator.calls == [("start", "baseline")]  # no drain, stop, restart


async def test_switch_during_a_trial_is_409(rig: Rig, api: httpx.AsyncClient) -> None:
    trial = await tick_until_trial(rig)
    for profile in ("eagle3-5step", trial["from"], trial["profile"]):
        r = await api.post("/v1/switch", json={"profile": profile}, headers=AUTH)
        assert r.status_code == 409, r.text
        assert r.json()["detail"] == (
            f"a trial of {trial['profile']} is running: wait for its verdict or "
            "POST /v1/trial/abort first"
        )
    assert rig.controller._manual is None
    assert rig.controller.state is not None and rig.controller.state.trial is not None
    # Unknown profiles are still 404, not 409.
    r = await api.post("/v1/switch", json={"profile": "eagle9-step"}, headers=AUTH)
    assert r.status_code == 404


async def test_trial_abort_while_switching_is_409(rig: Rig, api: httpx.AsyncClient) -> None:
    trial = await tick_until_trial(rig)
    rig.actuator.hold = asyncio.Event()
    # A switch the controller itself runs while the trial is on (a rollback the policy decided):
    # the API must answer 409 while it is in flight.
    d = Decision(rig.clock.now(), Action.SWITCH, trial["from"], Reason.ROLLBACK_TRIAL_FAILED, {})
    rig.controller._manual = asyncio.create_task(rig.controller._manual_switch(d))
    for _ in range(5):
        await asyncio.sleep(0)
    assert rig.controller.funnel.busy
    assert rig.controller.state is not None and rig.controller.state.trial is not None
    r = await api.post("/v1/trial/abort", headers=AUTH)
    assert r.status_code == 409
    assert "in flight" in r.json()["detail"]
    # In flight beats both "a trial is running" and "already running".
    for profile in ("eagle3-5step", trial["from"], trial["profile"]):
        r = await api.post("/v1/switch", json={"profile": profile}, headers=AUTH)
        assert r.status_code == 409
        assert r.json()["detail"] == "a switch is in flight"
    rig.actuator.hold.set()
    assert rig.controller._manual is not None
    await rig.controller._manual
    assert rig.controller.running == trial["from"]


async def test_trial_abort_rolls_back(rig: Rig, api: httpx.AsyncClient) -> None:
    trial = await tick_until_trial(rig)
    st_ = (await api.get("/v1/status")).json()
    assert st_["trial"]["profile"] == trial["profile"] == rig.controller.running
    assert st_["trial"]["from_profile"] == trial["from"]

    r = await api.post("/v1/trial/abort", json={"reason": "looks slow"}, headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"aborted": True}
    assert rig.controller._manual is not None
    await rig.controller._manual
    assert rig.controller.running == trial["from"]
    switches = (await api.get("/v1/switches")).json()
    assert switches[0]["reason"] == "rollback_trial_failed"
    assert switches[0]["to_profile"] == trial["from"]
    trial_states = [t["state"] for t in switches[1]["trial"]]
    assert trial_states[0] in ("pending", "running") and trial_states[-1] == "failed"
    assert switches[1]["trial"][-1]["detail"]["reason"] == "looks slow"
    assert rig.store.overrides_history()[0]["kind"] == "trial_abort"
    assert (await api.get("/v1/status")).json()["trial"] is None


async def test_warm_start_restores_overrides(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    rig = await make_rig(tmp_path, settings=settings)
    async with _client(rig) as api:
        await api.put("/v1/pin", json={"profile": "eagle3-5step", "ttl_s": 3600}, headers=AUTH)
        await api.put("/v1/pause", json={"ttl_s": 600}, headers=AUTH)
        await api.put("/v1/mode", json={"mode": "advisory"}, headers=AUTH)
        await rig.ticks(3)
        pin_until = rig.controller.overrides.pin_until_s
    await rig.close()

    rig2 = await make_rig(tmp_path, settings=settings, clock=rig.clock)
    try:
        assert rig2.controller.mode.value == "advisory"
        assert rig2.controller.overrides.pin_profile == "eagle3-5step"
        assert rig2.controller.overrides.pin_until_s == pin_until
        assert rig2.controller.overrides.paused_until_s is not None
        assert rig2.controller.state is not None
        async with _client(rig2) as api:
            view = (await api.get("/v1/status")).json()["overrides"]
            assert view["pin"]["profile"] == "eagle3-5step"
            assert view["mode"] == "advisory"
    finally:
        await rig2.close()
    # An override that expired while the controller was down is not restored.
    rig.clock.advance(4000)
    rig3 = await make_rig(tmp_path, settings=settings, clock=rig.clock)
    try:
        assert rig3.controller.overrides.pin_profile is None
        assert rig3.controller.overrides.paused_until_s is None
        assert rig3.controller.mode.value == "advisory"  # mode has no expiry
    finally:
        await rig3.close()


# --------------------------------------------------------------------------------- junk

_WRITES = [
    ("PUT", "/v1/pin"),
    ("DELETE", "/v1/pin"),
    ("PUT", "/v1/pause"),
    ("DELETE", "/v1/pause"),
    ("PUT", "/v1/mode"),
    ("POST", "/v1/trial/abort"),
    ("POST", "/v1/switch"),
    ("POST", "/v1/block/clear"),
]
_OK = {200, 202, 400, 404, 405, 409, 422}
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)  # NaN over the wire: raw bodies below
    | st.text(max_size=30)
    | st.sampled_from(["baseline", "eagle3-2step", "active", "advisory", "eagle3-5step"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_bodies = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "profile": _json_values,
            "ttl_s": _json_values,
            "reason": _json_values,
            "mode": _json_values,
        },
    ),
    _json_values,
)


@pytest.fixture(scope="module")
def junk_rig(tmp_path_factory: pytest.TempPathFactory) -> Any:
    loop = asyncio.new_event_loop()
    tmp = tmp_path_factory.mktemp("junk")
    rig = loop.run_until_complete(make_rig(tmp))
    client = _client(rig)
    yield loop, rig, client
    loop.run_until_complete(client.aclose())
    manual = rig.controller._manual
    if manual is not None and not manual.done():
        loop.run_until_complete(manual)
    loop.run_until_complete(rig.close())
    loop.close()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    endpoint=st.sampled_from(_WRITES),
    body=_bodies,
    raw=st.none() | st.binary(max_size=40),
    query=st.none() | st.text(max_size=20),
)
def test_junk_never_crashes_or_corrupts(
    junk_rig: Any, endpoint: tuple[str, str], body: Any, raw: bytes | None, query: str | None
) -> None:
    loop, rig, client = junk_rig
    method, path = endpoint

    async def go() -> httpx.Response:
        kwargs: dict[str, Any] = {"headers": dict(AUTH)}
        if raw is not None:
            kwargs["content"] = raw
            kwargs["headers"]["content-type"] = "application/json"
        else:
            kwargs["json"] = body
        if query is not None:
            kwargs["params"] = {"reason": query, "ttl_s": query}
        r = await client.request(method, path, **kwargs)
        manual = rig.controller._manual
        if manual is not None and not manual.done():
            await manual
        rig.clock.advance(10)
        await rig.controller.tick()
        return r

    r = loop.run_until_complete(go())
    assert r.status_code in _OK, (method, path, body, raw, r.status_code, r.text)
    if r.status_code == 422:
        assert r.json()["detail"], r.text
    status = loop.run_until_complete(client.get("/v1/status"))
    assert status.status_code == 200
    assert status.json()["profile"] in rig.controller.specs


def test_store_is_intact_after_junk(junk_rig: Any) -> None:
    _, rig, _ = junk_rig
    conn = sqlite3.connect(rig.store.path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    assert rig.store.counts()["decisions"] > 0


def test_deep_nesting_is_not_a_500(junk_rig: Any) -> None:
    loop, _, client = junk_rig
    deep = b"[" * 100_000 + b"]" * 100_000
    r = loop.run_until_complete(
        client.put("/v1/pin", content=deep, headers={**AUTH, "content-type": "application/json"})
    )
    assert r.status_code in (400, 422)
