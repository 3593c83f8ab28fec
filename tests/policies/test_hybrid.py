"""policies.hybrid against the simulator's SGLang adaptive rule (the ground truth).

The rule emulation is compared with simulator.adaptive.AdaptiveSlot fed chain draws batch by
batch; predict_adaptive with WindowEngine runs of the same table, with tier cycle times measured
from the engine itself (what specpilot's fitted surface would hold) and the workload's alpha.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import hybrid
from policies.hybrid import (
    SGLANG_DEFAULT_TABLE,
    AcceptModel,
    SlotRule,
    _block_increments,
    accept_model_from,
    adaptive_breakdown,
    cuda_graph_batch_sizes,
    generate_table,
    parse_table,
    predict_adaptive,
    rewrite_pays,
    route,
    seed_table,
    slot_shares,
    table_distance,
    table_steps,
    tier_cycle_from,
    tier_shares,
)
from policies.types import Estimate, ProfileSpec
from simulator.adaptive import AdaptiveSlot, SlotConfig, spec_cuda_graph_batch_sizes
from simulator.engine import WindowEngine
from simulator.model import (
    DEFAULT_ADAPTIVE_CONFIG,
    SpecConfig,
    builtin_workloads,
    draw_accepted_drafts,
    load_profile,
)

WL = builtin_workloads()
MAX_BS = 64


# -------------------------------------------------------------------------------- table format


def test_parse_table_validates_like_sglang() -> None:
    slots = parse_table(SGLANG_DEFAULT_TABLE)
    assert {b: s.candidate_steps for b, s in slots.items()} == {
        1: (1, 3, 5, 7),
        8: (0, 1, 3),
        32: (0, 1),
        64: (0,),
    }
    assert parse_table({"ema_alpha": 0.5, "1": {"candidate_steps": [3, 1]}})[1] == SlotRule(
        (1, 3), ema_alpha=0.5
    )
    for bad, match in (
        ({"ema_alpha": 0.2}, "at least one integer-string"),
        ({"1": {"candidate_steps": []}}, r"1\.candidate_steps"),
        ({"1": {"candidate_steps": [1, -1]}}, r"1\.candidate_steps"),
        ({"1": {"candidate_steps": [1], "ema_alpha": 0}}, "ema_alpha"),
        ({"1": {"candidate_steps": [1], "bogus": 1}}, "unknown keys"),
        ({"1": {"candidate_steps": [1], "update_interval": 0}}, "update_interval"),
        ({"1": {"candidate_steps": [1], "up_hysteresis": "x"}}, "up_hysteresis"),
        ({"1": {"candidate_steps": [1]}, "extra": 1}, "unknown key"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_table(bad)


def test_default_table_is_the_simulators() -> None:
    assert parse_table(SGLANG_DEFAULT_TABLE) == {
        b: SlotRule(s.candidate_steps, s.up_hysteresis, s.down_hysteresis)
        for b, s in parse_table(DEFAULT_ADAPTIVE_CONFIG).items()
    }


def test_routing_pads_to_cuda_graph_sizes_as_sglang() -> None:
    assert cuda_graph_batch_sizes(128) == spec_cuda_graph_batch_sizes(128)
    assert cuda_graph_batch_sizes(100) == spec_cuda_graph_batch_sizes(100)
    slots = parse_table(SGLANG_DEFAULT_TABLE)
    assert route(slots, 7, 128) == 1
    assert route(slots, 31, 128) == 32  # 31 pads to 32
    assert route(slots, 63, 128) == 64  # 63 pads to 64
    assert route(slots, 63, None) == 32
    later = parse_table({"8": {"candidate_steps": [0]}, "16": {"candidate_steps": [1]}})
    assert route(later, 2, 64) == 8  # below the first bound: the first slot, as SGLang


def test_seed_table_restricts_the_default_to_allowed_steps() -> None:
    t = seed_table([0, 2, 3])
    slots = parse_table(t)
    assert slots[1].candidate_steps == (3,)
    assert slots[8].candidate_steps == (0, 3)
    assert slots[64].candidate_steps == (0,)
    assert table_steps(t) == (0, 3)
    t = seed_table([2])
    assert all(s.candidate_steps == (2,) for s in parse_table(t).values())
    with pytest.raises(ValueError, match="candidate steps"):
        seed_table([])


def test_table_distance() -> None:
    a = seed_table([0, 1, 3])
    assert table_distance(a, a) == 0.0
    assert table_distance(None, a) == 1.0
    b = dict(a)
    b["64"] = {"candidate_steps": [1]}
    d = table_distance(a, b)
    assert 0.0 < d < 0.5
    c = {"1": {"candidate_steps": [5]}}
    assert table_distance(a, c) > d


# -------------------------------------------------------------------------------- the rule


def _ground_truth_shares(
    cfg: SlotConfig, alpha: float, batch: int, launch: int, batches: int, seed: int
) -> dict[int, float]:
    """simulator.adaptive.AdaptiveSlot fed per-request chain draws, one verify at a time."""
    rng = np.random.default_rng(seed)
    slot = AdaptiveSlot(launch, cfg)
    counts: dict[int, int] = {}
    burn = 500
    for i in range(batches + burn):
        g = slot.current_steps
        if i >= burn:
            counts[g] = counts.get(g, 0) + 1
        slot.update(draw_accepted_drafts(rng, np.full(batch, alpha), g))
    return {g: c / batches for g, c in counts.items()}


@pytest.mark.parametrize(
    ("cands", "up", "down", "alpha", "batch"),
    [
        ((1, 3, 5, 7), 0.0, -0.25, 0.55, 1),  # SGLang's first bucket, the field's drafter
        ((1, 3, 5, 7), 0.0, -0.25, 0.8455, 2),  # chat drafter: 3 vs 5 at the threshold
        ((0, 1, 3), 0.0, 0.0, 0.55, 8),  # second bucket
        ((0, 1), 0.0, 0.0, 0.35, 40),  # EMA wants 0: probes 1 every other interval
        ((0, 1, 3), 0.0, 0.0, 0.2, 1),  # noisy single stream near the tier-0 threshold
        ((2, 3, 5), 0.0, 0.0, 0.9, 16),
    ],
)
def test_tier_shares_match_the_simulators_rule(
    cands: tuple[int, ...], up: float, down: float, alpha: float, batch: int
) -> None:
    truth = _ground_truth_shares(
        SlotConfig(cands, up, down), alpha, batch, launch=3, batches=40_000, seed=1
    )
    got = tier_shares(SlotRule(cands, up, down), batch, AcceptModel.single(alpha), launch_steps=3)
    for g in set(truth) | set(got):
        assert got.get(g, 0.0) == pytest.approx(truth.get(g, 0.0), abs=0.04), (truth, got)


def test_bistable_rule_keeps_its_start_as_the_simulators_does() -> None:
    """At alpha 0.8, 2 steps accept 1.44 drafts (< 1.75: never up) and 3 steps 1.95 (> 1.25:
    never down): where the slot starts decides where it stays."""
    rule, cfg, acc = SlotRule((2, 3), 0.25, -0.25), SlotConfig((2, 3), 0.25, -0.25), 0.8
    for launch in (2, 3):
        truth = _ground_truth_shares(cfg, acc, 16, launch=launch, batches=5000, seed=2)
        got = tier_shares(rule, 16, AcceptModel.single(acc), launch_steps=launch)
        assert got == {launch: 1.0} and truth == {launch: 1.0}


@pytest.mark.parametrize(("n", "g"), [(1, 3), (5, 5), (16, 7)])
def test_block_increments_draw_a_batchs_sum_as_per_sequence_chain_draws_do(n: int, g: int) -> None:
    """A batch's sum is drawn from the n-fold convolution of the workloads' mixture pmf: its
    increments have the distribution of n per-sequence chain draws (workload by slot share)."""
    rule = SlotRule((1, 3, 5, 7))
    alphas, shares = np.array([0.85, 0.45]), np.array([0.6, 0.4])
    got = _block_increments(
        np.random.default_rng(3), rule.update_interval, rule.ema_alpha, g, n, alphas, shares, 40_000
    )
    rng = np.random.default_rng(4)
    ss = slot_shares(alphas, shares, g)
    seq_alpha = alphas[rng.choice(2, size=(40_000, rule.update_interval, n), p=ss)]
    a = rule.ema_alpha
    w = a * (1.0 - a) ** np.arange(rule.update_interval - 1, -1, -1)
    truth = draw_accepted_drafts(rng, seq_alpha, g).mean(axis=2) @ w
    assert got.mean() == pytest.approx(truth.mean(), rel=0.01)
    assert got.std() == pytest.approx(truth.std(), rel=0.02)
    for q in (0.1, 0.5, 0.9):
        assert np.quantile(got, q) == pytest.approx(np.quantile(truth, q), abs=0.02)


def _shares_interval_by_interval(
    r: SlotRule, n: int, alphas: tuple[float, ...], shares: tuple[float, ...], start: int
) -> tuple[tuple[int, float], ...]:
    """The emulation stepped one update interval at a time (the definition the runs
    of _tier_shares_cached must reproduce exactly)."""
    rng = np.random.default_rng(hybrid.EMULATION_SEED)
    al, sh = np.array(alphas), np.array(shares)
    g = start if start in r.candidate_steps else r.candidate_steps[len(r.candidate_steps) // 2]
    ema = float(g - 1)
    decay = (1.0 - r.ema_alpha) ** r.update_interval
    total = hybrid.EMULATION_BURN_IN + hybrid.EMULATION_INTERVALS
    inc: dict[int, np.ndarray] = {}
    pos: dict[int, int] = {}
    counts: dict[int, int] = {}
    for it in range(total):
        if g > 0:
            if g not in inc:
                every, a = r.update_interval, r.ema_alpha
                inc[g] = _block_increments(rng, every, a, g, n, al, sh, total)
                pos[g] = 0
            ema = decay * ema + float(inc[g][pos[g]])
            pos[g] += 1
        if it >= hybrid.EMULATION_BURN_IN:
            counts[g] = counts.get(g, 0) + 1
        g, ema = hybrid._recompute(r, g, ema)
    return tuple(sorted((k, v / hybrid.EMULATION_INTERVALS) for k, v in counts.items()))


@given(
    cands=st.sampled_from([(1, 3, 5, 7), (0, 1, 3), (0, 1), (2, 3), (1, 2, 4, 6), (0, 2, 5)]),
    hyst=st.sampled_from([(0.0, -0.25), (0.0, 0.0), (0.5, -0.5), (0.25, 0.25)]),
    ceiling=st.sampled_from([0.0, 0.0, 1.2, 2.0]),
    n=st.sampled_from([1, 2, 5, 16, 48]),
    alphas=st.lists(st.floats(0.05, 0.95), min_size=1, max_size=2),
    start=st.integers(0, 7),
)
@settings(max_examples=60, deadline=None)
def test_the_emulation_runs_intervals_at_once_exactly_as_stepping_them(
    cands: tuple[int, ...],
    hyst: tuple[float, float],
    ceiling: float,
    n: int,
    alphas: list[float],
    start: int,
) -> None:
    rule = SlotRule(cands, hyst[0], hyst[1], ceiling_coeff=ceiling)
    shares = tuple(1.0 / len(alphas) for _ in alphas)
    hybrid._tier_shares_cached.cache_clear()
    got = hybrid._tier_shares_cached(rule, n, tuple(alphas), shares, start)
    assert got == _shares_interval_by_interval(rule, n, tuple(alphas), shares, start)


def test_tier_zero_probing_alternates() -> None:
    shares = tier_shares(SlotRule((0, 1), 0.0, 0.0), 48, AcceptModel.single(0.3))
    assert shares[0] == pytest.approx(0.5, abs=0.01)
    assert shares[1] == pytest.approx(0.5, abs=0.01)
    # A single candidate never moves, 0 included.
    assert tier_shares(SlotRule((0,)), 48, AcceptModel.single(0.3)) == {0: 1.0}


# -------------------------------------------------------------------------------- engine truth


def _engine_rate(sim, spec: SpecConfig, conc: int, alpha_wl: str, windows: int = 20) -> float:
    """Decode tokens (accepted drafts + bonus, untruncated) per second of decode time."""
    eng = WindowEngine(sim, spec, WL, seed=3, max_running_requests=MAX_BS)
    tokens = step_s = 0.0
    for i in range(windows):
        r = eng.run_window(30.0, conc, {alpha_wl: 1.0})
        if i < 2:
            continue  # warmup of the rule
        h = np.asarray(r.accepted_drafts_hist)
        tokens += float(np.dot(np.arange(1, len(h) + 1), h)) if len(h) else r.cycles * conc
        step_s += r.sum_step_s
    return tokens / step_s


def _measured_cycles(sim, conc: int, wl: str, steps: list[int]):
    """Tier cycle seconds measured on the engine (fixed tiers; tier 0 as a one-candidate
    adaptive server, so it pays the draft-extend pass): the fitted surface's stand-in."""
    out = {}
    for g in steps:
        spec = (
            SpecConfig.eagle3(1, adaptive=True, adaptive_config={"1": {"candidate_steps": [0]}})
            if g == 0
            else SpecConfig.eagle3(g)
        )
        eng = WindowEngine(sim, spec, WL, seed=5, max_running_requests=MAX_BS)
        cyc = n = 0.0
        for _ in range(4):
            r = eng.run_window(30.0, conc, {wl: 1.0})
            cyc += r.sum_step_s
            n += r.cycles
        out[g] = cyc / n
    return out


