"""Closed-loop load against an SGLang server (the simulator or a real one), tagged by workload.

Owns: `LoadGenerator` (C clients, each keeping one request open; concurrency and workload mix
can change while it runs), `run_load` (the one-shot form) and the `python -m simulator.load`
CLI. Each request carries its workload as a custom label (`custom_labels` in the /generate body,
the `x-custom-labels` header on the OpenAI routes). Requests that fail (connection refused while
the server restarts, 5xx, timeouts) are counted, backed off exponentially and retried.
Must not: import the simulator's engine or model (it talks HTTP only), or read its clock for
anything but back-off and the run's duration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

DEFAULT_PROMPT_TOKENS = 256
# Back-off between failed attempts of one client (wall seconds): doubles from the first value
# up to the cap, with +-50% jitter so that clients do not retry in lockstep after a restart.
BACKOFF_FIRST_S = 0.05
BACKOFF_CAP_S = 2.0
DEFAULT_TIMEOUT_S = 600.0
# "generate" | "chat" | "completions": one HTTP request per simulated request (works against a
# real server too). "internal": the simulator's own closed loop (POST /sim/load), driven and
# re-armed after every restart from here; for speeds where HTTP per request cannot keep up.
ROUTES = ("generate", "chat", "completions", "internal")
INTERNAL_POLL_S = 0.25
# Filler prompt: "tok " is one token for the simulator (~4 characters per token) and close to
# one for real tokenizers.
PROMPT_WORD = "tok "


def parse_mix(text: str) -> dict[str, float]:
    """ "chat=0.7,code=0.3" -> {"chat": 0.7, "code": 0.3}; a bare name weighs 1."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, raw = part.partition("=")
        name = name.strip()
        if not name:
            raise ValueError(f"workload mix {text!r}: empty workload name")
        try:
            weight = float(raw) if sep else 1.0
        except ValueError as e:
            raise ValueError(f"workload mix {text!r}: bad weight for {name!r}") from e
        mix[name] = weight
    return validate_mix(mix)


def validate_mix(mix: Mapping[str, float]) -> dict[str, float]:
    out = {str(k): float(v) for k, v in mix.items()}
    if not out:
        raise ValueError("workload mix is empty")
    if any(not (v >= 0) or v == float("inf") for v in out.values()):
        raise ValueError(f"workload weights must be finite and >= 0: {out}")
    if sum(out.values()) <= 0:
        raise ValueError(f"workload weights must not all be 0: {out}")
    return out


@dataclass
class WorkloadStats:
    ok: int = 0
    output_tokens: int = 0


@dataclass
class LoadStats:
    """Counters of one load run (attempts that failed are counted once each)."""

    ok: int = 0
    failed: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    duration_s: float = 0.0
    last_error: str | None = None
    per_workload: dict[str, WorkloadStats] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["output_tok_s"] = self.output_tok_s
        return d


