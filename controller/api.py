"""The REST API and the controller's /metrics, as a FastAPI app over one Controller.

Owns the HTTP surface: read endpoints (status, estimates, decisions, switches, findings,
profiles, healthz), write endpoints behind a bearer token (pin, pause, mode, trial abort, one-off
switch, clearing a block), request/response models with field-level 422s (strict numbers; unknown
query parameters of a GET that takes some are 422 too, never silently ignored), and the mapping of
controller errors to 404/409 (store errors to 503). Must not decide or act itself: it calls
Controller operations.

Threading: handlers that touch the Controller's in-memory state (views, operator operations,
/metrics) are `async def`, so they run on the event loop between ticks and never race the
loop; history reads are plain `def` handlers (FastAPI runs them in its thread pool) on a
read-only connection of their own (`store.Reader`), never the writer's.
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations at
# definition time, and `Actor` is local to create_app.
import hmac
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from controller.loop import ConflictError, Controller, UnknownProfileError, prediction_view
from controller.settings import OVERRIDE_TTL_MAX_S
from controller.statuspage import render_status_page
from policies.changepoint import FindingKind
from policies.types import Mode
from store import Reader, StoreError

log = logging.getLogger("specpilot.api")

_bearer = HTTPBearer(auto_error=False)
MAX_ACTOR = 100
# The status page charts the last two hours of server time (720 polls at the default 10 s).
STATUS_CHART_S = 2 * 3600.0
STATUS_CHART_POINTS = 2000
T = TypeVar("T")


def _utf8(s: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"); SQLite cannot store them: refuse with 422
    rather than fail half-way through an operation."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 text (no lone surrogates)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
ProfileName = Annotated[
    str, Field(min_length=1, max_length=200, description="Profile name from config.toml."),
    AfterValidator(_utf8),
]  # fmt: skip
Reason = Annotated[Text, Field(max_length=500, description="Why (recorded with the action).")]
Since = Annotated[
    float | None,
    Query(allow_inf_nan=False, description="Epoch seconds; only rows at or after this time."),
]
Limit = Annotated[int, Query(ge=1, le=10000, description="Most rows returned, newest first.")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PinBody(_Body):
    profile: ProfileName
    # strict: a JSON number (integers included), never `true` or "60" coerced into one.
    ttl_s: float | None = Field(
        None,
        strict=True,
        gt=0,
        le=OVERRIDE_TTL_MAX_S,
        allow_inf_nan=False,
        description="Seconds until the pin expires; null: until unpinned.",
    )
    reason: Reason = ""


class PauseBody(_Body):
    ttl_s: float = Field(
        strict=True,
        gt=0,
        le=OVERRIDE_TTL_MAX_S,
        allow_inf_nan=False,
        description="Seconds until automatic switching resumes.",
    )
    reason: Reason = ""


class ModeBody(_Body):
    mode: Mode = Field(description="active: acts on decisions; advisory: decides, never acts.")
    reason: Reason = ""


class ReasonBody(_Body):
    reason: Reason = ""


class SwitchBody(_Body):
    profile: ProfileName
    reason: Reason = ""


def _json_safe(v: Any) -> Any:
    """Non-finite floats become null (JSON has no Inf/NaN); lone surrogates become "?"."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, str):
        return v.encode("utf-8", "replace").decode("utf-8")
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_json_safe(x) for x in v]
    return v


def _query_names(route: APIRoute) -> list[str]:
    """The query parameters a route declares, its dependencies' included, in order."""
    names: list[str] = []
    todo = [route.dependant]
    while todo:
        dep = todo.pop(0)
        names += [f.alias for f in dep.query_params if f.alias not in names]
        todo += dep.dependencies
    return names


def known_query_only(request: Request) -> None:
    """App-wide dependency: a GET that takes query parameters answers 422 for one it does not
    know (`?since=` for `since_s` would otherwise return every row), naming it and listing the
    accepted ones. GETs without parameters (status page, /metrics, /healthz) ignore a query
    string, as cache-busters and probes send them; writes are left as they are."""
    route = request.scope.get("route")
    if request.method != "GET" or not isinstance(route, APIRoute):
        return
    accepted = _query_names(route)
    if not accepted:
        return
    unknown = [k for k in dict.fromkeys(request.query_params.keys()) if k not in accepted]
    if unknown:
        raise RequestValidationError(
            [
                {
                    "type": "extra_forbidden",
                    "loc": ("query", k),
                    "msg": f"unknown query parameter {k!r}; accepted: {', '.join(accepted)}",
                    "input": request.query_params.get(k),
                }
                for k in unknown
            ]
        )


def _actor_header(request: Request) -> str | None:
    """X-Specpilot-Actor as UTF-8 text (HTTP headers arrive decoded as latin-1: re-encoding
    gives the raw bytes back); 422 when the bytes are not UTF-8."""
    raw = request.headers.get("x-specpilot-actor")
    if raw is None:
        return None
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise RequestValidationError(
            [
                {
                    "type": "string_unicode",
                    "loc": ("header", "x-specpilot-actor"),
                    "msg": "must be valid UTF-8 text",
                    "input": raw,
                }
            ]
        ) from None


