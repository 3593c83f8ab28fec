"""Calibration report: the built-in field profiles against docs/FIELD.md, and break-even tables.

Owns: the table of field numbers the profiles must reproduce (one stream, the field's own
drafter = the "default" workload), the simulated counterpart of each (StepEngine, fixed seed),
and the break-even accept length per batch size. `python -m simulator.calibrate` prints both and
exits 1 if a field row is off by more than 5%.
Must not: tune anything (it only measures the profiles as shipped) or import controller/store/
policies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from simulator.engine import StepEngine
from simulator.model import (
    SimProfile,
    SpecConfig,
    builtin_profiles,
    builtin_workloads,
    expected_accept_length,
    load_profile,
)

TOLERANCE = 0.05
BATCH_GRID = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class FieldRow:
    """One number from FIELD.md's table: a point (lo == hi) or a range."""

    profile: str
    config: str  # "baseline" | "2-step" | "5-step"
    metric: str  # "tok_s" | "verify_ms" | "cycle_ms" | "accept_len"
    lo: float
    hi: float
    note: str = ""


TUNED = "kimi-k2.5-pcie-tuned"
UNTUNED = "kimi-k2.5-pcie-untuned"
LATER = "kimi-k2.5-pcie-later-boot"

FIELD_ROWS: tuple[FieldRow, ...] = (
    FieldRow(TUNED, "baseline", "tok_s", 88.8, 88.8),
    FieldRow(TUNED, "2-step", "verify_ms", 18.67, 18.67),
    FieldRow(TUNED, "2-step", "cycle_ms", 19.85, 19.85),
    FieldRow(TUNED, "2-step", "accept_len", 1.85, 2.12, "SGLang logs, drafts + bonus"),
    FieldRow(TUNED, "2-step", "tok_s", 94.0, 94.0, "average (112 peak)"),
    FieldRow(TUNED, "5-step", "verify_ms", 21.7, 21.7),
    FieldRow(TUNED, "5-step", "tok_s", 86.7, 86.7, "average (94 peak)"),
    FieldRow(UNTUNED, "baseline", "tok_s", 62.9, 62.9),
    FieldRow(UNTUNED, "2-step", "verify_ms", 25.6, 25.6),
    FieldRow(LATER, "baseline", "tok_s", 82.0, 83.0, "89 not reproducible"),
    FieldRow(LATER, "2-step", "verify_ms", 29.5, 29.5, "~30"),
    FieldRow(LATER, "2-step", "cycle_ms", 30.0, 30.0, "~30"),
    FieldRow(
        LATER,
        "2-step",
        "accept_len",
        1.80,
        2.0,
        "field says ~2.0; its own 59-61 tok/s x 30 ms cycle gives 1.80: the range spans both",
    ),
    FieldRow(LATER, "2-step", "tok_s", 59.0, 61.0),
)

CONFIGS: dict[str, SpecConfig] = {
    "baseline": SpecConfig.baseline(),
    "2-step": SpecConfig.eagle3(2),
    "5-step": SpecConfig.eagle3(5),
}


@dataclass(frozen=True)
class OneStream:
    """Decode figures of one stream (prefill steps excluded, as SGLang's gen throughput)."""

    tok_s: float
    cycle_ms: float
    verify_ms: float | None
    accept_len: float | None


