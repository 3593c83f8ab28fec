"""StepEngine (request bookkeeping, SGLang's per-request counters) and WindowEngine (agreement
with the StepEngine over a simulated hour)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from simulator import engine as engine_module
from simulator import model
from simulator.engine import StepEngine, WindowEngine, drive_closed_loop
from simulator.model import (
    CostScale,
    SpecConfig,
    Workload,
    builtin_workloads,
    expected_accept_length,
    load_profile,
)

TUNED = "kimi-k2.5-pcie-tuned"
LATER = "kimi-k2.5-pcie-later-boot"
WL = builtin_workloads()


def run_to_end(eng: StepEngine, limit: int = 100_000) -> list:
    results = []
    for _ in range(limit):
        r = eng.step()
        if r is None:
            return results
        results.append(r)
    raise AssertionError("engine did not go idle")


def test_prefill_then_decode_and_finished_request_counters() -> None:
    eng = StepEngine(load_profile(TUNED), SpecConfig.eagle3(2), WL, seed=1)
    eng.add_request("a", "chat", 1000, max_new_tokens=50)
    eng.add_request("b", "code", 200, max_new_tokens=80)
    assert eng.num_queued == 2 and eng.num_running == 0
    results = run_to_end(eng)
    first = results[0]
    assert first.kind == "prefill" and first.new_tokens == {"a": 1, "b": 1}
    assert set(first.phase_s) == {"extend"} and first.steps == 0
    decodes = [r for r in results if r.kind == "decode"]
    assert all(r.steps == 2 for r in decodes)
    assert all(
        set(r.phase_s) == {"eagle_draft", "target_verify", "eagle_draft_extend"} for r in decodes
    )
    finished = {f.rid: f for r in results for f in r.finished}
    assert set(finished) == {"a", "b"}
    for rid in ("a", "b"):
        f = finished[rid]
        emitted = sum(r.new_tokens.get(rid, 0) for r in results)
        assert f.completion_tokens == emitted <= {"a": 50, "b": 80}[rid]
        cycles = sum(1 for r in decodes if rid in r.new_tokens)
        assert f.verify_ct == cycles == sum(f.correct_drafts_histogram)
        assert f.num_correct_drafts == sum(k * c for k, c in enumerate(f.correct_drafts_histogram))
        assert f.num_correct_drafts == sum(r.accepted_drafts.get(rid, 0) for r in decodes)
        assert f.num_proposed_drafts == 2 * f.verify_ct
        assert f.first_token_s == pytest.approx(first.duration_s)
        assert f.arrival_s == 0.0 and f.finish_s <= eng.now_s
    assert eng.now_s == pytest.approx(sum(r.duration_s for r in results))
    # Every decode step emits accepted + bonus, truncated at the output length.
    for r in decodes:
        for rid, n in r.new_tokens.items():
            assert 1 <= n <= r.accepted_drafts[rid] + 1


def test_baseline_emits_one_token_per_cycle_and_no_spec_counters() -> None:
    p = load_profile(TUNED)
    eng = StepEngine(p, SpecConfig.baseline(), WL, seed=2)
    eng.add_request("x", "default", 100, max_new_tokens=20)
    results = run_to_end(eng)
    decodes = [r for r in results if r.kind == "decode"]
    assert len(decodes) == 19  # the first of 20 tokens comes from prefill
    assert all(r.new_tokens == {"x": 1} and r.accepted_drafts == {} for r in decodes)
    assert all(set(r.phase_s) == {"decode"} for r in decodes)
    f = results[-1].finished[0]
    assert f.verify_ct == 0 and f.correct_drafts_histogram == [] and f.completion_tokens == 20
    assert decodes[0].duration_s == pytest.approx(
        p.cycle_s(1, SpecConfig.baseline(), context_tokens=96.0), rel=0.01
    )


def test_queueing_abort_unknown_workload_and_errors() -> None:
    eng = StepEngine(load_profile(TUNED), SpecConfig.eagle3(2), WL, seed=3, max_running_requests=2)
    for i in range(4):
        eng.add_request(f"r{i}", "mystery", 100, max_new_tokens=30)
    r = eng.step()
    assert r is not None and r.kind == "prefill" and r.batch_size == 2
    assert eng.num_running == 2 and eng.num_queued == 2
    eng.abort("r3")
    eng.abort("r0")
    assert eng.num_running == 1 and eng.num_queued == 1
    done = [f for r in run_to_end(eng) for f in r.finished]
    assert sorted(f.rid for f in done) == ["r1", "r2"]
    assert all(f.workload == "mystery" for f in done)  # label kept, default's alpha used
    assert eng.step() is None
    eng.advance_idle(5.0)
    t = eng.now_s
    eng.add_request("late", "chat", 10, max_new_tokens=3)
    late = next(f for r in run_to_end(eng) for f in r.finished)
    assert late.arrival_s == t and late.completion_tokens == 3
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request("r1x", "chat", 10)
        eng.add_request("r1x", "chat", 10)
    with pytest.raises(ValueError, match="prompt_tokens"):
        eng.add_request("bad", "chat", 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.add_request("bad2", "chat", 5, max_new_tokens=0)
    with pytest.raises(ValueError, match="default"):
        StepEngine(load_profile(TUNED), SpecConfig.baseline(), {"chat": WL["chat"]}).add_request(
            "q", "other", 5
        )


def test_scale_is_settable_for_drift() -> None:
    p = load_profile(TUNED)
    eng = StepEngine(p, SpecConfig.eagle3(2), WL, seed=4)
    eng.add_request("a", "chat", 100, max_new_tokens=1000)
    eng.step()
    d1 = eng.step().duration_s
    eng.scale = CostScale(verify=1.58)
    d2 = eng.step().duration_s
    verify = p.target_step_s(1, 3, context_tokens=100)
    assert d2 - d1 == pytest.approx(0.58 * verify, rel=0.02)


def test_adaptive_engine_uses_tiers_and_pays_draft_extend_at_zero() -> None:
    p = load_profile(TUNED)
    spec = SpecConfig.eagle3(3, adaptive=True)
    eng = StepEngine(p, spec, WL, seed=5, max_running_requests=64)
    for i in range(64):
        eng.add_request(f"r{i}", "default", 64, max_new_tokens=400)
    eng.step()  # prefill
    r = eng.step()
    assert r.steps == 0  # bs 64 -> bucket 64 -> [0]
    assert r.duration_s > p.cycle_s(64, SpecConfig.baseline(), context_tokens=65)
    assert r.phase_s["eagle_draft"] == 0.0 and r.phase_s["eagle_draft_extend"] > 0
    assert set(r.new_tokens.values()) == {1} and set(r.accepted_drafts.values()) == {0}

    one = StepEngine(p, spec, {"default": WL["math"]}, seed=6)
    tot = drive_closed_loop(one, 120.0, 1, {"default": 1.0}, seed=1)
    assert set(tot.tiers_used) <= {1, 3, 5, 7} and max(tot.tiers_used, key=tot.tiers_used.get) >= 5


def test_one_stream_accept_length_follows_the_chain() -> None:
    p = load_profile(TUNED)
    for wl, g in (("default", 2), ("code", 5)):
        eng = StepEngine(p, SpecConfig.eagle3(g), WL, seed=7)
        tot = drive_closed_loop(eng, 300.0, 1, {wl: 1.0}, seed=2)
        assert tot.accept_length == pytest.approx(expected_accept_length(WL[wl].alpha, g), rel=0.01)


def test_truncation_five_step_histogram_predicts_two_step_engine_accept_length() -> None:
    p = load_profile(TUNED)
    e5 = StepEngine(p, SpecConfig.eagle3(5), WL, seed=8)
    t5 = drive_closed_loop(e5, 600.0, 4, {"chat": 1.0}, seed=3)
    hist = np.array(t5.accepted_drafts_hist, dtype=float)
    tail = hist[::-1].cumsum()[::-1] / hist.sum()
    predicted = 1.0 + tail[1] + tail[2]
    e2 = StepEngine(p, SpecConfig.eagle3(2), WL, seed=9)
    t2 = drive_closed_loop(e2, 600.0, 4, {"chat": 1.0}, seed=4)
    assert predicted == pytest.approx(t2.accept_length, rel=0.01)


# -- WindowEngine ---------------------------------------------------------------------------


def window_totals(we: WindowEngine, hours: float, concurrency: int, mix, window_s: float = 10.0):
    out = gen = ver = cycles = 0.0
    for _ in range(round(hours * 3600 / window_s)):
        r = we.run_window(window_s, concurrency, mix)
        out += r.output_tokens
        gen += sum(r.generation_tokens.values())
        ver += sum(r.verify_calls.values())
        cycles += r.cycles
    return out, gen, ver, cycles


def compare(profile: str, spec: SpecConfig, concurrency: int, mix, *, seed: int = 0, wl=WL):
    p = load_profile(profile)
    step = drive_closed_loop(
        StepEngine(p, spec, wl, seed=seed), 3600.0, concurrency, mix, seed=seed
    )
    out, gen, ver, cycles = window_totals(
        WindowEngine(p, spec, wl, seed=seed + 100), 1.0, concurrency, mix
    )
    tok_ratio = out / step.output_tokens
    if spec.speculative:
        step_acc = sum(step.generation_tokens.values()) / sum(step.verify_calls.values())
        acc_ratio = (gen / ver) / step_acc
    else:
        acc_ratio = 1.0
    return tok_ratio, acc_ratio, cycles / step.cycles


AGREEMENT_FAST = [
    (TUNED, SpecConfig.eagle3(2), 8, {"chat": 0.5, "code": 0.5}),
    (LATER, SpecConfig.baseline(), 48, {"default": 1.0}),
    (TUNED, SpecConfig.eagle3(5), 32, {"math": 0.3, "default": 0.7}),
    (TUNED, SpecConfig.eagle3(3, adaptive=True), 48, {"chat": 1.0}),
]
AGREEMENT_SLOW = [
    (TUNED, SpecConfig.eagle3(2), 1, {"chat": 1.0}),
    (TUNED, SpecConfig.baseline(), 1, {"code": 1.0}),
    (TUNED, SpecConfig.eagle3(5), 8, {"chat": 0.5, "code": 0.5}),
    ("kimi-k2.5-pcie-untuned", SpecConfig.eagle3(2), 48, {"default": 1.0}),
    (TUNED, SpecConfig.eagle3(3, adaptive=True), 1, {"code": 1.0}),
    (TUNED, SpecConfig.eagle3(3, adaptive=True), 8, {"default": 1.0}),
]


@pytest.mark.parametrize(("profile", "spec", "concurrency", "mix"), AGREEMENT_FAST)
def test_window_engine_agrees_with_step_engine_over_an_hour(
    profile, spec, concurrency, mix
) -> None:
    tok, acc, cyc = compare(profile, spec, concurrency, mix)
    assert tok == pytest.approx(1.0, abs=0.01)
    assert acc == pytest.approx(1.0, abs=0.01)
    assert cyc == pytest.approx(1.0, abs=0.015)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SPECPILOT_LONG"), reason="SPECPILOT_LONG=1 runs it")
@pytest.mark.parametrize(("profile", "spec", "concurrency", "mix"), AGREEMENT_SLOW)
def test_window_engine_agrees_long(profile, spec, concurrency, mix) -> None:
    tok, acc, _ = compare(profile, spec, concurrency, mix)
    assert tok == pytest.approx(1.0, abs=0.01)
    assert acc == pytest.approx(1.0, abs=0.01)


def test_agreement_check_detects_a_wrong_model() -> None:
    """The comparison can fail: a WindowEngine whose chat alpha is off by 0.03 disagrees."""
    p = load_profile(TUNED)
    spec, mix = SpecConfig.eagle3(2), {"chat": 1.0}
    step = drive_closed_loop(StepEngine(p, spec, WL, seed=1), 1800.0, 8, mix, seed=1)
    wrong = dict(WL, chat=Workload("chat", WL["chat"].alpha - 0.03, WL["chat"].output_tokens,
                                   WL["chat"].prompt_tokens))  # fmt: skip
    _out, gen, ver, _ = window_totals(WindowEngine(p, spec, wrong, seed=2), 0.5, 8, mix)
    step_acc = sum(step.generation_tokens.values()) / sum(step.verify_calls.values())
    assert abs(gen / ver / step_acc - 1.0) > 0.01


def test_window_result_fields_and_queueing() -> None:
    p = load_profile(TUNED)
    we = WindowEngine(p, SpecConfig.eagle3(2), WL, seed=3)
    r = we.run_window(10.0, 60, {"chat": 1.0, "code": 1.0})
    assert r.mean_running == 48 and r.mean_queued == 12  # SGLang's 48 with speculation
    assert r.cycles > 0 and r.tiers_used == {2: r.cycles}
    assert r.sum_bs == r.cycles * 48 and r.sum_bs2 == r.cycles * 48 * 48
    assert r.sum_bs_step_s == pytest.approx(48 * r.sum_step_s)
    assert r.sum_step_s < 10.0  # prefill steps take the rest
    assert sum(r.accepted_drafts_hist) == r.cycles * 48 and len(r.accepted_drafts_hist) == 3
    assert set(r.requests) == {"chat", "code"}
    idle = we.run_window(10.0, 0, {"chat": 1.0})
    assert idle.cycles == 0 and idle.output_tokens == 0
    base = WindowEngine(p, SpecConfig.baseline(), WL).run_window(10.0, 4, {"x": 1.0})
    assert base.accepted_drafts_hist == [] and base.verify_calls == {"x": 0.0}
    with pytest.raises(ValueError, match="duration"):
        we.run_window(-1.0, 1, {"chat": 1.0})
    with pytest.raises(ValueError, match="positive weight"):
        we.run_window(10.0, 4, {"chat": 0.0})


def test_window_engine_adaptive_tiers_by_bucket() -> None:
    p = load_profile(TUNED)
    spec = SpecConfig.eagle3(3, adaptive=True)
    we = WindowEngine(p, spec, WL, seed=4, max_running_requests=128)
    r = we.run_window(60.0, 100, {"chat": 1.0})
    assert set(r.tiers_used) == {0}  # bs 100 -> bucket 64 -> [0]
    assert r.accepted_drafts_hist[0] == r.cycles * 100
    r1 = [we.run_window(10.0, 1, {"math": 1.0}) for _ in range(30)]
    used: dict[int, int] = {}
    for w in r1:
        for g, c in w.tiers_used.items():
            used[g] = used.get(g, 0) + c
    assert set(used) <= {1, 3, 5, 7} and max(used, key=used.get) >= 5


def test_window_engine_day_is_fast() -> None:
    p = load_profile(TUNED)
    we = WindowEngine(p, SpecConfig.eagle3(2), WL, seed=5)
    we.run_window(10.0, 16, {"chat": 0.6, "code": 0.4})  # warm the caches
    t0 = time.perf_counter()
    for _ in range(8640):
        we.run_window(10.0, 16, {"chat": 0.6, "code": 0.4})
    assert time.perf_counter() - t0 < 10.0  # ~0.3 s unloaded; generous for a busy CI box


class IntervalByInterval(WindowEngine):
    """The window engine with SGLang's rule stepped one update interval at a time: the
    definition the engine's runs of intervals must reproduce exactly."""

    def _run_adaptive(self, rule, n, budget_s, dt, alphas, shares):  # type: ignore[no-untyped-def]
        slot = rule.slots[rule.bucket(n)]
        cfg = slot.cfg
        every = cfg.update_interval
        decay = (1.0 - cfg.ema_alpha) ** every
        # Slot shares move a little with the window's tier mix; 1% steps keep the draws reused.
        shares = np.round(shares, 2)
        shares = shares / shares.sum()
        key = (rule.bucket(n), n, alphas.tobytes(), shares.tobytes())
        if key != self._block_key:
            self._block_key, self._blocks = key, {}
        counts: dict[int, int] = {}
        t = self._debt_s
        while t < budget_s:
            g = slot.current_steps
            if slot.batch_count < cfg.warmup_batches:
                k = cfg.warmup_batches - slot.batch_count
                means = np.zeros(k)
                if g > 0:
                    a = (
                        np.resize(alphas, (k, n))
                        if len(alphas) == 1
                        else alphas[self._rng.choice(len(alphas), size=(k, n), p=shares)]
                    )
                    means = model.draw_accepted_drafts(self._rng, a, g).mean(axis=1)
                slot.advance(means)
            else:
                k = every
                if g > 0:
                    buf, pos = self._blocks.get(g, ([], 0))
                    if pos >= len(buf):
                        buf, pos = self._block_terms(g, n, every, cfg.ema_alpha, alphas, shares), 0
                    slot.ema_accept_len = decay * slot.ema_accept_len + buf[pos]
                    self._blocks[g] = (buf, pos + 1)
                slot.batch_count += every
                slot.recompute()
            counts[g] = counts.get(g, 0) + k
            t += k * dt[g]
        self._debt_s = t - budget_s
        return counts


