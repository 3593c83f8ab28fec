"""SQLite persistence for specpilot (sqlite-utils): one writer, readers on their own connections.

Public surface: `Store` (writer + reads), `Reader` (read-only), `RetentionPolicy`, `StoreError`,
the closed value sets `SwitchOutcome`, `TrialState`, `OverrideKind`, `ALL_WORKLOADS` and
`EXPORTABLE_TABLES`.
Imports policies' types only; no HTTP, no policy logic.
"""

from store.db import ALL_WORKLOADS, EXPORTABLE_TABLES, Reader, Store, StoreError
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
]
