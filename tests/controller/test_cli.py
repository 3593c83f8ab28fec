"""The `specpilot` CLI: help everywhere, operator commands against a live daemon, a clear error
when the daemon is unreachable, and history / export / report over a recorded database."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controller.cli import EXPORT_TABLES, app, parse_time
from controller.clock import ManualClock
from policies.types import Mode
from store import Reader
from tests.controller.ops_support import TOKEN, LiveDaemon, ProfileModel, make_rig

runner = CliRunner()


def cli(*args: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, list(args), env={"COLUMNS": "200", **(env or {})})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends


# --------------------------------------------------------------------------------- help

OPERATOR = ["status", "pin", "unpin", "pause", "resume", "mode"]


def test_every_command_has_help() -> None:
    names = [c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands]
    for required in [*OPERATOR, "history", "export", "report", "breakeven"]:
        assert required in names
    for name in names:
        r = cli(name, "--help")
        assert r.exit_code == 0, (name, r.output)
        assert "Usage" in r.output
        cmd = next(c for c in app.registered_commands if (c.name or c.callback.__name__) == name)
        doc = (cmd.help or (cmd.callback.__doc__ if cmd.callback else "") or "").strip()
        assert doc, f"{name} has no help text"
        assert doc.split()[0] in r.output


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["pin", "eagle3-2step"],
        ["unpin"],
        ["pause", "--ttl-s", "60"],
        ["resume"],
        ["mode", "advisory"],
    ],
)
def test_unreachable_daemon_is_a_clear_error(args: list[str]) -> None:
    api = f"http://127.0.0.1:{_closed_port()}"
    r = cli(*args, "--api", api)
    assert r.exit_code == 1
    assert "cannot reach the specpilot daemon" in r.output
    assert api in r.output
    assert "Traceback" not in r.output


# --------------------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with LiveDaemon(tmp_path_factory.mktemp("cli-live")) as d:
        yield d


def test_status(live: LiveDaemon) -> None:
    r = cli("status", "--api", live.url)
    assert r.exit_code == 0, r.output
    assert "profile baseline" in r.output
    for p in ("baseline", "eagle3-2step", "eagle3-5step"):
        assert p in r.output
    r = cli("status", "--api", live.url, "--json")
    assert r.exit_code == 0
    assert json.loads(r.output)["profile"] == "baseline"


def test_operator_commands(live: LiveDaemon) -> None:
    env = {"SPECPILOT_API_TOKEN": TOKEN}
    r = cli("pause", "--ttl-s", "600", "--reason", "maintenance & more", "--api", live.url, env=env)
    assert r.exit_code == 0, r.output
    until = json.loads(r.output)["pause"]["until_s"]
    assert until > 0
    # status says until when, as the history dates it (the daemon's clock, UTC).
    r = cli("status", "--api", live.url)
    assert r.exit_code == 0, r.output
    at = dt.datetime.fromtimestamp(until, tz=dt.UTC)  # dated where it is another day
    assert re.search(rf"paused yes until ({at:%Y-%m-%d} )?{at:%H:%M:%S}", r.output), r.output
    r = cli("resume", "--reason", "done?", "--api", live.url, env=env)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["pause"] is None
    r = cli("mode", "advisory", "--api", live.url, "--token", TOKEN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["mode"] == "advisory"
    r = cli("pin", "eagle3-5step", "--ttl-s", "3600", "--api", live.url, env=env)
    assert r.exit_code == 0, r.output
    pin = json.loads(r.output)["pin"]
    assert pin["profile"] == "eagle3-5step"
    r = cli("status", "--api", live.url)
    at = dt.datetime.fromtimestamp(pin["until_s"], tz=dt.UTC)
    assert re.search(rf"pin eagle3-5step until ({at:%Y-%m-%d} )?{at:%H:%M:%S}", r.output)
    r = cli("unpin", "--reason", "a=b&c", "--api", live.url, env=env)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["pin"] is None
    r = cli("mode", "active", "--api", live.url, env=env)
    assert json.loads(r.output)["mode"] == "active"

    reasons = [o["reason"] for o in live.daemon.store.overrides_history(limit=10)]
    assert "maintenance & more" in reasons and "a=b&c" in reasons and "done?" in reasons

    # Errors the daemon gives are shown, not a traceback.
    r = cli("pin", "eagle9", "--api", live.url, env=env)
    assert r.exit_code == 1
    assert "HTTP 404" in r.output and "eagle9" in r.output
    r = cli("pin", "eagle3-2step", "--api", live.url, env={"SPECPILOT_API_TOKEN": ""})
    assert r.exit_code == 1
    assert "HTTP 401" in r.output and "--token" in r.output
    # The shipped config sets no token: --config alone is no answer, and the hint says so.
    assert "a daemon whose config sets none refuses every write" in " ".join(r.output.split())
    r = cli("pin", "eagle3-2step", "--api", live.url, "--token", "nope")
    assert r.exit_code == 1 and "HTTP 403" in r.output
    r = cli("mode", "turbo", "--api", live.url, env=env)
    assert r.exit_code == 2 and "active or advisory" in r.output


def test_an_actor_name_beyond_ascii_reaches_the_audit_log(live: LiveDaemon) -> None:
    """httpx sends a str header as ASCII: a user named José crashed every write command."""
    env = {"SPECPILOT_API_TOKEN": TOKEN, "USER": "José"}
    r = cli("pause", "--ttl-s", "60", "--api", live.url, env=env)
    assert r.exit_code == 0, r.output
    assert live.daemon.store.overrides_history(limit=1)[0]["actor"] == "cli:José"


def test_a_bad_token_file_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    shipped = (Path(__file__).parents[2] / "config.toml").read_text()
    assert 'token = ""' in shipped
    cfg.write_text(shipped.replace('token = ""', f'token_file = "{tmp_path / "missing"}"', 1))
    r = cli("status", "-c", str(cfg), env={"SPECPILOT_API_TOKEN": ""})
    assert r.exit_code == 78, r.output
    assert "api.token_file" in r.output and "no such file" in r.output
    assert "Traceback" not in r.output


def test_not_a_specpilot_is_a_clear_error(live: LiveDaemon) -> None:
    # An API base that answers something else than JSON (here: the status page HTML).
    r = cli("status", "--api", live.url + "/?x=")
    assert r.exit_code == 1
    assert "Traceback" not in r.output


def test_api_validation_errors_are_readable(live: LiveDaemon) -> None:
    """A 422 prints as `field: message`, not as the raw Python list of FastAPI's errors."""
    env = {"SPECPILOT_API_TOKEN": TOKEN}
    r = cli("pin", "eagle3-2step", "--reason", "x" * 600, "--api", live.url, env=env)
    assert r.exit_code == 1, r.output
    assert "HTTP 422: reason: " in r.output and "500" in r.output
    assert "[{" not in r.output and "'loc'" not in r.output
    assert "Traceback" not in r.output


