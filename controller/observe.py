"""Observation pipeline: fetch SGLang's /metrics and /v1/loads, filter, parse, fold -> Snapshot.

Owns the translation from SGLang's wire formats (Prometheus text, the /v1/loads JSON, the
/server_info JSON) into `policies.types.Snapshot`: which series count, how TP/DP ranks fold, unit
conversion (decode_moments microseconds -> seconds), and what counts as missing. It must not
compute deltas or rates (policies.observation.diff does, once, for the daemon and the benchmark),
must not decide anything, and never turns a missing series into 0.

Folding rules (why):
- Scheduler series: per DP rank, only the lowest (pp_rank, tp_rank) that reports. Every TP rank of
  one DP rank runs the same batch, so with --enable-metrics-for-all-schedulers the others are
  duplicates. The lowest rather than literally tp_rank="0": under DP attention the reporting
  rank of DP rank d is tp_rank d * attn_tp_size. Series without the labels (0.4.x) are rank 0.
- Across DP ranks (separate batches): running/queue reqs, gen_throughput and scheduler counters
  are summed; spec_accept_length/rate/num_steps are averaged weighted by each rank's running
  requests, because each rank's gauge is a per-request mean over its own batch, so the pooled mean
  is weighted by how many requests stood behind each (a rank with an empty batch reports a stale
  value that must not count). With no running-request weights, the plain mean.
- priority="<int>" series are per-priority breakdowns of the priority="" total: dropped.
- Tokenizer counters (one tokenizer, per finished request): summed over every label except the
  `workload` custom label; a missing or empty workload label is policies.types.UNLABELLED.
- sglang:startup_time_seconds (tokenizer side, set once at boot): phase tokenizer_e2e (launch to
  schedulers ready), else scheduler_e2e, the largest series: how long this server took to boot,
  what the policy prices a restart of the deployment by before it has timed one itself.
- Non-finite samples are dropped (treated as missing). A malformed exposition raises ObserveError.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controller import sglang_names as sg
from policies.types import UNLABELLED, Snapshot

log = logging.getLogger(__name__)

__all__ = [
    "ObserveError",
    "bench_fetch_parse",
    "bench_parse",
    "exposition_warnings",
    "fetch_exposition",
    "filter_exposition",
    "has_sglang_samples",
    "parse_exposition",
    "parse_loads",
    "scrape",
    "server_info",
    "snapshot_to_json",
]


class ObserveError(Exception):
    """The scrape failed (transport, HTTP status or malformed text): the tick is skipped."""


# Sample names (as they appear in the exposition) -> role. Dispatch is on the sample name, not on
# the family name, so captures without # TYPE lines (where the parser cannot strip `_total`) read
# the same.
_T = sg.COUNTER_SAMPLE_SUFFIX
_SCHED_GAUGES: dict[str, str] = {
    sg.NUM_RUNNING_REQS: "running_reqs",
    sg.NUM_QUEUE_REQS: "queue_reqs",
    sg.GEN_THROUGHPUT: "gen_throughput_tok_s",
    sg.SPEC_ACCEPT_LENGTH: "spec_accept_length",
    sg.SPEC_ACCEPT_RATE: "spec_accept_rate",
    sg.SPEC_NUM_STEPS: "spec_num_steps",
}
# Gauges summed across DP ranks; the others are averaged weighted by running requests.
_SUMMED_GAUGES = frozenset({"running_reqs", "queue_reqs", "gen_throughput_tok_s"})
_SCHED_COUNTERS: dict[str, tuple[str, frozenset[str]]] = {
    sg.REALTIME_TOKENS + _T: ("decode_tokens", frozenset({sg.MODE_DECODE_TOKENS})),
    sg.CUDA_GRAPH_PASSES + _T: ("decode_passes", frozenset(sg.MODES_DECODE_PASSES)),
}
_TOKENIZER_COUNTERS: dict[str, str] = {
    sg.GENERATION_TOKENS + _T: "generation_tokens",
    sg.SPEC_VERIFY_CALLS + _T: "verify_calls",
    sg.NUM_REQUESTS + _T: "requests",
}
# The engine's startup gauge, by phase, in order of preference: tokenizer_e2e runs from the
# engine's launch until its schedulers are ready, scheduler_e2e (older servers, or a frontend
# that sets no tokenizer phase) only the schedulers' part of it.
_STARTUP_PHASES: tuple[str, ...] = ("tokenizer_e2e", "scheduler_e2e")
_KEPT_SAMPLE_NAMES: tuple[str, ...] = (
    *_SCHED_GAUGES,
    *_SCHED_COUNTERS,
    *_TOKENIZER_COUNTERS,
    sg.STARTUP_TIME_SECONDS,
)


def _line_prefixes(names: Iterable[str]) -> tuple[str, ...]:
    """Line prefixes that select the kept families: samples (`name{` / `name `) and their
    # TYPE line under either the sample name or the `_total`-less family name. # HELP lines are
    documentation only and are dropped."""
    out: list[str] = []
    for name in names:
        out += [name + "{", name + " "]
        out += [f"# TYPE {fam} " for fam in sorted({name, name.removesuffix(_T)})]
    return tuple(out)


_PREFIXES = _line_prefixes(_KEPT_SAMPLE_NAMES)
_SCHED_SAMPLE_NAMES = frozenset((*_SCHED_GAUGES, *_SCHED_COUNTERS))
_SCHED_MODES: dict[str, frozenset[str]] = {n: m for n, (_r, m) in _SCHED_COUNTERS.items()}


def _label_value(line: str, key: str) -> str | None:
    """Raw value of label `key` in one sample line, or None. Used only for the rank, mode and
    priority labels (digits and identifiers, never escaped), to drop lines before parsing."""
    needle = key + '="'
    start = line.find(needle)
    while start > 0 and line[start - 1] not in "{,":
        start = line.find(needle, start + 1)  # `xtp_rank="` is another label
    if start <= 0:
        return None
    start += len(needle)
    end = line.find('"', start)
    return line[start:end] if end >= 0 else None


def filter_exposition(text: str) -> str:
    """Keep only the lines specpilot reads, so the parser (the cost: ~20 us a sample line) sees
    a few dozen lines of a 100+ KB exposition. Besides whole families, it drops scheduler lines
    the fold would discard anyway (TP duplicates above the lowest reporting rank of each DP
    rank, per-priority breakdowns, modes that are not decode); `_fold` applies the same rules
    again on the parsed samples, so this is an optimisation, not a second source of truth."""
    out: list[str | None] = []
    best: dict[tuple[str, str], tuple[tuple[int, int | str], tuple[int, int | str]]] = {}
    pending: list[tuple[int, str, str, Any]] = []
    for ln in text.splitlines():
        if not ln.startswith(_PREFIXES):
            continue
        if ln[0] == "#":
            out.append(ln)
            continue
        brace = ln.find("{")
        name = ln[:brace] if brace >= 0 else ln.split(" ", 1)[0]
        if name not in _SCHED_SAMPLE_NAMES:
            out.append(ln)
            continue
        modes = _SCHED_MODES.get(name)
        if modes is not None and _label_value(ln, sg.LABEL_MODE) not in modes:
            continue
        if _label_value(ln, sg.LABEL_PRIORITY) not in (None, ""):
            continue
        dp = _label_value(ln, sg.LABEL_DP_RANK) or "0"
        rank = (
            _rank_of(_label_value(ln, sg.LABEL_PP_RANK)),
            _rank_of(_label_value(ln, sg.LABEL_TP_RANK)),
        )
        key = (name, dp)
        if key not in best or rank < best[key]:
            best[key] = rank
        pending.append((len(out), name, dp, rank))
        out.append(ln)
    for idx, name, dp, rank in pending:
        if rank != best[(name, dp)]:
            out[idx] = None
    kept = [ln for ln in out if ln is not None]
    return "\n".join(kept) + "\n" if kept else ""


def _looks_like_exposition(text: str) -> None:
    """Raise ObserveError when text that matched no kept family is not Prometheus text at all
    (an HTML error page, JSON, binary). Parses the first few sample lines only."""
    head: list[str] = []
    for ln in text.splitlines():
        s = ln.strip()
        if not s or s.startswith("#"):
            continue
        head.append(s)
        if len(head) >= 5:
            break
    if not head:
        return
    try:
        for _ in text_string_to_metric_families("\n".join(head) + "\n"):
            pass
    except Exception as exc:  # the parser raises ValueError/IndexError/TypeError on garbage
        raise ObserveError(
            f"not Prometheus text exposition: {exc!s} (first line {head[0][:80]!r})"
        ) from exc


def _rank(labels: Mapping[str, str], name: str) -> tuple[int, int | str]:
    return _rank_of(labels.get(name))


def _rank_of(v: str | None) -> tuple[int, int | str]:
    """Sort key of a rank label value; absent (0.4.x) or empty means rank 0."""
    if v is None or v == "":
        return (0, 0)
    try:
        return (0, int(v))
    except ValueError:
        return (1, v)  # non-numeric rank label: sorts after numeric ranks, still deterministic


@dataclass
class _Folded:
    gauges: dict[str, float | None]
    counters: dict[str, float | None]
    tokenizer: dict[str, dict[str, float]]
    startup_s: float | None


def _startup(by_phase: Mapping[str, list[float]]) -> float | None:
    """The engine's startup seconds: the first phase of _STARTUP_PHASES with a sample, the
    longest of its series (several frontends or custom-label sets: the boot waited for the
    slowest); None where no such phase was reported or a value is not a positive finite
    number (a gauge not set yet reads 0)."""
    for phase in _STARTUP_PHASES:
        vals = by_phase.get(phase)
        if vals:
            if not all(map(math.isfinite, vals)):
                return None
            v = max(vals)
            return v if v > 0.0 else None
    return None


def _fold(families: Iterable[Any], workload_label: str) -> _Folded:
    nan = float("nan")
    # role -> dp_rank -> (pp, tp) -> values; a non-finite sample is kept as NaN so that the
    # rank it belongs to turns its sum into "missing" instead of silently shrinking it.
    sched: dict[str, dict[str, dict[tuple[Any, Any], list[float]]]] = {}
    tok: dict[str, dict[str, list[float]]] = {role: {} for role in _TOKENIZER_COUNTERS.values()}
    startup: dict[str, list[float]] = {}
    for fam in families:
        for s in fam.samples:
            name, labels, value = s.name, s.labels, s.value
            finite = isinstance(value, float | int) and math.isfinite(value)
            if name == sg.STARTUP_TIME_SECONDS:
                phase = labels.get(sg.LABEL_PHASE, "")
                startup.setdefault(phase, []).append(float(value) if finite else nan)
                continue
            tok_role = _TOKENIZER_COUNTERS.get(name)
            if tok_role is not None:
                w = labels.get(workload_label) or UNLABELLED
                tok[tok_role].setdefault(w, []).append(float(value) if finite else nan)
                continue
            if labels.get(sg.LABEL_PRIORITY, "") != "":
                continue
            role = _SCHED_GAUGES.get(name)
            if role is None:
                spec = _SCHED_COUNTERS.get(name)
                if spec is None:
                    continue
                role, modes = spec
                if labels.get(sg.LABEL_MODE) not in modes:
                    continue
            dp = labels.get(sg.LABEL_DP_RANK) or "0"
            rank = (_rank(labels, sg.LABEL_PP_RANK), _rank(labels, sg.LABEL_TP_RANK))
            sched.setdefault(role, {}).setdefault(dp, {}).setdefault(rank, []).append(
                float(value) if finite else nan
            )

    def per_dp(role: str, combine: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for dp, ranks in sched.get(role, {}).items():
            vals = ranks[min(ranks)]
            # Counters: modes of one rank add up (decode_cuda_graph + decode_none). Gauges: one
            # series per rank is expected; unknown extra label dimensions are averaged.
            out[dp] = math.fsum(vals) if combine == "sum" else math.fsum(vals) / len(vals)
        return out

    running = per_dp("running_reqs", "mean")
    gauges: dict[str, float | None] = {}
    for role in _SCHED_GAUGES.values():
        vals = per_dp(role, "mean")
        if role in _SUMMED_GAUGES:
            gauges[role] = _sum_or_none(vals.values())
        else:
            gauges[role] = _running_weighted_mean(vals, running)
    counters = {
        role: _sum_or_none(per_dp(role, "sum").values()) for role, _ in _SCHED_COUNTERS.values()
    }
    # A workload whose counter had a non-finite sample is missing, not smaller.
    tokenizer = {
        role: {w: math.fsum(vs) for w, vs in by_w.items() if all(map(math.isfinite, vs))}
        for role, by_w in tok.items()
    }
    return _Folded(
        gauges=gauges, counters=counters, tokenizer=tokenizer, startup_s=_startup(startup)
    )


def _sum_or_none(vals: Iterable[float]) -> float | None:
    """Sum over DP ranks; None when no rank reported or one rank's value is not finite (a sum
    missing a rank would look like a drop in traffic). Exactly rounded (math.fsum), so the
    order the ranks were read in does not move the last bit."""
    vs = list(vals)
    if not vs or not all(math.isfinite(v) for v in vs):
        return None
    return math.fsum(vs)


def _running_weighted_mean(vals: Mapping[str, float], running: Mapping[str, float]) -> float | None:
    """Mean over DP ranks of a per-request gauge, weighted by each rank's running requests; ranks
    with a non-finite value are left out; plain mean when the weights are unusable."""
    good = {dp: v for dp, v in vals.items() if math.isfinite(v)}
    if not good:
        return None
    weights = {dp: running.get(dp) for dp in good}
    if all(w is not None and math.isfinite(w) and w >= 0 for w in weights.values()):
        total = math.fsum(w for w in weights.values() if w is not None)
        if total > 0:
            return math.fsum(good[dp] * (weights[dp] or 0.0) for dp in good) / total
    return math.fsum(good.values()) / len(good)


def parse_exposition(
    text: str, *, profile: str, t_s: float, workload_label: str = sg.LABEL_WORKLOAD
) -> Snapshot:
    """Prometheus text of SGLang's /metrics -> Snapshot (no /v1/loads data: moments None).

    Raises ObserveError when the text is not a Prometheus exposition or a kept line is malformed.
    """
    if not isinstance(text, str):
        raise ObserveError(f"exposition must be str, got {type(text).__name__}")
    if "\x00" in text:
        raise ObserveError("exposition contains NUL bytes: not Prometheus text")
    filtered = filter_exposition(text)
    if not filtered:
        _looks_like_exposition(text)
    try:
        folded = _fold(text_string_to_metric_families(filtered), workload_label)
    except ObserveError:
        raise
    except Exception as exc:  # the parser's errors are ValueError/IndexError/TypeError...
        raise ObserveError(f"malformed Prometheus exposition: {exc!s}") from exc
    g, c, tok = folded.gauges, folded.counters, folded.tokenizer
    return Snapshot(
        t_s=t_s,
        profile=profile,
        running_reqs=g["running_reqs"],
        queue_reqs=g["queue_reqs"],
        gen_throughput_tok_s=g["gen_throughput_tok_s"],
        spec_accept_length=g["spec_accept_length"],
        spec_accept_rate=g["spec_accept_rate"],
        spec_num_steps=g["spec_num_steps"],
        generation_tokens=tok["generation_tokens"],
        verify_calls=tok["verify_calls"],
        requests=tok["requests"],
        decode_tokens=c["decode_tokens"],
        decode_passes=c["decode_passes"],
        startup_s=folded.startup_s,
    )


@dataclass(frozen=True)
class LoadsSummary:
    """/v1/loads folded over DP ranks: sums of separate batches; None where no rank reported."""

    running_reqs: float | None
    waiting_reqs: float | None
    gen_throughput_tok_s: float | None
    max_running_requests: float | None
    moments: tuple[float, float, float, float, float, float] | None


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def parse_loads(payload: Any) -> LoadsSummary:
    """The JSON of GET /v1/loads?include=core,spec -> LoadsSummary (moments in seconds).

    A rank whose decode_moments is null has run no decode step yet (SGLang sends null while
    n_steps is 0), so it adds nothing; a malformed moments list is treated as missing.
    Raises ObserveError when the payload is not the /v1/loads shape at all.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get(sg.LOADS_KEY_LOADS), list):
        raise ObserveError("/v1/loads: expected an object with a 'loads' list")
    sums: dict[str, float | None] = dict.fromkeys(
        (
            sg.LOADS_KEY_NUM_RUNNING,
            sg.LOADS_KEY_NUM_WAITING,
            sg.LOADS_KEY_GEN_THROUGHPUT,
            sg.LOADS_KEY_MAX_RUNNING,
        )
    )
    moments: list[float] | None = None
    any_rank = False
    moments_bad = False
    for load in payload[sg.LOADS_KEY_LOADS]:
        if not isinstance(load, dict):
            continue
        any_rank = True
        for key in sums:
            v = _finite(load.get(key))
            if v is not None:
                sums[key] = (sums[key] or 0.0) + v
        raw = load.get(sg.LOADS_KEY_DECODE_MOMENTS)
        if raw is None:
            continue
        vals = [_finite(x) for x in raw] if isinstance(raw, list) else []
        clean = [v for v in vals if v is not None]
        if len(clean) != sg.DECODE_MOMENTS_LEN or len(vals) != sg.DECODE_MOMENTS_LEN:
            moments_bad = True
            continue
        if moments is None:
            moments = [0.0] * sg.DECODE_MOMENTS_LEN
        for i, v in enumerate(clean):
            # SGLang accumulates step times in microseconds; the Snapshot speaks seconds.
            moments[i] += v / 1e6 if i in sg.DECODE_MOMENTS_US_INDICES else v
    if moments_bad:
        log.warning("/v1/loads: malformed decode_moments on some DP rank; moments dropped")
        moments = None
    m = None
    if moments is not None and any_rank:
        m = (moments[0], moments[1], moments[2], moments[3], moments[4], moments[5])
    return LoadsSummary(
        running_reqs=sums[sg.LOADS_KEY_NUM_RUNNING],
        waiting_reqs=sums[sg.LOADS_KEY_NUM_WAITING],
        gen_throughput_tok_s=sums[sg.LOADS_KEY_GEN_THROUGHPUT],
        max_running_requests=sums[sg.LOADS_KEY_MAX_RUNNING],
        moments=m,
    )


