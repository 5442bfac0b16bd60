"""OpenTelemetry traces of a live server, captured with the SDK's in-memory exporter.

Two servers on the tiny MoE checkpoint: one keeping every trace (ratio 1, 16-token prefill
chunks, no prefix cache, so the chunk events are known exactly) and one keeping none by ratio
(ratio 0, tenants with and without SLOs and rate limits), which must still export the whole
trace of every failed or over-SLO request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from sits.admission import BreakerConfig, OverloadState
from sits.config import EngineConfig
from sits.obs.tracing import TracingSettings
from sits.server.context import ServerSettings
from sits.server.qos.admit import QosSettings
from sits.tenancy import TenantsConfig
from tests.server.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.server.live import LiveServer
from tests.server.tenant_fixtures import NEVER_OVERLOADED, auth, ctx_of, tenant, tenant_engine

PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
CHUNK_TOKENS = 16
ENGINE_SPANS = ["queue", "prefill", "decode", "detokenize"]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TENANTS = TenantsConfig(
    (
        tenant("plain"),
        tenant("strict", ttft_ms=0.001),  # 1 microsecond: every request is over its SLO
        tenant("limited", requests_per_minute=1),
    )
)


class Traces:
    """The spans a live server exports, read trace by trace."""

    def __init__(self, live: LiveServer, exporter: InMemorySpanExporter) -> None:
        self.live = live
        self.exporter = exporter
        self.sampler = ctx_of(live).tracer.tracing.sampler
        self.num_seen = 0

    @property
    def num_decided(self) -> int:
        return self.sampler.num_kept_traces + self.sampler.num_dropped_traces

    def take(self, num_traces: int) -> list[ReadableSpan]:
        """Wait for `num_traces` more traces to end; the spans exported for them."""
        self.num_seen += num_traces
        assert self.live.wait_until(lambda: self.num_decided >= self.num_seen)
        assert self.num_decided == self.num_seen
        assert ctx_of(self.live).tracer.force_flush(30)
        spans = list(self.exporter.get_finished_spans())
        self.exporter.clear()
        return spans


def _serve(settings: ServerSettings, make_engine: Callable[[], Any]) -> Iterator[Traces]:
    exporter = settings.tracing.exporter
    with LiveServer(make_engine, settings) as live:
        yield Traces(live, exporter)


@pytest.fixture(scope="module")
def all_kept(tiny_model_factory) -> Iterator[Traces]:
    """Ratio 1, one default tenant, 16-token prefill chunks, no prefix cache."""
    model_dir = tiny_model_factory("qwen3_moe")
    tracing = TracingSettings(sample_ratio=1.0, exporter=InMemorySpanExporter())

    def make_engine() -> Any:
        from sits.engine.async_llm import AsyncLLM

        config = EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_num_batched_tokens=CHUNK_TOKENS,
            enable_prefix_caching=False,
        )
        return AsyncLLM(config)

    yield from _serve(ServerSettings(tracing=tracing), make_engine)


@pytest.fixture(scope="module")
def none_kept(tiny_model_factory) -> Iterator[Traces]:
    """Ratio 0, three tenants; a breaker that never opens (engine failures are injected)."""
    model_dir = tiny_model_factory("qwen3_moe")
    tracing = TracingSettings(sample_ratio=0.0, exporter=InMemorySpanExporter())
    breaker = BreakerConfig(max_consecutive_failures=1000, min_samples=1000)
    settings = ServerSettings(
        tenants=TENANTS,
        qos=QosSettings(breaker=breaker, overload=NEVER_OVERLOADED),
        tracing=tracing,
    )
    yield from _serve(settings, tenant_engine(model_dir, TENANTS))


def _by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def _check_tree(spans: list[ReadableSpan], root_name: str, children: list[str]) -> ReadableSpan:
    """Assert one root named `root_name` with exactly `children` under it; returns the root."""
    named = _by_name(spans)
    assert sorted(named) == sorted([root_name, *children])
    root = named[root_name]
    trace_id = root.context.trace_id
    for name in children:
        child = named[name]
        assert child.context.trace_id == trace_id
        assert child.parent is not None and child.parent.span_id == root.context.span_id
    return root


def _traceparent_of(span: ReadableSpan) -> str:
    """The W3C traceparent naming `span` (version 00)."""
    ctx = span.context
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _check_engine_timeline(named: dict[str, ReadableSpan], root: ReadableSpan) -> None:
    """The engine spans follow each other: queue -> prefill -> decode, inside the request."""
    queue, prefill, decode = named["queue"], named["prefill"], named["decode"]
    assert root.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time <= root.end_time
    detok = named["detokenize"]
    assert decode.start_time <= detok.start_time <= detok.end_time <= decode.end_time


def _inject_engine_failure(live: LiveServer) -> Any:
    """Make the engine's next requests fail after their first output; returns the original."""
    original = live.engine.generate

    async def generate(*args: Any, **kwargs: Any):
        outputs = original(*args, **kwargs)
        try:
            async for output in outputs:
                yield output
                raise RuntimeError("injected engine failure")
        finally:
            await outputs.aclose()

    live.engine.generate = generate
    return original


