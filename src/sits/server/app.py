"""`build_app`: the FastAPI application of one engine.

The app owns a `ServerContext` (settings, lifecycle, QoS state, per-app metrics registry) in
`app.state.ctx`; its lifespan opens the audit log (if any), starts the engine-health monitor,
the overload watcher, the precision policy's task (with `--precision-policy overload`) and,
with `--register-with`, the fleet heartbeat task; on exit it stops them, (optionally) shuts the
engine down and then closes the audit log. With `--fault-injection`,
`FaultInjectionMiddleware` (innermost, `sits.server.faults`) delays, fails or hangs a share of
the generation requests. `QosHeadersMiddleware` puts the overload state and the tenant's
rate-limit headers on every response; with tracing on, `TracingMiddleware` makes one trace per
request (`sits.server.request_tracing`); with an audit log, `AuditRefusalMiddleware` audits
every error answer to a generation request (`sits.server.audit_refusals`);
`RequestIdMiddleware` puts `x-request-id` on every response and `Retry-After` on every 503
(`sits.server.request_id`); with CORS settings (`--allowed-origins` ...) Starlette's
`CORSMiddleware` answers preflights and adds the CORS headers. `GET /dashboard`
serves the live dashboard (`sits.server.routes_dashboard`). Nothing is global, so one process
may build several apps.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import sits
from sits.server.admin import admin_router
from sits.server.audit_refusals import AuditRefusalMiddleware
from sits.server.context import ServerContext, ServerLifecycle, ServerSettings
from sits.server.engine_client import EngineClient
from sits.server.errors import install_error_handlers
from sits.server.faults import FaultInjectionMiddleware
from sits.server.qos.headers import QosHeadersMiddleware
from sits.server.request_id import RequestIdMiddleware
from sits.server.request_tracing import ReceivedAtMiddleware, TracingMiddleware
from sits.server.routes import api_router, models_router, ops_router
from sits.server.routes_dashboard import dashboard_router
from sits.server.serving_common import count_invalid_body

logger = logging.getLogger(__name__)


def build_app(
    engine: EngineClient,
    settings: ServerSettings | None = None,
    *,
    on_fatal: Callable[[int], None] | None = None,
    shutdown_engine: bool = True,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine`.

    Args:
        engine: a started engine front end (`AsyncLLM` or a test double).
        settings: server options; defaults to no key, 30 s drain.
        on_fatal: called with an exit code when the engine dies (the CLI exits the process).
        shutdown_engine: shut the engine down when the app's lifespan ends.
    """
    settings = settings or ServerSettings()
    lifecycle = ServerLifecycle(
        engine,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        health_poll_s=settings.health_poll_s,
        on_fatal=on_fatal,
    )
    ctx = ServerContext(engine, settings, lifecycle)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if ctx.audit is not None:
            ctx.audit.start()
        lifecycle.start()
        ctx.overload_watcher.start()
        ctx.precision.start()
        ctx.loop_lag.start()
        if ctx.faults is not None:
            logger.warning(
                "fault injection is ON (%s, seed %d): a share of /v1/completions and "
                "/v1/chat/completions requests is delayed, failed or hung on purpose",
                ctx.faults.spec.describe(),
                ctx.faults.spec.seed,
            )
        if ctx.registration is not None:
            ctx.registration.start()
        try:
            yield
        finally:
            try:
                if ctx.registration is not None:
                    await ctx.registration.stop()
                await ctx.overload_watcher.stop()
                await ctx.precision.stop()
                await ctx.loop_lag.stop()
                await lifecycle.stop()
                if shutdown_engine:
                    await engine.shutdown()
            finally:
                if ctx.audit is not None:
                    await ctx.audit.close()  # after the drain: every job has ended
                if ctx.tracer is not None:
                    await ctx.tracer.shutdown()  # flushes the kept spans
                ctx.tokenize_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="sits",
        version=sits.__version__,
        summary="OpenAI-compatible LLM server",
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    install_error_handlers(app, on_invalid_body=count_invalid_body)
    if ctx.faults is not None:  # innermost: the outer middlewares see the injected answers
        app.add_middleware(
            FaultInjectionMiddleware, injector=ctx.faults, drain_started=lifecycle.drain_started
        )
    app.add_middleware(QosHeadersMiddleware, qos=ctx.qos)
    if ctx.tracer is not None:  # sees every status and ends after the stream
        app.add_middleware(TracingMiddleware, tracer=ctx.tracer)
    if ctx.audit is not None:  # every error answer to a generation request, with its trace id
        app.add_middleware(AuditRefusalMiddleware, audit=ctx.audit)
    if settings.cors is not None:  # answers preflights before auth sees them
        cors = settings.cors
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    app.add_middleware(RequestIdMiddleware)  # x-request-id on all, Retry-After on all 503s
    app.add_middleware(ReceivedAtMiddleware)  # outermost: stamps the receipt time first
    app.include_router(ops_router)
    app.include_router(models_router)
    app.include_router(api_router)
    app.include_router(admin_router)
    app.include_router(dashboard_router)
    return app
