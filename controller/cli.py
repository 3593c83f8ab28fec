"""The `specpilot` command line (typer + rich).

Owns argument parsing, friendly errors (an unreachable daemon, a bad file) and rendering. Daemon
commands (`run`, `demo`) delegate to controller.daemon / controller.demo; operator commands talk to
a running daemon's REST API over httpx; history/export read the SQLite file directly (read-only);
`breakeven` and `scrape` are offline tools. No policy logic lives here.
"""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table
from rich.text import Text

from controller.numfmt import num, span_end
from controller.settings import (
    EXIT_CONFIG,
    OVERRIDE_TTL_MAX_S,
    ConfigError,
    decode_problem,
    load_settings,
)
from store import EXPORTABLE_TABLES, Reader, StoreError

app = typer.Typer(
    name="specpilot",
    help="Adaptive speculation controller for SGLang: picks the speculation profile that "
    "maximises tokens/s, paying for every restart.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True, soft_wrap=True)

ApiOpt = Annotated[
    str | None,
    typer.Option(
        "--api",
        help="Daemon API base URL (default: from --config, else $SPECPILOT_API or "
        "http://127.0.0.1:8471).",
    ),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="config.toml to read the API address from.")
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", help="API token (default: $SPECPILOT_API_TOKEN or the config's)."),
]
ReasonOpt = Annotated[str, typer.Option("--reason", help="Why (recorded with the action).")]
DbOpt = Annotated[
    Path | None,
    typer.Option(
        "--db",
        help="SQLite file to read (default: the database of --config, or of ./config.toml).",
    ),
]
SinceOpt = Annotated[
    str,
    typer.Option(
        "--since",
        help="Start of the period: a duration back from now (30m, 2h, 7d, 1h30m), an ISO time "
        "(UTC unless it says otherwise) or epoch seconds.",
    ),
]
UntilOpt = Annotated[
    str | None,
    typer.Option("--until", help="End of the period (same forms as --since; default: no end)."),
]


def _fail(msg: str, code: int = 1) -> typer.Exit:
    err.print(f"[red]specpilot:[/red] {escape(msg)}")
    return typer.Exit(code)


def finite_float(
    *, gt: float | None = None, ge: float | None = None, le: float | None = None
) -> Callable[[str | float], float]:
    """An option parser (float_option's): a finite number within the bounds, else
    typer.BadParameter, which typer reports as one "Invalid value for '--opt'" error with exit
    status 2 (nan and inf are refused: they would reach JSON bodies and divisions)."""
    bounds = [f"> {gt:g}" if gt is not None else "", f">= {ge:g}" if ge is not None else ""]
    bounds.append(f"<= {le:g}" if le is not None else "")
    want = " and ".join(b for b in bounds if b)
    what = f"{want} and finite" if want else "finite"

    def parse(value: str | float) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise typer.BadParameter(f"{value!r} is not a number") from None
        if (
            not math.isfinite(v)
            or (gt is not None and not v > gt)
            or (ge is not None and not v >= ge)
            or (le is not None and not v <= le)
        ):
            raise typer.BadParameter(f"must be {what} (got {value})")
        return v

    return parse


def float_option(*flags: str, help: str, **bounds: float) -> Any:
    """A typer option of one finite number within `bounds` (finite_float's gt, ge, le), shown
    as <float>: every float flag of the CLI."""
    return typer.Option(*flags, parser=finite_float(**bounds), metavar="<float>", help=help)


def _api_detail(payload: Any, text: str) -> str:
    """The error of an API answer, readably: FastAPI's 422 list as `field: message; ...`."""
    detail = payload.get("detail") if isinstance(payload, dict) else None
    if detail is None:
        return text[:500]
    if isinstance(detail, list):
        parts = []
        for e in detail:
            if not isinstance(e, dict):
                parts.append(str(e))
                continue
            loc = [str(x) for x in e.get("loc") or () if x not in ("body", "query", "header")]
            field = ".".join(loc) or "request"
            parts.append(f"{field}: {e.get('msg', e)}")
        return "; ".join(parts)
    return str(detail)


def _api_base(api: str | None, config: Path | None) -> tuple[str, str]:
    """(base URL, token from config) for operator commands."""
    token = ""
    if config is not None:
        try:
            s = load_settings(config)
        except ConfigError as e:
            raise _fail(str(e), EXIT_CONFIG) from None
        try:
            token = s.api_token()
        except ConfigError as e:
            raise _fail(f"{config}: {e}", EXIT_CONFIG) from None
        if api is None:
            api = f"http://{s.api.host}:{s.api.port}"
    return (api or os.environ.get("SPECPILOT_API") or "http://127.0.0.1:8471").rstrip("/"), token


def _call(
    method: str,
    api: str,
    path: str,
    *,
    token: str = "",
    body: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
) -> Any:
    headers: dict[str, str | bytes] = {"Authorization": f"Bearer {token}"} if token else {}
    # UTF-8 bytes: httpx encodes a str header as ASCII (a user named José would crash it), and
    # the API decodes the header as UTF-8.
    headers["x-specpilot-actor"] = f"cli:{os.environ.get('USER', 'unknown')}".encode()
    try:
        r = httpx.request(method, api + path, json=body, params=params, headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise _fail(
            f"cannot reach the specpilot daemon at {api} ({e.__class__.__name__}: {e}). "
            "Is `specpilot run` running, and is --api right?"
        ) from None
    try:
        payload = r.json()
    except ValueError:
        payload = None
    if r.status_code >= 400:
        detail = _api_detail(payload, r.text)
        hint = {
            401: (
                " (no token was sent: pass --token, set SPECPILOT_API_TOKEN, or give --config"
                " with [api] token or token_file; a daemon whose config sets none refuses"
                " every write)"
            ),
            403: " (the daemon refused the token)",
        }.get(r.status_code, "")
        raise _fail(f"{method} {path}: HTTP {r.status_code}: {detail}{hint}")
    if payload is None:
        raise _fail(f"{method} {path}: the answer from {api} is not JSON: is --api a specpilot?")
    return payload


def _token(token: str | None, cfg_token: str) -> str:
    return token or os.environ.get("SPECPILOT_API_TOKEN", "") or cfg_token


# --------------------------------------------------------------------------------- daemon
@app.command()
def run(
    config: Annotated[Path, typer.Option("--config", "-c", help="config.toml")] = Path(
        "config.toml"
    ),
    help_policy: Annotated[
        bool,
        typer.Option(
            "--help-policy", help="List every \\[policy] key with its default and reason, and exit."
        ),
    ] = False,
) -> None:
    """Run the daemon: control loop, REST API and metrics (systemd: Type=notify)."""
    if help_policy:
        import textwrap

        from controller.settings import policy_help

        for name, default, note in policy_help():
            value = str(default).lower() if isinstance(default, bool) else repr(default)
            typer.echo(f"{name} = {value}")
            for line in textwrap.wrap(note, 92):
                typer.echo(f"    {line}")
        raise typer.Exit(0)
    from controller.daemon import run_daemon

    raise typer.Exit(run_daemon(config))


@app.command()
def demo(
    duration_s: Annotated[
        float,
        float_option("--duration-s", help="Real seconds the demo runs (default 180).", gt=0),
    ] = 180.0,
    speed: Annotated[
        float,
        float_option(
            "--speed",
            help="Simulated seconds per real second (50: 3 real minutes = 2.5 simulated hours; "
            "much faster and one CPU cannot drive 48 simulated streams).",
            gt=0,
        ),
    ] = 50.0,
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Simulator port (0: a free one).")
    ] = 0,
    db: Annotated[Path | None, typer.Option(help="SQLite file (default: a temporary one).")] = None,
    fleet: Annotated[
        int, typer.Option(min=0, help="Fleet mode with N replicas (0: one server).")
    ] = 0,
) -> None:
    """Start the simulator, load and controller in accelerated time and show the loop live."""
    from controller.demo import run_demo

    if fleet:
        from controller.fleet.demo import run_fleet_demo

        raise typer.Exit(run_fleet_demo(fleet, duration_s, speed))
    raise typer.Exit(run_demo(duration_s=duration_s, speed=speed, port=port, db=db))


# --------------------------------------------------------------------------------- operator
@app.command()
def status(
    api: ApiOpt = None,
    config: ConfigOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON."),
) -> None:
    """Show the running profile, estimates per profile and the last decision."""
    base, _ = _api_base(api, config)
    st = _call("GET", base, "/v1/status")
    if as_json:
        console.print_json(json.dumps(st))
        return
    ov = st["overrides"]
    last = st["last_decision"]

    def until(o: dict[str, Any]) -> str:
        """When a pin or pause ends (the daemon's clock, UTC), dated only on another day than
        the last decision's; nothing for one without a TTL."""
        end = o.get("until_s")
        if end is None:
            return ""
        return f" until {span_end(last['t_s'] if last else end, end, '%H:%M:%S')}"

    pin = f"{ov['pin']['profile']}{until(ov['pin'])}" if ov["pin"] else "-"
    paused = f"yes{until(ov['pause'])}" if ov["pause"] else "no"
    if st["profile"] is None:  # nothing serves: say why rather than print None
        why = (st.get("target") or {}).get("down_reason")
        why = why or ("switch in flight" if st.get("switch_in_flight") else "no server running")
        profile = f"[bold]-[/bold] ({escape(why)})"
    else:
        profile = f"[bold]{escape(st['profile'])}[/bold]"
    # Two lines: each fits 80 columns with a pin's and a pause's end times.
    console.print(
        f"profile {profile}  mode {st['mode']}  blocked {escape(ov['blocked_reason'] or 'no')}"
    )
    console.print(f"pin {escape(pin)}  paused {paused}")
    in_force = ov.get("in_force")
    if in_force and in_force != "the policy":
        console.print(f"in force: {escape(in_force)}")
    # Profile names and numbers are never cut (a pipe or a narrow terminal is 80 columns): the
    # source (estimate provenance, the longest cell) wraps instead.
    t = Table(
        Column("profile", no_wrap=True),
        *(
            Column(h, no_wrap=True)
            for h in ("tok/s", "interval", "accept\nlen", "break-\neven", "cycle\nms")
        ),
        Column("source", overflow="fold"),
    )
    for e in st["estimates"]:
        tok = e["tok_s"] or {}
        acc = e["accept_length"] or {}
        cyc = e["cycle_s"] or {}
        t.add_row(
            ("* " if e["profile"] == st["profile"] else "  ") + e["profile"],
            _f(tok.get("mean")),
            f"{_f(tok.get('low'))}-{_f(tok.get('high'))}",
            _f(acc.get("mean")),
            _f(e["breakeven_accept_length"]),
            _f(cyc["mean"] * 1000 if cyc.get("mean") else None),
            e["source"] or "",
        )
    console.print(t)
    d = st["last_decision"]
    if d:
        console.print(f"last decision: {d['action']} {d['profile']} ({d['reason']})")


def _f(v: float | None, digits: int = 3) -> str:
    return num(v, digits, none="-")


def _operate(
    method: str,
    path: str,
    api: str | None,
    config: Path | None,
    token: str | None,
    *,
    body: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
) -> None:
    """An operator write: call the daemon with the token, print its JSON answer."""
    base, cfg_token = _api_base(api, config)
    out = _call(method, base, path, token=_token(token, cfg_token), body=body, params=params)
    console.print_json(json.dumps(out))


@app.command()
def pin(
    profile: str,
    ttl_s: Annotated[
        float | None,
        float_option(
            "--ttl-s",
            help="Seconds (server time) until the pin expires, at most 2592000 (30 days); "
            "default: none, it holds until unpinned.",
            gt=0,
            le=OVERRIDE_TTL_MAX_S,
        ),
    ] = None,
    reason: ReasonOpt = "",
    api: ApiOpt = None,
    config: ConfigOpt = None,
    token: TokenOpt = None,
) -> None:
    """Pin a profile (beats every automatic decision until unpinned or expired)."""
    body = {"profile": profile, "ttl_s": ttl_s, "reason": reason}
    _operate("PUT", "/v1/pin", api, config, token, body=body)


@app.command()
def unpin(
    reason: ReasonOpt = "", api: ApiOpt = None, config: ConfigOpt = None, token: TokenOpt = None
) -> None:
    """Remove the pin."""
    _operate("DELETE", "/v1/pin", api, config, token, params={"reason": reason})


@app.command()
def pause(
    ttl_s: Annotated[
        float,
        float_option(
            "--ttl-s",
            help="Seconds (server time) to pause, at most 2592000 (30 days; default 3600).",
            gt=0,
            le=OVERRIDE_TTL_MAX_S,
        ),
    ] = 3600.0,
    reason: ReasonOpt = "",
    api: ApiOpt = None,
    config: ConfigOpt = None,
    token: TokenOpt = None,
) -> None:
    """Pause automatic switching for a while."""
    _operate("PUT", "/v1/pause", api, config, token, body={"ttl_s": ttl_s, "reason": reason})


@app.command()
def resume(
    reason: ReasonOpt = "", api: ApiOpt = None, config: ConfigOpt = None, token: TokenOpt = None
) -> None:
    """End a pause."""
    _operate("DELETE", "/v1/pause", api, config, token, params={"reason": reason})


@app.command()
def mode(
    new_mode: Annotated[str, typer.Argument(metavar="active|advisory")],
    reason: ReasonOpt = "",
    api: ApiOpt = None,
    config: ConfigOpt = None,
    token: TokenOpt = None,
) -> None:
    """Set the mode: active (acts) or advisory (decides and explains, never restarts)."""
    if new_mode not in ("active", "advisory"):
        raise _fail(f"mode must be active or advisory, not {new_mode!r}", 2)
    _operate("PUT", "/v1/mode", api, config, token, body={"mode": new_mode, "reason": reason})


# --------------------------------------------------------------------------------- history
EXPORT_TABLES = EXPORTABLE_TABLES
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(w|d|h|m|s)", re.IGNORECASE)
_DURATIONS = re.compile(r"(?:\d+(?:\.\d+)?[wdhms])+", re.IGNORECASE)
_UNIT_S = {"w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


# The times a history can be asked about: what a datetime can show (years 1-9999 UTC).
_MIN_TIME_S = dt.datetime(1, 1, 1, tzinfo=dt.UTC).timestamp()
_MAX_TIME_S = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC).timestamp()


def _in_range(text: str, v: float) -> float:
    if not _MIN_TIME_S <= v <= _MAX_TIME_S:
        raise ValueError(f"{text!r} is out of range: a time must fall in the years 1-9999 (UTC)")
    return v


def parse_time(text: str, now_s: float) -> float:
    """'2h' / '1h30m' / '7d' (back from now), 'now', epoch seconds or an ISO time -> epoch s.
    ValueError for anything else, or a time outside the years 1-9999."""
    t = text.strip()
    if t.lower() == "now":
        return now_s
    compact = t.replace(" ", "")
    if compact and _DURATIONS.fullmatch(compact):
        total = sum(float(n) * _UNIT_S[u.lower()] for n, u in _DURATION.findall(compact))
        return _in_range(text, now_s - total)
    try:
        v = float(t)
    except ValueError:
        pass
    else:
        if math.isfinite(v):
            return _in_range(text, v)
    try:
        d = dt.datetime.fromisoformat(t)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time: use a duration (30m, 2h, 7d, 1h30m), 'now', "
            "epoch seconds or an ISO time such as 2026-01-31T14:00"
        ) from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=dt.UTC)
    return d.timestamp()


