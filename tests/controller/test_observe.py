"""controller.observe: fixtures of three SGLang eras, TP/DP folding, missing and garbage input."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from controller import observe
from controller.observe import ObserveError, parse_exposition, snapshot_to_json
from controller.observe_fixtures import synth_large_exposition
from policies.types import UNLABELLED, Snapshot

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _parse(name: str) -> Snapshot:
    return parse_exposition((FIXTURES / name).read_text(), profile="p", t_s=10.0)


def test_0523_dp_attention_priority_fixture() -> None:
    s = _parse("sglang-0.5.23-dpattn2-priority.prom")
    assert (s.t_s, s.profile) == (10.0, "p")
    # DP rank 0 reports on tp_rank 0, DP rank 1 on tp_rank 4; tp 1/5 duplicates and the
    # per-priority breakdowns are dropped.
    assert s.running_reqs == 32.0
    assert s.queue_reqs == 6.0
    # DP rank 1's gen_throughput is NaN: the sum is missing, not 1200.
    assert s.gen_throughput_tok_s is None
    # weighted by running requests: (2.0 * 24 + 3.0 * 8) / 32
    assert s.spec_accept_length == pytest.approx(2.25)
    assert s.spec_accept_rate == pytest.approx((0.5 * 24 + 1.0 * 8) / 32)
    assert s.spec_num_steps == 2.0
    assert s.decode_tokens == 50000.0 + 20000.0  # mode="decode" only
    assert s.decode_passes == 9000.0 + 1000.0 + 4000.0  # decode_cuda_graph + decode_none
    # tokenizer counters: summed over is_streaming and priority, per workload
    assert dict(s.generation_tokens) == {"code": 40000.0, "chat": 15000.0, UNLABELLED: 5000.0}
    assert dict(s.verify_calls) == {"code": 13000.0, "chat": 7500.0, UNLABELLED: 2500.0}
    assert dict(s.requests) == {"code": 100.0, "chat": 60.0}
    assert s.moments is None  # /metrics alone never carries decode_moments


def test_046_fixture_missing_families_are_none() -> None:
    s = _parse("sglang-0.4.6-eagle-tp1.prom")
    assert s.running_reqs == 12.0
    assert s.queue_reqs == 0.0  # a real zero stays zero
    assert s.gen_throughput_tok_s == pytest.approx(1543.2)
    assert s.spec_accept_length == pytest.approx(3.12)
    # families that 0.4.6 did not have
    assert s.spec_accept_rate is None
    assert s.spec_num_steps is None
    assert s.decode_tokens is None
    assert s.decode_passes is None
    assert dict(s.verify_calls) == {}
    # no workload label at all in 0.4.x: everything is unlabelled
    assert dict(s.generation_tokens) == {UNLABELLED: 251904.0}
    assert dict(s.requests) == {UNLABELLED: 1024.0}


def test_0410_dp_fixture_without_help_lines() -> None:
    s = _parse("sglang-0.4.10-dp2.prom")
    assert s.running_reqs == 40.0
    assert s.queue_reqs == 3.0
    assert s.gen_throughput_tok_s == 2800.0
    assert s.spec_accept_length == pytest.approx((3.0 * 30 + 2.0 * 10) / 40)
    assert s.spec_accept_rate is None
    assert dict(s.generation_tokens) == {UNLABELLED: 40000.0}
    assert dict(s.verify_calls) == {}


def test_partial_dump_only_tokenizer() -> None:
    s = _parse("sglang-0.5.23-partial-tokenizer-only.prom")
    for field in (
        "running_reqs",
        "queue_reqs",
        "gen_throughput_tok_s",
        "spec_accept_length",
        "spec_accept_rate",
        "spec_num_steps",
        "decode_tokens",
        "decode_passes",
    ):
        assert getattr(s, field) is None, field
    assert dict(s.generation_tokens) == {UNLABELLED: 1234.0}
    assert dict(s.verify_calls) == {UNLABELLED: 600.0}
    assert dict(s.requests) == {}


def test_every_fixture_parses_and_serialises() -> None:
    files = sorted(FIXTURES.glob("*.prom"))
    assert len(files) >= 4
    for f in files:
        s = parse_exposition(f.read_text(), profile="p", t_s=0.0)
        json.dumps(snapshot_to_json(s), allow_nan=False)


def test_synth_tp8_all_ranks_fold_to_tp0() -> None:
    s = parse_exposition(synth_large_exposition(tp=8, workloads=6), profile="p", t_s=0.0)
    assert s.running_reqs == 32.0  # other TP ranks report 132, 232, ...
    assert s.queue_reqs == 3.0
    assert s.gen_throughput_tok_s == 900.0
    assert s.spec_accept_length == 2.5
    assert s.spec_accept_rate == pytest.approx(0.6)
    assert s.spec_num_steps == 3.0
    assert s.decode_tokens == 3e5  # third realtime mode ("decode") of rank 0
    assert s.decode_passes == 1e5 + 2e5
    assert set(s.generation_tokens) == {"chat", "code", "math", "summarize", "agent", UNLABELLED}
    assert s.generation_tokens["code"] == 2000.0
    assert s.verify_calls[UNLABELLED] == 400.0 * 6 * 1.5


def test_synth_dp2_sums_and_weights() -> None:
    s = parse_exposition(synth_large_exposition(tp=4, workloads=2, dp=2), profile="p", t_s=0.0)
    assert s.running_reqs == 32.0 + 36.0
    assert s.queue_reqs == 3.0 + 4.0
    assert s.gen_throughput_tok_s == 900.0 + 910.0
    assert s.spec_accept_length == pytest.approx((2.5 * 32 + 2.75 * 36) / 68)
    assert s.decode_tokens == 3e5 * 1 + 3e5 * 2


def test_synth_size_and_determinism() -> None:
    a = synth_large_exposition()
    assert a == synth_large_exposition()
    size = len(a.encode())
    print(f"synthetic exposition: {size / 1024:.1f} KiB, {a.count(chr(10))} lines")
    assert 100_000 <= size <= 180_000
    with pytest.raises(ValueError):
        synth_large_exposition(tp=0)


def _full_fold(text: str) -> Snapshot:
    """Reference path: parse everything (no line filter), then fold."""
    f = observe._fold(text_string_to_metric_families(text), "workload")
    return Snapshot(
        t_s=0.0,
        profile="p",
        running_reqs=f.gauges["running_reqs"],
        queue_reqs=f.gauges["queue_reqs"],
        gen_throughput_tok_s=f.gauges["gen_throughput_tok_s"],
        spec_accept_length=f.gauges["spec_accept_length"],
        spec_accept_rate=f.gauges["spec_accept_rate"],
        spec_num_steps=f.gauges["spec_num_steps"],
        generation_tokens=f.tokenizer["generation_tokens"],
        verify_calls=f.tokenizer["verify_calls"],
        requests=f.tokenizer["requests"],
        decode_tokens=f.counters["decode_tokens"],
        decode_passes=f.counters["decode_passes"],
    )


@pytest.mark.parametrize(
    "text",
    [
        *(p.read_text() for p in sorted(FIXTURES.glob("sglang-*.prom"))),
        synth_large_exposition(tp=8, workloads=6),
        synth_large_exposition(tp=2, workloads=3, dp=3),
    ],
)
def test_line_filter_changes_nothing(text: str) -> None:
    """The pre-parse filter is an optimisation: same Snapshot as parsing everything."""
    assert parse_exposition(text, profile="p", t_s=0.0) == _full_fold(text)


def test_empty_and_unrelated_text_is_all_missing() -> None:
    for text in ("", "\n\n", '# TYPE other_metric gauge\nother_metric{a="b"} 1.0\n'):
        s = parse_exposition(text, profile="p", t_s=1.0)
        assert s.running_reqs is None and s.decode_tokens is None
        assert dict(s.generation_tokens) == {}


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>",
        '{"error": "not found"}',
        'sglang:num_running_reqs{tp_rank="0"} twelve\n',
        'sglang:num_running_reqs{tp_rank="0",model_name="m',  # truncated mid-line
        "sglang:generation_tokens_total{workload=code} 5\n",  # unquoted label value
        "\x00\x01\x02binary",
    ],
)
def test_garbage_raises_observe_error(text: str) -> None:
    with pytest.raises(ObserveError):
        parse_exposition(text, profile="p", t_s=0.0)


def test_non_str_raises_observe_error() -> None:
    with pytest.raises(ObserveError):
        parse_exposition(b"sglang:num_running_reqs 1\n", profile="p", t_s=0.0)  # type: ignore[arg-type]


def test_non_finite_values_are_missing() -> None:
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{tp_rank="0"} +Inf\n'
        "# TYPE sglang:spec_accept_length gauge\n"
        'sglang:spec_accept_length{tp_rank="0"} NaN\n'
        "# TYPE sglang:generation_tokens_total counter\n"
        'sglang:generation_tokens_total{workload="code"} NaN\n'
        'sglang:generation_tokens_total{workload="chat"} 7\n'
    )
    s = parse_exposition(text, profile="p", t_s=0.0)
    assert s.running_reqs is None
    assert s.spec_accept_length is None
    assert dict(s.generation_tokens) == {"chat": 7.0}
    out = snapshot_to_json(s)
    assert out["running_reqs"] is None
    json.dumps(out, allow_nan=False)


def test_startup_gauge_is_the_engines_boot() -> None:
    # The simulator's exposition (SGLang 0.5.23's families and labels): tokenizer_e2e.
    assert _parse("sim-baseline.prom").startup_s == pytest.approx(95.65217391304347)
    # Eras without the gauge: missing, never 0.
    assert _parse("sglang-0.4.6-eagle-tp1.prom").startup_s is None

    def startup(*lines: str) -> float | None:
        text = "# TYPE sglang:startup_time_seconds gauge\n" + "".join(
            f"sglang:startup_time_seconds{{{ln}\n" for ln in lines
        )
        return parse_exposition(text, profile="p", t_s=0.0).startup_s

    # tokenizer_e2e (launch to ready) over scheduler_e2e, whatever the order.
    assert startup('phase="scheduler_e2e"} 90', 'phase="tokenizer_e2e"} 120') == 120.0
    assert startup('phase="load_weight"} 60', 'phase="scheduler_e2e"} 90') == 90.0
    # Several series of one phase (custom label sets): the slowest.
    assert startup('a="1",phase="tokenizer_e2e"} 80', 'a="2",phase="tokenizer_e2e"} 85') == 85.0
    # A gauge not set yet (0), a NaN, or only phases that are parts of the boot: unknown.
    assert startup('phase="tokenizer_e2e"} 0') is None
    assert startup('a="1",phase="tokenizer_e2e"} NaN', 'a="2",phase="tokenizer_e2e"} 85') is None
    assert startup('phase="load_weight"} 60') is None
    assert snapshot_to_json(_parse("sim-baseline.prom"))["startup_s"] == pytest.approx(95.652, 1e-4)


def test_custom_workload_label_name() -> None:
    text = (
        "# TYPE sglang:generation_tokens_total counter\n"
        'sglang:generation_tokens_total{tenant="a",workload="x"} 3\n'
        'sglang:generation_tokens_total{tenant="b",workload="x"} 4\n'
    )
    s = parse_exposition(text, profile="p", t_s=0.0, workload_label="tenant")
    assert dict(s.generation_tokens) == {"a": 3.0, "b": 4.0}


def _counter_text(gen: float, verify: float, decode: float) -> str:
    return (
        "# TYPE sglang:generation_tokens_total counter\n"
        f'sglang:generation_tokens_total{{workload="code"}} {gen}\n'
        "# TYPE sglang:spec_verify_calls_total counter\n"
        f'sglang:spec_verify_calls_total{{workload="code"}} {verify}\n'
        "# TYPE sglang:realtime_tokens_total counter\n"
        f'sglang:realtime_tokens_total{{mode="decode",tp_rank="0"}} {decode}\n'
    )


def test_counter_reset_is_visible_in_snapshots() -> None:
    """A restart between scrapes makes cumulative counters go backwards; the Snapshot reports
    what the server says (no clamping), so diff() can detect the reset."""
    before = parse_exposition(_counter_text(90000, 30000, 95000), profile="p", t_s=0.0)
    after = parse_exposition(_counter_text(1200, 400, 1300), profile="p", t_s=5.0)
    assert after.generation_tokens["code"] < before.generation_tokens["code"]
    assert after.decode_tokens is not None and before.decode_tokens is not None
    assert after.decode_tokens < before.decode_tokens
    if importlib.util.find_spec("policies.observation") is not None:
        from policies.observation import diff  # written by another helper

        obs = diff(before, after)
        assert obs.counter_reset
        assert obs.decode_tokens == 1300.0  # a reset restarts from 0: delta = cur


def test_snapshot_to_json_shape() -> None:
    s = Snapshot(
        t_s=1.0,
        profile="eagle3-2",
        running_reqs=4.0,
        generation_tokens={"b": 2.0, "a": 1.0},
        moments=(10.0, 40.0, 0.2, 200.0, 0.8, 25.0),
        accepted_drafts_hist=(1.0, 2.0, 3.0),
    )
    d = snapshot_to_json(s)
    assert d["moments"] == {
        "n_steps": 10.0,
        "sum_bs": 40.0,
        "sum_step_s": 0.2,
        "sum_bs2": 200.0,
        "sum_bs_step_s": 0.8,
        "sum_generated": 25.0,
    }
    assert list(d["generation_tokens"]) == ["a", "b"]
    assert d["accepted_drafts_hist"] == [1.0, 2.0, 3.0]
    assert d["queue_reqs"] is None and d["max_running_reqs"] is None
    assert json.loads(observe.snapshot_json_dumps(s)) == d
    assert not any(isinstance(v, float) and math.isnan(v) for v in d.values())


_series = st.tuples(
    st.sampled_from(
        [
            "sglang:num_running_reqs",
            "sglang:spec_accept_length",
            "sglang:gen_throughput",
            "sglang:realtime_tokens_total",
            "sglang:cuda_graph_passes_total",
            "sglang:generation_tokens_total",
        ]
    ),
    st.integers(0, 2),  # dp_rank
    st.integers(0, 7),  # tp_rank
    st.integers(0, 1),  # pp_rank
    st.sampled_from(["", "", "1", "7"]),  # priority
    st.sampled_from(["decode", "prefill_compute", "decode_cuda_graph", "decode_none"]),
    st.sampled_from(["code", "chat", ""]),  # workload
    st.one_of(st.floats(0, 1e6, allow_nan=False), st.just(float("nan"))),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_series, max_size=40, unique_by=lambda t: t[:7]))
@example(  # DP ranks read in another order: a plain sum moved the last bit of the total
    [
        ("sglang:gen_throughput", 0, 0, 0, "", "decode", "code", 338057.9945108507),
        ("sglang:gen_throughput", 1, 0, 1, "", "decode", "code", float("nan")),
        ("sglang:gen_throughput", 2, 0, 0, "", "decode", "code", 186231.0),
        ("sglang:gen_throughput", 1, 0, 0, "", "decode", "code", 1.5528588333399966),
    ]
)
def test_line_filter_is_equivalent_on_random_layouts(series: list[tuple]) -> None:
    lines = []
    for name, dp, tp, pp, prio, mode, wl, value in series:
        if name.startswith("sglang:generation_tokens"):
            labels = f'priority="{prio}",workload="{wl}"'
        else:
            labels = f'dp_rank="{dp}",mode="{mode}",pp_rank="{pp}",priority="{prio}",tp_rank="{tp}"'
        lines.append(f"{name}{{{labels}}} {value!r}".replace("nan", "NaN"))
    text = "\n".join(lines) + "\n"
    a, b = parse_exposition(text, profile="p", t_s=0.0), _full_fold(text)
    assert json.dumps(snapshot_to_json(a), sort_keys=True) == json.dumps(
        snapshot_to_json(b), sort_keys=True
    )