@pytest.mark.parametrize(
    ("profile", "wl", "conc", "table"),
    [
        ("kimi-k2.5-pcie-tuned", "default", 1, "default"),
        ("kimi-k2.5-pcie-tuned", "chat", 2, "default"),
        ("kimi-k2.5-pcie-tuned", "default", 12, "default"),
        ("kimi-k2.5-pcie-tuned", "chat", 40, "default"),
        ("kimi-k2.5-pcie-later-boot", "default", 2, "default"),
        ("kimi-k2.5-pcie-tuned", "chat", 64, "generated"),
        ("kimi-k2.5-pcie-later-boot", "chat", 8, "generated"),
    ],
)
def test_predict_adaptive_matches_window_engine(
    profile: str, wl: str, conc: int, table: str
) -> None:
    sim = load_profile(profile)
    acc = AcceptModel.single(WL[wl].alpha, wl)
    steps = [0, 1, 2, 3, 4, 5, 6, 7]
    cycles = _measured_cycles(sim, conc, wl, steps)

    model_cycle = _sim_cycle(profile)

    def cyc(b: float, g: int) -> Estimate:
        if b != conc:  # other buckets of a generated table: the cost model itself
            return model_cycle(b, g)
        return Estimate(cycles[g], cycles[g], cycles[g])

    cfg = dict(SGLANG_DEFAULT_TABLE)
    if table == "generated":
        cfg, _ = generate_table(cyc, acc, steps, buckets=[1, conc], max_bs=MAX_BS, launch_steps=3)
    pred = predict_adaptive(cfg, acc, cyc, conc, launch_steps=3, max_bs=MAX_BS)
    assert pred is not None
    truth = _engine_rate(sim, SpecConfig.eagle3(3, adaptive=True, adaptive_config=cfg), conc, wl)
    assert pred.mean == pytest.approx(truth, rel=0.03)