# --- ratio 1: span trees and attributes ------------------------------------------------------


def test_completion_span_tree_and_attributes(all_kept: Traces) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with all_kept.live.http() as http:
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    num_prompt_tokens = answer["usage"]["prompt_tokens"]
    spans = all_kept.take(1)
    root = _check_tree(spans, "POST /v1/completions", ["admission", *ENGINE_SPANS])
    named = _by_name(spans)
    model = all_kept.live.engine.model_name
    assert dict(root.attributes) == {
        "http.request.method": "POST",
        "url.path": "/v1/completions",
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
        "server.address": "127.0.0.1",
        "server.port": all_kept.live.port,
        "sits.tenant": "default",
        "sits.outcome": "ok",
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "sits",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.request.top_p": 1.0,
        "gen_ai.response.id": answer["id"],
        "gen_ai.response.model": model,
        "gen_ai.usage.input_tokens": num_prompt_tokens,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.response.finish_reasons": ("length",),
        "sits.ttft_ms": root.attributes["sits.ttft_ms"],
        "sits.tpot_ms": root.attributes["sits.tpot_ms"],
    }
    assert root.parent is None
    assert root.status.status_code is StatusCode.UNSET
    _check_engine_timeline(named, root)
    prefill = named["prefill"]
    full, rest = divmod(num_prompt_tokens, CHUNK_TOKENS)
    chunks = [CHUNK_TOKENS] * full + ([rest] if rest else [])
    assert len(chunks) >= 2
    assert [e.name for e in prefill.events] == ["prefill_chunk"] * len(chunks)
    assert [e.attributes["sits.num_tokens"] for e in prefill.events] == chunks
    assert [e.attributes["sits.chunk_index"] for e in prefill.events] == list(range(len(chunks)))
    times = [e.timestamp for e in prefill.events]
    assert (
        times == sorted(times) and prefill.start_time <= times[0] and times[-1] <= prefill.end_time
    )
    assert prefill.attributes["sits.prefill.num_chunks"] == len(chunks)
    assert prefill.attributes["gen_ai.usage.input_tokens"] == num_prompt_tokens
    assert prefill.attributes["sits.num_cached_tokens"] == 0
    assert named["decode"].attributes["gen_ai.usage.output_tokens"] == 5
    assert named["decode"].events == ()
    assert named["detokenize"].attributes["sits.detokenize.aggregated"] is True
    for name in ENGINE_SPANS:
        assert named[name].attributes["sits.prompt_index"] == 0


def test_streaming_chat_span_tree_and_traceparent_header(all_kept: Traces) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 6,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        all_kept.live.http() as http,
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        traceparent = resp.headers["traceparent"]
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    spans = all_kept.take(1)
    root = _check_tree(spans, "POST /v1/chat/completions", ["admission", *ENGINE_SPANS])
    _check_engine_timeline(_by_name(spans), root)
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.response.id"] == chunks[0]["id"]
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == (finish,)
    assert attrs["http.response.status_code"] == 200
    assert attrs["sits.outcome"] == "ok"
    assert traceparent == _traceparent_of(root)


