"""Hybrid profiles in the shell: kind = "adaptive" with candidate_steps, the generated table's
file on the launch command line, its SQLite record and the status view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller import adaptive_tables
from controller.settings import ConfigError, settings_from_dict
from policies import decide
from policies.hybrid import parse_table, table_steps
from policies.settings import PolicySettings
from store import Store


def _cfg(tmp_path: Path, **hybrid: object) -> dict:
    prof = {
        "kind": "adaptive",
        "flags": [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-num-steps",
            "1",
            "--speculative-adaptive",
        ],
        **hybrid,
    }
    return {
        "controller": {"database": str(tmp_path / "state" / "sp.db")},
        "server": {"initial_profile": "baseline"},
        "profiles": {"baseline": {}, "hybrid": prof},
    }


def test_candidate_steps_validated_and_resolved(tmp_path: Path) -> None:
    s = settings_from_dict(_cfg(tmp_path, candidate_steps=[3, 0, 2, 2]))
    spec = {p.name: p for p in s.profile_specs()}["hybrid"]
    assert spec.adaptive and spec.candidate_steps == (0, 2, 3) and spec.num_steps == 1
    with pytest.raises(ConfigError, match="candidate_steps"):
        settings_from_dict(_cfg(tmp_path, candidate_steps=[]))
    bad = _cfg(tmp_path)
    bad["profiles"]["baseline"] = {"candidate_steps": [1]}
    with pytest.raises(ConfigError, match="kind = 'adaptive'"):
        settings_from_dict(bad)
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"1": {"candidate_steps": [1, 3]}}))
    cfg = _cfg(tmp_path, candidate_steps=[1])
    cfg["profiles"]["hybrid"]["flags"] += ["--speculative-adaptive-config", str(own)]
    with pytest.raises(ConfigError, match="the table is yours"):
        settings_from_dict(cfg)


def test_launch_argv_carries_the_generated_table(tmp_path: Path) -> None:
    s = settings_from_dict(_cfg(tmp_path, candidate_steps=[0, 2]))
    argv = s.launch_argv("hybrid")
    i = argv.index("--speculative-adaptive-config")
    path = Path(argv[i + 1])
    assert path == tmp_path / "state" / "adaptive-hybrid.json"
    assert set(table_steps(json.loads(path.read_text()))) <= {0, 2}  # the seed, restricted
    assert "--speculative-adaptive-config" not in s.launch_argv("baseline")
    assert "--speculative-adaptive-config" not in s.launch_argv("hybrid", extra_flags=[])


def test_sync_writes_files_records_tables_and_status(tmp_path: Path) -> None:
    s = settings_from_dict(_cfg(tmp_path, candidate_steps=[0, 1, 2]))
    tables = adaptive_tables.initial_tables(s)
    assert tables["hybrid"]["managed"] is True
    state = decide.initial_state(
        s.profile_specs(), "baseline", 0.0, PolicySettings(), adaptive_tables=tables
    )
    assert state.hybrid is not None
    new = {"1": {"candidate_steps": [2]}, "8": {"candidate_steps": [0]}}
    state.hybrid.tables["hybrid"]["table"] = new
    state.hybrid.events.append(
        {
            "t_s": 5.0,
            "profile": "hybrid",
            "table": new,
            "estimates": {"x": 1},
            "reason": "generated",
        }
    )
    with Store(tmp_path / "state" / "sp.db") as store:
        assert adaptive_tables.sync(s, state, store) == ["hybrid"]
        assert adaptive_tables.sync(s, state, store) == []  # unchanged: not rewritten
        rows = store.adaptive_tables("hybrid")
        assert len(rows) == 1 and rows[0]["table"] == new and rows[0]["reason"] == "generated"
    path = s.adaptive_table_path("hybrid")
    assert parse_table(json.loads(path.read_text())) == parse_table(new)
    view = adaptive_tables.status_view(state)
    assert view["hybrid"]["table"] == new and view["hybrid"]["managed"] is True
    # A restart of the controller starts from the file it wrote.
    again = adaptive_tables.initial_tables(s)
    assert again["hybrid"]["table"] == new


def test_sync_with_a_cache_does_not_reread_an_unchanged_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = settings_from_dict(_cfg(tmp_path, candidate_steps=[0, 1, 2]))
    tables = adaptive_tables.initial_tables(s)
    state = decide.initial_state(
        s.profile_specs(), "baseline", 0.0, PolicySettings(), adaptive_tables=tables
    )
    assert state.hybrid is not None
    state.hybrid.tables["hybrid"]["table"] = {"1": {"candidate_steps": [2]}}
    written: dict[Path, str] = {}
    with Store(tmp_path / "state" / "sp.db") as store:
        assert adaptive_tables.sync(s, state, store, written) == ["hybrid"]
        reads: list[Path] = []
        real = Path.read_text

        def counting(self: Path, *a: object, **k: object) -> str:
            reads.append(self)
            return real(self, *a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "read_text", counting)
        assert adaptive_tables.sync(s, state, store, written) == []
        assert reads == []
        # A file removed behind its back is written again.
        s.adaptive_table_path("hybrid").unlink()
        assert adaptive_tables.sync(s, state, store, written) == ["hybrid"]
