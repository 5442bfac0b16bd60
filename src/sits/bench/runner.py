"""Run an online serving benchmark: probe, build prompts, send on schedule, collect records.

Order of work (only step 4 is timed):
1. find the model (`GET /v1/models`) unless given, proving the server is up and takes the key;
2. plan the prompts (token ids or calibrated text, see `sits.bench.probe`);
3. draw the schedule (`sits.bench.workload.build_schedule`) and every prompt up front, from
   `random.Random(seed)` in schedule order, so the same seed sends the same requests;
4. send a request shaped like the first one (its tenant, lengths and key, but a prompt of its
   own) `warmup_requests` times, one after the other (as vLLM's initial test prompt): it
   warms the server up and stops a misconfigured run (wrong key, model or endpoint) with a
   `BenchmarkError` before anything is timed;
5. from t = 0, send each request at its arrival time as its own task (at most
   `max_concurrency` in flight when set; a held request is sent when a slot frees, and its
   latencies count from that send), then wait for all of them.
The duration is step 5's wall time: from t = 0 until the last request ended.

Step 5 runs in this process, or in `client_procs` spawned client processes that share t = 0
(`sits.bench.sender.send_in_processes`): one Python process parses every streamed event, and
at a few thousand events per second its own lag would land in the latencies it reports. The
client's event-loop lag is measured through step 5 (`sits.bench.sender.send_with_probe`) and
reported (`RunResult.client_loop_lag_ms`): a p99 lag near the latencies measured means they
are the client's, not the server's.
"""

from __future__ import annotations

import gc
import logging
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from sits.bench.client import (
    COMPLETIONS,
    ENDPOINTS,
    auth_headers,
    build_body,
    make_client,
    send_streaming,
)
from sits.bench.errors import BenchmarkError
from sits.bench.probe import fetch_model, normalize_base_url, plan_prompts
from sits.bench.prompts import TextPrompts, TokenIdPrompts
from sits.bench.records import RequestRecord
from sits.bench.sender import Outgoing, lag_summary, send_in_processes, send_with_probe
from sits.bench.workload import ScheduledRequest, TenantLoad, build_schedule
from sits.core.errors import InvalidParameterError
from sits.obs.gc_pauses import freeze_startup_heap

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """Everything a serving run needs.

    Attributes:
        base_url: the server root (`http://host:port`; a trailing `/v1` is dropped).
        tenants: the client tenants (one "default" tenant outside a tenants mix).
        endpoint: `/v1/completions` or `/v1/chat/completions`.
        model: the `model` field sent; None = the first model the server lists.
        seed: seeds the arrivals (tenant i: seed + i) and the prompts.
        max_concurrency: most requests in flight at once; None = no limit.
        ignore_eos: send `ignore_eos` so every request generates exactly `output_len` tokens.
        prompt_format: "auto" | "token-ids" | "text" (see `sits.bench.prompts`).
        stream_usage: ask for the usage chunk (`stream_options.include_usage`).
        request_timeout_s: httpx timeout of each request (connect, read gaps, write).
        tenants_mix: the mix file the tenants came from, for the report; None without one.
        warmup_requests: untimed copies of the first request sent before the run (>= 0).
        client_procs: client processes the requests are spread over (>= 1;
            `sits.bench.sender`); more than one cannot be combined with max_concurrency.

    Raises:
        InvalidParameterError: an unknown endpoint, no tenants, max_concurrency < 1,
            client_procs < 1, or client_procs > 1 with max_concurrency.
    """

    base_url: str
    tenants: tuple[TenantLoad, ...]
    endpoint: str = COMPLETIONS
    model: str | None = None
    seed: int = 0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    prompt_format: str = "auto"
    stream_usage: bool = True
    request_timeout_s: float = 3600.0
    tenants_mix: str | None = None
    warmup_requests: int = 1
    client_procs: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))
        if self.endpoint not in ENDPOINTS:
            raise InvalidParameterError("endpoint", f"endpoint must be one of {ENDPOINTS}")
        if not self.tenants:
            raise InvalidParameterError("tenants", "at least one tenant is needed")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidParameterError("max_concurrency", "max_concurrency must be >= 1")
        if self.client_procs < 1:
            raise InvalidParameterError("client_procs", "client_procs must be >= 1")
        if self.client_procs > 1 and self.max_concurrency is not None:
            raise InvalidParameterError(
                "client_procs", "client_procs > 1 cannot be combined with max_concurrency"
            )
        if self.warmup_requests < 0:
            raise InvalidParameterError("warmup_requests", "warmup_requests must be >= 0")
        if not (self.request_timeout_s > 0):
            raise InvalidParameterError("request_timeout_s", "request_timeout_s must be > 0")


@dataclass(slots=True)
class RunResult:
    """What a run produced.

    Attributes:
        model: the model name sent; model_card: its `/v1/models` card (or just its id).
        prompts: how prompts were made (`TokenIdPrompts.describe()` / `TextPrompts.describe()`).
        records: one per request, in schedule order.
        duration_s: wall time of the timed part.
        started_at_unix_s: wall-clock time of t = 0.
    """

    config: ServeBenchConfig
    model: str
    model_card: dict[str, Any]
    prompts: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    started_at_unix_s: float = 0.0
    client_loop_lag_ms: dict[str, float] | None = None