def merge_loads(snap: Snapshot, loads: LoadsSummary | None) -> Snapshot:
    """Add /v1/loads data to a Snapshot parsed from /metrics: moments and max running requests
    always; running, queue and gen_throughput only where /metrics lacked them (servers without
    --enable-metrics), so the gauges that weight the accept length come from the same log
    interval."""
    if loads is None:
        return snap
    return replace(
        snap,
        moments=loads.moments,
        running_reqs=snap.running_reqs if snap.running_reqs is not None else loads.running_reqs,
        queue_reqs=snap.queue_reqs if snap.queue_reqs is not None else loads.waiting_reqs,
        max_running_reqs=loads.max_running_requests,
        gen_throughput_tok_s=(
            snap.gen_throughput_tok_s
            if snap.gen_throughput_tok_s is not None
            else loads.gen_throughput_tok_s
        ),
    )


async def _get_metrics_text(client: httpx.AsyncClient, base_url: str) -> str:
    url = base_url.rstrip("/") + sg.PATH_METRICS
    try:
        resp = await client.get(url)
    except httpx.HTTPError as exc:
        raise ObserveError(f"GET {url} failed: {type(exc).__name__}: {exc!s}") from exc
    if resp.status_code != 200:
        raise ObserveError(f"GET {url} returned HTTP {resp.status_code}")
    try:
        return resp.text
    except (UnicodeDecodeError, LookupError) as exc:
        raise ObserveError(f"GET {url}: body is not text: {exc!s}") from exc