def simulate_one_stream(
    profile: SimProfile, spec: SpecConfig, *, seconds: float = 600.0, seed: int = 0
) -> OneStream:
    """One client, one request at a time, the field drafter's workload ("default" alpha) with
    prompts sized so the mean context equals the profile's `context_tokens` (the fit point)."""
    base = builtin_workloads()["default"]
    out = 512.0
    wl = dataclasses.replace(
        base,
        output_tokens=out,
        prompt_tokens=max(1.0, profile.serving.context_tokens - out / 2.0),
        output_sigma=0.0,
    )
    eng = StepEngine(profile, spec, {"default": wl}, seed=seed)
    rid = 0
    eng.add_request(f"c{rid}", "default", round(wl.prompt_tokens))
    tokens = cycles = 0
    decode_s = verify_s = 0.0
    accepted = verifies = 0
    # At least one decode cycle, however short `seconds`: the figures below divide by it (the
    # first step is the prompt's prefill, which can outlast a tiny run on its own).
    while eng.now_s < seconds or cycles == 0:
        r = eng.step()
        if r is None:  # pragma: no cover - one request is always open
            break
        if r.kind == "decode":
            tokens += sum(r.new_tokens.values())
            decode_s += r.duration_s
            cycles += 1
            verify_s += r.phase_s.get("target_verify", 0.0)
            accepted += sum(r.accepted_drafts.values())
            verifies += len(r.accepted_drafts)
        for _ in r.finished:
            rid += 1
            eng.add_request(f"c{rid}", "default", round(wl.prompt_tokens))
    return OneStream(
        tok_s=tokens / decode_s,
        cycle_ms=1000.0 * decode_s / cycles,
        verify_ms=1000.0 * verify_s / cycles if spec.speculative else None,
        accept_len=(1.0 + accepted / verifies) if verifies else None,
    )


def calibration_rows(*, seconds: float = 600.0, seed: int = 0) -> list[dict[str, Any]]:
    """Every FIELD.md row next to its simulated value: keys profile, config, metric, field
    (text), field_lo, field_hi, sim, ratio (sim / field midpoint), ok (inside the field value or
    range widened by 5%), note."""
    cache: dict[tuple[str, str], OneStream] = {}
    rows: list[dict[str, Any]] = []
    for fr in FIELD_ROWS:
        key = (fr.profile, fr.config)
        if key not in cache:
            cache[key] = simulate_one_stream(
                load_profile(fr.profile), CONFIGS[fr.config], seconds=seconds, seed=seed
            )
        sim = getattr(cache[key], fr.metric)
        mid = (fr.lo + fr.hi) / 2.0
        ok = sim is not None and fr.lo * (1 - TOLERANCE) <= sim <= fr.hi * (1 + TOLERANCE)
        rows.append(
            {
                "profile": fr.profile,
                "config": fr.config,
                "metric": fr.metric,
                "field": f"{fr.lo:g}" if fr.lo == fr.hi else f"{fr.lo:g}-{fr.hi:g}",
                "field_lo": fr.lo,
                "field_hi": fr.hi,
                "sim": sim,
                "ratio": (sim / mid) if sim is not None else None,
                "ok": bool(ok),
                "note": fr.note,
            }
        )
    return rows


def one_stream_summary(*, seconds: float = 600.0, seed: int = 0) -> list[dict[str, Any]]:
    """Simulated one-stream tok/s, cycle, verify and accept length per profile and config."""
    out = []
    for name in (TUNED, UNTUNED, LATER):
        prof = load_profile(name)
        for cfg, spec in CONFIGS.items():
            s = simulate_one_stream(prof, spec, seconds=seconds, seed=seed)
            out.append({"profile": name, "config": cfg, **dataclasses.asdict(s)})
    return out


def break_even_rows(profile: SimProfile, batches: tuple[int, ...] = BATCH_GRID) -> list[dict]:
    """Per batch size: baseline tok/s and, for 2 and 5 steps, the break-even accept length
    baseline_tok_s(B) / B x cycle_s(B) (accept length needed for spec to equal the baseline per
    sequence), at the profile's mean context."""
    rows = []
    base = SpecConfig.baseline()
    for b in batches:
        tb = b / profile.cycle_s(b, base)
        row: dict[str, float] = {"batch": b, "baseline_tok_s": tb}
        for g in (2, 5):
            row[f"break_even_{g}"] = tb / b * profile.cycle_s(b, SpecConfig.eagle3(g))
        rows.append(row)
    return rows


