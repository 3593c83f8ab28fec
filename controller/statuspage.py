"""The server-rendered status page at `/`: no JavaScript, no build step, no external assets.

Owns the HTML: current profile, mode and overrides, the break-even line for the running batch,
the estimates table (predicted tok/s with intervals, accept length against break-even), an
inline SVG chart of observed output tok/s with the running profile as coloured bands and
switches as markers, and the recent decisions. Reads Controller views and rows the API read for
it; escapes everything it prints. Must not read the database itself or change any state.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from html import escape
from typing import TYPE_CHECKING, Any

from controller.numfmt import num

if TYPE_CHECKING:
    from controller.loop import Controller

COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1")
Row = Mapping[str, Any]


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return num(v, digits)
    return escape(str(v))


def _ts(t: float | None) -> str:
    if t is None:
        return "–"
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _hm(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%H:%M")


def profile_colours(profiles: Sequence[str]) -> dict[str, str]:
    return {p: COLOURS[i % len(COLOURS)] for i, p in enumerate(profiles)}


def chart_svg(
    observations: Sequence[Row],
    switches: Sequence[Row],
    colours: Mapping[str, str],
    width: int = 960,
    height: int = 240,
) -> str:
    """Observed output tok/s (oldest first), profile bands behind it, switches as markers."""
    pts = [o for o in observations if o.get("output_tok_s") is not None]
    if len(pts) < 2:
        return '<p class="muted" id="chart-empty">Not enough observations for a chart yet.</p>'
    left, right, top_pad, bottom = 48, 10, 10, 36
    t0, t1 = float(pts[0]["t_s"]), float(pts[-1]["t_s"])
    span = max(t1 - t0, 1e-9)
    top = max(float(o["output_tok_s"]) for o in pts) * 1.1 or 1.0
    plot_h = height - top_pad - bottom

    def x(t: float) -> float:
        return left + (t - t0) / span * (width - left - right)

    def y(v: float) -> float:
        return top_pad + plot_h - v / top * plot_h

    parts = [
        f'<svg id="chart" width="{width}" height="{height}" role="img" '
        f'aria-label="observed output tokens per second over time" '
        f'xmlns="http://www.w3.org/2000/svg" font-size="11">'
    ]
    # One band per run of observations on the same profile, from the start of its first
    # window to the end of its last: the downtime of a switch stays blank.
    start = 0
    for i in range(1, len(pts) + 1):
        if i == len(pts) or pts[i]["profile"] != pts[start]["profile"]:
            prof = str(pts[start]["profile"])
            x0 = max(x(float(pts[start]["t_s"]) - float(pts[start].get("window_s") or 0.0)), left)
            x1 = x(float(pts[i - 1]["t_s"]))
            parts.append(
                f'<rect x="{x0:.1f}" y="{top_pad}" width="{max(x1 - x0, 1):.1f}" '
                f'height="{plot_h}" fill="{colours.get(prof, "#ccc")}" opacity="0.18">'
                f"<title>{escape(prof)}</title></rect>"
            )
            start = i
    for frac in (0.0, 0.5, 1.0):
        v = top / 1.1 * frac
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
            f'stroke="#ddd"/><text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">'
            f"{v:.0f}</text>"
        )
    for s in switches:
        ts = float(s["started_s"])
        if t0 <= ts <= t1:
            parts.append(
                f'<line class="switch" x1="{x(ts):.1f}" x2="{x(ts):.1f}" y1="{top_pad}" '
                f'y2="{top_pad + plot_h}" stroke="#333" stroke-dasharray="4 3">'
                f"<title>{escape(str(s.get('from_profile') or '(start)'))} → "
                f"{escape(str(s['to_profile']))}: {escape(str(s['reason']))} "
                f"({escape(str(s.get('outcome') or 'in flight'))})</title></line>"
            )
    # The line breaks where polls are missing (a restart, a failed scrape) or the profile
    # changes, rather than drawing a rate nobody measured.
    for seg in _segments(pts):
        line = " ".join(f"{x(float(o['t_s'])):.1f},{y(float(o['output_tok_s'])):.1f}" for o in seg)
        parts.append(f'<polyline fill="none" stroke="#222" stroke-width="1.5" points="{line}"/>')
    parts.append(
        f'<text x="{left}" y="{height - 20}">{_hm(t0)} UTC</text>'
        f'<text x="{width - right}" y="{height - 20}" text-anchor="end">{_hm(t1)} UTC</text>'
    )
    lx = left
    for p, c in colours.items():
        parts.append(
            f'<rect x="{lx}" y="{height - 12}" width="10" height="10" fill="{c}" '
            f'opacity="0.6"/><text x="{lx + 14}" y="{height - 3}">{escape(p)}</text>'
        )
        lx += 24 + 7 * len(p)
    parts.append(
        f'<line x1="{lx}" x2="{lx + 14}" y1="{height - 7}" y2="{height - 7}" stroke="#333" '
        f'stroke-dasharray="4 3"/><text x="{lx + 18}" y="{height - 3}">switch</text>'
    )
    parts.append("</svg>")
    return "".join(parts)


def _segments(pts: Sequence[Row]) -> list[list[Row]]:
    """Runs of points on one profile without a gap longer than 2.5 windows."""
    segs: list[list[Row]] = []
    for o in pts:
        if segs:
            prev = segs[-1][-1]
            gap = float(o["t_s"]) - float(prev["t_s"])
            limit = 2.5 * float(o.get("window_s") or prev.get("window_s") or gap)
            if o["profile"] == prev["profile"] and gap <= limit:
                segs[-1].append(o)
                continue
        segs.append([o])
    return segs


def _breakeven_line(st: Mapping[str, Any]) -> str:
    """The break-even accept length of the running profile, against its accept length."""
    running = st["profile"]
    obs = st.get("observed") or {}
    est = next((e for e in st["estimates"] if e["profile"] == running), None)
    spec = [e for e in st["estimates"] if e.get("breakeven_accept_length") is not None]
    batch = obs.get("running_reqs")
    at = f" at batch {_fmt(batch)}" if batch is not None else ""
    if est is not None and est.get("breakeven_accept_length") is not None:
        acc = (est.get("accept_length") or {}).get("mean")
        be = est["breakeven_accept_length"]
        verdict = ""
        if acc is not None:
            verdict = (
                ' · <b class="good">pays</b>' if acc > be else ' · <b class="bad">does not pay</b>'
            )
        return (
            f"{escape(running)} needs accept length <b>{_fmt(be)}</b> to match baseline{at}; "
            f"it accepts <b>{_fmt(acc)}</b>{verdict}"
        )
    if spec:
        items = ", ".join(
            f"{escape(e['profile'])} <b>{_fmt(e['breakeven_accept_length'])}</b>" for e in spec
        )
        return f"Accept length needed to match baseline{at}: {items}"
    return "No break-even yet: it needs baseline and cycle-time estimates at this batch size."


def render_status_page(
    controller: Controller,
    decisions: Sequence[Row],
    observations: Sequence[Row] = (),
    switches: Sequence[Row] = (),
) -> str:
    """The whole page. `decisions` newest first; `observations` oldest first."""
    st = controller.status()
    ov = st["overrides"]
    colours = profile_colours(list(controller.specs))
    best = max(
        (e for e in st["estimates"] if e["tok_s"]),
        key=lambda e: e["tok_s"]["mean"],
        default=None,
    )
    rows = []
    for e in st["estimates"]:
        tok = e["tok_s"] or {}
        acc = e["accept_length"] or {}
        cyc = e["cycle_s"] or {}
        running = e["profile"] == st["profile"]
        cls = ["running"] if running else []
        if best is not None and e["profile"] == best["profile"]:
            cls.append("best")
        swatch = colours.get(e["profile"], "#ccc")
        rows.append(
            f'<tr class="{" ".join(cls)}"><td><span class="sw" style="background:{swatch}">'
            f"</span>{escape(e['profile'])}</td><td>{_fmt(tok.get('mean'))}</td>"
            f"<td>{_fmt(tok.get('low'))} – {_fmt(tok.get('high'))}</td>"
            # Observed now only where it runs: another profile's is its last run's, under other
            # traffic, in a table of estimates for the traffic served now.
            f"<td>{_fmt(e['observed_tok_s'] if running else None)}</td>"
            f"<td>{_fmt(acc.get('mean'))}</td>"
            f"<td>{_fmt(e['breakeven_accept_length'])}</td>"
            f"<td>{_fmt(cyc['mean'] * 1000 if cyc.get('mean') is not None else None)}</td>"
            f"<td>{escape(e['source'] or '')}</td></tr>"
        )
    drows = "".join(
        f"<tr><td>{_ts(d['t_s'])}</td><td>{escape(str(d['action']))}</td>"
        f"<td>{escape(str(d['profile']))}</td><td>{escape(str(d['reason']))}</td>"
        f"<td>{escape(str(d.get('mode') or ''))}</td>"
        f"<td>{'yes' if d.get('acted') else 'no'}</td></tr>"
        for d in decisions
    )
    last = st["last_decision"]
    pin, pause, trial = ov["pin"], ov["pause"], st["trial"]
    obs = st["observed"] or {}
    pin_txt = (
        f"{escape(str(pin['profile']))} until {_ts(pin['until_s'])}"
        if pin and pin.get("until_s") is not None
        else (f"{escape(str(pin['profile']))} (no expiry)" if pin else "none")
    )
    trial_txt = (
        f"{escape(str(trial['profile']))} (from {escape(str(trial['from_profile']))}, "
        f"{trial['windows']} windows, observed {_fmt(trial['observed_tok_s'])} tok/s)"
        if trial
        else "none"
    )
    last_txt = (
        escape(f"{last['action']} {last['profile']} ({last['reason']}) at ") + _ts(last["t_s"])
        if last
        else "none yet"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>specpilot · {escape(str(st["profile"]))}</title>
<meta http-equiv="refresh" content="10">
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.2em 1.5em; color: #222; }}
h1 {{ margin: 0 0 .3em; }} h2 {{ margin: 1em 0 .3em; font-size: 1.15em; }}
table {{ border-collapse: collapse; margin: .3em 0 1em; }}
td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: right; }}
td {{ white-space: nowrap; }}  /* names, numbers and intervals whole; long headers wrap */
td:first-child, th:first-child {{ text-align: left; }}
th {{ background: #f4f4f4; }}
tr.running {{ background: #eef6ee; font-weight: 600; }}
tr.best td:nth-child(2) {{ color: #1a7f37; font-weight: 700; }}
.sw {{ display: inline-block; width: 10px; height: 10px; margin-right: 6px; opacity: .6; }}
.muted {{ color: #777; }} .big {{ font-size: 1.35em; margin: .2em 0; }}
.good {{ color: #1a7f37; }} .bad {{ color: #b42318; }} .warn {{ color: #b54708; }}
</style></head><body>
<h1>specpilot</h1>
<p class="big">Profile <b id="profile">{_fmt(st["profile"])}</b> · mode <b id="mode">{
        escape(st["mode"])
    }</b>{' · <b class="warn">switch in flight</b>' if st["switch_in_flight"] else ""}{
        "" if st["ready"] else ' · <b class="warn">no good scrape yet</b>'
    }</p>
<p id="observed">Observed {_fmt(obs.get("output_tok_s"))} tok/s · batch {
        _fmt(obs.get("running_reqs"))
    } · accept length {_fmt(obs.get("spec_accept_length"))}</p>
<p id="breakeven">{_breakeven_line(st)}</p>
<p id="overrides">Pin: {pin_txt} · Pause: {
        "until " + _ts(pause["until_s"]) if pause else "none"
    } · Blocked: {escape(ov["blocked_reason"]) if ov["blocked_reason"] else "no"} · Trial: {
        trial_txt
    }</p>
<p id="last-decision">Last decision: {last_txt}</p>
<h2>Output tokens/s (observed)</h2>
{chart_svg(observations, switches, colours)}
<h2>Estimates for the traffic served now</h2>
<table id="estimates"><tr><th>profile</th><th>predicted tok/s</th><th>interval</th>
<th>observed tok/s (running)</th><th>accept length</th><th>break-even accept length</th>
<th>cycle ms</th><th>source</th></tr>
{"".join(rows)}</table>
<h2>Recent decisions</h2>
<table id="decisions"><tr><th>time (UTC)</th><th>action</th><th>profile</th><th>reason</th>
<th>mode</th><th>acted</th></tr>{drows}</table>
<p class="muted">REST: <a href="/docs">/docs</a> · metrics: <a href="/metrics">/metrics</a> ·
refreshes every 10 s</p>
</body></html>"""
