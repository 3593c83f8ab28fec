"""The REST API and the controller's /metrics, as a FastAPI app over one Controller.

Owns the HTTP surface: read endpoints (status, estimates, decisions, switches, findings,
profiles, healthz), write endpoints behind a bearer token (pin, pause, mode, trial abort, one-off
switch, clearing a block), request/response models with field-level 422s, and the mapping of
controller errors to 404/409. Must not decide or act itself: it calls Controller operations.
"""

from __future__ import annotations

import hmac
import math
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import HTMLResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from controller.loop import ConflictError, Controller, UnknownProfileError, prediction_view
from controller.statuspage import render_status_page
from policies.types import Mode

_bearer = HTTPBearer(auto_error=False)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PinBody(_Body):
    profile: str = Field(min_length=1, description="Profile name from config.toml.")
    ttl_s: float | None = Field(
        None,
        gt=0,
        le=30 * 86400,
        description="Seconds until the pin expires; null: until unpinned.",
    )
    reason: str = Field("", max_length=500)


class PauseBody(_Body):
    ttl_s: float = Field(
        gt=0, le=30 * 86400, description="Seconds until automatic switching resumes."
    )
    reason: str = Field("", max_length=500)


class ModeBody(_Body):
    mode: Mode
    reason: str = Field("", max_length=500)


class ReasonBody(_Body):
    reason: str = Field("", max_length=500)


class SwitchBody(_Body):
    profile: str = Field(min_length=1)
    reason: str = Field("", max_length=500)


def _json_safe(v: Any) -> Any:
    """Non-finite floats become null (JSON has no Inf/NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_json_safe(x) for x in v]
    return v


def create_app(controller: Controller, token: str) -> FastAPI:
    """The app. `token` empty: every write endpoint answers 403 (no token configured)."""
    app = FastAPI(
        title="specpilot",
        version="0.1.0",
        description="Adaptive speculation controller for SGLang: status, history and overrides.",
    )

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
        return request.headers.get("x-specpilot-actor") or (
            request.client.host if request.client else "api"
        )

    Actor = Annotated[str, Depends(actor)]

    def _profile_guard(fn: Any) -> Any:
        try:
            return fn()
        except UnknownProfileError as e:
            raise HTTPException(
                404, f"unknown profile {e.args[0]!r}; known: {sorted(controller.specs)}"
            ) from None
        except ConflictError as e:
            raise HTTPException(409, str(e)) from None

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True, "ready": controller.ready, "profile": controller.running}

    @app.get("/v1/status")
    def status() -> dict[str, Any]:
        return _json_safe(controller.status())

    @app.get("/v1/estimates")
    def estimates(
        since_s: Annotated[float | None, Query(description="Epoch seconds; history since")] = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 500,
    ) -> dict[str, Any]:
        return _json_safe(
            {
                "current": [prediction_view(p) for p in controller.predictions],
                "history": controller.store.estimates(since_s=since_s, limit=limit),
            }
        )

    @app.get("/v1/decisions")
    def decisions(
        since_s: float | None = None, limit: Annotated[int, Query(ge=1, le=10000)] = 100
    ) -> list[dict[str, Any]]:
        return _json_safe(controller.store.recent_decisions(since_s=since_s, limit=limit))

    @app.get("/v1/switches")
    def switches(
        since_s: float | None = None, limit: Annotated[int, Query(ge=1, le=10000)] = 100
    ) -> list[dict[str, Any]]:
        return _json_safe(controller.store.switches(since_s=since_s, limit=limit))

    @app.get("/v1/findings")
    def findings(
        since_s: float | None = None, limit: Annotated[int, Query(ge=1, le=10000)] = 100
    ) -> list[dict[str, Any]]:
        return _json_safe(controller.store.findings(since_s=since_s, limit=limit))

    @app.get("/v1/profiles")
    def profiles() -> list[dict[str, Any]]:
        out = []
        for name, spec in controller.specs.items():
            cfg = controller.settings.profiles[name]
            out.append(
                {
                    "name": name,
                    "description": cfg.description,
                    "kind": cfg.kind,
                    "flags": cfg.flags,
                    "env": sorted(cfg.env),  # names only: values may be secrets
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

    @app.put("/v1/pin")
    def put_pin(body: PinBody, who: Actor) -> dict[str, Any]:
        _profile_guard(lambda: controller.pin(body.profile, body.ttl_s, body.reason, who))
        return controller.override_view()

    @app.delete("/v1/pin")
    def delete_pin(who: Actor, reason: str = "") -> dict[str, Any]:
        controller.unpin(reason, who)
        return controller.override_view()

    @app.put("/v1/pause")
    def put_pause(body: PauseBody, who: Actor) -> dict[str, Any]:
        controller.pause(body.ttl_s, body.reason, who)
        return controller.override_view()

    @app.delete("/v1/pause")
    def delete_pause(who: Actor, reason: str = "") -> dict[str, Any]:
        controller.resume(reason, who)
        return controller.override_view()

    @app.put("/v1/mode")
    def put_mode(body: ModeBody, who: Actor) -> dict[str, Any]:
        controller.set_mode(body.mode, body.reason, who)
        return controller.override_view()

    @app.post("/v1/trial/abort")
    def trial_abort(who: Actor, body: ReasonBody | None = None) -> dict[str, Any]:
        if not controller.abort_trial(body.reason if body else "", who):
            raise HTTPException(409, "no trial is running")
        return {"aborted": True}

    @app.post("/v1/switch", status_code=202)
    def post_switch(body: SwitchBody, who: Actor) -> dict[str, Any]:
        _profile_guard(lambda: controller.start_manual_switch(body.profile, body.reason, who))
        return {"accepted": True, "profile": body.profile, "mode": controller.mode.value}

    @app.post("/v1/block/clear")
    def clear_block(who: Actor, body: ReasonBody | None = None) -> dict[str, Any]:
        controller.clear_block(body.reason if body else "", who)
        return controller.override_view()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(controller.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return render_status_page(controller)

    return app