def test_a_batch_of_prompts_has_engine_spans_per_prompt(all_kept: Traces) -> None:
    body = {"prompt": ["a b c", "d e f g"], "max_tokens": 2, "n": 2, "ignore_eos": True}
    with all_kept.live.http() as http:
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    spans = all_kept.take(1)
    assert len(spans) == 2 + 2 * len(ENGINE_SPANS)
    (root,) = [s for s in spans if s.parent is None]
    assert root.name == "POST /v1/completions"
    engine = [s for s in spans if s.name in ENGINE_SPANS]
    assert sorted((s.attributes["sits.prompt_index"], s.name) for s in engine) == sorted(
        (index, name) for index in (0, 1) for name in ENGINE_SPANS
    )
    assert all(s.parent.span_id == root.context.span_id for s in spans if s is not root)
    attrs = root.attributes
    assert attrs["gen_ai.request.choice.count"] == 2
    assert attrs["gen_ai.response.finish_reasons"] == ("length",) * 4
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 8
    decode_tokens = [
        s.attributes["gen_ai.usage.output_tokens"] for s in engine if s.name == "decode"
    ]
    assert decode_tokens == [4, 4]


def test_incoming_traceparent_becomes_the_parent(all_kept: Traces) -> None:
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    with all_kept.live.http() as http:
        resp = http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=headers
        )
    assert resp.status_code == 200
    spans = all_kept.take(1)
    root = _check_tree(spans, "POST /v1/completions", ["admission", *ENGINE_SPANS])
    assert {span.context.trace_id for span in spans} == {int(TRACE_ID, 16)}
    assert root.parent is not None and root.parent.is_remote
    assert root.parent.span_id == int(PARENT_SPAN_ID, 16)
    assert root.context.span_id != int(PARENT_SPAN_ID, 16)
    assert resp.headers["traceparent"] == _traceparent_of(root)
    assert resp.headers["traceparent"].startswith(f"00-{TRACE_ID}-")


def test_invalid_traceparent_starts_a_new_trace(all_kept: Traces) -> None:
    headers = {"traceparent": f"00-{'0' * 32}-{PARENT_SPAN_ID}-01"}  # all-zero trace id
    with all_kept.live.http() as http:
        resp = http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=headers
        )
    assert resp.status_code == 200
    (root,) = [s for s in all_kept.take(1) if s.name == "POST /v1/completions"]
    assert root.parent is None and root.context.trace_id != 0


def test_ratio_one_exports_every_traced_route(all_kept: Traces) -> None:
    with all_kept.live.http() as http:
        assert http.get("/health").status_code == 200  # not traced
        assert http.get("/v1/models").status_code == 200
        assert (
            http.post("/v1/completions", json={"prompt": "x y", "max_tokens": 1}).status_code == 200
        )
    spans = all_kept.take(2)
    names = sorted(span.name for span in spans)
    assert names == sorted(["GET /v1/models", "POST /v1/completions", "admission", *ENGINE_SPANS])
    assert len({span.context.trace_id for span in spans}) == 2
    (models,) = [s for s in spans if s.name == "GET /v1/models"]
    assert "gen_ai.operation.name" not in models.attributes
    assert all_kept.sampler.num_dropped_traces == 0


def test_tracing_off_by_default(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    with LiveServer(tenant_engine(model_dir, TENANTS), ServerSettings(tenants=TENANTS)) as live:
        with live.http() as http:
            resp = http.post(
                "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=auth("plain")
            )
        assert resp.status_code == 200
        assert "traceparent" not in resp.headers
        assert ctx_of(live).tracer is None
        assert live.engine.engine_core.stats.record_request_chunks is False
        assert live.engine._processor.time_detokenize is False


# --- ratio 0: only failures and SLO misses are kept ------------------------------------------


def _complete(traces: Traces, tenant_id: str, **body: Any):
    payload = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **body}
    with traces.live.http() as http:
        return http.post("/v1/completions", json=payload, headers=auth(tenant_id))


def test_ratio_zero_drops_a_normal_request(none_kept: Traces) -> None:
    dropped = none_kept.sampler.num_dropped_traces
    assert _complete(none_kept, "plain").status_code == 200
    assert none_kept.take(1) == []
    assert none_kept.sampler.num_dropped_traces == dropped + 1


def test_ratio_zero_keeps_a_rejected_request(none_kept: Traces) -> None:
    resp = _complete(none_kept, "plain", max_tokens=100_000)  # longer than the context: 400
    assert resp.status_code == 400
    spans = none_kept.take(1)
    root = _check_tree(spans, "POST /v1/completions", ["admission"])
    assert root.attributes["error.type"] == "400"
    assert root.attributes["http.response.status_code"] == 400
    assert root.attributes["sits.outcome"] == "400"
    assert root.attributes["sits.tenant"] == "plain"
    assert root.status.status_code is StatusCode.UNSET  # a client error is no server fault
    admission = _by_name(spans)["admission"]
    assert admission.attributes["error.type"] == "400"
    assert [e.name for e in admission.events] == ["exception"]


