"""The SQLite store: one writer (`Store`), readers on their own connections (`Reader`).

Owns opening the database (WAL, incremental auto-vacuum, migrations applied at open), the typed
write functions (one transaction each, or one per tick through `Store.batch()`), the read
functions and retention. Every value is sanitised before it is bound: non-finite numbers become
NULL, enums their value, JSON columns are strict JSON; a write that cannot be made raises
StoreError and leaves nothing behind (the transaction rolls back). It must not do HTTP and must
not make policy decisions (it stores what the policy decided).

Durability: WAL with synchronous=NORMAL. Every committed write survives a crash or restart of
the process; a power loss may drop the last transactions (not corrupt the file).

One writer per database: `Store` takes an exclusive lock (filelock's FileLock: flock on POSIX)
on the lock file `<database>.lock` beside the database before it opens it, holds it until
`close()` (or the process ends: the kernel drops it, so a killed daemon never leaves a stale
lock) and writes its pid in it. A `Store` on the same database in another process (a second
daemon) is refused at once with StoreError "database X is in use by another specpilot (pid N)"
before the database is even read; the Stores of one process share the lock. Readers (`Reader`:
the API's read connection, `specpilot history/export/report`) take no lock and are never
blocked. The lock file is left in place on close; its content is only informative.

Opening fails with one-line StoreError naming the database for every problem found at open: a
path that is a directory, a file that is not (or no longer) a database, one written by a newer
specpilot, a schema that is not valid UTF-8, and a file that cannot be written (read-only file
or file system): a write probe (a header write, rolled back) runs at open, so that it is not
every later write that fails.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from enum import Enum
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from sqlite_utils import Database

from policies.types import (
    Decision,
    Estimate,
    Mode,
    Observation,
    Overrides,
    ProfilePrediction,
)
from store import schema
from store.retention import RetentionPolicy, apply_retention
from store.schema import OverrideKind, SwitchOutcome, TrialState

__all__ = [
    "ALL_WORKLOADS",
    "EXPORTABLE_TABLES",
    "Reader",
    "Store",
    "StoreError",
    "lock_path",
    "writer_lock",
]

# Workload key of estimates for the traffic mix as served (not one workload).
ALL_WORKLOADS = "*"
_MAX_TEXT = 16_384  # bound free text (error messages, reasons) so one bad row cannot bloat
_BUSY_TIMEOUT_S = 5.0
# The history tables a person may export (`specpilot export`, export_rows).
EXPORTABLE_TABLES = (
    "observations",
    "observations_hourly",
    "estimates",
    "decisions",
    "switches",
    "trials",
    "overrides",
    "findings",
)
_STATE_OVERRIDES = "overrides"


class StoreError(Exception):
    """A store operation failed (bad input, unknown id, I/O error, newer schema); nothing was
    written."""


# ---------------------------------------------------------------------------- sanitising


def _num(x: Any) -> float | None:
    """A finite float, or None (missing and non-finite are both stored as NULL)."""
    if x is None or isinstance(x, str):
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _time(x: Any, what: str) -> float:
    f = _num(x)
    if f is None:
        raise StoreError(f"{what} must be a finite number of seconds, got {x!r}")
    return f


def _text(x: Any) -> str | None:
    if x is None:
        return None
    s = x.value if isinstance(x, Enum) else x
    s = s if isinstance(s, str) else str(s)
    return s[:_MAX_TEXT]


def _required_text(x: Any, what: str) -> str:
    s = _text(x)
    if s is None or s == "":
        raise StoreError(f"{what} is required, got {x!r}")
    return s


def _choice(x: Any, enum: type[Enum], what: str) -> str:
    try:
        return str(enum(x.value if isinstance(x, Enum) else x).value)
    except ValueError:
        allowed = "|".join(str(e.value) for e in enum)
        raise StoreError(f"{what} must be one of {allowed}, got {x!r}") from None


def _jsonable(x: Any, depth: int = 0) -> Any:
    """Plain JSON values only: non-finite -> None, enums -> value, tuples -> lists, dataclasses
    -> dicts, anything else -> str (never raises)."""
    if depth > 32:
        return str(x)[:_MAX_TEXT]
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Enum):
        return _jsonable(x.value, depth + 1)
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, list | tuple | set | frozenset):
        return [_jsonable(v, depth + 1) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x), depth + 1)
    f = _num(x)  # numpy scalars and the like
    if f is not None or _is_nan_like(x):
        return f
    return str(x)[:_MAX_TEXT]


def _is_nan_like(x: Any) -> bool:
    try:
        return math.isnan(float(x))
    except (TypeError, ValueError, OverflowError):
        return False


def _json(x: Any) -> str | None:
    if x is None:
        return None
    return json.dumps(_jsonable(x), allow_nan=False, separators=(",", ":"))


def _row(d: Mapping[str, Any]) -> dict[str, Any]:
    """Decode a row: `x_json` columns become `x` (parsed), `acted`/`counter_reset` booleans."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if k.endswith("_json"):
            out[k[:-5]] = json.loads(v) if v is not None else None
        elif k in ("acted", "counter_reset"):
            out[k] = bool(v) if v is not None else None
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------- reads