class _Reads:
    """One read-only connection for the API's history reads, opened on first use (the writer
    has created the file by then) and serialised by a lock (handlers run in a thread pool)."""

    def __init__(self, controller: Controller) -> None:
        self._path = controller.store.path
        self._lock = threading.Lock()
        self._reader: Reader | None = None

    def __call__(self, fn: Callable[[Reader], T]) -> T:
        with self._lock:
            if self._reader is None:
                self._reader = Reader(self._path)
            return fn(self._reader)

    def close(self) -> None:
        with self._lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None


def create_app(controller: Controller, token: str) -> FastAPI:
    """The app. `token` empty: every write endpoint answers 403 (no token configured)."""
    reads = _Reads(controller)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        reads.close()

    app = FastAPI(
        title="specpilot",
        version="0.1.0",
        description="Adaptive speculation controller for SGLang: status, history and overrides. "
        "Write endpoints need `Authorization: Bearer <token>` (401 without, 403 with a wrong "
        "one or when no token is configured).",
        lifespan=lifespan,
        dependencies=[Depends(known_query_only)],
    )
    app.state.reads = reads

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input back and fails on NaN or a lone surrogate
        # (a 500 from a client's typo): echo a JSON-safe, bounded copy instead.
        errors = []
        for e in exc.errors():
            item = {k: e[k] for k in ("type", "loc", "msg") if k in e}
            if "input" in e:
                item["input"] = _json_safe(jsonable_encoder(e["input"]))
                if len(repr(item["input"])) > 500:
                    item["input"] = repr(item["input"])[:500]
            errors.append(_json_safe(item))
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(StoreError)
    async def store_error(_: Request, exc: StoreError) -> JSONResponse:
        log.error("store error answering a request: %s", exc)
        return JSONResponse({"detail": f"database unavailable: {exc}"}, status_code=503)

    def actor(
        request: Request,
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> str:
        if creds is None:
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not token:
            raise HTTPException(403, "no API token is configured: write endpoints are disabled")
        if not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(403, "wrong token")
        who = _actor_header(request) or (request.client.host if request.client else "api")
        return who[:MAX_ACTOR]

    Actor = Annotated[str, Depends(actor)]
    ReasonQuery = Annotated[str, Query(max_length=500)]

    def guard(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except UnknownProfileError as e:
            raise HTTPException(
                404, f"unknown profile {e.args[0]!r}; known: {sorted(controller.specs)}"
            ) from None
        except ConflictError as e:
            raise HTTPException(409, str(e)) from None

    def query_reason(reason: str) -> str:
        try:
            return _utf8(reason)[:500]
        except ValueError as e:
            raise HTTPException(422, f"reason: {e}") from None

    # ------------------------------------------------------------------------------ reads
    @app.get("/healthz", tags=["read"])
    async def healthz() -> dict[str, Any]:
        """Liveness: the process answers (during the start-up too, while the server starts);
        `ready` once the first scrape succeeded (false until the start-up started or adopted
        the server and a scrape answered); `profile` the one serving (null while none does)."""
        return {"ok": True, "ready": controller.ready, "profile": controller.running}

    @app.head("/healthz", include_in_schema=False)
    async def healthz_head() -> Response:
        """Load balancers and `curl -I` probe liveness without a body."""
        return Response()

    @app.get("/v1/status", tags=["read"])
    async def status() -> dict[str, Any]:
        """Profile now, estimates per profile with intervals, break-even accept length, last
        decision, overrides, trial, MoE routing and forward-cost roofline."""
        return _json_safe(controller.status())

    @app.get("/v1/estimates", tags=["read"])
    async def estimates(
        since_s: Since = None,
        profile: Annotated[str | None, Query(max_length=200)] = None,
        limit: Limit = 500,
    ) -> dict[str, Any]:
        """Current predictions per profile and the recorded estimate history."""
        current = [prediction_view(p) for p in controller.predictions]
        history = await run_in_threadpool(
            reads, lambda r: r.estimates(since_s=since_s, profile=profile, limit=limit)
        )
        return _json_safe({"current": current, "history": history})

    @app.get("/v1/decisions", tags=["read"])
    def decisions(since_s: Since = None, limit: Limit = 100) -> list[dict[str, Any]]:
        """Decisions with their reason and numbers, newest first."""
        return _json_safe(reads(lambda r: r.recent_decisions(since_s=since_s, limit=limit)))

    @app.get("/v1/switches", tags=["read"])
    def switches(since_s: Since = None, limit: Limit = 100) -> list[dict[str, Any]]:
        """Switches (downtime, outcome), newest first, each with its trial's states."""

        def read(r: Reader) -> list[dict[str, Any]]:
            rows = r.switches(since_s=since_s, limit=limit)
            for row in rows:
                row["trial"] = list(reversed(r.trials(switch_id=int(row["id"]), limit=20)))
            return rows

        return _json_safe(reads(read))

    @app.get("/v1/findings", tags=["read"])
    def findings(
        since_s: Since = None,
        kind: FindingKind | None = None,
        limit: Limit = 100,
    ) -> list[dict[str, Any]]:
        """Findings (drift, low acceptance...), newest first."""
        return _json_safe(reads(lambda r: r.findings(since_s=since_s, kind=kind, limit=limit)))

    @app.get("/v1/profiles", tags=["read"])
    async def profiles() -> list[dict[str, Any]]:
        """The configured profiles (environment variable names only: values may be secrets)."""
        out = []
        for name, spec in controller.specs.items():
            cfg = controller.settings.profiles[name]
            out.append(
                {
                    "name": name,
                    "description": cfg.description,
                    "kind": cfg.kind,
                    "flags": cfg.flags,
                    "env": sorted(cfg.env),
                    "speculative": spec.speculative,
                    "algorithm": spec.algorithm,
                    "num_steps": spec.num_steps,
                    "draft_tokens": spec.draft_tokens,
                    "topk": spec.topk,
                    "adaptive": spec.adaptive,
                    "running": name == controller.running,
                }
            )
        return out

    # ------------------------------------------------------------------------------ writes
    @app.put("/v1/pin", tags=["write"])
    async def put_pin(body: PinBody, who: Actor) -> dict[str, Any]:
        """Pin a profile: it beats every automatic decision until unpinned or expired."""
        guard(lambda: controller.pin(body.profile, body.ttl_s, body.reason, who))
        return controller.override_view()

    @app.delete("/v1/pin", tags=["write"])
    async def delete_pin(who: Actor, reason: ReasonQuery = "") -> Any:
        """Remove the pin."""
        controller.unpin(query_reason(reason), who)
        return controller.override_view()

    @app.put("/v1/pause", tags=["write"])
    async def put_pause(body: PauseBody, who: Actor) -> dict[str, Any]:
        """Pause automatic switching for ttl_s seconds."""
        controller.pause(body.ttl_s, body.reason, who)
        return controller.override_view()

    @app.delete("/v1/pause", tags=["write"])
    async def delete_pause(who: Actor, reason: ReasonQuery = "") -> Any:
        """End the pause."""
        controller.resume(query_reason(reason), who)
        return controller.override_view()

    @app.put("/v1/mode", tags=["write"])
    async def put_mode(body: ModeBody, who: Actor) -> dict[str, Any]:
        """active: act on decisions; advisory: decide and explain, never restart."""
        controller.set_mode(body.mode, body.reason, who)
        return controller.override_view()

    @app.post("/v1/trial/abort", tags=["write"])
    async def trial_abort(who: Actor, body: ReasonBody | None = None) -> dict[str, Any]:
        """Judge the running trial failed now and roll back (409 when none runs, while a
        switch is in flight and while the server starts)."""
        if not guard(lambda: controller.abort_trial(body.reason if body else "", who)):
            raise HTTPException(409, "no trial is running")
        return {"aborted": True}

    @app.post("/v1/switch", status_code=202, tags=["write"])
    async def post_switch(body: SwitchBody, who: Actor) -> dict[str, Any]:
        """A one-off switch (still a trial, rolled back if it underdelivers); 409 while the
        server starts (the daemon's start-up), while a switch is in flight, while a trial runs,
        or when the profile already runs. Advisory mode records it and does not act."""
        guard(lambda: controller.start_manual_switch(body.profile, body.reason, who))
        return {"accepted": True, "profile": body.profile, "mode": controller.mode.value}

    @app.post("/v1/block/clear", tags=["write"])
    async def clear_block(who: Actor, body: ReasonBody | None = None) -> dict[str, Any]:
        """Clear the block an unknown switch outcome set (after a person checked the server)."""
        controller.clear_block(body.reason if body else "", who)
        return controller.override_view()

    # ------------------------------------------------------------------------------ people
    @app.get("/metrics", tags=["read"])
    async def metrics() -> Response:
        """specpilot's own Prometheus metrics (`specpilot_*`)."""
        # Override expiry is a matter of time, not of ticks: refresh at scrape time.
        controller.metrics.set_overrides(controller.override_view())
        trial = controller.state.trial if controller.state is not None else None
        controller.metrics.set_activity(
            controller.switch_in_flight, str(trial["profile"]) if trial else None
        )
        return Response(controller.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse, tags=["people"])
    async def index() -> str:
        """The status page."""
        poll_s = controller.settings.controller.poll_interval_s
        since = controller.clock.now() - min(STATUS_CHART_S, STATUS_CHART_POINTS * poll_s)

        def read(r: Reader) -> tuple[list[Any], list[Any], list[Any]]:
            return (
                r.recent_decisions(limit=15),
                r.observations(since_s=since, limit=STATUS_CHART_POINTS),
                r.switches(since_s=since, limit=200),
            )

        recent, observations, switch_rows = await run_in_threadpool(reads, read)
        return render_status_page(controller, recent, observations, switch_rows)

    return app