@pytest.mark.parametrize(
    ("table", "mixes"),
    [
        (None, [{"chat": 1.0}, {"math": 1.0}, {"chat": 0.5, "code": 0.5}]),
        (
            {
                "1": {"candidate_steps": [0, 2, 4], "ceiling_coeff": 1.5},
                "16": {"candidate_steps": [0]},
            },
            [{"code": 1.0}, {"chat": 0.3, "math": 0.7}],
        ),
    ],
)
def test_runs_of_intervals_are_stepped_exactly_as_one_by_one(table, mixes) -> None:  # type: ignore[no-untyped-def]
    p = load_profile(TUNED)
    spec = SpecConfig.eagle3(3, adaptive=True, adaptive_config=table)
    engines = [cls(p, spec, WL, seed=11) for cls in (WindowEngine, IntervalByInterval)]
    for i in range(240):
        conc = (1, 2, 8, 24, 40, 100)[i // 8 % 6]
        mix = mixes[i // 16 % len(mixes)]
        a, b = (e.run_window(10.0, conc, mix) for e in engines)
        assert a == b, (i, conc, mix)


def test_the_window_model_cache_is_bounded_and_changes_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An adaptive server's window models follow its tier mix: the cache is emptied when full,
    and a run that keeps few models draws exactly what one that keeps them all draws."""
    p = load_profile(TUNED)
    spec = SpecConfig.eagle3(3, adaptive=True)
    kept_all = WindowEngine(p, spec, WL, seed=5)
    runs = [(conc, mix) for conc in (1, 3, 6, 24) for mix in ({"chat": 1.0}, {"code": 1.0})] * 6
    want = [kept_all.run_window(10.0, c, m) for c, m in runs]
    monkeypatch.setattr(engine_module, "MODELS_MAX", 4)
    few = WindowEngine(p, spec, WL, seed=5)
    sizes = []
    for (c, m), w in zip(runs, want, strict=True):
        assert few.run_window(10.0, c, m) == w
        sizes.append(len(few._models))
    assert max(sizes) <= 4 < len(kept_all._models)
