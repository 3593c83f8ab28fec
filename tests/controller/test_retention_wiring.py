"""The daemon keeps its database bounded: the loop runs Store.apply_retention once per hour of
server time (raw observations folded into hourly rows, old holds and estimates dropped)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from controller.loop import RETENTION_EVERY_S
from store import RetentionPolicy
from tests.controller.ops_support import make_rig


async def test_tick_applies_retention_hourly(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path)
    try:
        store = rig.store
        store.retention = RetentionPolicy(raw_s=1800.0, hourly_s=86400.0)
        runs: list[float] = []
        real = store.apply_retention

        def counting(now_s: float) -> dict[str, Any]:
            runs.append(now_s)
            return real(now_s)

        store.apply_retention = counting  # type: ignore[method-assign]
        recorded = [0]
        record = store.record_observation

        def count_obs(obs: Any) -> int:
            recorded[0] += 1
            return record(obs)

        store.record_observation = count_obs  # type: ignore[method-assign]
        start = rig.clock.now()
        await rig.ticks(3 * 360 + 5)  # three hours and a bit of 10 s polls
        # Once at the first tick, then once per hour of server time.
        assert len(runs) == 4
        assert all(b - a >= RETENTION_EVERY_S for a, b in itertools.pairwise(runs))
        assert runs[0] - start <= 10.0

        now = rig.clock.now()
        oldest = store.observations(limit=1)[0]["t_s"]
        # Raw rows never older than raw_s plus the hour between two runs.
        assert oldest >= now - 1800.0 - RETENTION_EVERY_S - 10.0
        hourly = store.observations_hourly()
        assert hourly and all(h["hour_s"] < now - 1800.0 for h in hourly)
        # Nothing is lost: every observation is either raw or folded into an hourly row.
        assert sum(h["n"] for h in hourly) + store.counts()["observations"] == recorded[0]
        assert any(h["output_tok_s"] for h in hourly)
        assert store.estimates(limit=1_000_000)[-1]["t_s"] >= now - 1800.0 - RETENTION_EVERY_S - 10
        assert rig.controller.maybe_apply_retention(now) is None  # ran within the hour
    finally:
        await rig.close()