def _period(since: str, until: str | None) -> tuple[float, float | None]:
    now = time.time()
    try:
        a = parse_time(since, now)
        b = parse_time(until, now) if until is not None else None
    except ValueError as e:
        raise _fail(str(e), 2) from None
    if b is not None and b <= a:
        raise _fail("--until must be later than --since", 2)
    return a, b


def _db_path(db: Path | None, config: Path | None) -> Path:
    """--db, else the database the config names (as the daemon resolves it)."""
    if db is None:
        cfg = config or (Path("config.toml") if Path("config.toml").exists() else None)
        if cfg is None:
            raise _fail("which database? pass --db FILE or --config config.toml", 2)
        try:
            settings = load_settings(cfg)
        except ConfigError as e:
            raise _fail(str(e), EXIT_CONFIG) from None
        from controller.daemon import database_path

        db = database_path(settings)
    if not db.exists():
        raise _fail(
            f"database {db} does not exist (has `specpilot run` written one with this config?)",
            2,
        )
    return db


def _open_reader(db: Path | None, config: Path | None) -> Reader:
    path = _db_path(db, config)
    try:
        return Reader(path)
    except StoreError as e:
        raise _fail(str(e)) from None


def _ts(t: float | None) -> str:
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def history_events(
    reader: Reader, since_s: float, until_s: float | None, *, every_decision: bool = False
) -> list[dict[str, Any]]:
    """Decisions, switches, trial states, overrides and findings of the period, oldest first.
    Runs of identical decisions that did not act are folded into one event with a count."""
    events: list[dict[str, Any]] = []
    run: dict[str, Any] | None = None
    for d in reader.export_rows("decisions", since_s=since_s, until_s=until_s):
        key = (d["action"], d["profile"], d["reason"], d["mode"])
        if not every_decision and not d["acted"] and run is not None and run["key"] == key:
            run["count"] += 1
            run["until_s"] = d["t_s"]
            continue
        run = {
            "t_s": d["t_s"],
            "kind": "decision",
            "key": key,
            "action": d["action"],
            "profile": d["profile"],
            "reason": d["reason"],
            "mode": d["mode"],
            "acted": d["acted"],
            "count": 1,
            "until_s": d["t_s"],
            "diagnostics": d.get("diagnostics"),
        }
        events.append(run)
        if d["acted"]:
            run = None  # an acted decision is never folded
    for s in reader.export_rows("switches", since_s=since_s, until_s=until_s):
        events.append({**s, "t_s": s["started_s"], "kind": "switch"})
    for t in reader.export_rows("trials", since_s=since_s, until_s=until_s):
        events.append({**t, "kind": "trial"})
    for o in reader.export_rows("overrides", since_s=since_s, until_s=until_s):
        # The row's own `kind` (pin, pause...) becomes `override`.
        events.append({**o, "t_s": o["created_s"], "kind": "override", "override": o["kind"]})
    for f in reader.export_rows("findings", since_s=since_s, until_s=until_s):
        events.append({**f, "kind": "finding", "finding": f["kind"]})
    for e in events:
        e.pop("key", None)
    events.sort(key=lambda e: (e["t_s"], e["kind"] != "decision"))
    return events


