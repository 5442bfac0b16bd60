"""Tracing pieces without a server: settings from flags and OTEL_* variables, the tail-sampling
processor's decisions, and the engine spans built from a timeline."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from sits.core.errors import InvalidParameterError
from sits.obs.trace_spans import EngineTimeline, add_engine_spans
from sits.obs.tracing import (
    TailSamplingProcessor,
    TracingSettings,
    resolve_tracing,
    traces_endpoint,
)

LOW_ID = 0x0AF7651916CD43DD0000000000000001  # low 64 bits tiny: under any ratio > 0
HIGH_ID = 0x0AF7651916CD43DDFFFFFFFFFFFFFFFF  # low 64 bits maximal: only under ratio 1


# --- settings --------------------------------------------------------------------------------


def test_tracing_is_off_without_endpoint() -> None:
    assert resolve_tracing(None, None, {}) is None
    assert resolve_tracing(None, 0.5, {"OTEL_TRACES_SAMPLER_ARG": "0.1"}) is None


def test_tracing_from_the_flags() -> None:
    settings = resolve_tracing("http://collector:4318", 0.25, {})
    assert settings == TracingSettings(
        endpoint="http://collector:4318/v1/traces", sample_ratio=0.25
    )


def test_tracing_from_the_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    assert resolve_tracing(None, None, env) == TracingSettings(endpoint=None, sample_ratio=0.1)
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}
    assert resolve_tracing(None, None, env) == TracingSettings(endpoint=None, sample_ratio=1.0)
    # The flag wins over the variable; OTEL_SDK_DISABLED turns everything off.
    assert resolve_tracing(None, 0.0, {**env, "OTEL_TRACES_SAMPLER_ARG": "0.7"}).sample_ratio == 0
    assert resolve_tracing("http://x:1/t", 1.0, {"OTEL_SDK_DISABLED": "true"}) is None


def test_bad_tracing_settings_are_refused() -> None:
    with pytest.raises(InvalidParameterError) as info:
        resolve_tracing("http://c:4318", 1.5, {})
    assert info.value.param == "trace_sample_ratio"
    with pytest.raises(InvalidParameterError) as info:
        resolve_tracing("http://c:4318", None, {"OTEL_TRACES_SAMPLER_ARG": "half"})
    assert info.value.param == "trace_sample_ratio"
    with pytest.raises(InvalidParameterError) as info:
        resolve_tracing("collector:4318", None, {})
    assert info.value.param == "otlp_traces_endpoint"
    with pytest.raises(InvalidParameterError):
        TracingSettings(max_buffered_traces=0)


def test_serve_flags() -> None:
    import argparse

    from sits.cli.serve import add_serve_parser, tracing_settings_arg

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert tracing_settings_arg(args, {}) is None
    flags = ["serve", "--otlp-traces-endpoint", "http://c:4318", "--trace-sample-ratio", "0.2"]
    assert tracing_settings_arg(parser.parse_args(flags), {}) == TracingSettings(
        endpoint="http://c:4318/v1/traces", sample_ratio=0.2
    )


def test_traces_endpoint_keeps_a_path() -> None:
    assert traces_endpoint("http://c:4318/") == ("http://c:4318/v1/traces", "http/protobuf")
    assert traces_endpoint("https://c/otlp/v1/traces") == (
        "https://c/otlp/v1/traces",
        "http/protobuf",
    )


# --- tail sampling ---------------------------------------------------------------------------


class _ChosenIds(RandomIdGenerator):
    """Trace ids chosen by the test for local roots (`next_trace_id`), random otherwise."""

    next_trace_id: int | None = None

    def generate_trace_id(self) -> int:
        chosen, self.next_trace_id = self.next_trace_id, None
        return chosen if chosen is not None else super().generate_trace_id()


_IDS = _ChosenIds()


def _pipeline(ratio: float, **kwargs: int):
    exporter = InMemorySpanExporter()
    sampler = TailSamplingProcessor(SimpleSpanProcessor(exporter), ratio, **kwargs)
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False, id_generator=_IDS)
    provider.add_span_processor(sampler)
    return provider.get_tracer("test"), sampler, exporter


def _local_root(tracer, name: str, trace_id: int):
    """A root span with no parent (a request without `traceparent`) of a chosen trace id."""
    _IDS.next_trace_id = trace_id
    return tracer.start_span(name)


def _remote_parent(trace_id: int, sampled: bool = False):
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    ctx = SpanContext(trace_id, 0x1234, is_remote=True, trace_flags=flags)
    return set_span_in_context(NonRecordingSpan(ctx))


def _trace(
    tracer, trace_id: int, *, sampled: bool | None = None, error: bool = False, **attrs
) -> None:
    """A root with two children: a local root of `trace_id` (sampled None), or the child of a
    remote parent of `trace_id` whose sampled flag is `sampled`."""
    if sampled is None:
        root = _local_root(tracer, "root", trace_id)
    else:
        root = tracer.start_span("root", context=_remote_parent(trace_id, sampled))
    for name in ("a", "b"):
        child = tracer.start_span(name, context=set_span_in_context(root))
        if error and name == "b":
            child.set_status(Status(StatusCode.ERROR))
        child.end()
    for key, value in attrs.items():
        root.set_attribute(key, value)
    root.end()


def test_ratio_decides_by_trace_id() -> None:
    tracer, sampler, exporter = _pipeline(0.5)
    _trace(tracer, LOW_ID)
    _trace(tracer, HIGH_ID)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["a", "b", "root"]
    assert {s.context.trace_id for s in spans} == {LOW_ID}
    assert (sampler.num_kept_traces, sampler.num_dropped_traces) == (1, 1)


def test_ratio_zero_keeps_errors_slo_misses_and_sampled_parents() -> None:
    tracer, sampler, exporter = _pipeline(0.0)
    _trace(tracer, LOW_ID)  # dropped
    _trace(tracer, LOW_ID + 1, error=True)  # a child failed
    _trace(tracer, LOW_ID + 2, **{"error.type": "429"})  # a client error on the root
    _trace(tracer, LOW_ID + 3, **{"sits.slo.violated": True})
    _trace(tracer, LOW_ID + 4, sampled=True)  # the upstream service sampled it
    _trace(tracer, LOW_ID + 5, **{"sits.slo.violated": False})  # dropped
    kept = sorted({s.context.trace_id - LOW_ID for s in exporter.get_finished_spans()})
    assert kept == [1, 2, 3, 4]
    assert len(exporter.get_finished_spans()) == 4 * 3
    assert (sampler.num_kept_traces, sampler.num_dropped_traces) == (4, 2)


def test_an_unsampled_remote_parent_is_followed_at_any_ratio() -> None:
    """ParentBased: the caller decided not to sample; only errors and SLO misses override."""
    tracer, sampler, exporter = _pipeline(1.0)
    _trace(tracer, LOW_ID, sampled=False)  # dropped although the ratio keeps everything
    _trace(tracer, LOW_ID + 1, sampled=False, error=True)  # kept: an error
    _trace(tracer, LOW_ID + 2)  # kept: no parent, ratio 1
    kept = sorted({s.context.trace_id - LOW_ID for s in exporter.get_finished_spans()})
    assert kept == [1, 2]
    assert sampler.head_sampled(LOW_ID, None) is True
    assert (sampler.num_kept_traces, sampler.num_dropped_traces) == (2, 1)


def test_a_span_ending_after_its_root_follows_the_decision() -> None:
    tracer, sampler, exporter = _pipeline(0.0)
    for trace_id, attrs in ((LOW_ID, {"error.type": "500"}), (LOW_ID + 1, {})):
        root = tracer.start_span("root", context=_remote_parent(trace_id))
        late = tracer.start_span("late", context=set_span_in_context(root))
        for key, value in attrs.items():
            root.set_attribute(key, value)
        root.end()
        late.end()
    spans = exporter.get_finished_spans()
    assert [(s.name, s.context.trace_id) for s in spans] == [("root", LOW_ID), ("late", LOW_ID)]
    assert (sampler.num_kept_traces, sampler.num_dropped_traces) == (1, 1)


def test_buffered_traces_are_bounded() -> None:
    tracer, sampler, exporter = _pipeline(1.0, max_buffered_traces=1)
    first = _local_root(tracer, "first", LOW_ID)
    second = _local_root(tracer, "second", LOW_ID + 1)
    for root in (first, second):
        tracer.start_span("child", context=set_span_in_context(root)).end()
    assert sampler.num_dropped_traces == 1  # the oldest waiting trace went
    first.end()  # its decision is remembered: dropped
    second.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["child", "second"]
    assert (sampler.num_kept_traces, sampler.num_dropped_traces) == (1, 1)


# --- engine spans ----------------------------------------------------------------------------


def _engine_spans(timeline: EngineTimeline):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    parent = tracer.start_span("request")
    names = add_engine_spans(tracer, set_span_in_context(parent), timeline, 0, {"k": 1})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert list(spans) == names
    assert all(s.parent.span_id == parent.get_span_context().span_id for s in spans.values())
    return spans


def test_a_request_never_scheduled_has_a_queue_span_only() -> None:
    spans = _engine_spans(EngineTimeline(1.0, None, None, None, None, end_s=3.5))
    (queue,) = spans.values()
    assert (queue.name, queue.start_time, queue.end_time) == ("queue", 1_000_000_000, 3_500_000_000)
    assert dict(queue.attributes) == {"k": 1}


def test_a_request_cut_during_prefill_ends_its_prefill_at_the_end() -> None:
    timeline = EngineTimeline(1.0, 2.0, None, None, None, end_s=4.0, prefill_chunks=((3.0, 8),))
    spans = _engine_spans(timeline)
    assert list(spans) == ["queue", "prefill"]
    prefill = spans["prefill"]
    assert (prefill.start_time, prefill.end_time) == (2_000_000_000, 4_000_000_000)
    assert [(e.timestamp, e.attributes["sits.num_tokens"]) for e in prefill.events] == [
        (3_000_000_000, 8)
    ]


def test_recomputed_chunks_are_decode_events_and_detokenize_ends_at_the_last_token() -> None:
    timeline = EngineTimeline(
        arrival_s=1.0,
        first_scheduled_s=1.5,
        first_token_s=2.0,
        last_token_s=6.0,
        finished_s=6.0,
        end_s=7.0,
        prefill_chunks=((1.75, 16), (1.9, 4), (4.0, 30)),  # the last after a preemption
        detokenize_s=0.25,
        num_prompt_tokens=20,
        num_output_tokens=11,
    )
    spans = _engine_spans(timeline)
    assert list(spans) == ["queue", "prefill", "decode", "detokenize"]
    prefill, decode, detok = spans["prefill"], spans["decode"], spans["detokenize"]
    assert [e.attributes["sits.num_tokens"] for e in prefill.events] == [16, 4]
    assert prefill.attributes["sits.prefill.num_chunks"] == 2
    assert [(e.name, e.timestamp) for e in decode.events] == [("recompute_chunk", 4_000_000_000)]
    assert (decode.start_time, decode.end_time) == (2_000_000_000, 6_000_000_000)
    assert decode.attributes["gen_ai.usage.output_tokens"] == 11
    assert (detok.start_time, detok.end_time) == (5_750_000_000, 6_000_000_000)
    assert detok.attributes["sits.detokenize.busy_s"] == 0.25