class _Reads:
    """Read functions shared by the writer and the readers. Lists are newest first except
    time series (observations, observations_hourly, export_rows), which run oldest first."""

    db: Database

    def _rows(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> list[dict]:
        try:
            cur = self.db.execute(sql, params)
            cols = [c[0] for c in cur.description]
            return [_row(dict(zip(cols, r, strict=True))) for r in cur.fetchall()]
        except (sqlite3.Error, UnicodeDecodeError) as exc:
            raise StoreError(f"read failed: {exc}") from exc

    @staticmethod
    def _since(col: str, since_s: float | None, until_s: float | None = None) -> tuple[str, list]:
        where, params = [], []
        if since_s is not None:
            where.append(f"{col} >= ?")
            params.append(float(since_s))
        if until_s is not None:
            where.append(f"{col} < ?")
            params.append(float(until_s))
        return (" WHERE " + " AND ".join(where) if where else ""), params

    def latest_time_s(self) -> float | None:
        """The latest time any row or saved state carries (None: an empty history)."""
        cols = (
            ("observations", "t_s"),
            ("observations_hourly", "hour_s"),
            ("estimates", "t_s"),
            ("decisions", "t_s"),
            ("switches", "started_s"),
            ("switches", "ended_s"),
            ("trials", "t_s"),
            ("overrides", "created_s"),
            ("findings", "t_s"),
            ("state", "updated_s"),
            ("adaptive_tables", "t_s"),
        )
        sql = " UNION ALL ".join(f"SELECT MAX({c}) AS t FROM {t}" for t, c in cols)
        rows = self._rows(f"SELECT MAX(t) AS t FROM ({sql})")
        t = rows[0]["t"] if rows else None
        return None if t is None else float(t)

    def recent_decisions(self, limit: int = 100, since_s: float | None = None) -> list[dict]:
        where, params = self._since("t_s", since_s)
        return self._rows(
            f"SELECT * FROM decisions{where} ORDER BY t_s DESC, id DESC LIMIT ?",
            [*params, int(limit)],
        )

    def switches(self, limit: int = 100, since_s: float | None = None) -> list[dict]:
        where, params = self._since("started_s", since_s)
        return self._rows(
            f"SELECT * FROM switches{where} ORDER BY started_s DESC, id DESC LIMIT ?",
            [*params, int(limit)],
        )

    def open_switch(self) -> dict | None:
        """The switch still in flight (no outcome), if any: after a restart the controller
        must settle it (usually as `unknown`)."""
        rows = self._rows("SELECT * FROM switches WHERE outcome IS NULL ORDER BY id DESC LIMIT 1")
        return rows[0] if rows else None

    def trials(self, switch_id: int | None = None, limit: int = 100) -> list[dict]:
        if switch_id is None:
            return self._rows(
                "SELECT * FROM trials ORDER BY t_s DESC, id DESC LIMIT ?", [int(limit)]
            )
        return self._rows(
            "SELECT * FROM trials WHERE switch_id = ? ORDER BY t_s DESC, id DESC LIMIT ?",
            [int(switch_id), int(limit)],
        )

    def overrides_history(self, limit: int = 100, since_s: float | None = None) -> list[dict]:
        where, params = self._since("created_s", since_s)
        return self._rows(
            f"SELECT * FROM overrides{where} ORDER BY created_s DESC, id DESC LIMIT ?",
            [*params, int(limit)],
        )

    def adaptive_tables(self, profile: str | None = None, limit: int = 100) -> list[dict]:
        """Generated adaptive tables, newest first (optionally one profile's)."""
        if profile is None:
            return self._rows(
                "SELECT * FROM adaptive_tables ORDER BY t_s DESC, id DESC LIMIT ?", [int(limit)]
            )
        return self._rows(
            "SELECT * FROM adaptive_tables WHERE profile = ? ORDER BY t_s DESC, id DESC LIMIT ?",
            [profile, int(limit)],
        )

    def findings(
        self, limit: int = 100, since_s: float | None = None, kind: str | None = None
    ) -> list[dict]:
        where, params = self._since("t_s", since_s)
        if kind is not None:
            where += (" AND" if where else " WHERE") + " kind = ?"
            params.append(kind)
        return self._rows(
            f"SELECT * FROM findings{where} ORDER BY t_s DESC, id DESC LIMIT ?",
            [*params, int(limit)],
        )

    def estimates(
        self,
        since_s: float | None = None,
        profile: str | None = None,
        workload: str | None = None,
        limit: int = 1000,
    ) -> list[dict]:
        where, params = self._since("t_s", since_s)
        for col, val in (("profile", profile), ("workload", workload)):
            if val is not None:
                where += (" AND" if where else " WHERE") + f" {col} = ?"
                params.append(val)
        return self._rows(
            f"SELECT * FROM estimates{where} ORDER BY t_s DESC, id DESC LIMIT ?",
            [*params, int(limit)],
        )

    def latest_estimates(self) -> list[dict]:
        """The newest estimate row of each (profile, workload)."""
        return self._rows(
            "SELECT e.* FROM estimates e JOIN (SELECT profile, workload, MAX(id) AS id "
            "FROM estimates GROUP BY profile, workload) m ON e.id = m.id "
            "ORDER BY e.profile, e.workload"
        )

    def observations(
        self,
        since_s: float | None = None,
        until_s: float | None = None,
        profile: str | None = None,
        limit: int | None = None,
    ) -> list[dict]:
        where, params = self._since("t_s", since_s, until_s)
        if profile is not None:
            where += (" AND" if where else " WHERE") + " profile = ?"
            params.append(profile)
        lim = " LIMIT ?" if limit is not None else ""
        if limit is not None:
            params.append(int(limit))
        return self._rows(f"SELECT * FROM observations{where} ORDER BY t_s, id{lim}", params)

    def observations_hourly(
        self, since_s: float | None = None, until_s: float | None = None
    ) -> list[dict]:
        """Hourly aggregates with their means: output_tok_s (window-weighted), running, queue,
        accept_length, accept_rate (window-weighted gauges) and the tokenizer accept length
        generation_tokens / verify_calls; None where nothing was known."""
        where, params = self._since("hour_s", since_s, until_s)
        rows = self._rows(f"SELECT * FROM observations_hourly{where} ORDER BY hour_s", params)
        for r in rows:
            r["output_tok_s"] = _ratio(r["output_tokens"], r["output_window_s"])
            for g in ("running", "queue", "accept_length", "accept_rate"):
                r[g] = _ratio(r[f"{g}_ws"], r[f"{g}_w"])
            r["tokenizer_accept_length"] = _ratio(r["generation_tokens"], r["verify_calls"])
        return rows

    def load_state(self, key: str) -> dict | None:
        rows = self._rows("SELECT value_json FROM state WHERE key = ?", [key])
        return rows[0]["value"] if rows else None

    def load_overrides(self) -> Overrides | None:
        """The operator overrides last saved with Store.save_overrides (warm start)."""
        d = self.load_state(_STATE_OVERRIDES)
        if d is None:
            return None
        try:
            return Overrides(
                pin_profile=d.get("pin_profile"),
                pin_until_s=d.get("pin_until_s"),
                paused_until_s=d.get("paused_until_s"),
                mode=Mode(d.get("mode", Mode.ACTIVE.value)),
                blocked_reason=d.get("blocked_reason"),
            )
        except (ValueError, AttributeError) as exc:
            raise StoreError(f"saved overrides are unreadable: {exc}") from exc

    def export_rows(
        self, table: str, since_s: float | None = None, until_s: float | None = None
    ) -> Iterator[dict]:
        """All rows of one history table in time order (for CLI export), streamed."""
        if table not in EXPORTABLE_TABLES:
            raise StoreError(f"unknown table {table!r}; one of {', '.join(EXPORTABLE_TABLES)}")
        col = {
            "observations_hourly": "hour_s",
            "switches": "started_s",
            "overrides": "created_s",
        }.get(table, "t_s")
        where, params = self._since(col, since_s, until_s)
        try:
            cur = self.db.execute(f"SELECT * FROM {table}{where} ORDER BY {col}", params)
            cols = [c[0] for c in cur.description]
            for r in cur:
                yield _row(dict(zip(cols, r, strict=True)))
        except sqlite3.Error as exc:
            raise StoreError(f"export of {table} failed: {exc}") from exc

    def counts(self) -> dict[str, int]:
        """Row count of every table (for status output and tests)."""
        return {t: self.db[t].count for t in (*EXPORTABLE_TABLES, "state")}


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


# ---------------------------------------------------------------------------- connections


def _connect(path: str | Path, *, readonly: bool) -> sqlite3.Connection:
    p = Path(path)
    try:
        if readonly:
            if not p.exists():
                raise StoreError(f"database {p} does not exist")
            conn = sqlite3.connect(
                f"{p.resolve().as_uri()}?mode=ro",
                uri=True,
                timeout=_BUSY_TIMEOUT_S,
                check_same_thread=False,
            )
        else:
            # check_same_thread off: the daemon may hand writes to a worker thread; Store
            # serialises them with its own lock.
            conn = sqlite3.connect(str(p), timeout=_BUSY_TIMEOUT_S, check_same_thread=False)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open database {p}: {exc}") from exc
    try:
        conn.execute("PRAGMA schema_version").fetchone()  # fails now on a non-database file
    except (sqlite3.Error, UnicodeDecodeError) as exc:
        conn.close()
        raise StoreError(f"cannot open database {p}: {_why(exc)}") from exc
    return conn


def _why(exc: BaseException) -> str:
    """One line for an error met while opening: sqlite's message, or what a decoding error
    means (a damaged schema: sqlite_master holds text that is not UTF-8)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"database disk image is malformed (its schema is not valid UTF-8: {exc})"
    return " ".join(str(exc).split()) or type(exc).__name__


def lock_path(database: str | Path) -> Path:
    """The lock file of a database's single writer: `<database>.lock`, beside it."""
    p = Path(database)
    return p.with_name(p.name + ".lock")


def _write_pid(fd: int) -> None:
    """The holder's pid into the lock file it just locked (informative only: the lock is what
    counts; a contender's open leaves it in place)."""
    with suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _lock_holder(path: Path) -> str:
    """'pid N' from a held lock file ('pid unknown' when it is empty or unreadable)."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        text = ""
    return f"pid {int(text)}" if text.isdigit() else "pid unknown"


class _WriterLock:
    """The exclusive lock on `<database>.lock` a Store holds for its lifetime (filelock's
    FileLock: flock on POSIX, dropped by the kernel when the process dies; one lock object per
    path in this process, reentrant, so the Stores of one process share it: module doc)."""

    def __init__(self, database: Path) -> None:
        path = lock_path(database)
        self._lock = FileLock(
            path, timeout=0, thread_local=False, is_singleton=True, on_acquired=_write_pid
        )
        try:
            self._lock.acquire()
        except Timeout:
            raise StoreError(
                f"database {database} is in use by another specpilot ({_lock_holder(path)})"
            ) from None
        except OSError as exc:
            raise StoreError(
                f"cannot lock database {database}: {path}: {exc.strerror or exc}"
            ) from None
        self._held = True

    def release(self) -> None:
        """Drop this Store's share of the lock (idempotent); the last one unlocks the file."""
        if self._held:
            self._held = False
            self._lock.release()


def writer_lock(database: str | Path) -> _WriterLock:
    """The single-writer lock of `database`, which a Store takes before its first read and
    fleet mode takes alone (it keeps no SQLite record, yet a second specpilot must not drive
    the same deployment): StoreError, naming the holder, when another specpilot holds it.
    `release()` drops it. Creates the database's directory."""
    path = Path(database)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot open database {path}: cannot create {path.parent}: {exc.strerror or exc}"
        ) from None
    return _WriterLock(path)