def test_api_detail_formats_every_shape() -> None:
    from controller.cli import _api_detail

    errors = {
        "detail": [
            {"type": "greater_than", "loc": ["body", "ttl_s"], "msg": "Input should be > 0"},
            {"type": "extra_forbidden", "loc": ["query", "since"], "msg": "unknown"},
            {"type": "missing", "loc": ["body"], "msg": "Field required"},
        ]
    }
    assert _api_detail(errors, "") == (
        "ttl_s: Input should be > 0; since: unknown; request: Field required"
    )
    assert _api_detail({"detail": "wrong token"}, "") == "wrong token"
    assert _api_detail(None, "plain text body") == "plain text body"


# --------------------------------------------------------------------------------- bad numbers


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["pin", "baseline", "--ttl-s", "nan"], "--ttl-s"),
        (["pin", "baseline", "--ttl-s", "inf"], "--ttl-s"),
        (["pin", "baseline", "--ttl-s", "0"], "--ttl-s"),
        (["pause", "--ttl-s", "nan"], "--ttl-s"),
        (["pause", "--ttl-s", "-inf"], "--ttl-s"),
        (["breakeven", "--baseline-tok-s", "nan", "--cycle-ms", "30"], "--baseline-tok-s"),
        (["breakeven", "--baseline-tok-s", "inf", "--cycle-ms", "30"], "--baseline-tok-s"),
        (["breakeven", "--baseline-tok-s", "82", "--cycle-ms", "inf"], "--cycle-ms"),
        (
            ["breakeven", "--baseline-tok-s", "82", "--cycle-ms", "30", "--target-tok-s", "-5"],
            "--target-tok-s",
        ),
        (["breakeven", "--baseline-tok-s", "abc", "--cycle-ms", "30"], "--baseline-tok-s"),
        (["breakeven", "--table", "--max-running-requests", "-5"], "--max-running-requests"),
        (["breakeven", "--table", "--max-running-requests", "0"], "--max-running-requests"),
        (["breakeven", "--table", "--candidate-step", "99"], "--candidate-step"),
        (["breakeven", "--table", "--candidate-step", "-1"], "--candidate-step"),
        (["sim-calibrate", "--seconds", "0"], "--seconds"),
        (["sim-calibrate", "--seconds", "-1"], "--seconds"),
        (["sim-calibrate", "--seconds", "nan"], "--seconds"),
        (["sim-calibrate", "--seconds", "1e12"], "--seconds"),
        (["demo", "--speed", "nan"], "--speed"),
        (["demo", "--duration-s", "inf"], "--duration-s"),
        (["demo", "--port", "-1"], "--port"),
        (["demo", "--port", "99999"], "--port"),
        (["demo", "--fleet", "-1"], "--fleet"),
    ],
)
def test_bad_numbers_are_one_error_and_exit_2(args: list[str], option: str) -> None:
    """nan, inf and out-of-range values are refused by the option itself (exit 2, one
    "Invalid value" message), before a request, a JSON body or a simulation sees them."""
    api = f"http://127.0.0.1:{_closed_port()}"
    extra = ["--api", api] if args[0] in OPERATOR else []
    r = cli(*args, *extra)
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert f"Invalid value for '{option}'" in r.output
    assert "cannot reach" not in r.output  # refused before any request