def stops_paying(
    profile: SimProfile, alpha: float, steps: int, max_batch: int = 256
) -> tuple[int | None, int | None]:
    """(first batch size where g-step speculation with this alpha gives fewer tok/s than the
    baseline, smallest batch size from which on it never pays again up to max_batch); None
    where that does not happen. They differ when the MoE shape makes the break-even
    non-monotonic in B."""
    el = expected_accept_length(alpha, steps)
    spec, base = SpecConfig.eagle3(steps), SpecConfig.baseline()
    first: int | None = None
    tail: int | None = None
    for b in range(1, max_batch + 1):
        pays = el / profile.cycle_s(b, spec) >= 1.0 / profile.cycle_s(b, base)
        if pays:
            tail = None
        else:
            first = b if first is None else first
            tail = b if tail is None else tail
    return first, tail


app = typer.Typer(add_completion=False, help=__doc__)


@app.command()
def main(
    seconds: float = typer.Option(600.0, help="simulated seconds per profile and config"),
    seed: int = typer.Option(0, help="random seed"),
) -> None:
    """Print the calibration against FIELD.md and break-even tables; exit 1 if a row is off."""
    console = Console(width=160)
    rows = calibration_rows(seconds=seconds, seed=seed)
    t = Table(title="Field rows (one stream, field drafter = 'default' workload)")
    for col in ("profile", "config", "metric", "field", "sim", "ratio", "ok", "note"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r["profile"],
            r["config"],
            r["metric"],
            r["field"],
            f"{r['sim']:.3f}",
            f"{r['ratio']:.3f}",
            "yes" if r["ok"] else "NO",
            r["note"],
        )
    console.print(t)

    s = Table(title="Simulated one stream (decode only)")
    for col in ("profile", "config", "tok/s", "cycle ms", "verify ms", "accept_len"):
        s.add_column(col)
    for r in one_stream_summary(seconds=seconds, seed=seed):
        s.add_row(
            r["profile"],
            r["config"],
            f"{r['tok_s']:.2f}",
            f"{r['cycle_ms']:.2f}",
            "-" if r["verify_ms"] is None else f"{r['verify_ms']:.2f}",
            "-" if r["accept_len"] is None else f"{r['accept_len']:.3f}",
        )
    console.print(s)

    wls = builtin_workloads()
    # Every built-in profile: the field's (calibrated) next to the measured H200 ones.
    for name in builtin_profiles():
        prof = load_profile(name)
        b = Table(
            title=f"{name} ({prof.kind}): break-even accept length (drafts + bonus) per batch size"
        )
        for col in ("B", "baseline tok/s", "2-step", "5-step"):
            b.add_column(col)
        for r in break_even_rows(prof):
            b.add_row(
                str(r["batch"]),
                f"{r['baseline_tok_s']:.0f}",
                f"{r['break_even_2']:.2f}",
                f"{r['break_even_5']:.2f}",
            )
        console.print(b)
        for wl in ("default", "chat", "code"):
            a = wls[wl].alpha
            parts = []
            for g in (2, 5):
                first, tail = stops_paying(prof, a, g)
                el = expected_accept_length(a, g)
                if first is None:
                    where = "pays at every B up to 256"
                elif first == tail:
                    where = f"stops paying at B {first}"
                else:
                    tail_txt = f"for good at B {tail}" if tail else "pays again at B 256"
                    where = f"first loses at B {first}, {tail_txt}"
                parts.append(f"{g}-step (E[L] {el:.2f}) {where}")
            console.print(f"  {wl} (alpha {a}): " + "; ".join(parts))
    bad = [r for r in rows if not r["ok"]]
    if bad:
        console.print(f"[red]{len(bad)} field row(s) off by more than {TOLERANCE:.0%}[/red]")
        raise typer.Exit(1)
    console.print(f"all {len(rows)} field rows within {TOLERANCE:.0%}")


if __name__ == "__main__":
    app()
