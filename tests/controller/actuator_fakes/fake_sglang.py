"""A minimal SGLang-like server for actuator tests that the simulator cannot play.

Speaks /ready, /health_generate, /server_info (flags -> SGLang's resolved keys), /v1/loads and
/pause_generation, /continue_generation. Behaviour knobs come from the environment, so the
launch flags stay SGLang's:
FAKE_IGNORE_SIGTERM=1 (the process and its child ignore SIGTERM), FAKE_CHILD=1 (spawn a child,
as SGLang spawns schedulers), FAKE_IN_FLIGHT=N (requests reported in flight until
/pause_generation), FAKE_EVENTS=path (append one line per /pause_generation),
FAKE_REPORT_STEPS=N (report this speculative_num_steps whatever the flags say),
FAKE_ZOMBIE_LEADER_S=S (the main thread exits at once, so the process leader shows as a zombie
while the server's threads run; SIGTERM, taken by a thread, ends the process S real seconds
later, as a multi-threaded server's teardown does), FAKE_PORT_HOLDER_S=S (a detached process,
outside the server's tree and process group, holds the listening socket until S real seconds
after the server is gone).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil

# Real seconds a detached port holder lives at most, whatever happens to the test.
_HOLDER_MAX_S = 60.0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _detach_port_holder(linger_s: float) -> None:
    """Double fork (before any thread exists): the grandchild leads its own session, is nobody's
    descendant, and keeps the inherited listening socket open until `linger_s` after we die."""
    server_pid = os.getpid()
    middle = os.fork()
    if middle:
        os.waitpid(middle, 0)
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    end = time.monotonic() + _HOLDER_MAX_S
    while not _gone(server_pid) and time.monotonic() < end:
        time.sleep(0.02)
    time.sleep(min(linger_s, max(0.0, end - time.monotonic())))
    os._exit(0)


def _serve_with_zombie_leader(server: ThreadingHTTPServer, linger_s: float) -> None:
    # Blocked before any thread starts, so every thread inherits the mask and only sigwait
    # takes SIGTERM.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def on_sigterm() -> None:
        signal.sigwait({signal.SIGTERM})
        time.sleep(linger_s)
        os._exit(0)

    threading.Thread(target=on_sigterm).start()
    threading.Thread(target=server.serve_forever).start()
    # ctypes releases the GIL for the call, so the other threads keep running Python.
    ctypes.CDLL(None).pthread_exit(None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", default="fake")
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    args, _unknown = p.parse_known_args()
    if os.environ.get("FAKE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("FAKE_CHILD") == "1":
        # Inherits SIG_IGN for SIGTERM when set above: only SIGKILL stops it.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    steps = args.speculative_num_steps
    if os.environ.get("FAKE_REPORT_STEPS"):
        steps = int(os.environ["FAKE_REPORT_STEPS"])
    info = {
        "model_path": args.model_path,
        "port": args.port,
        "speculative_algorithm": args.speculative_algorithm,
        "speculative_num_steps": steps,
        "speculative_eagle_topk": args.speculative_eagle_topk,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
        "speculative_adaptive": False,
        "version": "0.5.23",
    }
    state = {"in_flight": int(os.environ.get("FAKE_IN_FLIGHT", "0")), "paused": False}
    events = os.environ.get("FAKE_EVENTS")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _json(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in ("/ready", "/health_generate", "/health"):
                self._json(503 if state["paused"] else 200, {})
            elif path == "/server_info":
                self._json(200, info)
            elif path == "/v1/loads":
                n = 0 if state["paused"] else state["in_flight"]
                self._json(
                    200, {"loads": [{"dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0}]}
                )
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode() if length else ""
            if self.path == "/pause_generation":
                state["paused"] = True
                if events:
                    with open(events, "a") as fh:
                        fh.write(f"pause {body}\n")
                self._json(200, {"status": "ok"})
            elif self.path == "/continue_generation":
                state["paused"] = False
                if events:
                    with open(events, "a") as fh:
                        fh.write("continue\n")
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"detail": "Not Found"})

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    if os.environ.get("FAKE_PORT_HOLDER_S"):
        _detach_port_holder(float(os.environ["FAKE_PORT_HOLDER_S"]))
    print(f"fake sglang on {args.host}:{args.port} pid {os.getpid()}", flush=True)
    if os.environ.get("FAKE_ZOMBIE_LEADER_S"):
        _serve_with_zombie_leader(server, float(os.environ["FAKE_ZOMBIE_LEADER_S"]))
    server.serve_forever()


if __name__ == "__main__":
    main()
