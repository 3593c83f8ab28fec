"""`python -m simulator` as a process: closed port while starting, warmup, SIGTERM drain,
and each fault mode. Restart times are scaled down (--sim-override restart_s, --sim-speed)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.simulator.conftest import EAGLE2, SimProcess

# One-tier restart of 100 simulated s at 100x: 1 s wall (0.78 s load, 0.17 s graphs, 0.04 warmup)
FAST = ["--sim-override", "restart_s=100", "--sim-speed", "100"]


def test_port_closed_while_loading_then_startup_gauges(sim_process: type[SimProcess]) -> None:
    p = sim_process([*FAST, "--enable-metrics", *EAGLE2])
    time.sleep(0.3)
    assert not p.port_open()  # weights "loading": connections refused
    bound_after = p.wait_bound()
    p.wait_up()
    # load + graphs of a one-tier restart of 100 simulated s at 100x, plus interpreter start
    assert 0.8 < bound_after + 0.3 < 6.0
    text = httpx.get(f"{p.url}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    phases = {s.labels["phase"]: s.value for s in fams["sglang:startup_time_seconds"].samples}
    graphs = {
        s.labels["phase"]: s.value for s in fams["sglang:startup_cuda_graph_time_seconds"].samples
    }
    assert phases["scheduler_e2e"] == phases["load_weight"] + graphs["target_verify"]
    assert 90 < phases["scheduler_e2e"] < 100  # simulated seconds, before the warmup
    assert graphs["decode"] == 0


def _running(p: SimProcess) -> int:
    """Requests the server is running now (its /v1/loads)."""
    loads = httpx.get(f"{p.url}/v1/loads", params={"include": "core"}).json()["loads"]
    return sum(int(x["num_running_reqs"]) for x in loads)


def test_sigterm_drains_in_flight_then_exits_0(sim_process: type[SimProcess]) -> None:
    # 20 simulated s of decoding at 10x: a request that stays in flight ~2 s wall.
    p = sim_process(
        ["--sim-override", "restart_s=5", "--sim-speed", "10", "--sim-workload", "long=0.5:1000"]
    )
    p.wait_up()
    results: dict[str, httpx.Response] = {}

    def long_request() -> None:
        results["long"] = httpx.post(
            f"{p.url}/generate",
            json={"text": "a", "custom_labels": {"workload": "long"},
                  "sampling_params": {"max_new_tokens": 600}},
            timeout=30,
        )  # fmt: skip

    t = threading.Thread(target=long_request)
    t.start()
    # SIGTERM only once the long request is in flight (on a busy machine a fixed sleep could
    # signal an idle server, which exits at once).
    deadline = time.monotonic() + 10.0
    while _running(p) < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.05)
    p.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert httpx.get(f"{p.url}/health").status_code == 503
    assert httpx.get(f"{p.url}/ready").status_code == 503
    # still accepting new requests while draining, as SGLang does
    short = httpx.post(
        f"{p.url}/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 4}}
    )
    assert short.status_code == 200 and short.json()["meta_info"]["completion_tokens"] == 4
    assert p.proc.poll() is None  # the long one is still running
    t.join(30)
    assert results["long"].status_code == 200
    assert results["long"].json()["meta_info"]["completion_tokens"] == 600
    assert p.proc.wait(10) == 0


def test_start_fail_exits_nonzero_before_binding(sim_process: type[SimProcess]) -> None:
    p = sim_process([*FAST, "--sim-fault-start-fail"])
    code = p.proc.wait(15)
    assert code != 0
    assert "simulated fault" in p.output()


def test_fault_scope_spares_other_shapes(sim_process: type[SimProcess]) -> None:
    p = sim_process([*FAST, *EAGLE2, "--sim-fault-start-fail", "--sim-fault-scope", "steps=5"])
    p.wait_up()  # 2-step launch is not covered by the steps=5 fault


def test_hang_start_never_binds(sim_process: type[SimProcess]) -> None:
    p = sim_process([*FAST, "--sim-fault-hang-start"])
    time.sleep(2.5)  # well past the 1 s restart
    assert p.proc.poll() is None
    assert not p.port_open()


def test_crash_after_and_slow_responses(sim_process: type[SimProcess]) -> None:
    p = sim_process([*FAST, "--sim-fault-crash-after-s", "1.5", "--sim-fault-slow-ms", "200"])
    p.wait_up()
    t = time.monotonic()
    assert httpx.get(f"{p.url}/health").status_code == 200
    assert time.monotonic() - t >= 0.2
    assert p.proc.wait(10) == 1


def test_rejected_flags_exit_1_without_binding(sim_process: type[SimProcess]) -> None:
    p = sim_process(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
                     "--speculative-eagle-topk", "2"])  # fmt: skip
    assert p.proc.wait(15) == 1
    assert "ValueError" in p.output()
    p2 = sim_process(["--bogus-flag"])
    assert p2.proc.wait(15) == 2


def test_pause_then_sigterm_under_internal_load_exits_promptly(
    sim_process: type[SimProcess],
) -> None:
    """The in-server clients stop sending while generation is paused (SGLang's /ready is 503 then,
    so a router sends nothing new), so a SIGTERM after /pause_generation drains at once instead
    of waiting for requests that a paused engine never finishes."""
    p = sim_process(FAST)
    p.wait_up()
    load = {"concurrency": 8, "max_new_tokens": 5000}  # long: none finishes within the test
    assert httpx.post(f"{p.url}/sim/load", json=load).json()["in_flight"] == 8

    def in_flight() -> int:
        return int(httpx.get(f"{p.url}/sim/load").json()["in_flight"])

    paused = httpx.post(f"{p.url}/pause_generation", json={"mode": "abort"})
    assert paused.status_code == 200
    time.sleep(0.3)  # many decode-loop ticks
    assert in_flight() == 0
    # Resuming brings the clients back.
    assert httpx.post(f"{p.url}/continue_generation").status_code == 200
    deadline = time.monotonic() + 5
    while in_flight() < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert in_flight() == 8

    assert httpx.post(f"{p.url}/pause_generation", json={"mode": "abort"}).status_code == 200
    t0 = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(5) == 0  # a stop timeout of minutes would otherwise end in SIGKILL
    assert time.monotonic() - t0 < 3.0
