"""The loop's predictions (status, estimates table, metrics, a trial's baseline) are the ones
decide weighs: with the configured `[policy] stale_widen`, not the function's default."""

from __future__ import annotations

import math
from pathlib import Path

from policies import decide as policy
from tests.controller.ops_support import ProfileModel, make_rig, make_settings


async def test_predictions_use_the_configured_stale_widen(tmp_path: Path) -> None:
    base = make_settings(tmp_path)
    settings = base.model_copy(update={"policy": {**base.policy, "stale_widen": 5.0}})
    rig = await make_rig(tmp_path, settings=settings)
    c = rig.controller
    try:
        assert c.psettings.stale_widen == 5.0
        for i in range(30):  # baseline with some spread in its cycle time
            step_s = 0.030 * (1 + 0.1 * math.sin(i))
            rig.server.models["baseline"] = ProfileModel(step_s=step_s, accept_length=1.0)
            await rig.ticks(1)
        c.pin("eagle3-2step", None, "measure 2-step", "test")
        await rig.ticks(2)
        assert c.running == "eagle3-2step"
        assert c.state is not None
        # A change in step time after baseline's last window: its data is stale from here on.
        c.state.last_model_change_s = c.state.last_cycle_change_s = rig.clock.now()
        await rig.ticks(3)
        configured = {p.profile: p.tok_s for p in policy.predictions(c.state, 5.0)}
        default = {p.profile: p.tok_s for p in policy.predictions(c.state)}
        assert configured["baseline"] != default["baseline"]  # staleness widens the interval
        assert {p.profile: p.tok_s for p in c.predictions} == configured
        view = next(e for e in c.status()["estimates"] if e["profile"] == "baseline")
        assert configured["baseline"] is not None
        assert view["tok_s"] == configured["baseline"].to_dict()
    finally:
        await rig.close()


async def test_status_shows_the_routing_and_the_roofline(tmp_path: Path) -> None:
    """/v1/status's forward_cost: the routing in force and where it came from, and the
    roofline fitted over the served batch sizes once there are enough of them."""
    from policies.types import DecodeMoments

    base = make_settings(tmp_path)
    settings = base.model_copy(
        update={"policy": {**base.policy, "moe_experts": 384, "moe_topk": 8}}
    )
    rig = await make_rig(tmp_path, settings=settings)
    c = rig.controller
    try:
        view = c.status()["forward_cost"]
        assert view["moe_experts"] == 384 and view["moe_topk"] == 8
        assert view["routing_from"] == "[policy]" and view["roofline"] is None
        assert c.state is not None
        cycle = c.state.model.cycle
        share = 8 / 384
        t = 0.0
        for name, n in (("baseline", 1), ("eagle3-2step", 3)):
            for b in (1, 4, 16, 48):
                y = 0.010 + (0.005 if n > 1 else 0.0) + 0.6 * (1 - (1 - share) ** (b * n))
                for _ in range(4):
                    t += 10.0
                    k = 10.0 / y
                    cycle.update(
                        name, DecodeMoments(k, k * b, 10.0, k * b * b, 10.0 * b, k), t, 10.0
                    )
        roof = c.status()["forward_cost"]["roofline"]
        assert roof is not None and roof["points"] == 8 and roof["used"] is True
        assert roof["rel_rms"] < 0.01
        assert abs(roof["all_experts_ms"] - 600.0) < 10.0
        assert roof["compute_bound_above_tokens"] == math.inf
    finally:
        await rig.close()