def test_ratio_zero_keeps_a_rate_limited_request(none_kept: Traces) -> None:
    assert _complete(none_kept, "limited").status_code == 200
    resp = _complete(none_kept, "limited")
    assert resp.status_code == 429
    spans = none_kept.take(2)  # the first is dropped, the 429 kept
    root = _check_tree(spans, "POST /v1/completions", ["admission"])
    assert root.attributes["error.type"] == "429"
    assert root.attributes["sits.tenant"] == "limited"
    assert resp.headers["traceparent"].split("-")[1] == f"{root.context.trace_id:032x}"


def test_ratio_zero_keeps_a_shed_request(none_kept: Traces) -> None:
    qos = ctx_of(none_kept.live).qos
    qos.force_overload_state(OverloadState.RED)
    try:
        resp = _complete(none_kept, "plain")
    finally:
        qos.force_overload_state(None)
    assert resp.status_code == 503
    root = _check_tree(none_kept.take(1), "POST /v1/completions", ["admission"])
    assert root.attributes["error.type"] == "503"
    assert root.status.status_code is StatusCode.ERROR


def test_ratio_zero_keeps_an_engine_failure(none_kept: Traces) -> None:
    live = none_kept.live
    original = _inject_engine_failure(live)
    try:
        resp = _complete(none_kept, "plain")
        stream = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
        with (
            live.http() as http,
            http.stream("POST", "/v1/completions", json=stream, headers=auth("plain")) as sresp,
        ):
            assert sresp.status_code == 200
            events = [line for line in sresp.iter_lines() if line.startswith("data: ")]
    finally:
        live.engine.generate = original
    assert resp.status_code == 500
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    spans = none_kept.take(2)
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 2
    by_status = {root.attributes["http.response.status_code"]: root for root in roots}
    assert sorted(by_status) == [200, 500]
    for status, error_type in ((500, "500"), (200, "engine_error")):
        root = by_status[status]
        trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
        _check_tree(trace, "POST /v1/completions", ["admission", *ENGINE_SPANS])
        assert root.attributes["error.type"] == error_type
        assert root.attributes["sits.outcome"] == "error"
        assert root.status.status_code is StatusCode.ERROR
        assert root.attributes["gen_ai.response.finish_reasons"] == ()


def test_ratio_zero_keeps_a_request_over_its_slo(none_kept: Traces) -> None:
    resp = _complete(none_kept, "strict")
    assert resp.status_code == 200
    spans = none_kept.take(1)
    root = _check_tree(spans, "POST /v1/completions", ["admission", *ENGINE_SPANS])
    attrs = root.attributes
    assert attrs["sits.slo.violated"] is True
    assert attrs["sits.slo.violations"] == ("ttft",)
    assert attrs["sits.slo.ttft_ms"] == 0.001
    assert attrs["sits.ttft_ms"] > 0.001
    assert attrs["sits.tenant"] == "strict"
    assert "error.type" not in attrs and root.status.status_code is StatusCode.UNSET


def test_ratio_zero_follows_a_sampled_upstream_parent(none_kept: Traces) -> None:
    sampled = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    not_sampled = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-00"}
    payload = {"prompt": PROMPT, "max_tokens": 2}
    flags = []
    with none_kept.live.http() as http:
        for headers in ({}, sampled, not_sampled):
            resp = http.post("/v1/completions", json=payload, headers={**auth("plain"), **headers})
            assert resp.status_code == 200
            flags.append(int(resp.headers["traceparent"].rsplit("-", 1)[1], 16) & 1)
    # The response's sampled flag is the head decision: ratio 0, then the caller's flag.
    assert flags == [0, 1, 0]
    spans = none_kept.take(3)
    root = _check_tree(spans, "POST /v1/completions", ["admission", *ENGINE_SPANS])
    assert root.parent.trace_flags.sampled
    assert {span.context.trace_id for span in spans} == {int(TRACE_ID, 16)}