def test_finite_float() -> None:
    import typer

    from controller.cli import finite_float

    parse = finite_float(gt=0, le=10)
    assert parse("2.5") == 2.5 and parse(10.0) == 10.0
    for bad in ("0", "-1", "10.5", "nan", "inf", "-inf", "x", ""):
        with pytest.raises(typer.BadParameter):
            parse(bad)
    assert finite_float()("-1e300") == -1e300


def test_breakeven_table_takes_the_documented_steps() -> None:
    from controller.cli import TABLE_MAX_STEP
    from controller.hybrid_table import DEFAULT_STEPS

    assert max(DEFAULT_STEPS) == TABLE_MAX_STEP
    r = cli("breakeven", "--table", "--json", "--candidate-step", "0", "--candidate-step", "7")
    assert r.exit_code == 0, r.output


# --------------------------------------------------------------------------------- history

T0 = 1_800_000_000.0


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database with a few hours of history: an explore, a rollback on predicted gain (a
    trial), a pin, an advisory period and a change finding."""
    tmp = tmp_path_factory.mktemp("cli-db")

    async def build() -> Path:
        rig = await make_rig(tmp, clock=ManualClock(T0))
        rig.server.models["eagle3-5step"] = ProfileModel(step_s=0.070, accept_length=1.2)
        c = rig.controller
        for i in range(900):
            if i == 400:
                c.pin("eagle3-2step", 1800, "try 2-step", "cli:test")
            if i == 600:
                rig.server.batch = 40
            if i == 700:
                c.set_mode(Mode.ADVISORY, "look only", "cli:test")
            await rig.ticks(1)
        path = rig.store.path
        await rig.close()
        return path

    return asyncio.run(build())


def _events(db: Path, *args: str) -> list[dict[str, Any]]:
    r = cli("history", "--db", str(db), "--json", *args)
    assert r.exit_code == 0, r.output
    return [json.loads(line) for line in r.output.splitlines()]


def test_history(recorded: Path) -> None:
    since = str(T0 - 60)
    events = _events(recorded, "--since", since)
    kinds = {e["kind"] for e in events}
    assert kinds == {"decision", "switch", "trial", "override", "finding"}
    assert [e["t_s"] for e in events] == sorted(e["t_s"] for e in events)
    switches = [e for e in events if e["kind"] == "switch"]
    assert [s["reason"] for s in switches][:4] == [
        "start",  # the initial start
        "explore",
        "switch_predicted_gain",
        "switch_pinned",
    ]
    overrides = [(e["override"], e["actor"]) for e in events if e["kind"] == "override"]
    assert overrides == [("pin", "cli:test"), ("mode", "cli:test")]
    # Repeated holds are folded with a count; --all lists every decision.
    folded = [e for e in events if e["kind"] == "decision"]
    every = [e for e in _events(recorded, "--since", since, "--all") if e["kind"] == "decision"]
    assert sum(e["count"] for e in folded) == len(every) == 901
    assert len(folded) < 30
    # --since / --until bound the period.
    later = _events(recorded, "--since", str(T0 + 7000), "--until", str(T0 + 7200))
    assert later and all(T0 + 7000 <= e["t_s"] < T0 + 7200 for e in later)

    r = cli("history", "--db", str(recorded), "--since", since)
    assert r.exit_code == 0
    for text in ("switch_predicted_gain", "x2", "pin eagle3-2step for 1800 s by cli:test"):
        assert text in r.output
    assert "[ok, 60 s down]" in r.output  # not swallowed as rich markup
    # A folded run's end is the time of day where it is the start's day: one line at 80 columns.
    run = next(e for e in folded if e["count"] > 1)
    until = dt.datetime.fromtimestamp(run["until_s"], tz=dt.UTC)
    assert f"x{run['count']} until {until:%H:%M:%S}" in r.output
    assert f"until {until:%Y-%m-%d}" not in r.output


def test_parse_time() -> None:
    now = 1_000_000.0
    assert parse_time("2h", now) == now - 7200
    assert parse_time("1h30m", now) == now - 5400
    assert parse_time("7d", now) == now - 7 * 86400
    assert parse_time("45s", now) == now - 45
    assert parse_time("now", now) == now
    assert parse_time("1700000000", now) == 1_700_000_000
    assert parse_time("2023-11-14T22:13:20", now) == 1_700_000_000  # naive: UTC
    assert parse_time("2023-11-14T23:13:20+01:00", now) == 1_700_000_000
    for bad in ("yesterday", "2x", "", "nan"):
        with pytest.raises(ValueError, match="not a time"):
            parse_time(bad, now)


@pytest.mark.parametrize(
    ("since", "until"),
    [("1000000w", "999999w"), ("-99999999999", "1"), ("100000000000000w", None)],
)
@pytest.mark.parametrize("command", ["history", "report", "export"])
def test_times_out_of_range_are_one_error(
    recorded: Path, tmp_path: Path, command: str, since: str, until: str | None
) -> None:
    """Times a datetime cannot show were a `year -17139 is out of range` traceback."""
    args = [command, "--db", str(recorded), "--since", since]
    args += ["--until", until] if until is not None else []
    if command == "report":
        args += ["-o", str(tmp_path / "r.png")]
    r = cli(*args)
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "is out of range" in r.output and "years 1-9999" in r.output


def test_parse_time_refuses_times_out_of_range() -> None:
    now = 1_800_000_000.0
    for bad in ("1000000w", "-99999999999", "1e13", "100000000000000w"):
        with pytest.raises(ValueError, match="out of range"):
            parse_time(bad, now)
    assert parse_time("0", now) == 0.0
    assert parse_time("1000w", now) == now - 1000 * 7 * 86400


def test_history_errors(tmp_path: Path, recorded: Path) -> None:
    r = cli("history", "--db", str(tmp_path / "missing.db"))
    assert r.exit_code == 2 and "does not exist" in r.output
    r = cli("history", "--db", str(recorded), "--since", "last tuesday")
    assert r.exit_code == 2 and "not a time" in r.output
    r = cli("history", "--db", str(recorded), "--since", "1h", "--until", "2h")
    assert r.exit_code == 2 and "later" in r.output
    junk = tmp_path / "junk.db"
    junk.write_text("not a database at all, " * 100)
    r = cli("history", "--db", str(junk))
    assert r.exit_code == 1 and "Traceback" not in r.output
    r = cli("history", "--config", str(tmp_path / "nope.toml"))
    assert r.exit_code == 78


def test_history_from_config(tmp_path: Path, recorded: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[controller]\ndatabase = "{recorded}"\n[profiles.baseline]\nflags = []\n')
    r = cli("history", "--config", str(cfg), "--since", str(T0), "--json")
    assert r.exit_code == 0, r.output
    assert len(r.output.splitlines()) > 10


def test_export_jsonl(recorded: Path, tmp_path: Path) -> None:
    out = tmp_path / "all.jsonl"
    r = cli(
        "export", "--db", str(recorded), "--format", "jsonl", "--since", str(T0), "-o", str(out)
    )
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_table: dict[str, int] = {}
    for row in rows:
        by_table[row["table"]] = by_table.get(row["table"], 0) + 1
    assert by_table["decisions"] == 901
    assert by_table["estimates"] == 3 * 900  # three profiles per tick
    assert by_table["switches"] >= 4
    assert set(by_table) <= set(EXPORT_TABLES)
    decision = next(r for r in rows if r["table"] == "decisions")
    assert isinstance(decision["diagnostics"], dict)
    # To standard output, one table.
    r = cli("export", "--db", str(recorded), "--table", "switches", "--since", str(T0))
    assert r.exit_code == 0
    assert all(json.loads(line)["table"] == "switches" for line in r.output.splitlines())


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_an_export_whose_reader_stops_early_ends_quietly(recorded: Path, fmt: str) -> None:
    """`specpilot export | head -1`: the closed pipe is no error to report (it printed
    "cannot write None: [Errno 32] Broken pipe")."""
    args = ["export", "--db", str(recorded), "--format", fmt, "--table", "estimates"]
    p = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline()
    p.stdout.close()  # 2700 rows: far more than a pipe holds
    err = p.stderr.read().decode()
    assert p.wait(60) == 1  # click's status for a closed output
    assert err == ""


def test_export_csv(recorded: Path, tmp_path: Path) -> None:
    r = cli("export", "--db", str(recorded), "--format", "csv", "-t", "switches", "--since", "100w")
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(r.output.splitlines()))
    assert rows[0]["to_profile"] == "baseline" and rows[0]["from_profile"] == ""
    assert {"started_s", "downtime_s", "outcome", "reason"} <= set(rows[0])

    out = tmp_path / "csv"
    r = cli("export", "--db", str(recorded), "--format", "csv", "-o", str(out), "--since", "100w")
    assert r.exit_code == 0, r.output
    assert sorted(p.stem for p in out.iterdir()) == sorted(EXPORT_TABLES)
    with (out / "decisions.csv").open() as fh:
        decisions = list(csv.DictReader(fh))
    assert len(decisions) == 901
    assert json.loads(decisions[-1]["diagnostics"])  # nested values are JSON in a cell
    with (out / "observations_hourly.csv").open() as fh:
        assert fh.readline().startswith("hour_s,profile,")  # header even when empty

    for args, msg in (
        (["--format", "csv"], "needs --output DIR"),
        (["--format", "xml"], "csv or jsonl"),
        (["--table", "secrets"], "unknown table"),
    ):
        r = cli("export", "--db", str(recorded), *args)
        assert r.exit_code == 2 and msg in r.output, (args, r.output)


def test_report(recorded: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.png"
    started = time.monotonic()
    r = cli("report", "--db", str(recorded), "--since", str(T0), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert time.monotonic() - started < 30
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Reader(recorded) as reader:
        n_switches = len(reader.switches(limit=1000))
    assert f"{n_switches} switches" in r.output
    from matplotlib.image import imread

    img = imread(out)
    assert img.shape[0] >= 600 and img.shape[1] >= 1000
    print(f"report PNG: {out}")
    r = cli("report", "--db", str(recorded), "--since", str(T0 + 10**7), "-o", str(out))
    assert r.exit_code == 1 and "no observations" in r.output


def test_report_bands_end_where_the_history_has_a_gap() -> None:
    """A profile's band reaches the next profile's first point when that follows within a few
    polls (a switch seen window to window); across a longer gap (the restart's downtime, the
    daemon down) it ends at its last point: no profile served in between."""
    from controller.report import _runs

    poll = [50.0] * 6
    assert _runs([0, 10, 20, 30, 40, 50], ["a", "a", "a", "b", "b", "b"], poll) == [
        ("a", 0, 30),
        ("b", 30, 50),
    ]
    assert _runs([0, 10, 20, 400, 410, 420], ["a", "a", "a", "b", "b", "b"], poll) == [
        ("a", 0, 20),
        ("b", 400, 420),
    ]
    assert _runs([0, 10, 400, 410], ["a", "a", "a", "a"], poll[:4]) == [
        ("a", 0, 10),
        ("a", 400, 410),
    ]
    # Hourly aggregates (mid-hour) bridge their hour; the raw points after them keep the poll's.
    assert _runs([1800, 5400, 7200], ["a", "a", "b"], [5400.0, 5400.0, 50.0]) == [
        ("a", 1800, 7200),
        ("b", 7200, 7200),
    ]


def test_breakeven() -> None:
    r = cli("breakeven", "--baseline-tok-s", "82", "--cycle-ms", "30")
    assert r.exit_code == 0
    assert "2.46" in r.output  # FIELD.md: 82 tok/s x 30 ms
    r = cli("breakeven", "--baseline-tok-s", "0", "--cycle-ms", "30")
    assert r.exit_code == 2

    # FIELD.md's tuned 2-step (19.85 ms cycle, accept length ~1.87) against 88.8 tok/s, and the
    # later boot's (~30 ms, ~2.0) against 82.
    def priced(baseline: str, cycle: str, accept: str) -> Any:
        args = ["--baseline-tok-s", baseline, "--cycle-ms", cycle, "--accept-length", accept]
        return cli("breakeven", *args)

    tuned = priced("88.8", "19.85", "1.87")
    assert tuned.exit_code == 0, tuned.output
    assert "94.2 tok/s, +6.1% vs 88.8: speculation pays" in tuned.output
    later = priced("82", "30", "2")
    assert "66.7 tok/s, -18.7% vs 82: speculation does not pay" in later.output
    assert priced("82", "30", "0.9").exit_code == 2  # below 1: drafts only, not drafts + bonus


def test_run_help_policy_lists_every_key_with_its_reason() -> None:
    """config.toml points users at `specpilot run --help-policy`: every PolicySettings field,
    its default, and the reason its source gives (or the field whose comment covers it)."""
    import dataclasses

    from controller.settings import DERIVED_POLICY_KEYS
    from policies.settings import PolicySettings

    r = CliRunner().invoke(app, ["run", "--help-policy"])
    assert r.exit_code == 0, r.output
    blocks = r.output.split("\n")
    for f in dataclasses.fields(PolicySettings):
        if f.name in DERIVED_POLICY_KEYS:
            assert f"{f.name} = " not in r.output  # not a [policy] key
            continue
        head = next(i for i, line in enumerate(blocks) if line.startswith(f"{f.name} = "))
        assert blocks[head + 1].startswith("    ") and blocks[head + 1].strip(), f.name
    assert "moe_experts = 0" in r.output and "explore = true" in r.output
    assert "min_dwell_s = 300.0" in r.output
    helped = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert "List every [policy] key" in helped.output  # not eaten as rich markup


def test_status_table_keeps_names_and_numbers_at_80_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipe or a narrow terminal is 80 columns: the profile names and numbers come out whole
    (the long provenance column wraps), as a user reading or grepping `specpilot status` needs."""
    import controller.cli as cli_mod

    est = {
        "profile": "eagle3-5step-long-drafter",
        "tok_s": {"mean": 212.34, "low": 175.2, "high": 253.9},
        "accept_length": {"mean": 2.18},
        "breakeven_accept_length": 1.93,
        "cycle_s": {"mean": 0.0383},
        "source": "mean_model+observed+observed",
    }
    status = {
        "profile": "eagle3-5step-long-drafter",
        "mode": "active",
        "overrides": {"pin": None, "pause": None, "blocked_reason": None},
        "estimates": [est, {**est, "profile": "baseline-cuda-graph-off"}],
        "last_decision": None,
    }
    monkeypatch.setattr(cli_mod, "_call", lambda *a, **k: status)
    monkeypatch.setattr(cli_mod.console, "width", 80)
    r = cli("status", "--api", "http://127.0.0.1:1")
    assert r.exit_code == 0, r.output
    assert max(len(line) for line in r.output.splitlines()) <= 80
    for text in ("eagle3-5step-long-drafter", "baseline-cuda-graph-off", "212", "175-254"):
        assert text in r.output, r.output