async def _get_loads(client: httpx.AsyncClient, base_url: str) -> LoadsSummary | None:
    """/v1/loads is a second source; its failure (older servers have no such route) leaves the
    moments missing but does not fail the scrape."""
    url = base_url.rstrip("/") + sg.PATH_LOADS
    try:
        resp = await client.get(url, params=sg.LOADS_QUERY)
        if resp.status_code != 200:
            log.debug("GET %s returned HTTP %s; moments missing", url, resp.status_code)
            return None
        return parse_loads(resp.json())
    except (httpx.HTTPError, ValueError, ObserveError) as exc:
        log.debug("GET %s unusable (%s); moments missing", url, exc)
        return None


async def scrape(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    profile: str,
    t_s: float,
    workload_label: str = sg.LABEL_WORKLOAD,
) -> Snapshot:
    """GET /metrics and /v1/loads?include=core,spec concurrently -> Snapshot.

    Raises ObserveError when /metrics cannot be fetched or parsed; /v1/loads is optional.
    """
    text, loads = await fetch_exposition(client, base_url)
    snap = parse_exposition(text, profile=profile, t_s=t_s, workload_label=workload_label)
    return merge_loads(snap, loads)


async def fetch_exposition(
    client: httpx.AsyncClient, base_url: str
) -> tuple[str, LoadsSummary | None]:
    """The raw /metrics text and the parsed /v1/loads (None when unusable): what `scrape`
    parses, and what `specpilot scrape` also checks as text. ObserveError as `scrape`."""
    # Both requests finish (or fail) before we return: no request outlives the tick.
    text, loads = await asyncio.gather(
        _get_metrics_text(client, base_url), _get_loads(client, base_url), return_exceptions=True
    )
    if isinstance(text, BaseException):
        if isinstance(text, ObserveError):
            raise text
        raise ObserveError(f"GET /metrics failed: {type(text).__name__}: {text!s}") from text
    if isinstance(loads, BaseException):
        log.debug("/v1/loads unusable (%s); moments missing", loads)
        loads = None
    return text, loads


