"""Cost model, profiles (validation, overrides, table interpolation), workloads, chain maths."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from simulator.model import (
    WORKLOAD_SOURCES,
    CostScale,
    ProfileError,
    SpecConfig,
    Workload,
    accepted_drafts_pmf,
    alpha_for_accept_length,
    builtin_profiles,
    builtin_workloads,
    draw_accepted_drafts,
    expected_accept_length,
    load_profile,
    profile_from_dict,
)

TUNED = "kimi-k2.5-pcie-tuned"
PROFILES_DIR = Path(__file__).resolve().parents[2] / "simulator" / "profiles"


def raw(name: str = TUNED) -> dict:
    with (PROFILES_DIR / f"{name}.toml").open("rb") as fh:
        return tomllib.load(fh)


# -- chain maths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "g", "expected"),
    [(0.6, 2, 1.96), (0.6, 5, 2.38), (0.8, 2, 2.44), (0.8, 5, 3.69), (0.0, 3, 1.0), (1.0, 4, 5.0)],
)
def test_expected_accept_length_matches_field_theory(alpha: float, g: int, expected: float) -> None:
    assert expected_accept_length(alpha, g) == pytest.approx(expected, abs=0.005)


def test_alpha_for_accept_length_inverts() -> None:
    for alpha in (0.1, 0.55, 0.85, 0.95):
        for g in (1, 3, 6):
            el = expected_accept_length(alpha, g)
            assert alpha_for_accept_length(el, g) == pytest.approx(alpha, abs=1e-6)
    with pytest.raises(ValueError, match="impossible"):
        alpha_for_accept_length(4.5, 3)


def test_builtin_workload_alphas_reproduce_their_field_numbers() -> None:
    wls = builtin_workloads()
    assert set(wls) == {"default", "chat", "code", "math"}
    for name, (accept, g, _why) in WORKLOAD_SOURCES.items():
        assert expected_accept_length(wls[name].alpha, g) == pytest.approx(accept, rel=0.002)
    # The field drafter's 2-step accept length is inside SGLang's logged 1.85-2.12.
    assert 1.85 <= expected_accept_length(wls["default"].alpha, 2) <= 2.12


def test_accepted_drafts_pmf_and_draws_agree() -> None:
    rng = np.random.default_rng(7)
    for alpha, g in ((0.55, 2), (0.85, 5), (0.3, 7)):
        pmf = accepted_drafts_pmf(alpha, g)
        assert pmf.sum() == pytest.approx(1.0)
        draws = draw_accepted_drafts(rng, np.full(200_000, alpha), g)
        assert draws.max() <= g and draws.min() >= 0
        freq = np.bincount(draws, minlength=g + 1) / draws.size
        assert np.allclose(freq, pmf, atol=0.004)
        assert (draws + 1).mean() == pytest.approx(expected_accept_length(alpha, g), rel=0.005)


def test_truncation_property_five_step_histogram_predicts_two_step() -> None:
    """Topk 1: A_2 = min(A_5, 2), so E[L_2] = 1 + P(A_5 >= 1) + P(A_5 >= 2)."""
    rng = np.random.default_rng(3)
    for alpha in (0.55, 0.8455):
        a5 = draw_accepted_drafts(rng, np.full(300_000, alpha), 5)
        hist = np.bincount(a5, minlength=6)
        tail = hist[::-1].cumsum()[::-1] / hist.sum()  # P(A >= i)
        predicted = 1.0 + tail[1] + tail[2]
        assert predicted == pytest.approx(expected_accept_length(alpha, 2), rel=0.003)
        assert predicted == pytest.approx(1.0 + np.minimum(a5, 2).mean(), rel=1e-12)


def test_output_length_law() -> None:
    w = Workload("w", 0.5, output_tokens=300.0, prompt_tokens=100.0)
    pmf = w.output_length_pmf()
    assert pmf[0] == 0.0 and pmf.sum() == pytest.approx(1.0)
    mean, sd = w.output_length_moments()
    assert mean == pytest.approx(300.0, rel=0.01)
    draws = w.sample_output_tokens(np.random.default_rng(1), 100_000)
    assert draws.min() >= 1 and draws.max() <= w.max_output
    assert draws.mean() == pytest.approx(mean, rel=0.01)
    assert draws.std() == pytest.approx(sd, rel=0.02)
    fixed = Workload("f", 0.5, output_tokens=64.0, output_sigma=0.0)
    assert fixed.sample_output_tokens(np.random.default_rng(0)) == 64
    with pytest.raises(ValueError, match="alpha"):
        Workload("bad", 1.5, 10.0)


# -- specs ---------------------------------------------------------------------------------


def test_spec_config_tiers_and_validation() -> None:
    assert SpecConfig.baseline().tiers == (0,)
    assert SpecConfig.eagle3(2).tiers == (2,)
    assert SpecConfig.eagle3(2).draft_tokens == 3
    assert SpecConfig.eagle3(3, adaptive=True).tiers == (0, 1, 3, 5, 7)
    custom = {"1": {"candidate_steps": [2, 4]}, "16": {"candidate_steps": [0]}}
    assert SpecConfig.eagle3(3, adaptive=True, adaptive_config=custom).tiers == (0, 2, 3, 4)
    with pytest.raises(ValueError, match="baseline"):
        SpecConfig(algorithm=None, num_steps=2)
    with pytest.raises(ValueError, match="num_steps"):
        SpecConfig(algorithm="EAGLE3", num_steps=0)
    with pytest.raises(ValueError, match="topk 1"):
        SpecConfig(algorithm="EAGLE3", num_steps=3, topk=4, draft_tokens=8, adaptive=True)
    with pytest.raises(ValueError, match="positive"):
        CostScale(verify=0.0)


# -- profiles ------------------------------------------------------------------------------


def test_builtin_profiles_load_and_hit_field_costs_at_b1() -> None:
    names = builtin_profiles()
    for n in ("kimi-k2.5-pcie-tuned", "kimi-k2.5-pcie-untuned", "kimi-k2.5-pcie-later-boot"):
        assert n in names
        p = load_profile(n)
        assert p.kind == "field"
        assert p.provenance["measured"] and p.provenance["assumed"]
    p = load_profile(TUNED)
    base, s2, s5 = SpecConfig.baseline(), SpecConfig.eagle3(2), SpecConfig.eagle3(5)
    assert 1.0 / p.cycle_s(1, base) == pytest.approx(88.8, rel=0.002)
    assert p.target_step_s(1, 3) * 1000 == pytest.approx(18.67, rel=0.002)
    assert p.cycle_s(1, s2) * 1000 == pytest.approx(19.85, rel=0.002)
    assert p.target_step_s(1, 6) * 1000 == pytest.approx(21.7, rel=0.002)
    # Verify is 95%-ish of the cycle and 6 -> 3 draft tokens cut verify ~14% (FIELD.md).
    assert p.target_step_s(1, 3) / p.cycle_s(1, s2) > 0.93
    assert 1 - p.target_step_s(1, 3) / p.target_step_s(1, 6) == pytest.approx(0.14, abs=0.01)
    assert p.cycle_s(1, s5) > p.cycle_s(1, s2)


def test_cycle_composition_and_adaptive_step_zero_pays_draft_extend() -> None:
    p = load_profile(TUNED)
    b = np.array([1, 8, 64])
    ad = SpecConfig.eagle3(3, adaptive=True)
    base = p.cycle_s(b, SpecConfig.baseline())
    zero = p.cycle_s(b, ad, steps=0)
    assert np.allclose(zero - base, p.draft_extend_s(b))
    three = p.cycle_s(b, ad, steps=3)
    expected = 3 * p.draft_step_s(b) + p.target_step_s(b, 4) + p.draft_extend_s(b) + p.overhead_s(b)
    assert np.allclose(three, expected)
    phases = p.cycle_phases_s(8, SpecConfig.eagle3(2))
    assert set(phases) == {"eagle_draft", "target_verify", "eagle_draft_extend", "overhead"}
    assert set(p.cycle_phases_s(8, SpecConfig.baseline())) == {"decode", "overhead"}
    assert isinstance(p.cycle_s(4, SpecConfig.baseline()), float)


def test_cost_scale_multiplies_the_right_forward() -> None:
    p = load_profile(TUNED)
    sc = CostScale(verify=1.5, base=1.1, draft=2.0)
    assert p.target_step_s(4, 3, scale=sc) == pytest.approx(1.5 * p.target_step_s(4, 3))
    assert p.target_step_s(4, 1, scale=sc) == pytest.approx(1.1 * p.target_step_s(4, 1))
    assert p.draft_step_s(4, scale=sc) == pytest.approx(2.0 * p.draft_step_s(4))


def test_batch_shape_baseline_throughput_grows_and_speculation_stops_paying() -> None:
    p = load_profile(TUNED)
    base, s2 = SpecConfig.baseline(), SpecConfig.eagle3(2)
    batches = np.array([1, 2, 4, 8, 16, 32, 64, 128])
    tput = batches / p.cycle_s(batches, base)
    assert np.all(np.diff(tput) > 0)
    chat = builtin_workloads()["chat"].alpha
    gain = lambda b: expected_accept_length(chat, 2) / p.cycle_s(b, s2) * p.cycle_s(b, base)  # noqa: E731
    assert gain(1) > 1.3  # a strong drafter pays at one stream
    assert gain(128) < 1.0  # and not at high concurrency (vLLM: K=3 at 256 gave 0.79x)


def test_restart_phases_count_tiers_and_restart_override_scales() -> None:
    p = load_profile(TUNED)
    ph = p.restart_phases_s(SpecConfig.eagle3(2))
    assert set(ph) == {"load", "cuda_graph", "warmup"}
    assert 120 <= p.restart_s(SpecConfig.baseline()) <= 400  # minutes for a 1T model
    ad = SpecConfig.eagle3(3, adaptive=True)
    assert p.restart_phases_s(ad)["cuda_graph"] == pytest.approx(5 * ph["cuda_graph"])
    q = load_profile(TUNED, {"restart_s": 60})
    assert q.restart_s(SpecConfig.baseline()) == pytest.approx(60.0)
    assert q.restart_s(ad) / q.restart_s(SpecConfig.baseline()) == pytest.approx(
        p.restart_s(ad) / p.restart_s(SpecConfig.baseline())
    )


def test_dotted_override_and_unknown_override_keys() -> None:
    p = load_profile(TUNED, {"target.verify_fixed_ms": 9.0, "serving.max_running_requests": 64})
    assert p.target_step_s(1, 3) - load_profile(TUNED).target_step_s(1, 3) == pytest.approx(
        (9.0 - raw()["target"]["verify_fixed_ms"]) / 1000
    )
    assert p.max_running_requests(SpecConfig.baseline()) == 64
    assert p.max_running_requests(SpecConfig.eagle3(2)) == 48  # SGLang's forced default
    with pytest.raises(ValueError, match="nonsense"):
        load_profile(TUNED, {"nonsense": 1})
    with pytest.raises(ValueError, match=r"target\.no_such_key"):
        load_profile(TUNED, {"target.no_such_key": 1})
    with pytest.raises(ProfileError, match=r"target\.fixed_ms.*>= 0"):
        load_profile(TUNED, {"target.fixed_ms": -1})
    with pytest.raises(ProfileError, match="restart_s"):
        load_profile(TUNED, {"restart_s": 0})


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d["target"].pop("fixed_ms"), r"target\.fixed_ms: missing"),
        (lambda d: d["draft"].update(step_mss=1.0), r"draft\.step_mss: unknown key"),
        (lambda d: d.update(kind="guess"), r"kind: must be one of"),
        (lambda d: d["serving"].update(max_running_requests=0), "positive integer"),
        (lambda d: d["serving"].update(context_tokens="big"), "finite number"),
        (lambda d: d["target"].update(model="magic"), "roofline' or 'table"),
        (lambda d: d["provenance"].update(measured="FIELD"), "list of strings"),
        (lambda d: d["target"].pop("moe_topk"), "needs moe_experts and moe_topk"),
        (lambda d: d["target"].update(moe_topk=500), r"target\.moe_topk: must not exceed"),
        (lambda d: d.pop("restart"), r"restart: missing"),
    ],
)
def test_profile_validation_names_file_and_key(mutate, match: str) -> None:
    d = raw()
    mutate(d)
    with pytest.raises(ProfileError, match=match) as exc:
        profile_from_dict(d, source="bad.toml")
    assert str(exc.value).startswith("bad.toml: ")


def test_profile_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed")
    with pytest.raises(ProfileError, match="not valid TOML") as exc:
        load_profile(str(bad))
    assert str(bad) in str(exc.value)
    with pytest.raises(FileNotFoundError, match="unknown profile"):
        load_profile("no-such-profile")


def table_doc() -> dict:
    d = raw()
    batch = [1, 2, 4, 8]
    tokens = [1, 3, 6]
    context = [1024, 4096]
    # ms = 10 + 2 b + 3 (n - 1) + ctx / 1024: linear, so interpolation must be exact.
    ms = [[[10 + 2 * b + 3 * (n - 1) + c / 1024 for b in batch] for n in tokens] for c in context]
    d["target"] = {"model": "table", "batch": batch, "tokens": tokens, "context": context, "ms": ms}
    d["kind"] = "measured"
    return d


def test_table_model_interpolates_and_extrapolates_linearly() -> None:
    p = profile_from_dict(table_doc(), source="table.toml")
    f = lambda b, n, c: (10 + 2 * b + 3 * (n - 1) + c / 1024) / 1000  # noqa: E731
    for b, n, c in [(1, 1, 1024), (8, 6, 4096), (3, 2, 2048), (6, 4, 3000), (16, 8, 8192)]:
        assert p.target_step_s(b, n, c) == pytest.approx(f(b, n, c), rel=1e-9)
    arr = p.target_step_s(np.array([1, 3, 5]), 3, 1024)
    assert np.allclose(arr, [f(1, 3, 1024), f(3, 3, 1024), f(5, 3, 1024)])
    # Profile default context when none is given.
    assert p.target_step_s(2, 1) == pytest.approx(f(2, 1, p.serving.context_tokens))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t: t.update(ms=[[[1.0]]]), r"target\.ms: shape"),
        (lambda t: t.update(tokens=[2, 3, 6]), "starting at 1"),
        (lambda t: t.update(batch=[1, 4, 2, 8]), "strictly increasing"),
        (lambda t: t["ms"][0][0].__setitem__(0, -1.0), "positive finite"),
        (lambda t: t.update(fixed_ms=3.0), r"target\.fixed_ms: unknown key"),
    ],
)
def test_table_validation(mutate, match: str) -> None:
    d = table_doc()
    mutate(d["target"])
    with pytest.raises(ProfileError, match=match):
        profile_from_dict(d, source="table.toml")


def test_the_routing_a_user_gives_specpilot() -> None:
    """expert_share: top-k / experts of a roofline's or a table's model, 0 for a dense one."""
    assert load_profile(TUNED).expert_share == pytest.approx(8 / 384)
    assert load_profile("h200-moe").expert_share == pytest.approx(8 / 384)
    assert load_profile("h200-llama8b").expert_share == 0.0
    d = table_doc()
    d["target"].update(moe_experts=64, moe_topk=4)
    assert profile_from_dict(d, source="t.toml").expert_share == pytest.approx(4 / 64)
    d["target"].update(moe_topk=65)
    with pytest.raises(ProfileError, match="must not exceed moe_experts"):
        profile_from_dict(d, source="t.toml")
