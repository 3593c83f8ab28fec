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
        # A change after baseline's last window: its data is stale from here on.
        c.state.last_model_change_s = rig.clock.now()
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