# --- checks for `specpilot scrape` (reporting only: the daemon's parsing does not use them) ---

# An accept length (drafts + bonus per verify step) above this is absurd whatever the chain:
# no speculative configuration drafts hundreds of tokens per step.
MAX_PLAUSIBLE_ACCEPT_LENGTH = 256.0


def has_sglang_samples(text: str) -> bool:
    """Whether the exposition holds at least one sample of a series specpilot reads (an empty
    body, or another service's /metrics, holds none)."""
    return any(not ln.startswith("#") for ln in filter_exposition(text).splitlines())


def exposition_warnings(text: str) -> list[str]:
    """Impossible data among the samples specpilot reads, one line each: the same series twice
    with identical labels (the daemon sums or averages them), negative counters or gauges, an
    accept rate outside [0, 1], an accept length below 1 (but not the 0 of an idle server),
    above the series' spec_num_steps + 1, or absurdly large. Pure: parses `text`, logs nothing.
    A malformed exposition gives no warnings (parse_exposition reports it)."""
    try:
        samples = [
            s
            for fam in text_string_to_metric_families(filter_exposition(text))
            for s in fam.samples
        ]
    except Exception:  # the parser's errors: parse_exposition raises ObserveError for them
        return []

    def series(name: str, labels: Mapping[str, str]) -> str:
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}}" if inner else name

    out: list[str] = []
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
    steps: dict[tuple[tuple[str, str], ...], float] = {}
    for smp in samples:
        key = (smp.name, tuple(sorted(smp.labels.items())))
        seen[key] = seen.get(key, 0) + 1
        if smp.name == sg.SPEC_NUM_STEPS and math.isfinite(smp.value):
            steps[key[1]] = float(smp.value)
    for (name, labels), n in seen.items():
        if n > 1:
            out.append(
                f"{series(name, dict(labels))} appears {n} times with identical labels "
                "(specpilot sums or averages the copies)"
            )
    for smp in samples:
        v, name = smp.value, smp.name
        if not isinstance(v, float | int) or not math.isfinite(v):
            continue
        where = series(name, smp.labels)
        if v < 0:
            out.append(f"{where} is negative ({v:g}): counters and gauges cannot be")
        elif name == sg.SPEC_ACCEPT_RATE and v > 1:
            out.append(f"{where} is {v:g}: an accept rate is a fraction in [0, 1]")
        elif name == sg.SPEC_ACCEPT_LENGTH and v > 0:
            g = steps.get(tuple(sorted(smp.labels.items())))
            if v < 1:
                out.append(f"{where} is {v:g}: an accept length counts the bonus token, so >= 1")
            elif v > MAX_PLAUSIBLE_ACCEPT_LENGTH:
                out.append(f"{where} is {v:g}: an absurd accept length")
            elif g is not None and g > 0 and v > g + 1:
                out.append(
                    f"{where} is {v:g}, more than spec_num_steps + 1 = {g + 1:g} tokens per step"
                )
    return out


