"""store: opening a database that cannot be used, and the single-writer lock.

Every bad database (a directory, random bytes, a truncated file, a newer schema, a damaged
schema that is not UTF-8, a read-only file) is one StoreError line naming the file, raised at
open; the writer lock (`<db>.lock`) keeps a second writer process out with "in use by another
specpilot (pid N)" while readers go on reading; a killed holder leaves no stale lock."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from store import Reader, Store, StoreError
from store.db import lock_path

REPO = Path(__file__).resolve().parents[2]


def _good(path: Path) -> bytes:
    with Store(path) as s:
        s.save_state("k", {"v": 1}, 1.0)
    return path.read_bytes()


def make_directory(path: Path) -> None:
    path.mkdir()


def make_random(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def make_truncated(path: Path) -> None:
    data = _good(path)
    path.write_bytes(data[: len(data) // 3])


def make_newer(path: Path) -> None:
    _good(path)
    conn = sqlite3.connect(path)
    conn.execute(
        "INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
        "VALUES ('specpilot', 'm003_future', 'x')"
    )
    conn.commit()
    conn.close()


def make_undecodable_schema(path: Path) -> None:
    """Pages overwritten with the header intact: sqlite_master's text is no longer UTF-8
    (sqlite_utils' table_names() raised a bare UnicodeDecodeError)."""
    data = bytearray(_good(path))
    i = data.find(b"observations")  # the name column of sqlite_master's first row
    assert i > 0
    data[i : i + 4] = b"\xff\xfe\xff\xfe"
    path.write_bytes(bytes(data))


BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "directory": (make_directory, "unable to open database file"),
    "random": (make_random, "file is not a database"),
    "truncated": (make_truncated, "database disk image is malformed"),
    "newer": (make_newer, "written by a newer specpilot (unknown migrations: m003_future)"),
    "not-utf8": (make_undecodable_schema, "not valid UTF-8"),
}


def _locked(path: Path) -> bool:
    """Whether some open file description holds the flock on `path` (this process's too: flock
    conflicts between two opens of the file)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_database_is_one_store_error_naming_the_file(tmp_path: Path, case: str) -> None:
    path = tmp_path / "sp.db"
    make, problem = BAD[case]
    make(path)
    with pytest.raises(StoreError) as e:
        Store(path)
    msg = str(e.value)
    assert str(path) in msg and problem in msg and "\n" not in msg, msg
    assert not _locked(lock_path(path))  # the failed open released the writer lock
    if case != "directory":
        (path.unlink(), Store(path).close())  # nothing stays held in this process


def _read_only(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the database unwritable for this process: mode 444; as root (who writes through
    that) every connection refuses writes as sqlite does for an unwritable file (query_only:
    the same SQLITE_READONLY, "attempt to write a readonly database")."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        return
    connect = sqlite3.connect

    def ro_connect(*args: Any, **kw: Any) -> sqlite3.Connection:
        conn = connect(*args, **kw)
        conn.execute("PRAGMA query_only = ON")
        return conn

    monkeypatch.setattr(sqlite3, "connect", ro_connect)


def test_a_read_only_database_fails_at_open_not_at_every_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sp.db"
    _good(path)
    _read_only(path, monkeypatch)
    with pytest.raises(StoreError) as e:
        Store(path)
    msg = str(e.value)
    assert msg == f"cannot write database {path}: attempt to write a readonly database"


def test_the_write_probe_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "sp.db"
    _good(path)
    before = sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0]
    with Store(path) as s:
        assert not s.db.conn.in_transaction
        assert s.load_state("k") == {"v": 1}
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == before


HOLDER = textwrap.dedent(
    """
    import sys
    from store import Store
    s = Store(sys.argv[1])
    s.save_state("holder", {"v": 1}, 1.0)
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """Another process (a daemon already running) with the database open as its writer."""
    path = tmp_path / "sp.db"
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield path, p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_a_second_writer_process_is_refused_readers_are_not(
    holder: tuple[Path, subprocess.Popen[str]],
) -> None:
    path, p = holder
    assert lock_path(path).read_text().strip() == str(p.pid)
    with pytest.raises(StoreError) as e:
        Store(path)
    assert str(e.value) == f"database {path} is in use by another specpilot (pid {p.pid})"
    with Reader(path) as r:  # history, export, report and the API's reads go on
        assert r.load_state("holder") == {"v": 1}
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait(10) == 0
    with Store(path) as s:  # released on close
        assert lock_path(path).read_text().strip() == str(os.getpid())
        s.save_state("second", {"v": 2}, 2.0)


def test_a_killed_writer_leaves_no_stale_lock(
    holder: tuple[Path, subprocess.Popen[str]],
) -> None:
    path, p = holder
    p.kill()
    p.wait(10)
    assert lock_path(path).read_text().strip() == str(p.pid)  # stale content, no lock
    with Store(path) as s:
        assert s.load_state("holder") == {"v": 1}


def test_stores_of_one_process_share_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "sp.db"
    a = Store(path)
    b = Store(path)  # a restart simulated in one process
    a.close()
    a.close()  # idempotent: b's share stays
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from store import Store; Store(sys.argv[1])", path],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert probe.returncode != 0 and "is in use by another specpilot" in probe.stderr
    b.close()
    with Store(path):  # released by the last share
        pass
