"""The live dashboard: `GET /dashboard` (one static HTML page) and `GET /dashboard/data` (JSON).

The page (`sits/server/static/dashboard.html`: inline JS and CSS, no build step, no CDN; charts
drawn on canvas and SVG) polls `/dashboard/data` and shows throughput, latency percentiles,
queue, KV use per tier, overload and breaker state, per-tenant SLO attainment and cost, a
heatmap of MoE expert load per layer and a timeline (queue, prefill chunks, decode) of the
latest requests.

`/dashboard/data` is one JSON object built by `dashboard_data` (from the pure pieces of
`sits.obs.dashboard_data`):
- counters (requests by finish reason, tokens, preemptions, prefix cache) are read from the
  server's Prometheus registry, so the page shows exactly what `/metrics` exports;
- latency percentiles (nearest rank) and the request timelines come from the ring of the
  latest ended requests (`ServerMetrics.timelines`), with prefill chunks from the engine's
  chunk ring (`AsyncLLM.prefill_chunks`, matched by engine request id); times are seconds
  relative to the request's arrival (`*_s`) or ages before `time_s`;
- experts: the engine's last expert snapshot (`EngineStats.experts`), null for a dense model;
- precision: with `--precision-switch`, the current weight set, the sets held and the number
  of switches (`PrecisionState`); null without a switch;
- tenants: per tenant, its requests by outcome (`sits:tenant_requests_total`: ok and the
  refusals 400, 429, 503, ...), tokens, SLOs, busy seconds and cost, and its running and
  waiting requests (`tenant_load`). Without `--tenants` the one default tenant has tier null
  (the engine schedules first come first served, with no tier) and the engine's totals;
- device: where the engine runs ("cuda", "cpu"; null when unknown): its busy seconds
  (`gpu_s`, `sits:gpu_seconds_total`, the wall time of its steps) are GPU-seconds on a GPU
  only, and the page names them after the device.
Access: open like `/metrics`; with an admin key (`--admin-key`) the data needs it
(`Authorization: Bearer KEY`; the page asks for it), since it names recent requests. With
tenants (`--tenants`) and no admin key, the recent requests are left out (`requests` empty,
`requests_hidden` says why): they are the tenants', and a tenant never sees another's
requests; the aggregates stay, as on `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from sits.obs.cost_metrics import SECONDS_PER_HOUR, cost_per_million_tokens
from sits.obs.dashboard_data import (
    MetricSamples,
    chunks_by_request,
    finite_or_none,
    tenant_load,
    timeline_json,
)
from sits.obs.timeline import latency_summary
from sits.server.errors import ServerError
from sits.server.precision import engine_precision
from sits.server.qos.admit import keys_match, presented_key

if TYPE_CHECKING:
    from sits.server.context import ServerContext

logger = logging.getLogger(__name__)

DATA_PATH = "/dashboard/data"
MAX_TIMELINES_SHOWN = 40
_CHUNKS_TIMEOUT_S = 2.0
_SLO_KINDS = ("ttft", "tpot")
REQUESTS_HIDDEN = (
    "Recent requests are hidden: they belong to tenants and no admin key is set (start the "
    "server with --admin-key to see them)."
)


def dashboard_html() -> str:
    """The page's HTML (package data `sits/server/static/dashboard.html`)."""
    return (resources.files("sits.server") / "static" / "dashboard.html").read_text("utf-8")


def engine_device(engine: Any) -> str | None:
    """The type of the engine's device ("cuda", "cpu"), from `engine.info.device` (a
    `torch.device`); None for an engine without one (a test double)."""
    device = getattr(getattr(engine, "info", None), "device", None)
    return getattr(device, "type", None)


def _tenants_json(ctx: ServerContext, samples: MetricSamples) -> list[dict[str, Any]]:
    price = ctx.settings.gpu_price_per_hour
    _, gpu_s = ctx.cost.tenant_gpu_seconds()
    configured = ctx.settings.tenants is not None  # else one default tenant, plain FCFS
    out = []
    for tenant in ctx.qos.tenants:
        tid = tenant.id
        prompt = samples.get("sits:tenant_prompt_tokens_total", tenant=tid)
        generated = samples.get("sits:tenant_generation_tokens_total", tenant=tid)
        slo = {}
        for kind in _SLO_KINDS:
            total = samples.get("sits:tenant_slo_requests_total", tenant=tid, slo=kind)
            met = samples.get("sits:tenant_slo_met_total", tenant=tid, slo=kind)
            slo[kind] = {
                "target_ms": tenant.ttft_ms if kind == "ttft" else tenant.tpot_ms,
                "num_requests": total,
                "num_met": met,
                "attainment": met / total if total else None,
            }
        seconds = gpu_s.get(tid, 0.0)
        out.append(
            {
                "id": tid,
                "tier": tenant.tier.value if configured else None,
                "requests": samples.by_label("sits:tenant_requests_total", "outcome", tenant=tid),
                "prompt_tokens": prompt,
                "generation_tokens": generated,
                **tenant_load(samples, tid, per_tenant=configured),
                "in_flight": samples.get("sits:tenant_requests_in_flight", tenant=tid),
                "slo": slo,
                "gpu_s": seconds,
                "cost": seconds / SECONDS_PER_HOUR * price if price > 0 else None,
                "cost_per_million_tokens": (
                    cost_per_million_tokens(seconds, prompt + generated, price)
                    if price > 0
                    else None
                ),
            }
        )
    return out


