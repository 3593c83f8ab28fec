"""What specpilot_hybrid does at one stream in tuned-one-stream, the first hour: from 5-step
(explored first), its adaptive profile and the fixed 2-step are both unknown and priced alike
(~100 tok/s), and the adaptive profile is explored first: its information is not charged the
switch margin (policies.explore_value.explore_gain: what its price cannot see, its choice of
tier per batch, is in its favour). Its table runs the 2-step tier at one stream, as SGLang's rule
would not (the rule runs 3 steps there: 1.010 of oracle_dp over the day)."""

from __future__ import annotations

import pytest

from controller.bench import peers
from controller.bench.harness import replay
from controller.bench.scenario import HYBRID_PROFILE, load_scenario, shipped_scenarios_dir
from policies.hybrid import parse_table, route
from policies.types import Decision, Observation, Reason
from tests.bench.conftest import record_ticks

H = HYBRID_PROFILE
TWO = "eagle3-2step"


@pytest.fixture(scope="module")
def run() -> tuple[peers.SpecpilotHybrid, list[tuple[Observation, Decision]]]:
    sc = load_scenario(shipped_scenarios_dir() / "tuned-one-stream.toml").scaled(60.0 / 1440.0)
    pol = peers.SpecpilotHybrid(sc.max_running_requests)
    log = record_ticks(pol)
    replay(sc, pol)
    return pol, log


def test_the_adaptive_profile_is_explored_before_an_equal_chain(
    run: tuple[peers.SpecpilotHybrid, list[tuple[Observation, Decision]]],
) -> None:
    pol, log = run
    s = pol.settings
    explored = [d for _, d in log if d.reason is Reason.EXPLORE]
    assert [d.profile for d in explored[:2]] == ["eagle3-5step", H]
    diag = explored[1].diagnostics
    # Priced within 1% of each other...
    assert diag[f"pred_tok_s.{H}"] == pytest.approx(diag[f"pred_tok_s.{TWO}"], rel=0.01)
    # ... the chain's information is charged the margin over the useful horizon, the adaptive
    # profile's is not, and that is what puts it first: charged as well, it would come second.
    h_net, c_net = diag[f"explore_net_tokens.{H}"], diag[f"explore_net_tokens.{TWO}"]
    cur = diag["pred_tok_s.eagle3-5step"]
    restart = pol.state.restart_s["eagle3-5step"]  # the one measured: both are priced at it
    charged = s.margin_frac * cur * (diag["explore_horizon_s"] - restart - s.min_dwell_s)
    assert h_net > c_net > 0
    assert h_net - charged < c_net


def test_its_table_runs_the_two_step_tier_at_one_stream(
    run: tuple[peers.SpecpilotHybrid, list[tuple[Observation, Decision]]],
) -> None:
    pol, log = run
    table = pol.adaptive_table(H)
    assert table is not None
    slots = parse_table(table)
    assert slots[route(slots, 1, 48)].candidate_steps == (2,)
    tiers = {o.spec_num_steps for o, _ in log if o.profile == H and o.decode_tokens}
    assert tiers == {2.0}


def test_the_chain_of_the_tier_it_ran_is_priced_by_that_tier(
    run: tuple[peers.SpecpilotHybrid, list[tuple[Observation, Decision]]],
) -> None:
    """The 2-step chain never ran, and its step time read off 5-step and the baseline was 10%
    short: priced at 100.9 tok/s, it was explored 65 minutes in and kept at 90.9, a restart for
    nothing. The adaptive profile's windows at its 2-step tier are that chain's forward: once
    they count, the chain is priced at what the tier served."""
    _pol, log = run
    served = [o for o, _ in log if o.profile == H and o.decode_tokens]
    assert len(served) > 60
    tok_s = sum(o.decode_tokens for o in served[-30:]) / sum(o.window_s for o in served[-30:])
    last = next(d for _, d in reversed(log) if f"pred_tok_s.{TWO}" in d.diagnostics)
    assert last.diagnostics[f"pred_tok_s.{TWO}"] == pytest.approx(tok_s, rel=0.02)