async def server_info(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """GET /server_info (falling back to the deprecated /get_server_info on 404) -> its JSON.

    Raises ObserveError on transport errors, other HTTP errors or a non-object body.
    """
    base = base_url.rstrip("/")
    last = ""
    for path in (sg.PATH_SERVER_INFO, sg.PATH_SERVER_INFO_DEPRECATED):
        url = base + path
        try:
            resp = await client.get(url)
        except httpx.HTTPError as exc:
            raise ObserveError(f"GET {url} failed: {type(exc).__name__}: {exc!s}") from exc
        if resp.status_code == 404:
            last = f"GET {url} returned HTTP 404"
            continue
        if resp.status_code != 200:
            raise ObserveError(f"GET {url} returned HTTP {resp.status_code}")
        try:
            body = resp.json()
        except ValueError as exc:
            raise ObserveError(f"GET {url}: body is not JSON: {exc!s}") from exc
        if not isinstance(body, dict):
            raise ObserveError(f"GET {url}: expected a JSON object, got {type(body).__name__}")
        return body
    raise ObserveError(last or "server_info: no endpoint answered")


_MOMENT_KEYS = ("n_steps", "sum_bs", "sum_step_s", "sum_bs2", "sum_bs_step_s", "sum_generated")


def _json_num(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def snapshot_to_json(s: Snapshot) -> dict[str, Any]:
    """Snapshot -> JSON-serialisable dict (for `specpilot scrape --json`); None stays null."""
    return {
        "t_s": s.t_s,
        "profile": s.profile,
        "running_reqs": _json_num(s.running_reqs),
        "queue_reqs": _json_num(s.queue_reqs),
        "max_running_reqs": _json_num(s.max_running_reqs),
        "gen_throughput_tok_s": _json_num(s.gen_throughput_tok_s),
        "spec_accept_length": _json_num(s.spec_accept_length),
        "spec_accept_rate": _json_num(s.spec_accept_rate),
        "spec_num_steps": _json_num(s.spec_num_steps),
        "generation_tokens": dict(sorted(s.generation_tokens.items())),
        "verify_calls": dict(sorted(s.verify_calls.items())),
        "requests": dict(sorted(s.requests.items())),
        "decode_tokens": _json_num(s.decode_tokens),
        "decode_passes": _json_num(s.decode_passes),
        "moments": (
            dict(zip(_MOMENT_KEYS, s.moments, strict=True)) if s.moments is not None else None
        ),
        "accepted_drafts_hist": (
            list(s.accepted_drafts_hist) if s.accepted_drafts_hist is not None else None
        ),
        "startup_s": _json_num(s.startup_s),
    }


def bench_parse(text: str, repeats: int) -> dict[str, float]:
    """Median (and p90) milliseconds of filter + parse + fold of `text`, no fetch."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        parse_exposition(text, profile="bench", t_s=0.0)
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "parse_ms_median": statistics.median(times),
        "parse_ms_p90": _p90(times),
        "bytes": float(len(text.encode())),
        "repeats": float(repeats),
    }


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]


async def bench_fetch_parse(url: str, repeats: int) -> dict[str, float]:
    """Over one keep-alive connection to `url` (the full /metrics URL, loopback): median ms of a
    plain GET, and of GET + filter + parse + fold."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    fetch: list[float] = []
    full: list[float] = []
    size = 0
    async with httpx.AsyncClient(timeout=10.0) as client:
        await client.get(url)  # connect once; the daemon keeps its connection too
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = await client.get(url)
            r.raise_for_status()
            _ = r.text
            fetch.append((time.perf_counter() - t0) * 1e3)
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = await client.get(url)
            r.raise_for_status()
            parse_exposition(r.text, profile="bench", t_s=0.0)
            full.append((time.perf_counter() - t0) * 1e3)
            size = len(r.content)
    return {
        "fetch_ms_median": statistics.median(fetch),
        "fetch_parse_ms_median": statistics.median(full),
        "fetch_parse_ms_p90": _p90(full),
        "bytes": float(size),
        "repeats": float(repeats),
    }


def snapshot_json_dumps(s: Snapshot) -> str:
    """One-line JSON of a Snapshot (sorted keys), for logs and `scrape --json`."""
    return json.dumps(snapshot_to_json(s), sort_keys=True)
