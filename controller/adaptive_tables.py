"""The shell's side of hybrid profiles: table files, their SQLite record, their status view.

Owns: the tables the policy starts from (a managed profile's last written file, else its seed
table; an unmanaged profile's own --speculative-adaptive-config, predicted but never rewritten),
writing each managed profile's launch table to its file (Settings.adaptive_table_path, which
Settings.launch_argv passes as --speculative-adaptive-config) whenever the policy's table
changes, recording every generated table with its estimates in `adaptive_tables`, and the
`adaptive_tables` key of GET /v1/status.
Must not: generate or judge tables (policies.hybrid, policies.hybrid_decide do) or start servers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from controller.actuators.envfile import write_atomic
from controller.settings import Settings, _flag_values
from policies.hybrid import parse_table, seed_table

log = logging.getLogger("specpilot.adaptive")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        table = json.loads(path.read_text())
        parse_table(table)
        return table
    except (OSError, ValueError) as e:
        log.warning("adaptive table %s unusable (%s): starting from the seed table", path, e)
        return None


def initial_tables(settings: Settings) -> dict[str, dict[str, Any]]:
    """{profile: {"table", "managed"}} for policies.decide.initial_state."""
    out: dict[str, dict[str, Any]] = {}
    for spec in settings.profile_specs():
        if not spec.adaptive:
            continue
        if settings.managed_adaptive(spec.name):
            path = settings.adaptive_table_path(spec.name)
            table = _read(path) if path.exists() else None
            out[spec.name] = {
                "table": table or seed_table(spec.candidate_steps),
                "managed": True,
            }
        else:
            own = _flag_values(settings.profiles[spec.name].flags).get(
                "--speculative-adaptive-config"
            )
            table = _read(Path(own)) if own else None
            if table is not None:
                out[spec.name] = {"table": table, "managed": False}
    return out


def sync(
    settings: Settings, state: Any, store: Any, on_disk: dict[Path, str] | None = None
) -> list[str]:
    """Write every managed profile's launch table to its file when it differs, then record the
    policy's new tables (events) in SQLite (`store`; None, as in fleet mode: logged).
    Returns the profiles whose file was written.
    `on_disk` (the caller's, kept across ticks) remembers what each file was last written or
    found to hold, so an unchanged table costs a stat per tick instead of a read."""
    hs = getattr(state, "hybrid", None)
    if hs is None:
        return []
    written = []
    for name, t in hs.tables.items():
        if not t.get("managed") or name not in settings.profiles:
            continue
        path = settings.adaptive_table_path(name)
        text = json.dumps(t["table"]) + "\n"
        try:
            if path.exists() and (
                (on_disk is not None and on_disk.get(path) == text) or path.read_text() == text
            ):
                if on_disk is not None:
                    on_disk[path] = text
                continue
        except OSError:
            pass
        write_atomic(path, text, mode=0o644)
        if on_disk is not None:
            on_disk[path] = text
        written.append(name)
        log.info("adaptive table for %s written to %s", name, path)
    # The files first: a launch needs its table even where the history cannot be written.
    for ev in hs.drain_events():
        if store is None:
            log.info("adaptive table for %s generated (%s)", ev["profile"], ev.get("reason"))
            continue
        store.record_adaptive_table(
            ev["t_s"], ev["profile"], ev["table"], ev.get("estimates"), ev.get("reason")
        )
    return written


def status_view(state: Any) -> dict[str, Any]:
    """GET /v1/status `adaptive_tables`: per adaptive profile, the table its next launch gets,
    the one its running server has, a newer one waiting for a restart that pays, and why."""
    hs = getattr(state, "hybrid", None)
    if hs is None:
        return {}
    return {
        name: {
            "managed": t.get("managed"),
            "table": t.get("table"),
            "running_table": t.get("running_table"),
            "candidate_table": t.get("candidate"),
            "t_s": t.get("t_s"),
            "reason": t.get("reason"),
        }
        for name, t in hs.tables.items()
    }
