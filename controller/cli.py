"""The `specpilot` command line (typer + rich).

Owns argument parsing, friendly errors (an unreachable daemon, a bad file) and rendering. Daemon
commands (`run`, `demo`) delegate to controller.daemon / controller.demo; operator commands talk to
a running daemon's REST API over httpx; history/export read the SQLite file directly (read-only);
`breakeven` and `scrape` are offline tools. No policy logic lives here.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from controller.settings import EXIT_CONFIG, ConfigError, load_settings

app = typer.Typer(
    name="specpilot",
    help="Adaptive speculation controller for SGLang: picks the speculation profile that "
    "maximises tokens/s, paying for every restart.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

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


def _fail(msg: str, code: int = 1) -> typer.Exit:
    err.print(f"[red]specpilot:[/red] {msg}")
    return typer.Exit(code)


def _api_base(api: str | None, config: Path | None) -> tuple[str, str]:
    """(base URL, token from config) for operator commands."""
    token = ""
    if config is not None:
        try:
            s = load_settings(config)
        except ConfigError as e:
            raise _fail(str(e), EXIT_CONFIG) from None
        token = s.api_token()
        if api is None:
            api = f"http://{s.api.host}:{s.api.port}"
    return (api or os.environ.get("SPECPILOT_API") or "http://127.0.0.1:8471").rstrip("/"), token


def _call(
    method: str, api: str, path: str, *, token: str = "", body: dict[str, Any] | None = None
) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers["x-specpilot-actor"] = f"cli:{os.environ.get('USER', 'unknown')}"
    try:
        r = httpx.request(method, api + path, json=body, headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise _fail(
            f"cannot reach the specpilot daemon at {api} ({e.__class__.__name__}: {e}). "
            "Is `specpilot run` running, and is --api right?"
        ) from None
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail")
        except ValueError:
            detail = r.text
        raise _fail(f"{method} {path}: HTTP {r.status_code}: {detail}")
    return r.json()


def _token(token: str | None, cfg_token: str) -> str:
    return token or os.environ.get("SPECPILOT_API_TOKEN", "") or cfg_token


# --------------------------------------------------------------------------------- daemon
@app.command()
def run(
    config: Annotated[Path, typer.Option("--config", "-c", help="config.toml")] = Path(
        "config.toml"
    ),
) -> None:
    """Run the daemon: control loop, REST API and metrics (systemd: Type=notify)."""
    from controller.daemon import run_daemon

    raise typer.Exit(run_daemon(config))


@app.command()
def demo(
    duration_s: Annotated[
        float, typer.Option("--duration-s", help="Real seconds the demo runs (default 180).")
    ] = 180.0,
    speed: Annotated[
        float,
        typer.Option(
            "--speed",
            help="Simulated seconds per real second (50: 3 real minutes = 2.5 simulated hours; "
            "much faster and one CPU cannot drive 48 simulated streams).",
        ),
    ] = 50.0,
    port: Annotated[int, typer.Option(help="Simulator port (0: a free one).")] = 0,
    db: Annotated[Path | None, typer.Option(help="SQLite file (default: a temporary one).")] = None,
    fleet: Annotated[int, typer.Option(help="Fleet mode with N replicas (0: one server).")] = 0,
) -> None:
    """Start the simulator, load and controller in accelerated time and show the loop live."""
    from controller.demo import run_demo

    if fleet:
        raise _fail("fleet mode is not available in this build: run the single-server demo", 2)
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
    console.print(
        f"profile [bold]{st['profile']}[/bold]  mode {st['mode']}  "
        f"pin {ov['pin']['profile'] if ov['pin'] else '-'}  "
        f"paused {'yes' if ov['pause'] else 'no'}  blocked {ov['blocked_reason'] or 'no'}"
    )
    t = Table("profile", "tok/s", "interval", "accept len", "break-even", "cycle ms", "source")
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
    return "-" if v is None else f"{v:.{digits}g}"


@app.command()
def pin(
    profile: str,
    ttl_s: Annotated[float | None, typer.Option("--ttl-s", help="Expiry in seconds.")] = None,
    reason: Annotated[str, typer.Option(help="Why (recorded).")] = "",
    api: ApiOpt = None,
    config: ConfigOpt = None,
    token: TokenOpt = None,
) -> None:
    """Pin a profile (beats every automatic decision until unpinned or expired)."""
    base, tok = _api_base(api, config)
    out = _call(
        "PUT",
        base,
        "/v1/pin",
        token=_token(token, tok),
        body={"profile": profile, "ttl_s": ttl_s, "reason": reason},
    )
    console.print_json(json.dumps(out))


@app.command()
def unpin(
    reason: str = "", api: ApiOpt = None, config: ConfigOpt = None, token: TokenOpt = None
) -> None:
    """Remove the pin."""
    base, tok = _api_base(api, config)
    console.print_json(
        json.dumps(_call("DELETE", base, f"/v1/pin?reason={reason}", token=_token(token, tok)))
    )


@app.command()
def pause(
    ttl_s: Annotated[float, typer.Option("--ttl-s", help="Seconds to pause.")] = 3600.0,
    reason: str = "",
    api: ApiOpt = None,
    config: ConfigOpt = None,
    token: TokenOpt = None,
) -> None:
    """Pause automatic switching for a while."""
    base, tok = _api_base(api, config)
    console.print_json(
        json.dumps(
            _call(
                "PUT",
                base,
                "/v1/pause",
                token=_token(token, tok),
                body={"ttl_s": ttl_s, "reason": reason},
            )
        )
    )


@app.command()
def resume(
    reason: str = "", api: ApiOpt = None, config: ConfigOpt = None, token: TokenOpt = None
) -> None:
    """End a pause."""
    base, tok = _api_base(api, config)
    console.print_json(
        json.dumps(_call("DELETE", base, f"/v1/pause?reason={reason}", token=_token(token, tok)))
    )


@app.command()
def mode(
    new_mode: Annotated[str, typer.Argument(metavar="active|advisory")],
    reason: str = "",
    api: ApiOpt = None,
    config: ConfigOpt = None,
    token: TokenOpt = None,
) -> None:
    """Set the mode: active (acts) or advisory (decides and explains, never restarts)."""
    if new_mode not in ("active", "advisory"):
        raise _fail(f"mode must be active or advisory, not {new_mode!r}", 2)
    base, tok = _api_base(api, config)
    console.print_json(
        json.dumps(
            _call(
                "PUT",
                base,
                "/v1/mode",
                token=_token(token, tok),
                body={"mode": new_mode, "reason": reason},
            )
        )
    )


# --------------------------------------------------------------------------------- offline
@app.command()
def breakeven(
    baseline_tok_s: Annotated[
        float, typer.Option("--baseline-tok-s", help="Baseline (no speculation) tok/s.")
    ],
    cycle_ms: Annotated[float, typer.Option("--cycle-ms", help="Speculative cycle time, ms.")],
    target: Annotated[
        list[float] | None,
        typer.Option("--target-tok-s", help="Targets to price (default 100 and 120)."),
    ] = None,
) -> None:
    """The break-even rule of FIELD.md: accept_len = baseline_tok_s x cycle_s."""
    from policies.breakeven import accept_length_for, breakeven_accept_length

    if baseline_tok_s <= 0 or cycle_ms <= 0:
        raise _fail("--baseline-tok-s and --cycle-ms must be > 0", 2)
    cycle_s = cycle_ms / 1000.0
    be = breakeven_accept_length(baseline_tok_s, cycle_s)
    console.print(
        f"break-even accept length at {baseline_tok_s:g} tok/s and {cycle_ms:g} ms: "
        f"[bold]{be:.2f}[/bold]"
    )
    for t in target or [100.0, 120.0]:
        console.print(f"  {t:g} tok/s needs accept length {accept_length_for(t, cycle_s):.2f}")


@app.command()
def scrape(
    url: Annotated[
        str | None, typer.Option(help="SGLang base URL, e.g. http://127.0.0.1:30000")
    ] = None,
    file: Annotated[Path | None, typer.Option(help="A recorded /metrics exposition.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = True,
    profile: Annotated[str, typer.Option(help="Profile name to tag the snapshot with.")] = "?",
) -> None:
    """Parse one exposition (live or recorded) and print what specpilot reads from it."""
    from controller.observe import ObserveError, parse_exposition, snapshot_to_json
    from controller.observe import scrape as do_scrape

    if (url is None) == (file is None):
        raise _fail("give exactly one of --url or --file", 2)
    try:
        if file is not None:
            try:
                text = file.read_text()
            except OSError as e:
                raise _fail(f"{file}: {e}", 2) from None
            snap = parse_exposition(text, profile=profile, t_s=0.0)
        else:

            async def once() -> Any:
                async with httpx.AsyncClient(timeout=10) as client:
                    return await do_scrape(client, url.rstrip("/"), profile=profile, t_s=0.0)

            snap = asyncio.run(once())
    except ObserveError as e:
        raise _fail(f"cannot read the exposition: {e}") from None
    out = snapshot_to_json(snap)
    if as_json:
        sys.stdout.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
    else:
        console.print(out)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
