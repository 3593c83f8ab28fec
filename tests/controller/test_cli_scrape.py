"""`specpilot scrape`: real expositions print the JSON as before (no warning), anything that is
not one (binary, empty, another service's /metrics) is one error and a non-zero exit, impossible
data is warned about on stderr, and --no-json prints a table."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.observe import exposition_warnings, parse_exposition, snapshot_to_json

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROMS = sorted(FIXTURES.glob("*.prom"))
runner = CliRunner()


def cli(*args: str) -> Any:
    return runner.invoke(app, ["scrape", *args], env={"COLUMNS": "200"})


@pytest.mark.parametrize("path", PROMS, ids=lambda p: p.stem)
def test_real_expositions_print_the_same_json_and_no_warning(path: Path) -> None:
    r = cli("--file", str(path))
    assert r.exit_code == 0, r.output
    expected = snapshot_to_json(parse_exposition(path.read_text(), profile="?", t_s=0.0))
    assert json.loads(r.stdout) == expected
    assert "warning" not in r.output
    assert cli("--file", str(path), "--json").stdout == r.stdout


def test_a_partial_capture_prints_null_for_what_it_lacks() -> None:
    r = cli("--file", str(FIXTURES / "sglang-0.4.6-eagle-tp1.prom"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["spec_num_steps"] is None and out["spec_accept_length"] == pytest.approx(3.12)


def test_no_json_prints_a_table() -> None:
    r = cli("--file", str(FIXTURES / "sglang-0.4.6-eagle-tp1.prom"), "--no-json")
    assert r.exit_code == 0, r.output
    assert not r.stdout.lstrip().startswith("{")
    lines = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines() if ln.strip()}
    assert lines["spec_accept_length"] == ["3.12"]
    assert lines["spec_num_steps"] == ["-"]
    assert lines["requests"] == ["_unlabelled=1024"]


def test_binary_file_is_one_error_naming_it(tmp_path: Path) -> None:
    p = tmp_path / "random.bin"
    p.write_bytes(bytes(range(128, 256)) * 4)
    r = cli("--file", str(p))
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert f"{p}: not UTF-8 text" in r.output


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        ("# HELP up whether\n# TYPE up gauge\nup 1\nprocess_cpu_seconds_total 3.5\n", "holds no"),
    ],
)
def test_no_sglang_metrics_is_an_error(tmp_path: Path, text: str, what: str) -> None:
    p = tmp_path / "capture.prom"
    p.write_text(text)
    r = cli("--file", str(p))
    assert r.exit_code == 1, r.output
    assert f"no SGLang metrics found in {p}: it {what}" in r.output
    assert "null" not in r.stdout


class _Metrics(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/metrics":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, type[_Metrics]]]:
    handler = type("H", (_Metrics,), {})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_url_that_is_not_sglang_is_an_error(metrics_server: tuple[str, Any]) -> None:
    url, handler = metrics_server
    handler.body = b"# TYPE node_load1 gauge\nnode_load1 0.5\n"
    r = cli("--url", url)
    assert r.exit_code == 1, r.output
    assert f"no SGLang metrics found in {url}/metrics" in r.output


def test_a_url_with_sglang_metrics_prints_json(metrics_server: tuple[str, Any]) -> None:
    url, handler = metrics_server
    path = FIXTURES / "sglang-0.5.23-dpattn2-priority.prom"
    handler.body = path.read_bytes()
    r = cli("--url", url)
    assert r.exit_code == 0, r.output
    expected = snapshot_to_json(parse_exposition(path.read_text(), profile="?", t_s=0.0))
    assert json.loads(r.stdout) == expected


IMPOSSIBLE = """\
sglang:num_running_reqs{tp_rank="0"} 3
sglang:num_running_reqs{tp_rank="0"} 3
sglang:num_queue_reqs{tp_rank="0"} -2
sglang:spec_num_steps{tp_rank="0"} 2
sglang:spec_accept_length{tp_rank="0"} 7
sglang:spec_accept_rate{tp_rank="0"} 3
sglang:generation_tokens_total{workload="chat"} -10
"""


def test_impossible_data_is_warned_about_on_stderr(tmp_path: Path) -> None:
    p = tmp_path / "odd.prom"
    p.write_text(IMPOSSIBLE)
    r = cli("--file", str(p))
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # the JSON is still printed, on stdout alone
    warnings = [ln for ln in r.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 5, r.stderr
    text = "\n".join(warnings)
    assert 'sglang:num_running_reqs{tp_rank="0"} appears 2 times' in text
    assert 'sglang:num_queue_reqs{tp_rank="0"} is negative (-2)' in text
    assert "generation_tokens_total" in text and "is negative (-10)" in text
    assert "more than spec_num_steps + 1 = 3" in text
    assert "an accept rate is a fraction in [0, 1]" in text


def test_exposition_warnings_bounds() -> None:
    assert exposition_warnings("sglang:spec_accept_length 0\n") == []  # idle server
    assert exposition_warnings("sglang:spec_accept_length 2.5\n") == []
    assert exposition_warnings("not prometheus {{{\n") == []
    (w,) = exposition_warnings("sglang:spec_accept_length 0.5\n")
    assert ">= 1" in w
    (w,) = exposition_warnings("sglang:spec_accept_length 1e9\n")
    assert "absurd" in w
    # A TP duplicate the fold drops is not what specpilot reads: no warning for it.
    text = 'sglang:spec_accept_length{tp_rank="0"} 2\nsglang:spec_accept_length{tp_rank="1"} 900\n'
    assert exposition_warnings(text) == []
