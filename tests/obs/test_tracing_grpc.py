"""OTLP over gRPC (issue 29): `--otlp-traces-endpoint grpc://...` or the OTEL protocol
variables pick the gRPC exporter, and a request's server span reaches a gRPC receiver with
`gen_ai.provider.name`, `server.address` and `server.port`."""

from __future__ import annotations

import threading
from concurrent import futures

import pytest

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.obs.tracing import TracingSettings, resolve_tracing, traces_endpoint
from sits.server.context import ServerSettings
from tests.server.live import LiveServer, free_port
from tests.server.tenant_fixtures import ctx_of
from tests.waits import HANG_S

grpc = pytest.importorskip("grpc")


def test_grpc_endpoints_and_protocol_variables() -> None:
    assert traces_endpoint("grpc://c:4317") == ("http://c:4317", "grpc")
    assert traces_endpoint("grpcs://c:4317/") == ("https://c:4317", "grpc")
    assert traces_endpoint("http://c:4317", "grpc") == ("http://c:4317", "grpc")
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert resolve_tracing("http://c:4317", None, env) == TracingSettings(
        endpoint="http://c:4317", protocol="grpc"
    )
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317", **env}
    assert resolve_tracing(None, None, env).protocol == "grpc"
    traces_first = {**env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert resolve_tracing(None, None, traces_first).protocol == "http/protobuf"
    with pytest.raises(InvalidParameterError, match="http/json"):
        resolve_tracing("http://c:4318", None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


class _Receiver:
    """A minimal OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        self.spans: list = []
        self.received = threading.Event()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the gRPC method's name
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                receiver.received.set()
                return trace_service_pb2.ExportTraceServiceResponse()

        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_a_request_span_reaches_a_grpc_receiver(tiny_model_factory) -> None:
    from sits.engine.async_llm import AsyncLLM

    receiver = _Receiver()
    receiver.server.start()
    try:
        tracing = resolve_tracing(f"grpc://127.0.0.1:{receiver.port}", 1.0, {})
        model_dir = tiny_model_factory("qwen3_moe")
        config = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=128)
        with LiveServer(lambda: AsyncLLM(config), ServerSettings(tracing=tracing)) as live:
            client = live.client()
            client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
            )
            tracer = ctx_of(live).tracer
            assert live.wait_until(lambda: tracer.force_flush(5) and receiver.received.is_set())
            port = live.port
        assert receiver.received.wait(HANG_S)
        (chat,) = [s for s in receiver.spans if s.name == "POST /v1/chat/completions"]
        attributes = _attributes(chat)
        assert attributes["gen_ai.provider.name"] == "sits"
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["server.address"] == "127.0.0.1"
        assert attributes["server.port"] == port
        assert {"queue", "prefill", "decode"} <= {s.name for s in receiver.spans}
    finally:
        receiver.server.stop(0)