def _describe(e: dict[str, Any]) -> str:
    k = e["kind"]
    if k == "decision":
        n = e["count"]
        rep = f" x{n} until {span_end(e['t_s'], e['until_s'], '%H:%M:%S')}" if n > 1 else ""
        acted = "acted" if e["acted"] else ("advisory" if e["mode"] == "advisory" else "")
        return f"{e['action']} {e['profile']} ({e['reason']}){rep} {acted}".rstrip()
    if k == "switch":
        down = f", {e['downtime_s']:.0f} s down" if e.get("downtime_s") is not None else ""
        err = f": {e['error']}" if e.get("error") else ""
        return (
            f"{e.get('from_profile') or '(start)'} -> {e['to_profile']} {e['reason']} "
            f"[{e.get('outcome') or 'in flight'}{down}]{err}"
        )
    if k == "trial":
        obs = e.get("observed_tok_s")
        pred = e.get("predicted_tok_s")
        nums = ""
        if obs is not None or pred is not None:
            nums = f" observed {_f(obs)} vs predicted {_f(pred)} tok/s"
        return f"trial of switch {e['switch_id']}: {e['state']}{nums}"
    if k == "override":
        what = e.get("profile") or e.get("mode") or ""
        ttl = f" for {e['ttl_s']:.0f} s" if e.get("ttl_s") else ""
        why = f" - {e['reason']}" if e.get("reason") else ""
        return f"{e['override']} {what}{ttl} by {e['actor']}{why}".replace("  ", " ")
    return str(e.get("message") or e["finding"])