def test_generated_table_beats_default_in_the_engine_where_costs_make_it_wrong() -> None:
    """Later boot, the field's drafter, 2 streams: SGLang's default table drafts 3 steps by
    acceptance alone (27%+ below baseline); the generated one settles on tier 0."""
    sim = load_profile("kimi-k2.5-pcie-later-boot")
    acc = AcceptModel.single(WL["default"].alpha)
    cycles = _measured_cycles(sim, 2, "default", [0, 1, 2, 3, 5, 7])

    def cyc(b: float, g: int) -> Estimate:
        return Estimate(cycles[g], cycles[g], cycles[g])

    table, _ = generate_table(
        cyc, acc, [0, 1, 2, 3, 5, 7], buckets=[1, 2, 4], max_bs=MAX_BS, launch_steps=3
    )
    assert parse_table(table)[2].candidate_steps == (0,)
    gen = _engine_rate(
        sim, SpecConfig.eagle3(3, adaptive=True, adaptive_config=table), 2, "default"
    )
    dflt = _engine_rate(sim, SpecConfig.eagle3(3, adaptive=True), 2, "default")
    base = _engine_rate(sim, SpecConfig.baseline(), 2, "default")
    assert gen > 1.2 * dflt
    # Tier 0 still pays the draft-extend pass: just below the true baseline.
    assert 0.97 * base < gen < base


