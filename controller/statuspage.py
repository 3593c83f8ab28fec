"""The server-rendered status page at `/`: no JavaScript build step, no external assets.

Owns the HTML: current profile and overrides, the estimates table with break-even accept
lengths, recent decisions, and an inline SVG chart of output tok/s over recent ticks with the
running profile as coloured bands. Reads Controller views only; escapes everything it prints.
"""

from __future__ import annotations

import datetime as dt
from html import escape
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controller.loop import Controller

_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1")


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return escape(str(v))


def _ts(t: float | None) -> str:
    if t is None:
        return "–"
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def chart_svg(controller: Controller, width: int = 900, height: int = 220) -> str:
    """Output tok/s over the remembered ticks, profile bands behind the line."""
    hist = [h for h in controller.history]
    if len(hist) < 2:
        return '<p class="muted">Not enough data for a chart yet.</p>'
    t0, t1 = hist[0].t_s, hist[-1].t_s
    span = max(t1 - t0, 1e-9)
    rates = [h.tok_s for h in hist if h.tok_s is not None]
    top = max(rates) * 1.1 if rates else 1.0
    colour = {p: _COLOURS[i % len(_COLOURS)] for i, p in enumerate(controller.specs)}

    def x(t: float) -> float:
        return 40 + (t - t0) / span * (width - 50)

    def y(v: float) -> float:
        return height - 20 - v / top * (height - 30)

    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="tok/s chart">']
    # One band per run of ticks on the same profile.
    seg_start = 0
    for i in range(1, len(hist) + 1):
        if i == len(hist) or hist[i].profile != hist[seg_start].profile:
            prof = hist[seg_start].profile
            x0, x1 = x(hist[seg_start].t_s), x(hist[min(i, len(hist) - 1)].t_s)
            parts.append(
                f'<rect x="{x0:.1f}" y="10" width="{max(x1 - x0, 1):.1f}" height="{height - 30}" '
                f'fill="{colour.get(prof, "#ccc")}" opacity="0.15">'
                f"<title>{escape(prof)}</title></rect>"
            )
            seg_start = i
    pts = " ".join(f"{x(h.t_s):.1f},{y(h.tok_s):.1f}" for h in hist if h.tok_s is not None)
    parts.append(f'<polyline fill="none" stroke="#222" stroke-width="1.5" points="{pts}"/>')
    parts.append(f'<text x="2" y="16" font-size="11">{top:.0f}</text>')
    parts.append(f'<text x="2" y="{height - 20}" font-size="11">0</text>')
    legend_x = 45
    for p, c in colour.items():
        parts.append(
            f'<rect x="{legend_x}" y="{height - 14}" width="10" height="10" fill="{c}" '
            f'opacity="0.5"/><text x="{legend_x + 14}" y="{height - 5}" font-size="11">'
            f"{escape(p)}</text>"
        )
        legend_x += 20 + 7 * len(p)
    parts.append("</svg>")
    return "".join(parts)


def render_status_page(controller: Controller) -> str:
    st = controller.status()
    ov = st["overrides"]
    rows = []
    for e in st["estimates"]:
        tok = e["tok_s"] or {}
        acc = e["accept_length"] or {}
        cyc = e["cycle_s"] or {}
        running = " class=running" if e["profile"] == st["profile"] else ""
        rows.append(
            f"<tr{running}><td>{escape(e['profile'])}</td><td>{_fmt(tok.get('mean'))}</td>"
            f"<td>{_fmt(tok.get('low'))} – {_fmt(tok.get('high'))}</td>"
            f"<td>{_fmt(acc.get('mean'))}</td>"
            f"<td>{_fmt(e['breakeven_accept_length'])}</td>"
            f"<td>{_fmt(cyc.get('mean') * 1000 if cyc.get('mean') else None)}</td>"
            f"<td>{_fmt(e['observed_tok_s'])}</td><td>{escape(e['source'] or '')}</td></tr>"
        )
    decisions = controller.store.recent_decisions(limit=15, since_s=None)
    drows = "".join(
        f"<tr><td>{_ts(d['t_s'])}</td><td>{escape(str(d['action']))}</td>"
        f"<td>{escape(str(d['profile']))}</td><td>{escape(str(d['reason']))}</td>"
        f"<td>{'yes' if d.get('acted') else 'no'}</td></tr>"
        for d in decisions
    )
    last = st["last_decision"]
    pin = ov["pin"]
    pause = ov["pause"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>specpilot</title>
<meta http-equiv="refresh" content="10">
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: .5em 0 1.5em; }}
td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
tr.running {{ background: #eef6ee; font-weight: 600; }}
.muted {{ color: #777; }} .big {{ font-size: 1.4em; }}
</style></head><body>
<h1>specpilot</h1>
<p class="big">Profile: <b id="profile">{_fmt(st["profile"])}</b> · mode <b id="mode">
{escape(st["mode"])}</b>{" · <b>switch in flight</b>" if st["switch_in_flight"] else ""}</p>
<p>Pin: {escape(str(pin["profile"])) + " until " + _ts(pin["until_s"]) if pin else "none"} ·
Pause: {"until " + _ts(pause["until_s"]) if pause else "none"} ·
Blocked: {escape(ov["blocked_reason"]) if ov["blocked_reason"] else "no"}</p>
<p>Last decision: {
        escape(last["action"] + " " + last["profile"] + " (" + last["reason"] + ")")
        if last
        else "none yet"
    }</p>
<h2>Output tokens/s</h2>
{chart_svg(controller)}
<h2>Estimates</h2>
<table id="estimates"><tr><th>profile</th><th>predicted tok/s</th><th>interval</th>
<th>accept length</th><th>break-even accept length</th><th>cycle ms</th><th>observed tok/s</th>
<th>source</th></tr>
{"".join(rows)}</table>
<h2>Recent decisions</h2>
<table id="decisions"><tr><th>time (UTC)</th><th>action</th><th>profile</th><th>reason</th>
<th>acted</th></tr>{drows}</table>
<p class="muted">REST: <a href="/docs">/docs</a> · metrics: <a href="/metrics">/metrics</a></p>
</body></html>"""