_STYLE = {
    "decision": "dim",
    "switch": "bold cyan",
    "trial": "magenta",
    "override": "yellow",
    "finding": "red",
}


@app.command()
def history(
    since: SinceOpt = "2h",
    until: UntilOpt = None,
    db: DbOpt = None,
    config: ConfigOpt = None,
    every_decision: Annotated[
        bool, typer.Option("--all", help="Every decision (default: repeats folded).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, one event each.")] = False,
) -> None:
    """What happened: decisions, switches, trials, overrides and findings, oldest first.

    Reads the SQLite history directly (read-only), so it works while the daemon is down."""
    a, b = _period(since, until)
    with _open_reader(db, config) as reader:
        try:
            events = history_events(reader, a, b, every_decision=every_decision)
        except StoreError as e:
            raise _fail(str(e)) from None
    if as_json:
        for e in events:
            sys.stdout.write(json.dumps(e, sort_keys=True, allow_nan=False) + "\n")
        return
    if not events:
        console.print(f"nothing recorded since {_ts(a)} UTC")
        return
    t = Table("time (UTC)", "what", "event", box=None, pad_edge=False)
    for e in events:
        t.add_row(_ts(e["t_s"]), e["kind"], Text(_describe(e)), style=_STYLE.get(e["kind"]))
    console.print(t)


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True, allow_nan=False)
    return v


