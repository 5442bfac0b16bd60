"""The data of the live dashboard (`GET /dashboard/data`), shaped from metrics and timelines.

The route and the assembly of the whole body live in `sits.server.routes_dashboard`; these are
its pure parts:
- `MetricSamples`: every sample of a Prometheus registry at one instant, so the page shows
  exactly what `/metrics` exports;
- `tenant_load`: a tenant's running and waiting requests and KV blocks, from the same samples
  as the totals when the scheduler keeps no per-tenant numbers (no configured tenants);
- `timeline_json`: one ended request's bars (queue, prefill chunks, decode), in seconds after
  its arrival (`sits.obs.timeline.RequestTimeline`);
- `chunks_by_request`: the engine's prefill chunks (`sits.engine.stats.PrefillChunk`, read by
  attribute) matched to their parent request (its samples run as `id` or `id-i`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from sits.obs.timeline import RequestTimeline

_LabelKey = tuple[str, frozenset[tuple[str, str]]]


class MetricSamples:
    """Every sample of a registry at one instant, looked up by name and labels (`model_name`
    ignored: one server serves one model)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._values: dict[_LabelKey, float] = {}
        self._by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in registry.collect():
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                self._values[(sample.name, frozenset(labels.items()))] = sample.value
                self._by_name.setdefault(sample.name, []).append((labels, sample.value))

    def get(self, name: str, **labels: str) -> float:
        """The sample's value, 0.0 when it is not exported."""
        return self._values.get((name, frozenset(labels.items())), 0.0)

    def by_label(self, name: str, label: str, **where: str) -> dict[str, float]:
        """label value -> value of the samples of `name` whose other labels match `where`."""
        out: dict[str, float] = {}
        for labels, value in self._by_name.get(name, ()):
            if label in labels and all(labels.get(k) == v for k, v in where.items()):
                out[labels[label]] = out.get(labels[label], 0.0) + value
        return out


def tenant_load(samples: MetricSamples, tenant_id: str, *, per_tenant: bool) -> dict[str, float]:
    """A tenant's requests running and waiting in the scheduler and the KV blocks they hold.

    Args:
        samples: the registry's samples.
        tenant_id: the tenant.
        per_tenant: the scheduler keeps per-tenant numbers (configured tenants:
            `sits:tenant_num_requests_running`, `..._waiting`, `sits:tenant_kv_blocks_used`).
            Without them the scheduler is plain FCFS and keeps none: its one tenant (the
            default) owns the whole engine, so its numbers are the engine's totals
            (`sits:num_requests_running`, `..._waiting`, device-tier blocks used).

    Returns:
        {"num_running", "num_waiting", "kv_blocks_used"}: counts (requests, blocks).
    """
    if per_tenant:
        return {
            "num_running": samples.get("sits:tenant_num_requests_running", tenant=tenant_id),
            "num_waiting": samples.get("sits:tenant_num_requests_waiting", tenant=tenant_id),
            "kv_blocks_used": samples.get("sits:tenant_kv_blocks_used", tenant=tenant_id),
        }
    return {
        "num_running": samples.get("sits:num_requests_running"),
        "num_waiting": samples.get("sits:num_requests_waiting"),
        "kv_blocks_used": samples.get("sits:kv_tier_blocks_used", tier="device"),
    }


def finite_or_none(value: float | None) -> float | None:
    """`value` when it is a finite number, else None (JSON has no inf or NaN)."""
    return value if value is not None and math.isfinite(value) else None


def _offset(t: float | None, origin: float) -> float | None:
    return None if t is None else t - origin


def timeline_json(timeline: RequestTimeline, chunks: Sequence[Any], now_s: float) -> dict[str, Any]:
    """One request's bars, in seconds after its arrival."""
    origin = timeline.arrival_s
    return {
        "request_id": timeline.request_id,
        "tenant": timeline.tenant_id,
        "age_s": now_s - origin,
        "queue_end_s": _offset(timeline.first_scheduled_s, origin),
        "first_token_s": _offset(timeline.first_token_s, origin),
        "last_token_s": _offset(timeline.last_token_s, origin),
        "finished_s": timeline.finished_s - origin,
        "prefill_chunks": [
            {
                "start_s": c.start_s - origin,
                "end_s": c.end_s - origin,
                "start_position": c.start_position,
                "num_tokens": c.num_tokens,
            }
            for c in chunks
        ],
        "num_prompt_tokens": timeline.num_prompt_tokens,
        "num_cached_tokens": timeline.num_cached_tokens,
        "num_output_tokens": timeline.num_output_tokens,
        "num_samples": timeline.num_samples,
        "finish_reason": timeline.finish_reason,
    }


def chunks_by_request(
    timelines: Iterable[RequestTimeline], chunks: Iterable[Any]
) -> dict[str, list[Any]]:
    """Parent request id -> its prefill chunks (its samples run as `id` or `id-i`)."""
    parent_of: dict[str, str] = {}
    for t in timelines:
        if t.num_samples == 1:
            parent_of[t.request_id] = t.request_id
        else:
            for i in range(t.num_samples):
                parent_of[f"{t.request_id}-{i}"] = t.request_id
    out: dict[str, list[Any]] = {}
    for chunk in chunks:
        parent = parent_of.get(chunk.request_id)
        if parent is not None:
            out.setdefault(parent, []).append(chunk)
    return out
