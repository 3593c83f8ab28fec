"""Findings in the daemon's log (controller/loop.py, Controller._record_findings): a change point,
which every traffic change brings, is logged at INFO; drift and acceptance far below history,
what an operator is to be warned of, at WARNING. Each is recorded in the history either way."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from policies.changepoint import Finding
from tests.controller.ops_support import make_rig


async def test_change_points_are_info_and_drift_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = await make_rig(tmp_path)
    c = rig.controller
    try:
        await rig.ticks(2)
        assert c.state is not None
        now = rig.clock.now()
        c.state.new_findings = [
            Finding("change", "batch", 7.56, 7.11, now),
            Finding("drift", "cycle:eagle3-2step", 20.0, 30.0, now, "ms"),
            Finding("acceptance_low", "accept:eagle3-2step", 0.47, 0.19, now),
        ]
        caplog.set_level(logging.INFO, logger="specpilot.loop")
        c._record_findings(now)
        levels = {
            r.getMessage().split(":")[1].strip(): r.levelno
            for r in caplog.records
            if r.getMessage().startswith("finding:")
        }
        assert levels == {
            "change": logging.INFO,
            "drift": logging.WARNING,
            "acceptance_low": logging.WARNING,
        }
        assert sorted(f["kind"] for f in rig.store.findings()) == [
            "acceptance_low",
            "change",
            "drift",
        ]
    finally:
        await rig.close()