# -------------------------------------------------------------------------------- generation


def _sim_cycle(profile: str):
    sim = load_profile(profile)

    def cyc(b: float, g: int) -> Estimate:
        spec = SpecConfig.eagle3(max(g, 1), adaptive=g == 0)
        t = float(sim.cycle_s(b, spec, steps=g))
        return Estimate(t, t, t)

    return cyc


def test_generate_table_respects_allowed_steps_and_costs() -> None:
    cyc = _sim_cycle("kimi-k2.5-pcie-tuned")
    chat = AcceptModel.single(WL["chat"].alpha, "chat")
    table, choices = generate_table(cyc, chat, [0, 2, 5], max_bs=MAX_BS)
    slots = parse_table(table)
    assert set(table_steps(table)) <= {0, 2, 5}
    assert sorted(slots) == [1, 2, 4, 8, 16, 32, 64]
    assert slots[1].candidate_steps == (5,)  # one stream, strong drafter: deep chain
    for c in choices:
        assert set(c.rule.candidate_steps) <= set(c.kept)
        assert max(c.fixed_score.values()) <= 1.0 + 1e-12
        assert c.score >= max(c.fixed_score.values()) - 0.01
    # Later boot, weak drafter: no speculation pays anywhere, tier 0 everywhere.
    weak = AcceptModel.single(WL["default"].alpha)
    table, _ = generate_table(_sim_cycle("kimi-k2.5-pcie-later-boot"), weak, [0, 1, 2, 3, 5])
    assert {s.candidate_steps for s in parse_table(table).values()} == {(0,)}