def dashboard_data(
    ctx: ServerContext, chunks: Sequence[Any] = (), now_s: float | None = None
) -> dict[str, Any]:
    """The `/dashboard/data` body (see the module docstring).

    Args:
        ctx: the server's context.
        chunks: the engine's latest prefill chunks (`sits.engine.stats.PrefillChunk`s).
        now_s: time.monotonic() now (ages are relative to it).
    """
    now_s = time.monotonic() if now_s is None else now_s
    samples = MetricSamples(ctx.metrics.registry)
    timelines = ctx.metrics.timelines.recent()
    shown = timelines[-MAX_TIMELINES_SHOWN:][::-1]  # newest first
    chunk_map = chunks_by_request(shown, chunks)
    try:
        stats = ctx.engine.stats()
    except Exception:  # noqa: BLE001 - a dead engine: show the rest
        stats = None
    experts = getattr(stats, "experts", None)
    signals, rate = ctx.overload_watcher.snapshot()
    breaker = ctx.qos.breaker
    kv_used = samples.by_label("sits:kv_tier_blocks_used", "tier")
    kv_total = samples.by_label("sits:kv_tier_blocks_capacity", "tier")
    precision = engine_precision(ctx.engine)
    return {
        "model_name": ctx.model_name,
        "time_s": now_s,
        "healthy": ctx.lifecycle.healthy(),
        "totals": {
            "requests": samples.by_label("sits:request_success_total", "finished_reason"),
            "prompt_tokens": samples.get("sits:prompt_tokens_total"),
            "generation_tokens": samples.get("sits:generation_tokens_total"),
            "num_preemptions": samples.get("sits:num_preemptions_total"),
            "prefix_cache_queries": samples.get("sits:prefix_cache_queries_total"),
            "prefix_cache_hits": samples.get("sits:prefix_cache_hits_total"),
            "gpu_s": samples.get("sits:gpu_seconds_total"),
        },
        "queue": {
            "num_running": samples.get("sits:num_requests_running"),
            "num_waiting": samples.get("sits:num_requests_waiting"),
            "queue_delay_s": signals.queue_delay_s if signals is not None else 0.0,
        },
        "kv": [
            {"tier": tier, "used_blocks": kv_used.get(tier, 0.0), "total_blocks": total}
            for tier, total in kv_total.items()
        ],
        "overload": {
            "state": ctx.qos.overload_state.value,
            "predicted_ttft_s": signals.predicted_ttft_s if signals is not None else 0.0,
            "prefill_tokens_per_s": finite_or_none(rate),
            "breaker": breaker.state.value,
            "breaker_opened": breaker.num_opened,
        },
        "latency": latency_summary(timelines),
        "tenants": _tenants_json(ctx, samples),
        "gpu_price_per_hour": ctx.settings.gpu_price_per_hour,
        "device": engine_device(ctx.engine),
        "experts": experts.to_json() if experts is not None else None,
        "precision": None
        if precision is None
        else {
            "current": precision.current,
            "available": list(precision.available),
            "num_switches": precision.num_switches,
        },
        "requests": [timeline_json(t, chunk_map.get(t.request_id, ()), now_s) for t in shown],
    }


async def _engine_chunks(engine: Any) -> list[Any]:
    """The engine's prefill chunk ring ([] for an engine without one, or a dead one)."""
    method = getattr(engine, "prefill_chunks", None)
    if method is None:
        return []
    try:
        return list(await asyncio.wait_for(method(), _CHUNKS_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - the timelines still show queue and decode
        logger.debug("no prefill chunks from the engine", exc_info=True)
        return []


def _check_access(request: Request, admin_key: str | None) -> None:
    """Open without an admin key; with one, 401 without a key and 403 for a wrong one."""
    if not admin_key:
        return
    presented = presented_key(request)
    if not presented:
        raise ServerError(
            401, "Missing admin key: pass it as 'Authorization: Bearer KEY'.", code="no_api_key"
        )
    if not keys_match(admin_key, presented):
        raise ServerError(403, "Incorrect admin key provided.", code="forbidden")


dashboard_router = APIRouter()


@dashboard_router.get("/dashboard", response_class=HTMLResponse)
async def dashboard_page() -> HTMLResponse:
    """The dashboard page (static; it polls /dashboard/data)."""
    return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-cache"})


@dashboard_router.get(DATA_PATH)
async def dashboard_json(request: Request) -> JSONResponse:
    """The dashboard's data (see `dashboard_data`)."""
    ctx: ServerContext = request.app.state.ctx
    settings = ctx.settings
    _check_access(request, settings.admin_key)
    hide = settings.tenants is not None and not settings.admin_key
    chunks = [] if hide else await _engine_chunks(ctx.engine)
    data = dashboard_data(ctx, chunks)
    data["requests_hidden"] = REQUESTS_HIDDEN if hide else None
    if hide:
        data["requests"] = []
    return JSONResponse(data, headers={"Cache-Control": "no-store"})
