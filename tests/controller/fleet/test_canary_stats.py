"""The canary test (policies/canary.py) and the fleet's window arithmetic (observe.py), no I/O."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from controller.fleet.observe import arm_window, mean_replica
from policies.canary import (
    ARM_CANARY,
    ARM_CONTROL,
    ArmWindow,
    CanaryTestSettings,
    Verdict,
    assess,
    judgeable,
    out_of_time,
    pooled_control,
)
from policies.types import DecodeMoments, Observation, WorkloadWindow


def windows(
    n: int,
    *,
    canary_rate: float,
    canary_traffic: float = 1.0,
    controls: int = 2,
    noise: float = 0.05,
    seed: int = 0,
    drift: bool = False,
) -> list[ArmWindow]:
    """n ticks of one canary and `controls` control replicas. `*_rate`: tokens per running
    request-second; traffic scales requests in flight (and so raw tok/s) only."""
    rng = np.random.default_rng(seed)
    out: list[ArmWindow] = []
    for i in range(n):
        level = 1.0 + (0.5 * math.sin(i) if drift else 0.0)  # the load moves all replicas
        t = 10.0 * (i + 1)
        for arm, name, rate, traffic in [(ARM_CANARY, "c", canary_rate, canary_traffic)] + [
            (ARM_CONTROL, f"k{j}", 1.0, 1.0) for j in range(controls)
        ]:
            running = 8.0 * traffic * level
            r = 30.0 * rate / level * float(np.exp(rng.normal(0.0, noise)))
            req_s = running * 10.0
            out.append(ArmWindow(arm, name, t, 10.0, r * req_s, req_s, running, None))
    return out


S = CanaryTestSettings(min_windows=6, max_windows=30)


def test_needs_min_windows_before_any_verdict() -> None:
    v = assess(windows(5, canary_rate=1.5), S)
    assert v.verdict is Verdict.CONTINUE and v.why == "insufficient_windows"


@pytest.mark.parametrize("method", ["paired", "welch", "mannwhitney"])
def test_a_faster_candidate_is_promoted(method: str) -> None:
    s = CanaryTestSettings(min_windows=6, max_windows=30, method=method)  # type: ignore[arg-type]
    v = assess(windows(10, canary_rate=1.2), s)
    assert v.verdict is Verdict.PROMOTE, v.summary()
    assert v.ratio is not None and 1.1 < v.ratio < 1.3
    assert v.ci_low is not None and v.ci_low > 1.0


@pytest.mark.parametrize("method", ["paired", "welch", "mannwhitney"])
def test_a_slower_candidate_is_rolled_back(method: str) -> None:
    s = CanaryTestSettings(min_windows=6, max_windows=30, method=method)  # type: ignore[arg-type]
    v = assess(windows(10, canary_rate=0.8), s)
    assert v.verdict is Verdict.ROLLBACK and v.why == "worse", v.summary()


def test_uneven_traffic_is_not_mistaken_for_a_gain() -> None:
    # The canary gets twice the requests: twice the raw tok/s, the same speed per request.
    v = assess(windows(30, canary_rate=1.0, canary_traffic=2.0), S)
    assert v.raw_tok_s_ratio is not None and v.raw_tok_s_ratio > 1.8
    assert v.verdict is not Verdict.PROMOTE, v.summary()
    assert v.ratio is not None and abs(v.ratio - 1.0) < 0.05


def test_a_less_loaded_canary_is_not_mistaken_for_a_loss() -> None:
    v = assess(windows(30, canary_rate=1.0, canary_traffic=0.5), S)
    assert v.raw_tok_s_ratio is not None and v.raw_tok_s_ratio < 0.6
    assert v.why != "worse", v.summary()


def test_equal_profiles_end_without_promotion() -> None:
    v = assess(windows(30, canary_rate=1.0, noise=0.1, seed=3), S)
    assert v.verdict is Verdict.ROLLBACK and v.why in ("no_gain", "inconclusive"), v.summary()


def test_pairing_sees_through_load_swings() -> None:
    # The load moves every replica by +-50% from window to window; a 5% gain is still found by
    # the paired test, not by the unpaired one.
    w = windows(12, canary_rate=1.05, noise=0.01, drift=True)
    paired = assess(w, CanaryTestSettings(min_windows=6, method="paired"))
    welch = assess(w, CanaryTestSettings(min_windows=6, method="welch"))
    assert paired.verdict is Verdict.PROMOTE, paired.summary()
    assert welch.verdict is Verdict.CONTINUE, welch.summary()


def test_idle_windows_are_ignored() -> None:
    w = windows(8, canary_rate=1.3)
    idle = [ArmWindow(ARM_CANARY, "c", 1000.0 + i, 10.0, 0.0, 0.0, 0.0) for i in range(20)]
    v = assess(w + idle, S)
    assert v.n_canary == 8 and v.verdict is Verdict.PROMOTE


def test_out_of_time_rolls_back_only_an_undecided_canary() -> None:
    waiting = assess(windows(3, canary_rate=1.5), S)
    v = out_of_time(waiting)
    assert v.verdict is Verdict.ROLLBACK and v.why == "insufficient_windows"
    assert v.n_canary == waiting.n_canary == 3
    unsure = assess(windows(10, canary_rate=1.02, noise=0.2), S)
    assert unsure.verdict is Verdict.CONTINUE and unsure.why == "inconclusive"
    assert out_of_time(unsure).verdict is Verdict.ROLLBACK
    better = assess(windows(8, canary_rate=1.5), S)
    assert better.verdict is Verdict.PROMOTE and out_of_time(better) == better


def test_judgeable_needs_traffic_on_both_arms() -> None:
    w = windows(1, canary_rate=1.0)
    canary, control = w[0], w[1:]
    idle = ArmWindow(ARM_CANARY, "c", 10.0, 10.0, 0.0, 0.0, 0.0)
    idle_ctl = [ArmWindow(ARM_CONTROL, "k", 10.0, 10.0, 0.0, 0.0, 0.0)]
    assert judgeable(canary, control, S)
    assert not judgeable(None, control, S)
    assert not judgeable(idle, control, S)
    assert not judgeable(canary, idle_ctl, S) and not judgeable(canary, [], S)
    assert judgeable(canary, [*idle_ctl, *control], S)


def test_control_pool_is_traffic_weighted() -> None:
    a = ArmWindow(ARM_CONTROL, "a", 10.0, 10.0, 3000.0, 100.0, 10.0)  # 30 tok/req-s, busy
    b = ArmWindow(ARM_CONTROL, "b", 10.0, 10.0, 100.0, 10.0, 1.0)  # 10 tok/req-s, nearly idle
    assert pooled_control([a, b]) == pytest.approx(3100.0 / 110.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_windows"):
        CanaryTestSettings(min_windows=1)
    with pytest.raises(ValueError, match="max_windows"):
        CanaryTestSettings(min_windows=8, max_windows=4)
    with pytest.raises(ValueError, match="method"):
        CanaryTestSettings(method="ttest")  # type: ignore[arg-type]


def _obs(tok: float, bs: float, *, profile: str = "p", requests: float = 4.0) -> Observation:
    return Observation(
        t_s=100.0,
        window_s=10.0,
        profile=profile,
        running_reqs=bs,
        decode_tokens=tok,
        generation_tokens=tok,
        verify_calls=tok / 2,
        spec_accept_length=2.0,
        moments=DecodeMoments(100.0, 100.0 * bs, 9.0, 100.0 * bs * bs, 9.0 * bs, tok),
        workloads=(WorkloadWindow("chat", tok, tok / 2, requests),),
    )


def test_mean_replica_keeps_one_replica_scale() -> None:
    m = mean_replica([_obs(1000.0, 4.0), _obs(3000.0, 8.0)])
    assert m is not None
    assert m.decode_tokens == 2000.0 and m.running_reqs == 6.0
    assert m.moments is not None and m.moments.sum_bs / m.moments.n_steps == pytest.approx(6.0)
    assert m.workloads[0].requests == 4.0
    # A rolling restart waits for its slowest boot.
    slow = mean_replica([replace(_obs(1.0, 1.0), startup_s=200.0), _obs(1.0, 1.0)])
    assert slow is not None and slow.startup_s == 200.0 and m.startup_s is None
    assert mean_replica([]) is None
    with pytest.raises(ValueError, match="one profile"):
        mean_replica([_obs(1.0, 1.0), _obs(1.0, 1.0, profile="q")])


def test_arm_window_uses_decode_request_seconds() -> None:
    w = arm_window("r", ARM_CANARY, _obs(1800.0, 4.0))
    assert w is not None
    # 1800 tokens over sum(batch x step time) = 9 s x 4 requests
    assert w.output_tokens / w.request_seconds == pytest.approx(50.0)
    assert w.running_reqs == pytest.approx(4.0)


def test_arm_window_counts_the_queue_over_the_decode_seconds() -> None:
    """Requests a capped batch keeps waiting are in the server: the queue gauge over the seconds
    the decode integral covers (the moments' step time, else the window)."""
    w = arm_window("r", ARM_CONTROL, replace(_obs(1800.0, 4.0), queue_reqs=4.0))
    assert w is not None
    assert w.queued_seconds == pytest.approx(4.0 * 9.0)  # 4 waiting through 9 s of steps
    assert w.output_tokens / w.server_seconds == pytest.approx(25.0)
    plain = replace(_obs(1800.0, 4.0), moments=None, queue_reqs=2.0)
    v = arm_window("r", ARM_CONTROL, plain)
    assert v is not None and v.queued_seconds == pytest.approx(2.0 * 10.0)
    for bad in (None, -1.0, math.nan):
        u = arm_window("r", ARM_CONTROL, replace(_obs(1800.0, 4.0), queue_reqs=bad))
        assert u is not None and u.queued_seconds == 0.0


def test_a_capped_control_is_judged_with_its_queue() -> None:
    """A baseline canary runs all 96 requests of its replica (no cap) at 1.4x the control's
    tok/s; the control (speculation, SGLang's cap of 48) runs 48 and queues 48. Per running
    request the canary is slower (a larger batch); per request in the server it is faster,
    which is what the same arrivals see. Counting only running requests rolled it back."""
    out: list[ArmWindow] = []
    rng = np.random.default_rng(3)
    for i in range(8):
        t = 10.0 * (i + 1)
        for arm, name, tok_s, running, queued in [
            (ARM_CANARY, "c", 1000.0, 96.0, 0.0),
            (ARM_CONTROL, "k0", 700.0, 48.0, 48.0),
            (ARM_CONTROL, "k1", 700.0, 48.0, 48.0),
        ]:
            tok = tok_s * 10.0 * float(np.exp(rng.normal(0.0, 0.02)))
            out.append(
                ArmWindow(arm, name, t, 10.0, tok, running * 10.0, running, None, queued * 10.0)
            )
    v = assess(out, S)
    assert v.verdict is Verdict.PROMOTE and v.ratio == pytest.approx(1000 / 700, rel=0.03)
    running_only = [replace(w, queued_seconds=0.0) for w in out]
    assert assess(running_only, S).verdict is Verdict.ROLLBACK


def test_the_deployment_window_leaves_out_replicas_that_served_nothing() -> None:
    """One stream on four replicas: the three the router sent nothing would add window seconds
    without a decode step, learned as non-decode time of every profile. The deployment's window
    is the mean of those that served; an idle fleet's is the mean of all (the policy holds)."""
    from controller.fleet.controller import deployment_window
    from controller.fleet.observe import ReplicaObservation

    def idle() -> Observation:
        return Observation(
            t_s=100.0,
            window_s=10.0,
            profile="p",
            running_reqs=0.0,
            decode_tokens=0.0,
            moments=DecodeMoments(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        )

    busy = _obs(300.0, 1.0)
    tick = {"r0": ReplicaObservation("r0", "p", busy)} | {
        f"r{i}": ReplicaObservation(f"r{i}", "p", idle()) for i in (1, 2, 3)
    }
    w = deployment_window(tick, "p")
    assert w is not None and w.decode_tokens == 300.0 and w.moments == busy.moments
    quiet = {f"r{i}": ReplicaObservation(f"r{i}", "p", idle()) for i in range(4)}
    q = deployment_window(quiet, "p")
    assert q is not None and q.decode_tokens == 0.0
    # A canary's window (another profile) is never the deployment's.
    tick["r0"] = ReplicaObservation("r0", "q", _obs(300.0, 1.0, profile="q"))
    assert deployment_window(tick, "p").decode_tokens == 0.0  # type: ignore[union-attr]


def test_the_deployment_window_has_no_queue_while_a_replica_is_out() -> None:
    """Two replicas capped at 48 with 96 streams each: 48 queue behind each cap. While one
    restarts the router sends all 192 to the other, whose queue is 144: not the load the
    deployment offers a replica, so that tick's window carries no queue (its batch stays)."""
    import dataclasses

    from controller.fleet.controller import deployment_window
    from controller.fleet.observe import ReplicaObservation

    def capped(queue: float) -> Observation:
        return dataclasses.replace(
            _obs(300.0, 48.0), queue_reqs=queue, max_running_reqs=48.0, running_reqs=48.0
        )

    both = {r: ReplicaObservation(r, "p", capped(48.0)) for r in ("r0", "r1")}
    w = deployment_window(both, "p")
    assert w is not None and (w.queue_reqs, w.max_running_reqs) == (48.0, 48.0)
    one = {
        "r0": ReplicaObservation("r0", "p", capped(144.0)),
        "r1": ReplicaObservation("r1", None, None, "profile unknown (down or starting)"),
    }
    w = deployment_window(one, "p")
    assert w is not None and w.queue_reqs is None and w.running_reqs == 48.0