def test_generate_table_leaves_out_steps_without_costs() -> None:
    base = _sim_cycle("kimi-k2.5-pcie-tuned")

    def cyc(b: float, g: int) -> Estimate | None:
        return None if g == 5 else base(b, g)

    table, _ = generate_table(cyc, AcceptModel.single(0.85), [0, 2, 5], max_bs=8)
    assert 5 not in table_steps(table)
    with pytest.raises(ValueError, match="no candidate step has a cost"):
        generate_table(lambda b, g: None, AcceptModel.single(0.5), [0, 2], max_bs=8)


def test_predict_adaptive_blends_fractional_batches_and_interval() -> None:
    cyc = _sim_cycle("kimi-k2.5-pcie-tuned")
    acc = AcceptModel({"chat": Estimate(0.8455, 0.80, 0.88)}, {"chat": 1.0})
    t = SGLANG_DEFAULT_TABLE
    a = predict_adaptive(t, acc, cyc, 4, max_bs=MAX_BS)
    b = predict_adaptive(t, acc, cyc, 5, max_bs=MAX_BS)
    m = predict_adaptive(t, acc, cyc, 4.25, max_bs=MAX_BS)
    assert a is not None and b is not None and m is not None
    assert m.mean == pytest.approx(0.75 * a.mean + 0.25 * b.mean)
    assert a.low < a.mean < a.high
    br = adaptive_breakdown(t, acc, cyc, 4, max_bs=MAX_BS)
    assert br is not None and br.bucket == 1 and math.isclose(sum(br.shares.values()), 1.0)
    with pytest.raises(ValueError, match="batch"):
        predict_adaptive(t, acc, cyc, 0.5)
    assert predict_adaptive(t, acc, lambda b, g: None, 4) is None