async def _send_all(
    client: httpx.AsyncClient,
    url: str,
    schedule: list[ScheduledRequest],
    bodies: list[dict[str, Any]],
    records: list[RequestRecord],
    config: ServeBenchConfig,
) -> tuple[float, list[float]]:
    """Send every request at its time; returns (the wall time until the last one ended, the
    client's event-loop lag samples in ms)."""
    headers = [auth_headers(t.api_key) for t in config.tenants]
    outgoing = [
        Outgoing(req.index, req.arrival_s, bodies[req.index], headers[req.tenant_index])
        for req in schedule
    ]
    if config.client_procs > 1:
        return await send_in_processes(
            url, outgoing, records, config.client_procs, config.request_timeout_s
        )
    return await send_with_probe(
        client, url, outgoing, dict(enumerate(records)), time.perf_counter(),
        config.max_concurrency,
    )  # fmt: skip


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files to the hard one (each in-flight request holds a
    socket; the usual soft limit of 1024 would fail a large run); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            return soft
    return soft


async def _warm_up(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], n: int
) -> None:
    """Send `body` `n` times in a row, untimed.

    Raises:
        BenchmarkError: one of them failed (its status and error are in the message).
    """
    for _ in range(n):
        record = RequestRecord(index=-1, tenant="warmup", arrival_s=0.0, input_len=0, output_len=0)
        await send_streaming(client, url, body, headers, record, time.perf_counter())
        if not record.ok:
            raise BenchmarkError(
                f"the initial test request to {url} failed (HTTP {record.status}): {record.error}"
            )


def _build_requests(
    config: ServeBenchConfig, model: str, maker: TokenIdPrompts | TextPrompts
) -> tuple[list[ScheduledRequest], list[dict[str, Any]], list[RequestRecord]]:
    """The schedule, each request's body and its empty record, all in schedule order."""
    schedule = build_schedule(config.tenants, config.seed)
    rng = random.Random(config.seed)
    bodies, records = [], []
    for req in schedule:
        tenant = config.tenants[req.tenant_index]
        prompt = maker.make(tenant.input_len, rng)
        bodies.append(
            build_body(config.endpoint, model, prompt, tenant.output_len,
                       ignore_eos=config.ignore_eos, stream_usage=config.stream_usage)
        )  # fmt: skip
        records.append(
            RequestRecord(
                index=req.index, tenant=tenant.name, arrival_s=req.arrival_s,
                input_len=tenant.input_len, output_len=tenant.output_len,
                slo_ttft_ms=tenant.ttft_ms, slo_tpot_ms=tenant.tpot_ms,
            )
        )  # fmt: skip
    return schedule, bodies, records


async def run_serve_benchmark(config: ServeBenchConfig) -> RunResult:
    """Run the benchmark described by `config` (see the module docstring).

    Raises:
        BenchmarkError: the server cannot be reached, refuses the probes or the warm-up.
        InvalidParameterError: the prompt format cannot be used with this server or endpoint.
    """
    base_url = config.base_url
    probe_headers = auth_headers(config.tenants[0].api_key)
    async with make_client(config.request_timeout_s) as client:
        if config.model is None:
            card = await fetch_model(client, base_url, probe_headers)
            model = str(card["id"])
        else:
            card, model = {"id": config.model}, config.model
        max_input_len = max(t.input_len for t in config.tenants)
        maker = await plan_prompts(
            client, base_url, config.endpoint, probe_headers, model, config.prompt_format,
            config.seed, max_input_len,
        )  # fmt: skip
        schedule, bodies, records = _build_requests(config, model, maker)
        url = f"{base_url}{config.endpoint}"
        first = config.tenants[schedule[0].tenant_index]
        # Its own prompt (same shape as the first request's), so no request of the run finds
        # its prompt already in the prefix cache.
        warm_prompt = maker.make(first.input_len, random.Random(f"warmup-{config.seed}"))
        warm_body = build_body(
            config.endpoint, model, warm_prompt, first.output_len,
            ignore_eos=config.ignore_eos, stream_usage=config.stream_usage,
        )  # fmt: skip
        await _warm_up(client, url, warm_body, auth_headers(first.api_key), config.warmup_requests)
        raise_open_file_limit()
        result = RunResult(config, model, dict(card), maker.describe(), records)
        logger.info(
            "%s model=%s prompts=%s: sending %d requests of %d tenant(s) over %.1f s",
            url, model, result.prompts, len(schedule), len(config.tenants),
            schedule[-1].arrival_s,
        )  # fmt: skip
        result.started_at_unix_s = time.time()
        # What exists now lives through the run: keep the collector off it, so its pauses
        # (which stop the loop that timestamps every chunk) stay short as records grow.
        freeze_startup_heap()
        try:
            result.duration_s, lags = await _send_all(
                client, url, schedule, bodies, records, config
            )
        finally:
            gc.unfreeze()
        result.client_loop_lag_ms = lag_summary(lags)
    return result