@pytest.mark.parametrize(
    ("extra", "shown"),
    [
        ({"switch_in_flight": True}, "profile - (switch in flight)"),
        (
            {"switch_in_flight": True, "target": {"down_reason": "start-up: starting baseline"}},
            "profile - (start-up: starting baseline)",
        ),
        (
            {"target": {"down_reason": "server down: restart_crashed of baseline in 30 s"}},
            "profile - (server down: restart_crashed of baseline in 30 s)",
        ),
        ({}, "profile - (no server running)"),
    ],
)
def test_status_says_why_no_profile_runs(
    monkeypatch: pytest.MonkeyPatch, extra: dict, shown: str
) -> None:
    import controller.cli as cli_mod

    status = {
        "profile": None,
        "mode": "active",
        "switch_in_flight": False,
        "overrides": {"pin": None, "pause": None, "blocked_reason": None},
        "estimates": [],
        "last_decision": None,
        **extra,
    }
    monkeypatch.setattr(cli_mod, "_call", lambda *a, **k: status)
    r = cli("status", "--api", "http://127.0.0.1:1")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith(shown), r.output
    assert "None" not in r.output and "in force" not in r.output
    status["overrides"]["in_force"] = "paused: nothing switches; the pin on x acts when ..."
    r = cli("status", "--api", "http://127.0.0.1:1")
    assert f"in force: {status['overrides']['in_force']}" in r.output.splitlines()


@pytest.mark.parametrize("command", [["pin", "eagle3-2step"], ["pause"]])
def test_an_override_ttl_past_a_month_is_refused_before_the_api(
    monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    import controller.cli as cli_mod

    def no_call(*a: object, **k: object) -> None:
        raise AssertionError("the API was called")

    monkeypatch.setattr(cli_mod, "_call", no_call)
    r = cli(*command, "--ttl-s", "2592001", "--api", "http://127.0.0.1:1")
    assert r.exit_code == 2
    assert "<= 2.592e+06" in r.output
