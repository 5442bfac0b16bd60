"""`build_router_app`: the FastAPI application of `sits router`.

The router speaks the OpenAI API of `sits serve` (`/v1/completions`, `/v1/chat/completions`,
`/tokenize`, `/detokenize` forwarded by `sits.router.proxy`; `/v1/models` as the union of the
healthy replicas' models; `/health`; `/metrics`) so a client cannot tell it from one server, plus
the fleet's own routes, all behind the router's key: `POST /v1/router/register`, `/heartbeat`,
`/deregister` (the replicas' `Heartbeat` messages, `sits.core.fleet`), `GET /v1/router/canary`
(state, weights, window figures and history) and `GET /v1/router/replicas`.
Nothing is global: the app owns its registry, canary, metrics and HTTP client (`app.state.router`);
the lifespan adds the static replicas, starts the probe rounds and closes the pool at the end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import sits
from sits.admission import Clock, SystemClock
from sits.core.errors import InvalidParameterError
from sits.core.fleet import (
    CANARY_VERSION_LABEL,
    DEREGISTER_PATH,
    HEARTBEAT_PATH,
    REGISTER_PATH,
    Heartbeat,
    normalize_url,
)
from sits.router.canary import CanaryController, CanaryState
from sits.router.limits import FleetLimits
from sits.router.metrics import CONTENT_TYPE, RouterMetrics
from sits.router.prober import Prober
from sits.router.proxy import Proxy
from sits.router.registry import Registry
from sits.router.settings import RouterSettings
from sits.server.errors import ServerError, error_response, install_error_handlers
from sits.server.qos.admit import keys_match, presented_key

logger = logging.getLogger(__name__)

_KEEPALIVE_S = 4.0
_CANARY_DONE = (CanaryState.PROMOTED, CanaryState.ROLLED_BACK)
_FORWARDED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@dataclass(slots=True)
class RouterState:
    """What the router's routes share (`app.state.router`)."""

    settings: RouterSettings
    registry: Registry
    canary: CanaryController
    metrics: RouterMetrics
    limits: FleetLimits
    proxy: Proxy | None = None
    prober: Prober | None = None


def build_router_app(
    settings: RouterSettings,
    *,
    clock: Clock | None = None,
    probe: bool = True,
) -> FastAPI:
    """The router app.

    Args:
        settings: the router's options.
        clock: time source of every policy (default `SystemClock`).
        probe: run the background probe rounds (tests of the routing alone may turn them off).
    """
    clock = clock or SystemClock()
    registry = Registry(
        clock,
        settings.breaker,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        missed_heartbeats=settings.missed_heartbeats,
    )
    canary = CanaryController(settings.canary, clock)
    metrics = RouterMetrics(registry, lambda: canary)
    state = RouterState(settings, registry, canary, metrics, FleetLimits(settings.tenants, clock))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # aiohttp's pool hands out a connection in O(1); httpx's walked every pooled connection
        # per request, which capped the router near 800 relayed events/s at 200 streams.
        # Idle connections close before uvicorn's 5 s keep-alive would close them under us.
        connector = aiohttp.TCPConnector(
            limit=settings.max_connections, keepalive_timeout=_KEEPALIVE_S
        )
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as client:
            for url in settings.replicas:
                registry.add_static(url)
            for url in settings.fallbacks:
                registry.add_static(url, pool="fallback")
            for url in settings.canaries:
                registry.add_static(url, version_label=CANARY_VERSION_LABEL)
            state.proxy = Proxy(settings, registry, canary, metrics, state.limits, client, clock)
            state.prober = Prober(
                registry,
                canary,
                client,
                interval_s=settings.probe_interval_s,
                timeout_s=settings.probe_timeout_s,
                router_key=settings.router_key,
                canary_present=state.proxy.canary_present,
            )
            if probe:
                state.prober.start()
            try:
                yield
            finally:
                await state.prober.stop()

    app = FastAPI(title="sits router", version=sits.__version__, lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app)
    _add_api_routes(app, state)
    _add_fleet_routes(app, state)
    return app


