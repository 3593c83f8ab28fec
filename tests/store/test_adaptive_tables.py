"""The adaptive_tables table (migration m002): generated tables with their estimates."""

from __future__ import annotations

from pathlib import Path

import pytest

from store import Reader, Store, StoreError


def test_record_and_read_adaptive_tables(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with Store(db) as s:
        t1 = {"1": {"candidate_steps": [3]}, "64": {"candidate_steps": [0]}}
        t2 = {"1": {"candidate_steps": [5]}}
        s.record_adaptive_table(10.0, "hybrid", t1, {"alphas": {"chat": 0.8}}, "generated")
        s.record_adaptive_table(20.0, "hybrid", t2, None, "rewrite")
        s.record_adaptive_table(15.0, "other", t1, None, None)
        rows = s.adaptive_tables("hybrid")
        assert [r["reason"] for r in rows] == ["rewrite", "generated"]
        assert rows[1]["table"] == t1
        assert rows[1]["estimates"] == {"alphas": {"chat": 0.8}}
        assert len(s.adaptive_tables()) == 3
        with pytest.raises(StoreError):
            s.record_adaptive_table(1.0, "hybrid", {}, None, None)
    with Reader(db) as r:
        assert r.adaptive_tables(limit=1)[0]["profile"] == "hybrid"
