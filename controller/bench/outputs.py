"""Output paths of the long-running commands, checked before the work starts.

Owns the up-front check that `bench --json FILE --png-dir DIR` and `bench-estimators --json FILE`
can write where they are told to: a benchmark that runs for minutes and only then finds its
output path unusable loses its results. Each check creates the missing parent directories (the
commands create them anyway) and proves the directory writable by creating and removing a
temporary file in it; it returns a one-line problem, or None when the path is usable.
Must not: write the results (bench.report does) or leave anything but those directories behind.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def _probe_dir(directory: Path, what: str) -> str | None:
    """Create `directory` (and its parents) and create/remove one file in it."""
    for parent in (directory, *directory.parents):
        if parent.exists():
            if not parent.is_dir():
                return f"{what}: {parent} is not a directory"
            break
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory, prefix=".specpilot-probe-"):
            pass
    except OSError as e:
        return f"{what}: cannot write in {directory}: {e.strerror or e}"
    return None


def check_output_file(path: Path, what: str) -> str | None:
    """None when `path` can be written (an existing file is replaced), else the problem."""
    if path.is_dir():
        return f"{what}: {path} is a directory, not a file"
    problem = _probe_dir(path.parent, what)
    if problem is None and path.exists():
        try:
            with path.open("ab"):
                pass
        except OSError as e:
            return f"{what}: cannot write {path}: {e.strerror or e}"
    return problem


def check_output_dir(path: Path, what: str) -> str | None:
    """None when `path` is, or can be created as, a writable directory, else the problem."""
    return _probe_dir(path, what)
