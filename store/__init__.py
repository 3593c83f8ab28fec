"""SQLite persistence for specpilot (sqlite-utils): one writer, readers on their own connections.

Public surface: `Store` (writer + reads), `Reader` (read-only), `RetentionPolicy`, `StoreError`,
the closed value sets `SwitchOutcome`, `TrialState`, `OverrideKind`, `ALL_WORKLOADS` and
`EXPORTABLE_TABLES`, and `writer_lock` (the database's single-writer lock alone, for fleet mode).
Imports policies' types only; no HTTP, no policy logic.
"""

from store.db import ALL_WORKLOADS, EXPORTABLE_TABLES, Reader, Store, StoreError, writer_lock
from store.retention import RetentionPolicy
from store.schema import OverrideKind, SwitchOutcome, TrialState

__all__ = [
    "ALL_WORKLOADS",
    "EXPORTABLE_TABLES",
    "OverrideKind",
    "Reader",
    "RetentionPolicy",
    "Store",
    "StoreError",
    "SwitchOutcome",
    "TrialState",
    "writer_lock",
]
