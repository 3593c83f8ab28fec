"""`specpilot report`: a PNG of what the controller saw and did, from the SQLite history.

Owns the figure (matplotlib, Agg backend: no display needed): observed output tok/s over time
with the running profile as coloured bands, predicted tok/s per profile as thin lines, switches
(and advisory switch decisions) as vertical markers; below it, the observed accept length
against the running profile's break-even accept length. Older periods whose raw observations
were downsampled are drawn from the hourly aggregates. Reads through a `store.Reader` only; it
must not write the database or decide anything.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: render to files, never to a display

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from controller.numfmt import span_end
from policies.types import verified_accept_length
from store import ALL_WORKLOADS, Reader

COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1")
# Lines with more points than this are averaged into this many time bins: a week of 10 s polls
# would otherwise draw 60,000 segments per line for no visible gain.
MAX_POINTS = 2000


class ReportError(Exception):
    """Nothing to draw (no rows in the period) or the file could not be written."""


@dataclass(frozen=True)
class ReportSummary:
    """What went into the PNG (for the CLI's one-line summary and for tests)."""

    path: Path
    since_s: float
    until_s: float
    observations: int
    hourly_points: int
    switches: int
    advisory_switches: int
    profiles: tuple[str, ...]


def _dt(ts: Iterable[float]) -> list[dt.datetime]:
    return [dt.datetime.fromtimestamp(t, tz=dt.UTC) for t in ts]


def _binned(t: np.ndarray, v: np.ndarray, n: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """Mean of v in n equal time bins (empty bins dropped); unchanged when short."""
    if len(t) <= n:
        return t, v
    edges = np.linspace(t[0], t[-1], n + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, n - 1)
    counts = np.bincount(idx, minlength=n)
    sums = np.bincount(idx, weights=v, minlength=n)
    tsum = np.bincount(idx, weights=t, minlength=n)
    keep = counts > 0
    return tsum[keep] / counts[keep], sums[keep] / counts[keep]


def _gapped(t: np.ndarray, v: np.ndarray, gap_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Insert a NaN wherever two points are more than gap_s apart, so that a line breaks
    across periods without data (another profile ran, the server was down)."""
    if len(t) < 2:
        return t, v
    cut = np.nonzero(np.diff(t) > gap_s)[0] + 1
    return np.insert(t, cut, t[cut] - gap_s / 2), np.insert(v, cut, np.nan)


def _line(
    t: Sequence[float], v: Sequence[float], gap_s: float
) -> tuple[list[dt.datetime], np.ndarray]:
    tb, vb = _binned(np.asarray(t, dtype=float), np.asarray(v, dtype=float))
    tg, vg = _gapped(tb, vb, gap_s)
    return _dt(tg), vg


def _runs(
    times: Sequence[float], profiles: Sequence[str], max_gaps: Sequence[float]
) -> list[tuple[str, float, float]]:
    """(profile, start, end) for each run of consecutive points on one profile. A run lasts
    until the next point when that comes within the point's `max_gaps` entry; a longer gap (a
    restart, the daemon down) ends it at its last point: no profile was serving in between."""
    out: list[tuple[str, float, float]] = []
    last: tuple[float, float] | None = None  # (time, max gap) of the previous point
    for t, p, g in zip(times, profiles, max_gaps, strict=True):
        near = last is not None and t - last[0] <= last[1]
        if out and near and out[-1][0] == p:
            out[-1] = (p, out[-1][1], t)
        else:
            if out and near:  # the previous run lasts until this one starts
                out[-1] = (out[-1][0], out[-1][1], t)
            out.append((p, t, t))
        last = (t, g)
    return out


def _rows(reader: Reader, table: str, since_s: float, until_s: float) -> list[dict[str, Any]]:
    return list(reader.export_rows(table, since_s=since_s, until_s=until_s))


def render_report(
    reader: Reader,
    out: Path,
    *,
    since_s: float,
    until_s: float,
    profiles: Sequence[str] = (),
    title: str = "specpilot",
) -> ReportSummary:
    """Draw the period [since_s, until_s) into `out` (PNG). `profiles` fixes the colour order
    (the configuration's); profiles only seen in the history are added after them."""
    served = _rows(reader, "observations", since_s, until_s)
    obs = [o for o in served if o["output_tok_s"]]
    first_raw = served[0]["t_s"] if served else until_s
    hourly = [
        h
        for h in reader.observations_hourly(since_s=since_s - 3600.0, until_s=until_s)
        if h["output_tok_s"] is not None and h["hour_s"] + 3600.0 <= first_raw
    ]
    decisions = [
        d
        for d in _rows(reader, "decisions", since_s, until_s)
        if d["action"] == "switch" and not d["acted"]
    ]
    switches = [
        s
        for s in _rows(reader, "switches", since_s, until_s)
        if s["from_profile"] is not None or s["outcome"] == "ok"
    ]
    estimates = [
        e
        for e in _rows(reader, "estimates", since_s, until_s)
        if e["workload"] == ALL_WORKLOADS and e["tok_s_mean"] is not None
    ]
    if not obs and not hourly:
        end = f" and {_dt([until_s])[0]:%Y-%m-%d %H:%M}" if math.isfinite(until_s) else ""
        raise ReportError(
            f"no observations between {_dt([since_s])[0]:%Y-%m-%d %H:%M}{end or ' and now'} UTC"
        )

    # Points: hourly aggregates (mid-hour) before the first raw observation, then raw.
    hour_t = [h["hour_s"] + 1800.0 for h in hourly]
    pts_t = hour_t + [o["t_s"] for o in obs]
    pts_v = [h["output_tok_s"] for h in hourly] + [o["output_tok_s"] for o in obs]
    # Bands from every observation (an idle window too: the profile ran), an hour's aggregate
    # reaching the next one's.
    band_t = hour_t + [o["t_s"] for o in served]
    band_p = [str(h["profile"]) for h in hourly] + [str(o["profile"]) for o in served]
    seen = list(dict.fromkeys([*profiles, *band_p, *(e["profile"] for e in estimates)]))
    colour = {p: COLOURS[i % len(COLOURS)] for i, p in enumerate(seen)}

    # A line breaks where no point came for this long: several polls missed.
    steps = np.diff(np.asarray([o["t_s"] for o in obs], dtype=float))
    gap_s = 5.0 * float(np.median(steps)) if len(steps) else 3600.0

    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}, dpi=100
    )
    try:
        # A gap of several polls (a restart, the daemon down) is no profile.
        gaps = [1.5 * 3600.0] * len(hourly) + [gap_s] * len(served)
        for p, a, b in _runs(band_t, band_p, gaps):
            for axis in (ax, ax2):
                axis.axvspan(*_dt([a, b]), color=colour[p], alpha=0.15, lw=0)

        by_profile: dict[str, list[Mapping[str, Any]]] = {}
        for e in estimates:
            by_profile.setdefault(str(e["profile"]), []).append(e)
        for p, rows in by_profile.items():
            x, v = _line([r["t_s"] for r in rows], [r["tok_s_mean"] for r in rows], gap_s)
            ax.plot(x, v, lw=1.0, ls="--", color=colour[p], label=f"predicted {p}")

        x, v = _line(pts_t, pts_v, max(gap_s, 3 * 3600.0) if hourly else gap_s)
        ax.plot(x, v, lw=1.6, color="#222", label="observed")

        top = max(pts_v) * 1.15
        for s in switches:
            x = _dt([s["started_s"]])[0]
            ok = s["outcome"] == "ok"
            ax.axvline(x, color="#333" if ok else "#d62728", lw=1.0, ls="-" if ok else ":")
            label = f"{s['reason']}" + ("" if ok else f" ({s['outcome']})")
            ax.annotate(
                label, (x, top), rotation=90, fontsize=7, va="top", ha="right", color="#333"
            )
        for d in decisions:
            ax.axvline(_dt([d["t_s"]])[0], color="#999", lw=0.8, ls="-.")

        # The title's period: everything drawn, a switch before the first point included.
        drawn = [*band_t, *(s["started_s"] for s in switches), *(d["t_s"] for d in decisions)]
        first, last = min(drawn), max(drawn)
        ax.set_ylim(0, top)
        ax.set_ylabel("output tokens/s")
        fig.suptitle(
            f"{title}: {len(switches)} switches"
            + (f", {len(decisions)} advisory switch decisions" if decisions else "")
            + f" · {_dt([first])[0]:%Y-%m-%d %H:%M} to {span_end(first, last, '%H:%M')} UTC"
        )
        handles, _ = ax.get_legend_handles_labels()
        handles += [Patch(color=colour[p], alpha=0.3, label=f"running {p}") for p in seen]
        # Above the plot, never over the data.
        ax.legend(
            handles=handles,
            loc="lower left",
            bbox_to_anchor=(0.0, 1.01),
            fontsize=8,
            ncol=4,
            frameon=False,
        )
        ax.grid(alpha=0.3)

        # Accept length (observed) against the running profile's break-even.
        # Rows stored by earlier versions hold SGLang's 0 where nothing was verified.
        acc = [o for o in obs if verified_accept_length(o["accept_length"]) is not None]
        if acc:
            x, v = _line([o["t_s"] for o in acc], [o["accept_length"] for o in acc], gap_s)
            ax2.plot(x, v, lw=1.2, color="#222", label="observed accept length")
        be = [e for e in estimates if e["breakeven_accept_length"] is not None]
        running_at = dict(zip(band_t, band_p, strict=True))
        be_running = [e for e in be if running_at.get(e["t_s"]) == e["profile"]]
        if be_running:
            x, v = _line(
                [e["t_s"] for e in be_running],
                [e["breakeven_accept_length"] for e in be_running],
                gap_s,
            )
            ax2.plot(x, v, lw=1.2, ls="--", color="#d62728", label="break-even (running)")
        ax2.set_ylabel("accept length")
        ax2.grid(alpha=0.3)
        if acc or be_running:
            ax2.legend(loc="best", fontsize=8)  # off the lines, wherever they run
        ax2.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M", tz=dt.UTC))
        ax2.set_xlabel("time (UTC)")
        fig.tight_layout()
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(out, format="png")
        except OSError as e:
            raise ReportError(f"cannot write {out}: {e}") from e
    finally:
        plt.close(fig)
    return ReportSummary(
        path=out,
        since_s=since_s,
        until_s=until_s,
        observations=len(obs),
        hourly_points=len(hourly),
        switches=len(switches),
        advisory_switches=len(decisions),
        profiles=tuple(seen),
    )
