"""Operator routes under /v1/admin, guarded by the admin key (`sits serve --admin-key`).

- GET /v1/admin/experts: a fresh read of the MoE experts' load, health and frozen flags
  (`ExpertStats.to_json()`; `{"layers": []}` for a dense model).
- POST /v1/admin/experts/{layer}/{expert}/freeze and .../unfreeze: mask an expert in its
  layer's router, or route to it again; .../restore: reload its weights from the checkpoint and
  unfreeze it (into a spare slot, then switching the layer's routing table, when the engine
  has spare expert slots: `--num-spare-experts`); each answers the stats right after.
- GET /v1/admin/precision: the engine's weight sets and the current one, its switch count and
  the last switch (step, time, delay from the call to the first step in the new set), and the
  precision policy (`sits.server.precision.precision_json`); `available` is empty without
  `--precision-switch`.
- POST /v1/admin/precision with `{"precision": NAME}`: switch the engine to that weight set
  before its next step; answers the new state. 400 (OpenAI error body, param "precision") for
  a name that is not one of the sets or a server without `--precision-switch`. With
  `--precision-policy overload` the policy resumes from the operator's choice (its red / green
  time counts again from this switch: `sits.admission.precision_policy`).

Auth: without a configured admin key every admin route is 404 (the surface does not exist);
with one, a missing bearer key is 401 and a wrong one 403. The tenants' API keys never open
these routes. The engine work runs on its thread between steps; a dead or hung engine is 503.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from sits.server.errors import ServerError, unavailable
from sits.server.precision import precision_json
from sits.server.qos.admit import keys_match, presented_key

_ENGINE_CALL_TIMEOUT_S = 10.0


async def require_admin(request: Request) -> None:
    """FastAPI dependency: the request carries the admin key.

    Raises:
        ServerError: 404 without a configured admin key, 401 without a key, 403 for a wrong
            key.
    """
    expected = request.app.state.ctx.settings.admin_key
    if not expected:
        raise ServerError(404, "Not Found", code="not_found")
    presented = presented_key(request)
    if not presented:
        raise ServerError(
            401, "Missing admin key: pass it as 'Authorization: Bearer KEY'.", code="no_api_key"
        )
    if not keys_match(expected, presented):
        raise ServerError(403, "Incorrect admin key provided.", code="forbidden")


admin_router = APIRouter(prefix="/v1/admin", dependencies=[Depends(require_admin)])


async def _on_engine(request: Request, name: str, *args: int) -> JSONResponse:
    engine = request.app.state.ctx.engine
    method = getattr(engine, name, None)
    if method is None:
        return JSONResponse({"layers": []})
    try:
        stats = await asyncio.wait_for(method(*args), _ENGINE_CALL_TIMEOUT_S)
    except TimeoutError as exc:
        raise unavailable("The engine did not answer in time.", "engine_timeout") from exc
    return JSONResponse(stats.to_json() if stats is not None else {"layers": []})


@admin_router.get("/experts")
async def experts(request: Request) -> JSONResponse:
    """Per MoE layer and expert: tokens routed, anomalous checks, frozen; imbalance per layer."""
    return await _on_engine(request, "expert_stats")


@admin_router.post("/experts/{layer}/{expert}/freeze")
async def freeze_expert(layer: int, expert: int, request: Request) -> JSONResponse:
    """Mask the expert in its layer's router (400 for an unknown layer/expert or too few left)."""
    return await _on_engine(request, "freeze_expert", layer, expert)


@admin_router.post("/experts/{layer}/{expert}/unfreeze")
async def unfreeze_expert(layer: int, expert: int, request: Request) -> JSONResponse:
    """Route to the expert again (400 for an unknown layer/expert)."""
    return await _on_engine(request, "unfreeze_expert", layer, expert)


@admin_router.post("/experts/{layer}/{expert}/restore")
async def restore_expert(layer: int, expert: int, request: Request) -> JSONResponse:
    """Reload the expert's weights from the checkpoint (into a spare slot when the layer has
    one) and unfreeze it (400 for an unknown layer/expert or a checkpoint without them)."""
    return await _on_engine(request, "restore_expert", layer, expert)


class PrecisionRequest(BaseModel):
    """The body of `POST /v1/admin/precision`.

    Attributes:
        precision: the weight set to run, one of the state's `available` (e.g. "int4").
    """

    model_config = ConfigDict(extra="forbid")

    precision: str


@admin_router.get("/precision")
async def precision(request: Request) -> JSONResponse:
    """The engine's weight sets, the current one, its switches, and the precision policy."""
    ctx = request.app.state.ctx
    return JSONResponse(precision_json(ctx.precision.state(), ctx.settings.precision_policy))


@admin_router.post("/precision")
async def set_precision(body: PrecisionRequest, request: Request) -> JSONResponse:
    """Switch the engine's weights before its next step; the new state (400 for an unknown
    name or a server without `--precision-switch`, 503 when the engine does not answer)."""
    ctx = request.app.state.ctx
    try:
        state = await asyncio.wait_for(ctx.precision.switch(body.precision), _ENGINE_CALL_TIMEOUT_S)
    except TimeoutError as exc:
        raise unavailable("The engine did not answer in time.", "engine_timeout") from exc
    return JSONResponse(precision_json(state, ctx.settings.precision_policy))