class LoadGenerator:
    """`concurrency` closed-loop clients; change concurrency and mix while `run()` runs."""

    def __init__(
        self,
        url: str,
        *,
        concurrency: int = 1,
        mix: Mapping[str, float] | None = None,
        max_new_tokens: int | None = None,
        prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
        route: str = "generate",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        seed: int = 0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)} (got {route!r})")
        if prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.url = url.rstrip("/")
        self.route = route
        self.max_new_tokens = max_new_tokens
        self.prompt_tokens = prompt_tokens
        self.prompt = PROMPT_WORD * prompt_tokens
        self._remote_seen: dict[str, int] = {}
        self.timeout_s = timeout_s
        self.stats = LoadStats()
        self._workers: dict[int, asyncio.Task[None]] = {}
        self._running = False
        self._concurrency = 0
        self.set_concurrency(concurrency)
        self._names: list[str] = []
        self._weights: list[float] = []
        self.set_mix(mix or {"default": 1.0})
        self._rng = random.Random(seed)
        self._client = client
        self._own_client = client is None
        self._stop = asyncio.Event()

    # ---- live controls ------------------------------------------------------------------------
    @property
    def concurrency(self) -> int:
        return self._concurrency

    @property
    def mix(self) -> dict[str, float]:
        return dict(zip(self._names, self._weights, strict=True))

    def set_concurrency(self, concurrency: int) -> None:
        """Clients above the new level finish their current request, then leave."""
        if concurrency < 0:
            raise ValueError(f"concurrency must be >= 0 (got {concurrency})")
        self._concurrency = int(concurrency)
        if self._running:
            self._spawn()

    def set_mix(self, mix: Mapping[str, float]) -> None:
        valid = validate_mix(mix)
        self._names = list(valid)
        self._weights = list(valid.values())

    # ---- running --------------------------------------------------------------------------
    async def run(self, duration_s: float | None = None) -> LoadStats:
        """Run until stop() (or for `duration_s` wall seconds); returns the stats."""
        if self._running:
            raise RuntimeError("LoadGenerator is already running")
        self._running = True
        self._stop.clear()
        t0 = time.monotonic()
        client = self._client or httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self._client = client
        try:
            if self.route == "internal":
                self._workers[0] = asyncio.create_task(self._internal_driver())
            else:
                self._spawn()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=duration_s)
            if self.route == "internal":
                await self._internal_stop(client)
        finally:
            workers = list(self._workers.values())
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self._workers.clear()
            self.stats.duration_s += time.monotonic() - t0
            self._running = False
            if self._own_client:
                await client.aclose()
                self._client = None
        return self.stats

    async def stop(self) -> None:
        self._stop.set()

    def _spawn(self) -> None:
        if self.route == "internal":
            return  # the driver pushes the new level on its next poll
        for i in range(self._concurrency):
            task = self._workers.get(i)
            if task is None or task.done():
                self._workers[i] = asyncio.create_task(self._worker(i))

    async def _worker(self, index: int) -> None:
        backoff = BACKOFF_FIRST_S
        while index < self._concurrency and not self._stop.is_set():
            workload = self._rng.choices(self._names, self._weights)[0]
            try:
                tokens, prompt = await self._one(workload)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.stats.failed += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                await asyncio.sleep(backoff * self._rng.uniform(0.5, 1.5))
                backoff = min(backoff * 2, BACKOFF_CAP_S)
                continue
            backoff = BACKOFF_FIRST_S
            self.stats.ok += 1
            self.stats.output_tokens += tokens
            self.stats.prompt_tokens += prompt
            w = self.stats.per_workload.setdefault(workload, WorkloadStats())
            w.ok += 1
            w.output_tokens += tokens

    # ---- internal (in-server) closed loop ---------------------------------------------------
    def _internal_config(self) -> dict[str, Any]:
        return {
            "concurrency": self._concurrency,
            "mix": self.mix,
            "prompt_tokens": self.prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
        }

    def _absorb(self, remote: Mapping[str, Any]) -> None:
        """Fold the server's cumulative counters into the stats (a restarted server starts
        from 0 again: its counters are then all new)."""
        seen = self._remote_seen
        if remote["ok"] < seen.get("ok", 0):
            seen.clear()
        self.stats.ok += remote["ok"] - seen.get("ok", 0)
        self.stats.output_tokens += remote["output_tokens"] - seen.get("output_tokens", 0)
        for name, w in remote["per_workload"].items():
            key_ok, key_tok = f"{name}/ok", f"{name}/tok"
            mine = self.stats.per_workload.setdefault(name, WorkloadStats())
            mine.ok += w["ok"] - seen.get(key_ok, 0)
            mine.output_tokens += w["output_tokens"] - seen.get(key_tok, 0)
            seen[key_ok], seen[key_tok] = w["ok"], w["output_tokens"]
        seen["ok"], seen["output_tokens"] = remote["ok"], remote["output_tokens"]

    async def _internal_driver(self) -> None:
        assert self._client is not None
        self._remote_seen = {}
        backoff = BACKOFF_FIRST_S
        while not self._stop.is_set():
            try:
                r = await self._client.get(f"{self.url}/sim/load")
                r.raise_for_status()
                remote = r.json()
                self._absorb(remote)
                want = self._internal_config()
                if any(remote[k] != v for k, v in want.items()):
                    p = await self._client.post(f"{self.url}/sim/load", json=want)
                    p.raise_for_status()
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.stats.failed += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_CAP_S)
                continue
            backoff = BACKOFF_FIRST_S
            await asyncio.sleep(INTERNAL_POLL_S)

    async def _internal_stop(self, client: httpx.AsyncClient) -> None:
        """Stop the in-server clients and take the final counts (best effort)."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            r = await client.post(
                f"{self.url}/sim/load", json={**self._internal_config(), "concurrency": 0}
            )
            r.raise_for_status()
            self._absorb(r.json())

    async def _one(self, workload: str) -> tuple[int, int]:
        """One request; (completion tokens, prompt tokens) or an exception."""
        assert self._client is not None
        labels = {"workload": workload}
        if self.route == "generate":
            body: dict[str, Any] = {"text": self.prompt, "custom_labels": labels}
            if self.max_new_tokens is not None:
                body["sampling_params"] = {"max_new_tokens": self.max_new_tokens}
            r = await self._client.post(f"{self.url}/generate", json=body)
            r.raise_for_status()
            meta = r.json()["meta_info"]
            return int(meta["completion_tokens"]), int(meta["prompt_tokens"])
        headers = {"x-custom-labels": json.dumps(labels)}
        body = {"model": "default"}
        if self.route == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = self.prompt
            path = "/v1/completions"
        if self.max_new_tokens is not None:
            body["max_tokens"] = self.max_new_tokens
        r = await self._client.post(f"{self.url}{path}", json=body, headers=headers)
        r.raise_for_status()
        usage = r.json()["usage"]
        return int(usage["completion_tokens"]), int(usage["prompt_tokens"])


async def run_load(
    url: str,
    concurrency: int,
    mix: Mapping[str, float] | str,
    duration_s: float,
    *,
    max_new_tokens: int | None = None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    route: str = "generate",
    seed: int = 0,
    stop_event: asyncio.Event | None = None,
) -> LoadStats:
    """Run closed-loop load for `duration_s` wall seconds (or until `stop_event` is set)."""
    gen = LoadGenerator(
        url,
        concurrency=concurrency,
        mix=parse_mix(mix) if isinstance(mix, str) else mix,
        max_new_tokens=max_new_tokens,
        prompt_tokens=prompt_tokens,
        route=route,
        seed=seed,
    )
    if stop_event is None:
        return await gen.run(duration_s)

    async def relay() -> None:
        await stop_event.wait()
        await gen.stop()

    watcher = asyncio.create_task(relay())
    try:
        return await gen.run(duration_s)
    finally:
        watcher.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m simulator.load", description="Closed-loop load, tagged by workload."
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workload", default="default", help="mix, e.g. chat=0.7,code=0.3")
    p.add_argument("--duration-s", type=float, required=True, help="wall seconds")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    p.add_argument("--route", choices=ROUTES, default="generate")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    try:
        mix = parse_mix(ns.workload)
        if ns.concurrency < 0 or ns.duration_s <= 0:
            raise ValueError("--concurrency must be >= 0 and --duration-s > 0")
        stats = asyncio.run(
            run_load(
                ns.url,
                ns.concurrency,
                mix,
                ns.duration_s,
                max_new_tokens=ns.max_new_tokens,
                prompt_tokens=ns.prompt_tokens,
                route=ns.route,
                seed=ns.seed,
            )
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
