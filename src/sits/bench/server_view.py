"""The server's own view of a benchmark run: its /metrics after the load, per tenant.

A client's TTFT includes what happens before the engine sees a request (HTTP parsing,
validation, tokenization, admission) and after it produced the first token (the output's
trip to the HTTP process, detokenization, the SSE write). The server measures TTFT from the
moment it hands the request to the engine (`sits:tenant_time_to_first_token_seconds`), from
the moment the HTTP process received it to the first token's arrival there
(`sits:tenant_http_time_to_first_token_seconds`), and the engine's queueing until its first
step (`sits:request_queue_time_seconds`). Side by side with the client's figures they tell
where a TTFT goes: client - from receipt is the network, the socket write and the client;
from receipt - from hand-off is the HTTP process before and after the engine; from hand-off -
queue is the prefill and the output path.

`scrape(base_url)` fetches the text; `summarize(text)` reads it into a `ServerView`;
`format_view` prints one line per tenant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

_TTFT = "sits:tenant_time_to_first_token_seconds"
_HTTP_TTFT = "sits:tenant_http_time_to_first_token_seconds"
_SLO_REQUESTS = "sits:tenant_slo_requests"
_SLO_MET = "sits:tenant_slo_met"
_QUEUE = "sits:request_queue_time_seconds"


@dataclass(slots=True)
class TenantView:
    """One tenant's server-side figures.

    Attributes:
        ttft_count: engine requests with a first token.
        ttft_mean_s: their mean TTFT from hand-off to the engine (seconds), None if none.
        ttft_met_pct: % of the requests measured against its TTFT SLO that met it, judged
            by the server on the TTFT from receipt; requests the server shed (503) count as
            misses (None without an SLO or without requests).
        http_ttft_mean_s: their mean TTFT from the HTTP request's receipt (seconds), None if
            the server does not report it.
    """

    ttft_count: int = 0
    ttft_mean_s: float | None = None
    ttft_met_pct: float | None = None
    http_ttft_mean_s: float | None = None


@dataclass(slots=True)
class ServerView:
    """A run's server-side figures: per tenant, and the engine's mean queue time (seconds)."""

    tenants: dict[str, TenantView] = field(default_factory=dict)
    queue_mean_s: float | None = None


def scrape(base_url: str, timeout_s: float = 10.0) -> str:
    """GET {base_url}/metrics (Prometheus text).

    Raises:
        httpx.HTTPError: the server did not answer 200.
    """
    response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return response.text


def summarize(text: str) -> ServerView:
    """Read the per-tenant TTFT histogram and SLO counters, and the queue-time histogram."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    http_sums: dict[str, float] = {}
    http_counts: dict[str, float] = {}
    slo_total: dict[str, float] = {}
    slo_met: dict[str, float] = {}
    queue = [0.0, 0.0]  # sum, count
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            tenant = sample.labels.get("tenant")
            if sample.name == f"{_TTFT}_sum" and tenant:
                sums[tenant] = sums.get(tenant, 0.0) + sample.value
            elif sample.name == f"{_TTFT}_count" and tenant:
                counts[tenant] = counts.get(tenant, 0.0) + sample.value
            elif sample.name == f"{_HTTP_TTFT}_sum" and tenant:
                http_sums[tenant] = http_sums.get(tenant, 0.0) + sample.value
            elif sample.name == f"{_HTTP_TTFT}_count" and tenant:
                http_counts[tenant] = http_counts.get(tenant, 0.0) + sample.value
            elif sample.labels.get("slo") == "ttft" and tenant:
                if sample.name == f"{_SLO_REQUESTS}_total":
                    slo_total[tenant] = slo_total.get(tenant, 0.0) + sample.value
                elif sample.name == f"{_SLO_MET}_total":
                    slo_met[tenant] = slo_met.get(tenant, 0.0) + sample.value
            elif sample.name == f"{_QUEUE}_sum":
                queue[0] += sample.value
            elif sample.name == f"{_QUEUE}_count":
                queue[1] += sample.value
    view = ServerView(queue_mean_s=queue[0] / queue[1] if queue[1] else None)
    for tenant in sorted(set(counts) | set(slo_total)):
        count = int(counts.get(tenant, 0))
        total = slo_total.get(tenant, 0.0)
        http_count = http_counts.get(tenant, 0.0)
        view.tenants[tenant] = TenantView(
            ttft_count=count,
            ttft_mean_s=sums.get(tenant, 0.0) / count if count else None,
            ttft_met_pct=100.0 * slo_met.get(tenant, 0.0) / total if total else None,
            http_ttft_mean_s=http_sums.get(tenant, 0.0) / http_count if http_count else None,
        )
    return view


def format_view(view: ServerView, mode: str) -> str:
    """One line per tenant, e.g. `[qos] server view: gold TTFT mean 84.1 ms from hand-off,
    95.3 ms from receipt, SLO met 100.0 % (1388 requests); engine queue time mean 12.0 ms`."""
    parts = []
    for tenant, t in view.tenants.items():
        mean = "-" if t.ttft_mean_s is None else f"{t.ttft_mean_s * 1e3:.1f} ms"
        http = (
            ""
            if t.http_ttft_mean_s is None
            else f", {t.http_ttft_mean_s * 1e3:.1f} ms from receipt"
        )
        met = "" if t.ttft_met_pct is None else f", SLO met {t.ttft_met_pct:.1f} %"
        parts.append(
            f"{tenant} TTFT mean {mean} from hand-off{http}{met} ({t.ttft_count} requests)"
        )
    queue = "-" if view.queue_mean_s is None else f"{view.queue_mean_s * 1e3:.1f} ms"
    body = "; ".join(parts) if parts else "no tenant TTFTs"
    return f"[{mode}] server view: {body}; engine queue time mean {queue}"
