"""specpilot's SQLite schema as sqlite-utils migrations, and the closed value sets it stores.

Owns table and column definitions (applied in order at open, recorded in `_sqlite_migrations`)
and the StrEnums for the closed sets (switch outcome, trial state, override kind). It must not
read or write rows; store.db does. Add a migration for every change; never edit an applied one.
Times are UTC epoch seconds (`*_s` REAL); JSON columns end in `_json`.
"""

from __future__ import annotations

from enum import StrEnum

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

MIGRATION_SET = "specpilot"


class SwitchOutcome(StrEnum):
    OK = "ok"
    START_FAILED = "start_failed"
    ROLLED_BACK = "rolled_back"
    UNKNOWN = "unknown"  # the daemon lost track (crash mid-switch): blocks automatic switching


class TrialState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCESSFUL = "successful"
    FAILED = "failed"
    INCONCLUSIVE = "inconclusive"


class OverrideKind(StrEnum):
    PIN = "pin"
    PAUSE = "pause"
    MODE = "mode"
    CLEAR_BLOCK = "clear_block"
    UNPIN = "unpin"
    RESUME = "resume"
    TRIAL_ABORT = "trial_abort"
    SWITCH = "switch"  # a one-off switch asked by an operator


migrations = Migrations(MIGRATION_SET)


@migrations()
def m001_initial(db: Database) -> None:
    db["observations"].create(
        {
            "id": int,
            "t_s": float,
            "profile": str,
            "window_s": float,
            "output_tok_s": float,
            "running": float,
            "queue": float,
            "gen_throughput_tok_s": float,
            "accept_length": float,
            "accept_rate": float,
            "num_steps": float,
            "generation_tokens": float,
            "verify_calls": float,
            "decode_tokens": float,
            "decode_passes": float,
            "counter_reset": int,
            "moments_json": str,
            "workloads_json": str,
            "accepted_drafts_hist_json": str,
        },
        pk="id",
        not_null={"t_s", "profile", "window_s", "counter_reset"},
    )
    db["observations"].create_index(["t_s"])
    # Downsampled observations: additive sums per (hour, profile) so that partial hours merged
    # at different retention runs add up exactly; means are computed when read.
    db["observations_hourly"].create(
        {
            "hour_s": int,
            "profile": str,
            "n": int,
            "window_s": float,
            "output_tokens": float,  # sum of output_tok_s * window_s where known
            "output_window_s": float,  # window seconds behind output_tokens
            "running_ws": float,  # sum of running * window_s
            "running_w": float,
            "queue_ws": float,
            "queue_w": float,
            "accept_length_ws": float,
            "accept_length_w": float,
            "accept_rate_ws": float,
            "accept_rate_w": float,
            "generation_tokens": float,
            "verify_calls": float,
            "counter_resets": int,
        },
        pk=("hour_s", "profile"),
        not_null={"hour_s", "profile", "n"},
    )
    db["estimates"].create(
        {
            "id": int,
            "t_s": float,
            "profile": str,
            "workload": str,
            "tok_s_mean": float,
            "tok_s_low": float,
            "tok_s_high": float,
            "tok_s_n": float,
            "accept_length_mean": float,
            "accept_length_low": float,
            "accept_length_high": float,
            "accept_length_n": float,
            "cycle_s_mean": float,
            "cycle_s_low": float,
            "cycle_s_high": float,
            "cycle_s_n": float,
            "breakeven_accept_length": float,
            "observed_tok_s": float,
            "source": str,
        },
        pk="id",
        not_null={"t_s", "profile", "workload"},
    )
    db["estimates"].create_index(["t_s"])
    db["estimates"].create_index(["profile", "workload", "t_s"])
    db["decisions"].create(
        {
            "id": int,
            "t_s": float,
            "action": str,
            "profile": str,
            "reason": str,
            "diagnostics_json": str,
            "mode": str,
            "acted": int,
        },
        pk="id",
        not_null={"t_s", "action", "profile", "reason", "mode", "acted"},
    )
    db["decisions"].create_index(["t_s"])
    db["switches"].create(
        {
            "id": int,
            "from_profile": str,
            "to_profile": str,
            "reason": str,
            "decision_id": int,
            "started_s": float,
            "ended_s": float,
            "downtime_s": float,
            "outcome": str,  # NULL while in flight
            "error": str,
        },
        pk="id",
        not_null={"to_profile", "reason", "started_s"},
    )
    db["switches"].create_index(["started_s"])
    # Append-only: one row per state a trial enters.
    db["trials"].create(
        {
            "id": int,
            "switch_id": int,
            "t_s": float,
            "state": str,
            "predicted_tok_s": float,
            "observed_tok_s": float,
            "detail_json": str,
        },
        pk="id",
        not_null={"switch_id", "t_s", "state"},
        foreign_keys=[("switch_id", "switches", "id")],
    )
    db["trials"].create_index(["switch_id", "t_s"])
    db["overrides"].create(
        {
            "id": int,
            "created_s": float,
            "kind": str,
            "profile": str,
            "mode": str,
            "ttl_s": float,
            "until_s": float,
            "reason": str,
            "actor": str,
        },
        pk="id",
        not_null={"created_s", "kind", "actor"},
    )
    db["overrides"].create_index(["created_s"])
    db["findings"].create(
        {
            "id": int,
            "t_s": float,
            "kind": str,
            "subject": str,
            "numbers_json": str,
            "message": str,
        },
        pk="id",
        not_null={"t_s", "kind", "message"},
    )
    db["findings"].create_index(["t_s"])
    db["state"].create(
        {"key": str, "value_json": str, "updated_s": float},
        pk="key",
        not_null={"value_json"},
    )


@migrations()
def m002_adaptive_tables(db: Database) -> None:
    # Append-only: every adaptive table specpilot generated for a hybrid profile (issue 10), with
    # the estimates it came from and why it was written ("generated", "candidate", "rewrite",
    # "rollback": a failed rewrite's table replaced by the one it had replaced).
    db["adaptive_tables"].create(
        {
            "id": int,
            "t_s": float,
            "profile": str,
            "table_json": str,
            "estimates_json": str,
            "reason": str,
        },
        pk="id",
        not_null={"t_s", "profile", "table_json"},
    )
    db["adaptive_tables"].create_index(["profile", "t_s"])


def known_migrations() -> frozenset[str]:
    """Names of every migration this code defines (read through the public `pending` API)."""
    return frozenset(m.name for m in migrations.pending(Database(memory=True)))