def test_a_table_changed_in_place_is_parsed_again() -> None:
    """Parses are found by the table object's identity; one edited in place since is not the
    table that was parsed."""
    t = {"1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0, 1]}}
    assert hybrid._parsed(t)[1].candidate_steps == (1, 3)
    assert hybrid._parsed(t) is hybrid._parsed(t)  # the same table: the same parse
    t["1"]["candidate_steps"] = [3, 5]
    assert hybrid._parsed(t)[1].candidate_steps == (3, 5)
    t["1"]["candidate_steps"] = [3, -1]
    with pytest.raises(ValueError, match=r"1\.candidate_steps"):
        hybrid._parsed(t)


# -------------------------------------------------------------------------------- economics, inputs


def test_rewrite_pays_uses_the_switch_rules_economics() -> None:
    cur = Estimate(100.0, 99.0, 101.0)
    new = Estimate(110.0, 109.0, 111.0)
    pays, net = rewrite_pays(cur, new, horizon_s=7200, restart_s=300, margin_frac=0.02, margin_z=1)
    assert pays and net > 0
    # The same gain over a regime barely longer than the restart does not pay.
    pays, net = rewrite_pays(cur, new, horizon_s=400, restart_s=300, margin_frac=0.02, margin_z=1)
    assert not pays and net < 0
    # A gain inside the margin never pays.
    small = Estimate(101.0, 100.0, 102.0)
    pays, _ = rewrite_pays(cur, small, horizon_s=1e6, restart_s=1, margin_frac=0.02, margin_z=1)
    assert not pays


def test_tier_cycle_from_fixed_profiles() -> None:
    def fixed(t: float):
        return lambda b: Estimate(t * b, t * b * 0.95, t * b * 1.05, 10)

    cyc = tier_cycle_from(
        {2: fixed(0.020), 5: fixed(0.023)}, lambda b: Estimate(0.011, 0.0105, 0.0115)
    )
    assert cyc(1, 2).mean == pytest.approx(0.020)
    assert cyc(1, 3).mean == pytest.approx(0.021)  # linear in steps between 2 and 5
    assert cyc(1, 7).mean == pytest.approx(0.025)  # extrapolated along the secant
    assert cyc(1, 7).high - cyc(1, 7).mean > cyc(1, 3).high - cyc(1, 3).mean
    t0 = cyc(1, 0)
    tax_max = 0.05 * 0.020 / 3
    assert t0.mean == pytest.approx(0.011 + tax_max / 2)
    assert t0.low < 0.011 + 1e-12 < t0.high
    assert tier_cycle_from({2: fixed(0.02)}, None)(1, 0) is None  # no baseline: no tier 0
    assert tier_cycle_from({2: fixed(0.02)}, None)(1, 3) is None  # one tier: no growth


def test_one_chain_and_the_baseline_price_every_tier() -> None:
    # baseline + 2-step + an adaptive profile whose table uses 1 and 3 steps: a verify forward's
    # excess over a decode forward is anywhere from all per token (the line through tier 0 and
    # the chain) to all fixed (every tier costs the chain's cycle): the middle, that wide.
    def fixed(t: float):
        return lambda b: Estimate(t * b, t * b * 0.99, t * b * 1.01, 10)

    cyc = tier_cycle_from({2: fixed(0.020)}, lambda b: Estimate(0.011, 0.0109, 0.0111))
    t0, t2 = cyc(1, 0), cyc(1, 2)
    assert t0 is not None and t2 is not None
    assert t2.mean == pytest.approx(0.020)
    line1 = (t0.mean + t2.mean) / 2
    t1 = cyc(1, 1)
    assert t1.mean == pytest.approx((line1 + t2.mean) / 2)
    assert t1.low < line1 and t1.high > t2.mean  # the range the data allow, inside the band
    line3 = t2.mean + (t2.mean - t0.mean) / 2
    t3 = cyc(1, 3)  # past the chain: between its cost and the line continued
    assert t3.mean == pytest.approx((t2.mean + line3) / 2)
    assert t3.low < t2.mean and t3.high > line3


def test_a_chain_never_run_is_held_to_what_the_run_ones_allow() -> None:
    # 5-step ran (its own windows); 2-step never did: its cycle is a reading of 5-step's (n 0),
    # centred on a guess, here under the decode step. The cycle never falls with more steps and
    # grows no faster per step than the line from tier 0 to the run chain: the guess is held to
    # that line before any other tier is read through it (unheld, the line through it put tier
    # 1 under tier 0 and tier 7 dearer than the run chain allows).
    def run(b: float) -> Estimate:
        return Estimate(0.0100, 0.0099, 0.0101, 500.0)

    def guess(b: float) -> Estimate:
        return Estimate(0.0063, 0.0043, 0.0090, 0.0)

    def base(b: float) -> Estimate:
        return Estimate(0.0064, 0.0063, 0.0065, 400.0)

    cyc = tier_cycle_from({2: guess, 5: run}, base)
    t0, t1, t2, t5, t7 = (cyc(4, g) for g in (0, 1, 2, 5, 7))
    assert t0 is not None and t1 is not None and t2 is not None and t7 is not None
    assert t5 == run(4)
    line2 = t0.mean + 2 / 5 * (0.0100 - t0.mean)
    assert t2.mean == pytest.approx(line2)
    assert t2.low <= t2.mean <= t2.high <= 0.0100
    assert t0.mean < t1.mean < t2.mean
    assert t7.mean == pytest.approx(0.0100 + 2 / 3 * (0.0100 - line2))
    # A guess inside that band is left as it is.
    inside = lambda b: Estimate(0.0090, 0.0080, 0.0100, 0.0)  # noqa: E731
    assert tier_cycle_from({2: inside, 5: run}, base)(4, 2) == inside(4)
    # Without the baseline's decode nothing holds the guess from below.
    blind = tier_cycle_from({2: guess, 5: run}, None)
    b2, b7 = blind(4, 2), blind(4, 7)
    assert b2 is not None and b2.mean == pytest.approx(0.0063)
    assert b7 is not None and b7.mean == pytest.approx(0.0100 + 2 * (0.0100 - 0.0063) / 3)


def test_accept_model_from_predictions() -> None:
    specs = [
        ProfileSpec("baseline"),
        ProfileSpec("e2", 2, 3, algorithm="EAGLE3"),
        ProfileSpec("e5", 5, 6, algorithm="EAGLE3"),
    ]
    preds = {("e2", "chat"): Estimate(2.3, 2.2, 2.4), ("e5", "code"): Estimate(3.9, 3.8, 4.0)}
    am = accept_model_from(lambda p, w: preds.get((p, w)), specs, {"chat": 0.5, "code": 0.5})
    assert am is not None
    al, sh = am.alphas_of("mean")
    assert np.allclose(sh, [0.5, 0.5])
    assert 1 + al[0] + al[0] ** 2 == pytest.approx(2.3)
    assert am.alphas["code"].low < am.alphas["code"].mean < am.alphas["code"].high
    assert accept_model_from(lambda p, w: None, specs, {"chat": 1.0}) is None
    assert accept_model_from(lambda p, w: None, specs[:1], {"chat": 1.0}) is None
    with pytest.raises(ValueError, match="alpha"):
        AcceptModel({"x": Estimate(0.5, 0.6, 0.7)}, {"x": 1.0})
