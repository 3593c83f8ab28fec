"""SGLang 0.5.23's adaptive speculation rule as modelled in simulator.adaptive."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.adaptive import (
    AdaptiveRule,
    AdaptiveSlot,
    SlotConfig,
    parse_adaptive_config,
    spec_cuda_graph_batch_sizes,
)
from simulator.model import DEFAULT_ADAPTIVE_CONFIG


def test_default_table_matches_sglang() -> None:
    slots = parse_adaptive_config(None)
    assert {b: s.candidate_steps for b, s in slots.items()} == {
        1: (1, 3, 5, 7),
        8: (0, 1, 3),
        32: (0, 1),
        64: (0,),
    }
    assert slots[1].down_hysteresis == -0.25 and slots[8].down_hysteresis == 0.0
    assert all(s.ema_alpha == 0.2 for s in slots.values())
    assert all(s.update_interval == 5 and s.warmup_batches == 10 for s in slots.values())


def test_config_parsing_merges_shared_keys_and_rejects_bad_input() -> None:
    cfg = {"ema_alpha": 0.5, "1": {"candidate_steps": [3, 1]}, "16": {"candidate_steps": [0]}}
    slots = parse_adaptive_config(cfg)
    assert slots[1].candidate_steps == (1, 3) and slots[1].ema_alpha == 0.5
    with pytest.raises(ValueError, match="at least one integer-string"):
        parse_adaptive_config({"ema_alpha": 0.2})
    with pytest.raises(ValueError, match=r"1\.candidate_steps"):
        parse_adaptive_config({"1": {"candidate_steps": []}})
    with pytest.raises(ValueError, match=r"1\.candidate_steps"):
        parse_adaptive_config({"1": {"candidate_steps": [1, -2]}})
    with pytest.raises(ValueError, match="ema_alpha"):
        parse_adaptive_config({"1": {"candidate_steps": [1], "ema_alpha": 0}})
    with pytest.raises(ValueError, match="unknown keys"):
        parse_adaptive_config({"1": {"candidate_steps": [1], "emaalpha": 0.1}})
    with pytest.raises(ValueError, match="update_interval"):
        parse_adaptive_config({"1": {"candidate_steps": [1], "update_interval": 0}})


def test_slot_starts_at_launch_steps_or_middle_candidate() -> None:
    s = AdaptiveSlot(3, SlotConfig(candidate_steps=(1, 3, 5, 7)))
    assert s.current_steps == 3 and s.ema_accept_len == 2.0
    s = AdaptiveSlot(2, SlotConfig(candidate_steps=(1, 3, 5, 7)))
    assert s.current_steps == 5 and s.ema_accept_len == 4.0  # index len // 2
    s = AdaptiveSlot(3, SlotConfig(candidate_steps=(0, 1)))
    assert s.current_steps == 1


def test_warmup_then_every_interval_target_round_ema_plus_one() -> None:
    cfg = SlotConfig(candidate_steps=(1, 3, 5, 7), down_hysteresis=0.0)
    s = AdaptiveSlot(3, cfg)
    # Every request accepts 4 drafts: EMA climbs toward 4, target = round(ema) + 1 -> 5.
    changes = [s.update([4, 4]) for _ in range(15)]
    assert not any(changes[:14])  # 10 warmup batches, then the first decision at batch 15
    assert changes[14] and s.current_steps == 5
    ema = 2.0
    for _ in range(15):
        ema = 0.8 * ema + 0.2 * 4
    assert s.ema_accept_len == pytest.approx(ema)


def test_step_down_with_hysteresis() -> None:
    cfg = SlotConfig(candidate_steps=(1, 3, 5, 7), down_hysteresis=-0.25)
    s = AdaptiveSlot(5, cfg)
    s.ema_accept_len = 2.4
    s.batch_count = 14
    s.update([2])  # ema 2.32 > 3 - 0.5 - 0.25 = 2.25 (round(ema) + 1 = 3 without hysteresis)
    assert s.current_steps == 5
    s.ema_accept_len = 1.0
    s.batch_count = 19
    s.update([0])  # ema 0.8: <= 2.25 drops to 3, > 1 - 0.5 - 0.25 = 0.25 stops there
    assert s.current_steps == 3


def test_zero_tier_freezes_ema_and_probes_up() -> None:
    s = AdaptiveSlot(0, SlotConfig(candidate_steps=(0, 1, 3), down_hysteresis=0.0))
    assert s.current_steps == 0 and s.ema_accept_len == -1.0
    for _ in range(14):
        s.update([0, 0, 0])
    assert s.ema_accept_len == -1.0  # no drafting, no acceptance data
    assert s.update([0, 0, 0]) and s.current_steps == 1
    assert s.ema_accept_len == 0.0  # reset to the probe's neutral start
    # Nothing accepted at tier 1: back to 0 at the next decision (0.5 threshold).
    for _ in range(5):
        s.update([0, 0, 0])
    assert s.current_steps == 0


def test_ceiling_caps_only_downward_or_equal_moves() -> None:
    s = AdaptiveSlot(7, SlotConfig(candidate_steps=(1, 3, 5, 7), ceiling_coeff=1.0))
    s.ema_accept_len = 6.6  # would keep 7; ceil(6.6 * 1.0) = 7 -> no cap
    assert not s.recompute() and s.current_steps == 7
    s.ema_accept_len = 6.55
    s.cfg = SlotConfig(candidate_steps=(1, 3, 5, 7), ceiling_coeff=0.5)
    assert s.recompute() and s.current_steps == 3  # ceiling ceil(3.275) = 4 caps 7 -> 3


def test_advance_equals_repeated_update() -> None:
    rng = np.random.default_rng(11)
    for cfg in (
        SlotConfig(candidate_steps=(1, 3, 5, 7)),
        SlotConfig(candidate_steps=(0, 1, 3), down_hysteresis=0.0, update_interval=3),
    ):
        a, b = AdaptiveSlot(3, cfg), AdaptiveSlot(3, cfg)
        for _ in range(40):
            k = int(rng.integers(1, 12))
            batches = [rng.integers(0, 5, size=4) for _ in range(k)]
            changed_a = False
            for x in batches:
                changed_a |= a.update(list(x))
            # Blocks may span several decisions: the EMA is applied segment by segment.
            assert b.advance([float(np.mean(x)) for x in batches]) == changed_a
            assert (b.current_steps, b.batch_count) == (a.current_steps, a.batch_count)
            assert b.ema_accept_len == pytest.approx(a.ema_accept_len)


def test_routing_pads_to_cuda_graph_sizes() -> None:
    sizes = spec_cuda_graph_batch_sizes(48)
    assert sizes[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12] and sizes[-1] == 48
    rule = AdaptiveRule(3, None, sizes)
    assert [rule.bucket(b) for b in (1, 7, 8, 9, 30, 31, 33, 48)] == [1, 1, 8, 8, 8, 32, 32, 32]
    assert AdaptiveRule(3, None, spec_cuda_graph_batch_sizes(128)).bucket(63) == 64
    unpadded = AdaptiveRule(3, None, None)
    assert unpadded.bucket(31) == 8 and unpadded.bucket(63) == 32
    assert rule.steps_for_batch(1) == 3 and rule.steps_for_batch(40) == 1
    assert rule.candidate_steps == [0, 1, 3, 5, 7]


def test_rule_feeds_the_routed_slot_only() -> None:
    rule = AdaptiveRule(3, copy.deepcopy(DEFAULT_ADAPTIVE_CONFIG), None)
    for _ in range(15):
        rule.on_verify_complete([0] * 10, 10)
    assert rule.slots[8].current_steps == 0  # ema 2 x 0.8^15 = 0.07 <= 0.5: 3 -> 1 -> 0
    assert rule.slots[1].current_steps == 3 and rule.slots[1].batch_count == 0


@given(
    cands=st.sampled_from([(1, 3, 5, 7), (0, 1, 3), (0, 1), (2, 3), (3,), (1, 2, 4, 6)]),
    up=st.sampled_from([0.0, 0.25, 0.5]),
    down=st.sampled_from([-0.25, 0.0, -0.5, 0.25]),
    ceiling=st.sampled_from([0.0, 1.2, 2.0]),
    pick=st.integers(0, 10),
    ema=st.floats(-1.0, 8.0),
)
@settings(max_examples=300, deadline=None)
def test_stay_bounds_say_where_recompute_keeps_the_tier(
    cands: tuple[int, ...], up: float, down: float, ceiling: float, pick: int, ema: float
) -> None:
    spec = [c for c in cands if c > 0]
    if not spec:
        return
    g = spec[pick % len(spec)]
    slot = AdaptiveSlot(g, SlotConfig(cands, up, down, ceiling_coeff=ceiling))
    lo, hi, ceil_c = slot.stay_bounds()
    stays = lo < ema <= hi and not (ceil_c > 0 and max(1, math.ceil(ema * ceil_c)) < g)
    slot.ema_accept_len = ema
    assert (not slot.recompute()) == stays