def _add_api_routes(app: FastAPI, state: RouterState) -> None:
    for path in _FORWARDED:

        async def forward(request: Request, _path: str = path) -> Response:
            assert state.proxy is not None
            return await state.proxy.forward(request, _path)

        app.add_api_route(path, forward, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        _require_client(request, state)
        return {"object": "list", "data": [_card(m, state) for m in state.registry.models()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
        _require_client(request, state)
        if model_id not in state.registry.models():
            raise ServerError(
                404,
                f"The model `{model_id}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return _card(model_id, state)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not state.registry.candidates(None, "primary") and not state.registry.candidates(
            None, "fallback"
        ):
            err = ServerError(
                503, "No healthy replica.", type="service_unavailable_error", code="no_replica"
            )
            return error_response(err, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _card(model: str, state: RouterState) -> dict[str, Any]:
    lengths = [r.max_model_len for r in state.registry.candidates(model, "primary")]
    card: dict[str, Any] = {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sits",
    }
    if lengths and max(lengths) > 0:
        card["max_model_len"] = max(lengths)
    return card


def _require_client(request: Request, state: RouterState) -> None:
    """With tenants, the model list needs a tenant's key (or the router's), as on a replica.

    Raises:
        ServerError: 401 `invalid_api_key`.
    """
    if not state.limits.enabled:
        return
    key = presented_key(request)
    router_key = state.settings.router_key
    if router_key is not None and keys_match(router_key, key):
        return
    state.limits.authenticate(key)


def _require_router_key(request: Request, state: RouterState) -> None:
    """Raises ServerError 401 unless the request carries the router's key (404 without one:
    the router then takes no registrations)."""
    key = state.settings.router_key
    if key is None:
        raise ServerError(404, "This router takes no registrations (no --router-key).")
    if not keys_match(key, presented_key(request)):
        raise ServerError(401, "Incorrect or missing router key.", code="invalid_api_key")


def _add_fleet_routes(app: FastAPI, state: RouterState) -> None:
    async def beat(request: Request) -> dict[str, Any]:
        _require_router_key(request, state)
        try:
            body = await request.json()
        except ValueError as exc:
            raise ServerError(400, f"The body is not JSON: {exc}", code="invalid_json") from exc
        try:
            heartbeat = Heartbeat.from_json(body)
        except InvalidParameterError as exc:  # before ValueError: it is one
            raise ServerError(400, str(exc), param=exc.param, code="invalid_value") from exc
        before = state.registry.get(heartbeat.url)
        known, was = before is not None, before.status if before is not None else None
        replica = state.registry.heartbeat(heartbeat)
        if not known or was is not replica.status:
            logger.info(
                "replica %s (%s, %s): %s", replica.url, replica.version_label,
                ", ".join(replica.models), "registered" if not known else replica.status.value,
            )  # fmt: skip
        if not known and replica.is_canary and state.canary.state in _CANARY_DONE:
            state.canary.reset()  # a new canary version: its ramp starts over
        return {"url": replica.url, "status": replica.status.value}

    app.add_api_route(REGISTER_PATH, beat, methods=["POST"])
    app.add_api_route(HEARTBEAT_PATH, beat, methods=["POST"])

    @app.post(DEREGISTER_PATH)
    async def deregister(request: Request) -> dict[str, Any]:
        _require_router_key(request, state)
        body = await request.json()
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str):
            raise ServerError(400, "The body needs 'url'.", param="url")
        return {"url": normalize_url(url), "removed": state.registry.deregister(url)}

    @app.get("/v1/router/canary")
    async def canary(request: Request) -> dict[str, Any]:
        _require_router_key(request, state)
        return state.canary.snapshot()

    @app.get("/v1/router/replicas")
    async def replicas(request: Request) -> dict[str, Any]:
        _require_router_key(request, state)
        return {"data": state.registry.snapshot()}