def _columns(reader: Reader, table: str) -> list[str]:
    cols = [c.name for c in reader.db[table].columns]
    return [c[:-5] if c.endswith("_json") else c for c in cols]


def _write_csv(reader: Reader, table: str, a: float, b: float | None, fh: Any) -> int:
    w = csv.DictWriter(fh, fieldnames=_columns(reader, table), extrasaction="ignore")
    w.writeheader()
    n = 0
    for row in reader.export_rows(table, since_s=a, until_s=b):
        w.writerow({k: _csv_value(v) for k, v in row.items()})
        n += 1
    return n


@app.command()
def export(
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="csv (one table per file) or jsonl.")
    ] = "jsonl",
    table: Annotated[
        list[str] | None,
        typer.Option("--table", "-t", help=f"Table(s) to export (default all): {EXPORT_TABLES}."),
    ] = None,
    since: SinceOpt = "100w",
    until: UntilOpt = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="File (jsonl, or csv of one table) or directory (csv of several tables); "
            "default: standard output.",
        ),
    ] = None,
    db: DbOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Export the history for analysis: jsonl rows carry a "table" key; csv cells hold JSON
    for nested values. Times are UTC epoch seconds."""
    if fmt not in ("csv", "jsonl"):
        raise _fail(f"--format must be csv or jsonl, not {fmt!r}", 2)
    tables = list(dict.fromkeys(table or EXPORT_TABLES))
    unknown = [t for t in tables if t not in EXPORT_TABLES]
    if unknown:
        raise _fail(f"unknown table {unknown[0]!r}; one of {', '.join(EXPORT_TABLES)}", 2)
    a, b = _period(since, until)
    per_file = fmt == "csv" and len(tables) > 1
    if per_file and output is None:
        raise _fail("csv of several tables needs --output DIR (or one --table)", 2)
    if per_file and output is not None and output.exists() and not output.is_dir():
        raise _fail(f"{output} is a file; csv of several tables needs a directory", 2)
    counts: dict[str, int] = {}
    with _open_reader(db, config) as reader:
        try:
            if per_file:
                assert output is not None
                output.mkdir(parents=True, exist_ok=True)
                for t in tables:
                    with (output / f"{t}.csv").open("w", newline="") as fh:
                        counts[t] = _write_csv(reader, t, a, b, fh)
            else:
                fh = output.open("w", newline="") if output else sys.stdout
                try:
                    for t in tables:
                        if fmt == "csv":
                            counts[t] = _write_csv(reader, t, a, b, fh)
                            continue
                        counts[t] = 0
                        for row in reader.export_rows(t, since_s=a, until_s=b):
                            fh.write(json.dumps({"table": t, **row}, allow_nan=False) + "\n")
                            counts[t] += 1
                finally:
                    if output:
                        fh.close()
        except StoreError as e:
            raise _fail(str(e)) from None
        except BrokenPipeError:
            raise  # standard output closed by its reader (`| head`): click exits 1, quietly
        except OSError as e:
            raise _fail(f"cannot write {output or 'standard output'}: {e}") from None
    if output is not None:
        summary = ", ".join(f"{t} {n}" for t, n in counts.items())
        err.print(f"exported to {output}: {summary}")


@app.command()
def report(
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write.")] = Path(
        "specpilot-report.png"
    ),
    since: SinceOpt = "24h",
    until: UntilOpt = None,
    db: DbOpt = None,
    config: ConfigOpt = None,
) -> None:
    """A PNG: tok/s over time (observed and predicted) with profile bands and switches, and
    accept length against break-even."""
    from controller.report import ReportError, render_report

    a, b = _period(since, until)
    profiles: list[str] = []
    if config is not None:
        try:
            profiles = list(load_settings(config).profiles)
        except ConfigError as e:
            raise _fail(str(e), EXIT_CONFIG) from None
    with _open_reader(db, config) as reader:
        try:
            s = render_report(
                reader,
                output,
                since_s=a,
                until_s=b if b is not None else math.inf,
                profiles=profiles,
            )
        except (ReportError, StoreError) as e:
            raise _fail(str(e)) from None
    console.print(
        f"wrote {s.path}: {s.observations} observations, {s.hourly_points} hourly points, "
        f"{s.switches} switches, profiles {', '.join(s.profiles)}"
    )


# --------------------------------------------------------------------------------- offline
# The deepest step `breakeven --table` prices: controller.hybrid_table.DEFAULT_STEPS, the range
# SGLang's default adaptive table spans (not imported here: it pulls in the simulator).
TABLE_MAX_STEP = 7


@app.command()
def breakeven(
    baseline_tok_s: Annotated[
        float | None,
        float_option("--baseline-tok-s", help="Baseline (no speculation) tok/s.", gt=0),
    ] = None,
    cycle_ms: Annotated[
        float | None,
        float_option("--cycle-ms", help="Speculative cycle time, ms.", gt=0),
    ] = None,
    target: Annotated[
        list[float] | None,
        float_option("--target-tok-s", help="Targets to price (default 100 and 120).", gt=0),
    ] = None,
    accept_length: Annotated[
        float | None,
        float_option(
            "--accept-length",
            help="The accept length measured (drafts + bonus, SGLang's spec_accept_length): "
            "say what it gives at --cycle-ms and whether that beats the baseline.",
            ge=1,
        ),
    ] = None,
    table: Annotated[
        bool,
        typer.Option(
            "--table",
            help="Print the adaptive table specpilot generates for the field's profiles, with "
            "the break-even accept length per bucket (hybrid profiles).",
        ),
    ] = False,
    sim_profile: Annotated[
        list[str] | None,
        typer.Option(
            "--sim-profile",
            help="With --table: simulator profiles whose cost model stands in for the fitted "
            "surface (default kimi-k2.5-pcie-tuned and kimi-k2.5-pcie-later-boot).",
        ),
    ] = None,
    workload: Annotated[
        str, typer.Option(help="With --table: the workload whose acceptance is used.")
    ] = "default",
    candidate_steps: Annotated[
        list[int] | None,
        typer.Option(
            "--candidate-step",
            min=0,
            max=TABLE_MAX_STEP,
            help=f"With --table: allowed steps, 0-{TABLE_MAX_STEP} (default all).",
        ),
    ] = None,
    max_running_requests: Annotated[
        int, typer.Option(min=1, help="With --table: the server's max running requests.")
    ] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="With --table: print JSON.")] = False,
) -> None:
    """The break-even rule of FIELD.md: accept_len = baseline_tok_s x cycle_s."""
    from policies.breakeven import accept_length_for, breakeven_accept_length, tok_s_for

    if table:
        from controller.hybrid_table import DEFAULT_STEPS, FIELD_PROFILES, print_field_tables

        try:
            print_field_tables(
                console,
                sim_profile or list(FIELD_PROFILES),
                workload,
                candidate_steps or list(DEFAULT_STEPS),
                max_running_requests,
                as_json,
            )
        except (ValueError, FileNotFoundError) as e:
            raise _fail(str(e), 2) from None
        return
    if baseline_tok_s is None or cycle_ms is None:
        raise _fail("give --baseline-tok-s and --cycle-ms (or --table)", 2)
    cycle_s = cycle_ms / 1000.0
    be = breakeven_accept_length(baseline_tok_s, cycle_s)
    console.print(
        f"break-even accept length at {baseline_tok_s:g} tok/s and {cycle_ms:g} ms: "
        f"[bold]{be:.2f}[/bold]"
    )
    for t in target or [100.0, 120.0]:
        console.print(f"  {t:g} tok/s needs accept length {accept_length_for(t, cycle_s):.2f}")
    if accept_length is not None:
        spec = tok_s_for(accept_length, cycle_s)
        verdict = "pays" if spec > baseline_tok_s else "does not pay"
        console.print(
            f"accept length {accept_length:g} at {cycle_ms:g} ms: {num(spec)} tok/s, "
            f"{spec / baseline_tok_s - 1:+.1%} vs {baseline_tok_s:g}: "
            f"[bold]speculation {verdict}[/bold]"
        )


@app.command()
def scrape(
    url: Annotated[
        str | None, typer.Option(help="SGLang base URL, e.g. http://127.0.0.1:30000")
    ] = None,
    file: Annotated[Path | None, typer.Option(help="A recorded /metrics exposition.")] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json/--no-json", help="Print JSON (default), or a table for people (--no-json)."
        ),
    ] = True,
    profile: Annotated[str, typer.Option(help="Profile name to tag the snapshot with.")] = "?",
) -> None:
    """Parse one exposition (live or recorded) and print what specpilot reads from it.

    Exits 1 when it holds no SGLang series specpilot reads (an empty file, another service's
    /metrics); warns on stderr about impossible data (duplicate series, negative values, accept
    lengths or rates out of range). Series a server does not export (0.4.x) print as null."""
    from controller.observe import (
        ObserveError,
        exposition_warnings,
        fetch_exposition,
        has_sglang_samples,
        merge_loads,
        parse_exposition,
        snapshot_to_json,
    )

    if (url is None) == (file is None):
        raise _fail("give exactly one of --url or --file", 2)
    loads = None
    if file is not None:
        source = str(file)
        try:
            raw = file.read_bytes()
        except OSError as e:
            raise _fail(f"{file}: {e.strerror or e}", 2) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _fail(
                f"{file}: not UTF-8 text, so not a Prometheus exposition ({decode_problem(e)})"
            ) from None
    else:
        assert url is not None
        base = url.rstrip("/")
        source = base + "/metrics"

        async def fetch() -> Any:
            async with httpx.AsyncClient(timeout=10) as client:
                return await fetch_exposition(client, base)

        try:
            text, loads = asyncio.run(fetch())
        except ObserveError as e:
            raise _fail(f"cannot read the exposition: {e}") from None
    try:
        snap = merge_loads(parse_exposition(text, profile=profile, t_s=0.0), loads)
    except ObserveError as e:
        raise _fail(f"cannot read the exposition in {source}: {e}") from None
    if not has_sglang_samples(text):
        what = "is empty" if not text.strip() else "holds no series specpilot reads"
        hint = (
            "is it a capture of an SGLang server's /metrics?"
            if file is not None
            else "is it an SGLang server, started with --enable-metrics?"
        )
        raise _fail(f"no SGLang metrics found in {source}: it {what} ({hint})")
    for w in exposition_warnings(text):
        err.print(f"[yellow]specpilot scrape: warning:[/yellow] {escape(source)}: {escape(w)}")
    out = snapshot_to_json(snap)
    if as_json:
        sys.stdout.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
        return
    t = Table("series", "value", box=None, pad_edge=False)
    for key, v in out.items():
        t.add_row(key, Text(_scrape_value(v)))
    console.print(t)


def _scrape_value(v: Any) -> str:
    """One value of `scrape --no-json`: null as "-", per-workload maps as `name=value` pairs."""
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_scrape_value(x)}" for k, x in v.items()) or "(none)"
    if isinstance(v, list):
        return " ".join(_scrape_value(x) for x in v)
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


# --------------------------------------------------------------------------------- benchmarks
def _register_benchmarks() -> None:
    """Benchmark commands live with their code; imported lazily so `specpilot status` stays fast."""
    from controller.bench.cli import bench as bench_cmd
    from controller.bench.cli import generate_scenarios
    from controller.estimator_bench import bench_estimators_cmd

    app.command("bench", help="Replay scenarios in virtual time: specpilot vs peers and oracles.")(
        bench_cmd
    )
    app.command("generate-scenarios", help="Write random benchmark days in the scenario format.")(
        generate_scenarios
    )
    app.command(
        "bench-estimators",
        help="Measure the estimators against the simulator's ground truth (issue targets).",
    )(bench_estimators_cmd)


# sim-calibrate simulates one stream step by step (the default 600 s: ~10 s of CPU): a simulated
# day per profile and config is already ~20 minutes; more is a hang, not a calibration.
CALIBRATE_MAX_S = 86400.0


@app.command("sim-calibrate")
def sim_calibrate(
    seconds: Annotated[
        float,
        float_option(
            help=f"Simulated seconds per profile and config (at most {CALIBRATE_MAX_S:g}).",
            gt=0,
            le=CALIBRATE_MAX_S,
        ),
    ] = 600.0,
    seed: int = 0,
) -> None:
    """Print each built-in simulator profile next to FIELD.md's numbers (exit 1 if off by >5%)."""
    from simulator.calibrate import main as calibrate_main

    calibrate_main(seconds=seconds, seed=seed)


_register_benchmarks()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
