"""Retention: downsample old raw observations into observations_hourly and drop old bulk rows.

Owns the SQL that bounds the database: raw observations older than `raw_s` are folded into
additive hourly sums (so an hour split across two retention runs still adds up) and deleted;
HOLD decisions that did not act and estimates older than `raw_s` are deleted; hourly rows older
than `hourly_s` are deleted. Switches, trials, overrides, findings and acted/switch decisions are
the audit trail and are kept. Runs inside the caller's transaction; it must not commit, vacuum
or decide anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlite_utils import Database

from policies.types import Action

HOUR_S = 3600


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each kind of row is kept, in seconds."""

    # A week of per-poll rows covers the change detector's and the trial's look-back with room
    # for an operator to investigate last week's incident at full resolution.
    raw_s: float = 7 * 86400.0
    # Hourly aggregates are tiny (one row per profile-hour): keep more than a year for
    # seasonality and before/after comparisons across releases.
    hourly_s: float = 400 * 86400.0

    def __post_init__(self) -> None:
        if not (self.raw_s > 0 and self.hourly_s >= self.raw_s):
            raise ValueError(
                f"retention needs raw_s > 0 and hourly_s >= raw_s (got {self.raw_s}, "
                f"{self.hourly_s})"
            )


_DOWNSAMPLE = f"""
INSERT INTO observations_hourly (
    hour_s, profile, n, window_s, output_tokens, output_window_s, running_ws, running_w,
    queue_ws, queue_w, accept_length_ws, accept_length_w, accept_rate_ws, accept_rate_w,
    generation_tokens, verify_calls, counter_resets)
SELECT
    CAST(t_s / {HOUR_S} AS INTEGER) * {HOUR_S} AS hour_s,
    profile,
    COUNT(*),
    TOTAL(window_s),
    TOTAL(output_tok_s * window_s),
    TOTAL(CASE WHEN output_tok_s IS NOT NULL THEN window_s END),
    TOTAL(running * window_s),
    TOTAL(CASE WHEN running IS NOT NULL THEN window_s END),
    TOTAL(queue * window_s),
    TOTAL(CASE WHEN queue IS NOT NULL THEN window_s END),
    TOTAL(accept_length * window_s),
    TOTAL(CASE WHEN accept_length IS NOT NULL THEN window_s END),
    TOTAL(accept_rate * window_s),
    TOTAL(CASE WHEN accept_rate IS NOT NULL THEN window_s END),
    TOTAL(generation_tokens),
    TOTAL(verify_calls),
    TOTAL(counter_reset)
FROM observations
WHERE t_s < :cutoff
GROUP BY hour_s, profile
ON CONFLICT (hour_s, profile) DO UPDATE SET
    n = n + excluded.n,
    window_s = window_s + excluded.window_s,
    output_tokens = output_tokens + excluded.output_tokens,
    output_window_s = output_window_s + excluded.output_window_s,
    running_ws = running_ws + excluded.running_ws,
    running_w = running_w + excluded.running_w,
    queue_ws = queue_ws + excluded.queue_ws,
    queue_w = queue_w + excluded.queue_w,
    accept_length_ws = accept_length_ws + excluded.accept_length_ws,
    accept_length_w = accept_length_w + excluded.accept_length_w,
    accept_rate_ws = accept_rate_ws + excluded.accept_rate_ws,
    accept_rate_w = accept_rate_w + excluded.accept_rate_w,
    generation_tokens = generation_tokens + excluded.generation_tokens,
    verify_calls = verify_calls + excluded.verify_calls,
    counter_resets = counter_resets + excluded.counter_resets
"""


def apply_retention(db: Database, policy: RetentionPolicy, now_s: float) -> dict[str, int]:
    """Downsample and delete; returns row counts per action. Caller owns the transaction."""
    cutoff = now_s - policy.raw_s
    hourly_cutoff = now_s - policy.hourly_s
    out: dict[str, int] = {}
    out["observations_downsampled"] = db.execute(
        "SELECT COUNT(*) FROM observations WHERE t_s < ?", [cutoff]
    ).fetchone()[0]
    db.execute(_DOWNSAMPLE, {"cutoff": cutoff})
    out["observations_deleted"] = db.execute(
        "DELETE FROM observations WHERE t_s < ?", [cutoff]
    ).rowcount
    out["estimates_deleted"] = db.execute("DELETE FROM estimates WHERE t_s < ?", [cutoff]).rowcount
    out["decisions_deleted"] = db.execute(
        "DELETE FROM decisions WHERE t_s < ? AND action = ? AND acted = 0",
        [cutoff, Action.HOLD.value],
    ).rowcount
    out["hourly_deleted"] = db.execute(
        "DELETE FROM observations_hourly WHERE hour_s < ?", [hourly_cutoff]
    ).rowcount
    return out