class Reader(_Reads):
    """A read-only connection of its own (API handlers, CLI), never blocking the writer."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.db = Database(_connect(self.path, readonly=True))

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Store(_Reads):
    """The single writer. Open once per daemon; every write is one transaction (or part of the
    caller's `batch()`), so a restart never loses a committed row. Holds the database's writer
    lock from open to `close()`; opening raises StoreError (one line, naming the database) for
    a database that cannot be used or that another process writes (module doc)."""

    def __init__(self, path: str | Path, *, retention: RetentionPolicy | None = None) -> None:
        self.path = Path(path)
        self.retention = retention or RetentionPolicy()
        self._lock = threading.RLock()
        # Before the first byte is read: a second writer must not migrate, repair or write.
        self._writer_lock = writer_lock(self.path)
        try:
            self.db = Database(_connect(self.path, readonly=False))
        except BaseException:
            self._writer_lock.release()
            raise
        try:
            self._prepare()
        except (sqlite3.Error, UnicodeDecodeError) as exc:
            self._close_all()
            raise StoreError(f"cannot prepare database {self.path}: {_why(exc)}") from exc
        except BaseException:
            self._close_all()
            raise

    def _prepare(self) -> None:
        """The foreign-file check, pragmas, the newer-schema check, migrations and the write
        probe (all at open)."""
        tables = self.db.table_names()
        if tables and not schema.migrations.applied(self.db):
            # Another application's database (a typo in `database`, a shared path): refused
            # before WAL mode or a table of ours is written into it.
            shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
            raise StoreError(
                f"database {self.path} is not specpilot's: it holds other tables ({shown}); "
                "name a file of its own"
            )
        if not tables:
            # Must precede the first table: lets retention hand freed pages back to the OS.
            self.db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        self.db.enable_wal()
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("PRAGMA foreign_keys = ON")
        applied = {m.name for m in schema.migrations.applied(self.db)}
        unknown = applied - schema.known_migrations()
        if unknown:
            raise StoreError(
                f"database {self.path} was written by a newer specpilot "
                f"(unknown migrations: {', '.join(sorted(unknown))})"
            )
        schema.migrations.apply(self.db)
        self._write_probe()

    def _write_probe(self) -> None:
        """A read-only file (mode 444 for this user, chattr +i, a read-only mount) opens and
        reads; only its first write would fail, then every tick's. Write page 1 (the header's
        user_version, set to what it is) in a transaction rolled back: it fails now if the file
        cannot be written, and changes nothing. BEGIN IMMEDIATE alone succeeds in WAL mode."""
        conn = self.db.conn
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(f"PRAGMA user_version = {version}")
            finally:
                conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write database {self.path}: {_why(exc)}") from exc

    def _close_all(self) -> None:
        try:
            self.db.close()
        finally:
            self._writer_lock.release()

    # -- lifecycle

    def close(self) -> None:
        """Close the connection and release the writer lock (idempotent)."""
        with self._lock:
            self._close_all()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reader(self) -> Reader:
        return Reader(self.path)

    @contextmanager
    def batch(self) -> Iterator[Store]:
        """One transaction around several writes (a tick): all or nothing."""
        with self._lock:
            try:
                with self.db.atomic():
                    yield self
            except sqlite3.Error as exc:
                raise StoreError(f"write failed: {exc}") from exc

    @contextmanager
    def _tx(self) -> Iterator[None]:
        with self._lock:
            try:
                with self.db.atomic():
                    yield
            except sqlite3.Error as exc:
                raise StoreError(f"write failed: {exc}") from exc

    def _insert(self, table: str, row: dict[str, Any]) -> int:
        with self._tx():
            cur = self.db.execute(
                f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                list(row.values()),
            )
            rowid = cur.lastrowid
        if rowid is None:
            raise StoreError(f"insert into {table} returned no row id")
        return int(rowid)

    # -- observations

    @staticmethod
    def _observation_row(obs: Observation) -> dict[str, Any]:
        verified = obs.verified_accept_length
        try:
            output = obs.output_tok_s
        except (TypeError, ZeroDivisionError):
            output = None
        return {
            "t_s": _time(obs.t_s, "observation t_s"),
            "profile": _required_text(obs.profile, "observation profile"),
            "window_s": _time(obs.window_s, "observation window_s"),
            "output_tok_s": _num(output),
            "running": _num(obs.running_reqs),
            "queue": _num(obs.queue_reqs),
            "gen_throughput_tok_s": _num(obs.gen_throughput_tok_s),
            # No accept length (nor rate) where nothing was verified: a 0 would plot as one
            # and pull the hourly means down.
            "accept_length": _num(verified),
            "accept_rate": _num(obs.spec_accept_rate if verified is not None else None),
            "num_steps": _num(obs.spec_num_steps),
            "generation_tokens": _num(obs.generation_tokens),
            "verify_calls": _num(obs.verify_calls),
            "decode_tokens": _num(obs.decode_tokens),
            "decode_passes": _num(obs.decode_passes),
            "counter_reset": 1 if obs.counter_reset else 0,
            "moments_json": _json(obs.moments),
            "workloads_json": _json(list(obs.workloads)) if obs.workloads else None,
            "accepted_drafts_hist_json": _json(obs.accepted_drafts_hist),
        }

    def record_observation(self, obs: Observation) -> int:
        return self._insert("observations", self._observation_row(obs))

    def record_observations(self, observations: Sequence[Observation]) -> int:
        """Many observations in one transaction (replays, imports); returns the count."""
        rows = [self._observation_row(o) for o in observations]
        if not rows:
            return 0
        with self._tx():
            self.db["observations"].insert_all(rows, batch_size=500)
        return len(rows)

    # -- estimates and decisions

    def record_estimates(
        self, t_s: float, preds: Sequence[ProfilePrediction], workload: str = ALL_WORKLOADS
    ) -> int:
        """One row per prediction (the per-profile estimates behind a decision); returns the
        number of rows written."""
        t = _time(t_s, "estimate t_s")
        w = _required_text(workload, "workload")
        rows = []
        for p in preds:
            row: dict[str, Any] = {
                "t_s": t,
                "profile": _required_text(p.profile, "prediction profile"),
                "workload": w,
                "breakeven_accept_length": _num(p.breakeven_accept_length),
                "observed_tok_s": _num(p.observed_tok_s),
                "source": _text(p.source),
            }
            for name, est in (
                ("tok_s", p.tok_s),
                ("accept_length", p.accept_length),
                ("cycle_s", p.cycle_s),
            ):
                e: Estimate | None = est
                row[f"{name}_mean"] = _num(e.mean) if e is not None else None
                row[f"{name}_low"] = _num(e.low) if e is not None else None
                row[f"{name}_high"] = _num(e.high) if e is not None else None
                row[f"{name}_n"] = _num(e.n) if e is not None else None
            rows.append(row)
        if rows:
            with self._tx():
                self.db["estimates"].insert_all(rows, batch_size=500)
        return len(rows)

    def record_decision(self, d: Decision, mode: Mode | str, acted: bool) -> int:
        return self._insert(
            "decisions",
            {
                "t_s": _time(d.t_s, "decision t_s"),
                "action": _required_text(d.action, "decision action"),
                "profile": _required_text(d.profile, "decision profile"),
                "reason": _required_text(d.reason, "decision reason"),
                "diagnostics_json": _json(dict(d.diagnostics)),
                "mode": _choice(mode, Mode, "mode"),
                "acted": 1 if acted else 0,
            },
        )

    # -- switches and trials

    def start_switch(
        self,
        from_profile: str | None,
        to_profile: str,
        reason: str,
        started_s: float,
        decision_id: int | None = None,
    ) -> int:
        """Record the start of a restart into `to_profile`; refuses while another is open (one
        switch in flight)."""
        row = {
            "from_profile": _text(from_profile),
            "to_profile": _required_text(to_profile, "to_profile"),
            "reason": _required_text(reason, "switch reason"),
            "decision_id": int(decision_id) if decision_id is not None else None,
            "started_s": _time(started_s, "started_s"),
        }
        with self._tx():
            open_ = self.open_switch()
            if open_ is not None:
                raise StoreError(
                    f"switch {open_['id']} ({open_['from_profile']} -> {open_['to_profile']}) "
                    "is still open; finish it first"
                )
            return self._insert("switches", row)

    def finish_switch(
        self,
        switch_id: int,
        *,
        ended_s: float,
        outcome: SwitchOutcome | str,
        downtime_s: float | None = None,
        error: str | None = None,
    ) -> None:
        values = {
            "ended_s": _time(ended_s, "ended_s"),
            "outcome": _choice(outcome, SwitchOutcome, "outcome"),
            "downtime_s": _num(downtime_s),
            "error": _text(error),
        }
        with self._tx():
            rows = self._rows("SELECT outcome FROM switches WHERE id = ?", [int(switch_id)])
            if not rows:
                raise StoreError(f"no switch with id {switch_id}")
            if rows[0]["outcome"] is not None:
                raise StoreError(f"switch {switch_id} already finished ({rows[0]['outcome']})")
            self.db["switches"].update(int(switch_id), values)

    def record_trial(
        self,
        switch_id: int,
        state: TrialState | str,
        t_s: float,
        *,
        predicted_tok_s: float | None = None,
        observed_tok_s: float | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> int:
        """Append the state a switch's trial entered (pending, running, successful, ...)."""
        row = {
            "switch_id": int(switch_id),
            "t_s": _time(t_s, "trial t_s"),
            "state": _choice(state, TrialState, "trial state"),
            "predicted_tok_s": _num(predicted_tok_s),
            "observed_tok_s": _num(observed_tok_s),
            "detail_json": _json(detail),
        }
        with self._tx():
            if not self._rows("SELECT id FROM switches WHERE id = ?", [row["switch_id"]]):
                raise StoreError(f"no switch with id {switch_id}")
            return self._insert("trials", row)

    # -- overrides, findings, state

    def record_override(
        self,
        kind: OverrideKind | str,
        created_s: float,
        actor: str,
        *,
        profile: str | None = None,
        mode: Mode | str | None = None,
        ttl_s: float | None = None,
        until_s: float | None = None,
        reason: str | None = None,
    ) -> int:
        """Audit one operator action. `until_s` defaults to created_s + ttl_s."""
        created = _time(created_s, "created_s")
        ttl = _num(ttl_s)
        if ttl is not None and ttl <= 0:
            raise StoreError(f"ttl_s must be > 0, got {ttl_s!r}")
        until = _num(until_s)
        if until is None and ttl is not None:
            until = created + ttl
        return self._insert(
            "overrides",
            {
                "created_s": created,
                "kind": _choice(kind, OverrideKind, "override kind"),
                "profile": _text(profile),
                "mode": _choice(mode, Mode, "mode") if mode is not None else None,
                "ttl_s": ttl,
                "until_s": until,
                "reason": _text(reason),
                "actor": _required_text(actor, "actor"),
            },
        )

    def record_finding(
        self,
        kind: str,
        t_s: float,
        message: str,
        *,
        subject: str | None = None,
        numbers: Mapping[str, Any] | None = None,
    ) -> int:
        return self._insert(
            "findings",
            {
                "t_s": _time(t_s, "finding t_s"),
                "kind": _required_text(kind, "finding kind"),
                "subject": _text(subject),
                "numbers_json": _json(numbers),
                "message": _required_text(message, "finding message"),
            },
        )

    def record_adaptive_table(
        self,
        t_s: float,
        profile: str,
        table: Mapping[str, Any],
        estimates: Mapping[str, Any] | None = None,
        reason: str | None = None,
    ) -> int:
        """One adaptive table a hybrid profile got, with the estimates it came from."""
        if not isinstance(table, Mapping) or not table:
            raise StoreError("adaptive table must be a non-empty mapping")
        return self._insert(
            "adaptive_tables",
            {
                "t_s": _time(t_s, "adaptive table t_s"),
                "profile": _required_text(profile, "adaptive table profile"),
                "table_json": _json(table),
                "estimates_json": _json(estimates),
                "reason": _text(reason),
            },
        )

    def save_state(self, key: str, value: Mapping[str, Any], t_s: float | None = None) -> None:
        """Replace the JSON value under `key` (policy state for warm start, overrides, ...)."""
        if not isinstance(value, Mapping):
            raise StoreError(f"state value must be a mapping, got {type(value).__name__}")
        row = {
            "key": _required_text(key, "state key"),
            "value_json": _json(value),
            "updated_s": _num(t_s),
        }
        with self._tx():
            self.db["state"].upsert(row, pk="key")

    def save_overrides(self, o: Overrides, t_s: float | None = None) -> None:
        self.save_state(
            _STATE_OVERRIDES,
            {
                "pin_profile": o.pin_profile,
                "pin_until_s": o.pin_until_s,
                "paused_until_s": o.paused_until_s,
                "mode": o.mode.value,
                "blocked_reason": o.blocked_reason,
            },
            t_s,
        )

    def delete_state(self, key: str) -> None:
        with self._tx():
            self.db.execute("DELETE FROM state WHERE key = ?", [key])

    # -- retention

    def apply_retention(self, now_s: float) -> dict[str, int]:
        """Downsample raw observations older than retention.raw_s into observations_hourly and
        delete old bulk rows (one transaction), then return freed pages to the file system and
        truncate the WAL. Returns row counts per action."""
        now = _time(now_s, "now_s")
        with self._tx():
            out = apply_retention(self.db, self.retention, now)
        with self._lock:
            try:
                self.db.execute("PRAGMA incremental_vacuum").fetchall()  # runs as it is stepped
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:  # a reader holding the WAL only delays the truncate
                out["checkpoint_error"] = 1
                _ = exc
        return out
