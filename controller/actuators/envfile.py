"""systemd EnvironmentFile= text: writing it atomically, and reading it back.

Owns the quoting rules of systemd's environment files (systemd.exec(5), parse_env_file in
src/basic/env-file.c): one KEY=VALUE per line, `#` comments, values in double quotes where a
backslash escapes `"`, `\\`, `` ` `` and `$`, values in single quotes taken literally. Values are
written double-quoted and escaped, so any text round-trips except a newline, which is refused.
Must not run systemctl.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from controller.settings import ENV_NAME

_ESCAPED = '"\\`$'


def quote_value(value: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        raise ValueError(f"environment value {value[:40]!r} contains a newline or NUL")
    return '"' + "".join("\\" + c if c in _ESCAPED else c for c in value) + '"'


def render(assignments: Mapping[str, str], header: str = "") -> str:
    lines = [f"# {ln}" for ln in header.splitlines()]
    for key, value in assignments.items():
        if not ENV_NAME.fullmatch(key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
        lines.append(f"{key}={quote_value(value)}")
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, str]:
    """The assignments of an environment file (the subset of systemd's syntax `render` writes,
    plus unquoted and single-quoted values and `export ` prefixes)."""
    out: dict[str, str] = {}
    # Only \n ends a line (str.splitlines would also split on \f, \v, \x1c..., which systemd
    # keeps inside values).
    for raw in text.split("\n"):
        line = raw.strip(" \t\r")
        if not line or line[0] in "#;":
            continue
        line = line.removeprefix("export ").lstrip()
        key, sep, rest = line.partition("=")
        key = key.strip()
        if not sep or not ENV_NAME.fullmatch(key):
            continue
        rest = rest.lstrip()
        if rest.startswith('"'):
            value, i = [], 1
            while i < len(rest) and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < len(rest) and rest[i + 1] in _ESCAPED:
                    i += 1
                value.append(rest[i])
                i += 1
            out[key] = "".join(value)
        elif rest.startswith("'"):
            end = rest.find("'", 1)
            out[key] = rest[1:end] if end > 0 else rest[1:]
        else:
            out[key] = rest.rstrip()
    return out


def read(path: str | os.PathLike[str]) -> dict[str, str]:
    """The assignments of the environment file at `path`. Bytes that are not UTF-8 (a hand edit
    in another encoding) become U+FFFD instead of failing the whole file. Raises OSError."""
    return parse(Path(path).read_text(encoding="utf-8", errors="replace"))


def write_atomic(path: str | os.PathLike[str], text: str, mode: int = 0o600) -> None:
    """Write a temporary file next to `path`, fsync it, then os.replace: systemd (or anyone)
    reading the file sees the old or the new content, never a mix. Mode 0600: profile
    environments may hold tokens."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        # UTF-8 whatever the locale: systemd reads environment files as UTF-8.
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
