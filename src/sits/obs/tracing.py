"""OpenTelemetry tracing set-up: settings, the OTLP pipeline and tail sampling per request.

One `Tracing` per server owns a `TracerProvider` (never the global one), whose SDK sampler is
ALWAYS_ON: every span is recorded, and the sampling decision is taken when a request ends by
`TailSamplingProcessor`, which buffers the spans of each local trace (a local root span and
its descendants) and hands them to the exporting `BatchSpanProcessor` only when the trace is
kept:
- its remote parent (incoming W3C `traceparent`) was sampled (the ParentBased rule; a remote
  parent that was not sampled is not overridden by the ratio), or
- its trace id falls under the configured ratio (the same deterministic rule as the SDK's
  `TraceIdRatioBased`, so every service sampling by ratio keeps the same traces), or
- any of its spans has an ERROR status or an `error.type` attribute, or is marked over its
  SLO (`sits.slo.violated`): such traces are kept whatever the ratio.
The decision is taken when the local root span ends; spans of that trace ending later follow
the same decision (remembered for the last `_MAX_DECISIONS` traces). At most
`max_buffered_traces` traces wait for a decision at once; beyond that the oldest is dropped.
The exporter is OTLP over HTTP/protobuf or over gRPC (a `grpc://` or `grpcs://` endpoint, or
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` = `grpc`, as vLLM's
`--otlp-traces-endpoint grpc://...`), configured by the standard `OTEL_*` environment
variables (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT`, headers,
timeout, ...) which the exporter library reads itself; `resolve_tracing` turns the CLI flags
and those variables into `TracingSettings`. Nothing here is imported unless tracing is on.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, TraceIdRatioBased
from opentelemetry.trace import SpanContext, StatusCode

from sits.config import (
    OTEL_ENDPOINT_ENVS,
    OTEL_PROTOCOL_ENVS,
    OTEL_SAMPLER_ARG_ENV,
    OTEL_SDK_DISABLED_ENV,
)
from sits.core.errors import InvalidParameterError

DEFAULT_SERVICE_NAME = "sits"
TRACER_NAME = "sits"
ERROR_TYPE = "error.type"  # OpenTelemetry semantic conventions
SLO_VIOLATED = "sits.slo.violated"
OTLP_TRACES_PATH = "/v1/traces"
HTTP_PROTOCOL = "http/protobuf"
GRPC_PROTOCOL = "grpc"
OTLP_PROTOCOLS = (HTTP_PROTOCOL, GRPC_PROTOCOL)
_GRPC_SCHEMES = {"grpc": "http", "grpcs": "https"}  # -> the gRPC exporter's URL schemes

_MAX_DECISIONS = 4096


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """How requests are traced.

    Attributes:
        endpoint: the OTLP traces URL (`--otlp-traces-endpoint`; with gRPC "http://host:port"
            for plain text, "https://host:port" for TLS); None = what the
            `OTEL_EXPORTER_OTLP_*` variables say (the exporter reads them).
        protocol: "http/protobuf" (the default) or "grpc".
        sample_ratio: fraction in [0, 1] of ordinary traces kept (errors and traces over
            their SLO are always kept).
        exporter: a span exporter to use instead of OTLP (tests: `InMemorySpanExporter`).
        max_buffered_traces: most traces waiting for their decision at once, >= 1.

    Raises:
        InvalidParameterError: a ratio outside [0, 1] or a bound < 1.
    """

    endpoint: str | None = None
    sample_ratio: float = 1.0
    exporter: SpanExporter | None = None
    max_buffered_traces: int = 10_000
    protocol: str = HTTP_PROTOCOL

    def __post_init__(self) -> None:
        if self.protocol not in OTLP_PROTOCOLS:
            raise InvalidParameterError(
                "otlp_traces_endpoint",
                f"the OTLP protocol must be one of {OTLP_PROTOCOLS}, got {self.protocol!r}",
            )
        if not (math.isfinite(self.sample_ratio) and 0.0 <= self.sample_ratio <= 1.0):
            raise InvalidParameterError(
                "trace_sample_ratio",
                f"the trace sample ratio must be in [0, 1], got {self.sample_ratio}",
            )
        if self.max_buffered_traces < 1:
            raise InvalidParameterError(
                "max_buffered_traces", f"must be >= 1, got {self.max_buffered_traces}"
            )


def traces_endpoint(url: str, protocol: str = HTTP_PROTOCOL) -> tuple[str, str]:
    """(endpoint, protocol) of `url`: a `grpc://` URL is gRPC in plain text and `grpcs://`
    gRPC over TLS (the exporter's "http://" and "https://" forms); an http(s) URL is sent
    with `protocol`, and with HTTP gets `/v1/traces` when it has no path
    (`http://collector:4318` -> `http://collector:4318/v1/traces`).

    Raises:
        InvalidParameterError("otlp_traces_endpoint"): not a grpc(s) or http(s) URL.
    """
    parts = urlsplit(url)
    if parts.scheme in _GRPC_SCHEMES and parts.netloc:
        return f"{_GRPC_SCHEMES[parts.scheme]}://{parts.netloc}", GRPC_PROTOCOL
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidParameterError(
            "otlp_traces_endpoint",
            f"--otlp-traces-endpoint must be an http(s) URL such as "
            f"http://localhost:4318{OTLP_TRACES_PATH}, or grpc://localhost:4317, got {url!r}",
        )
    if protocol == HTTP_PROTOCOL and parts.path in ("", "/"):
        return url.rstrip("/") + OTLP_TRACES_PATH, protocol
    return url, protocol


def _protocol_of(environ: Mapping[str, str]) -> str:
    """The OTLP protocol the variables ask for (the traces' own first), else HTTP.

    Raises:
        InvalidParameterError: a protocol other than grpc or http/protobuf.
    """
    for name in OTEL_PROTOCOL_ENVS:
        value = environ.get(name, "").strip().lower()
        if value:
            if value not in OTLP_PROTOCOLS:
                raise InvalidParameterError(
                    "otlp_traces_endpoint",
                    f"{name}={value!r}: sits exports traces over {' or '.join(OTLP_PROTOCOLS)}",
                )
            return value
    return HTTP_PROTOCOL


def resolve_tracing(
    endpoint: str | None, sample_ratio: float | None, environ: Mapping[str, str]
) -> TracingSettings | None:
    """The tracing settings of the CLI flags and the environment, or None (tracing off).

    Tracing is on when `endpoint` (`--otlp-traces-endpoint`) is given or an OTLP endpoint
    variable (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT`) is set,
    unless `OTEL_SDK_DISABLED=true`. The ratio is `sample_ratio` (`--trace-sample-ratio`),
    else `OTEL_TRACES_SAMPLER_ARG`, else 1.

    Raises:
        InvalidParameterError: a bad URL or ratio (the variable's included).
    """
    if environ.get(OTEL_SDK_DISABLED_ENV, "").strip().lower() == "true":
        return None
    if endpoint is None and not any(environ.get(name) for name in OTEL_ENDPOINT_ENVS):
        return None
    if sample_ratio is None:
        raw = environ.get(OTEL_SAMPLER_ARG_ENV)
        try:
            sample_ratio = 1.0 if raw is None or not raw.strip() else float(raw)
        except ValueError as exc:
            raise InvalidParameterError(
                "trace_sample_ratio", f"{OTEL_SAMPLER_ARG_ENV}={raw!r} is not a number"
            ) from exc
    protocol = _protocol_of(environ)
    if endpoint is not None:
        endpoint, protocol = traces_endpoint(endpoint, protocol)
    return TracingSettings(endpoint=endpoint, sample_ratio=sample_ratio, protocol=protocol)


def is_error_span(span: ReadableSpan) -> bool:
    """True when the span failed: ERROR status or an `error.type` attribute."""
    if span.status.status_code is StatusCode.ERROR:
        return True
    attributes = span.attributes or {}
    return ERROR_TYPE in attributes


class TailSamplingProcessor(SpanProcessor):
    """Buffers each local trace's spans and forwards the kept ones (see the module docstring).

    Args:
        delegate: receives the spans of kept traces (the exporting BatchSpanProcessor).
        sample_ratio: fraction of ordinary traces kept, by trace id.
        max_buffered_traces: most traces buffered at once (the oldest is dropped beyond it).

    Attributes:
        num_kept_traces, num_dropped_traces: decisions so far (local traces).
    """

    def __init__(
        self, delegate: SpanProcessor, sample_ratio: float, max_buffered_traces: int = 10_000
    ) -> None:
        self.delegate = delegate
        self.sample_ratio = sample_ratio
        self._ratio = TraceIdRatioBased(sample_ratio)
        self._max_buffered = max_buffered_traces
        self._lock = threading.Lock()
        self._root_of: dict[int, int] = {}  # open span id -> its local root's span id
        self._buffers: dict[int, list[ReadableSpan]] = {}  # local root span id -> ended spans
        self._decisions: OrderedDict[int, bool] = OrderedDict()  # decided local roots
        self.num_kept_traces = 0
        self.num_dropped_traces = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        parent = span.parent
        span_id = span.context.span_id
        with self._lock:
            root_id = None
            if parent is not None and not parent.is_remote:
                root_id = self._root_of.get(parent.span_id)
                if root_id is None and parent.span_id in self._decisions:
                    root_id = parent.span_id  # a child started after its root ended
            self._root_of[span_id] = span_id if root_id is None else root_id
        self.delegate.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        span_id = span.context.span_id
        with self._lock:
            root_id = self._root_of.pop(span_id, span_id)
            decided = self._decisions.get(root_id)
            if decided is not None:
                spans = [span] if decided else []
            else:
                self._buffers.setdefault(root_id, []).append(span)
                if root_id != span_id:
                    self._evict_over_bound()
                    return
                spans = self._buffers.pop(root_id)
                decided = self._keep(span, spans)
                self._decide(root_id, decided)
                if not decided:
                    spans = []
        for ended in spans:
            self.delegate.on_end(ended)

    def head_sampled(self, trace_id: int, parent: SpanContext | None) -> bool:
        """The decision known when the trace starts (ParentBased over TraceIdRatioBased): a
        remote parent's sampled flag when there is one, else the ratio by trace id. Errors
        and SLO misses found later keep a trace too, but cannot change headers already sent.
        """
        if parent is not None and parent.is_remote:
            return parent.trace_flags.sampled
        return self._ratio.should_sample(None, trace_id, "").decision.is_sampled()

    def _keep(self, root: ReadableSpan, spans: list[ReadableSpan]) -> bool:
        if self.head_sampled(root.context.trace_id, root.parent):
            return True
        return any(is_error_span(s) or (s.attributes or {}).get(SLO_VIOLATED) for s in spans)

    def _decide(self, root_id: int, keep: bool) -> None:
        """Remember a decision (lock held)."""
        self._decisions[root_id] = keep
        if len(self._decisions) > _MAX_DECISIONS:
            self._decisions.popitem(last=False)
        if keep:
            self.num_kept_traces += 1
        else:
            self.num_dropped_traces += 1

    def _evict_over_bound(self) -> None:
        """Drop the oldest undecided trace while too many wait (lock held)."""
        while len(self._buffers) > self._max_buffered:
            oldest = next(iter(self._buffers))
            del self._buffers[oldest]
            self._decide(oldest, False)

    def shutdown(self) -> None:
        self.delegate.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.delegate.force_flush(timeout_millis)


def _otlp_exporter(settings: TracingSettings) -> SpanExporter:
    """The OTLP exporter of `settings.protocol` (each reads the `OTEL_*` variables itself)."""
    if settings.protocol == GRPC_PROTOCOL:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(endpoint=settings.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=settings.endpoint)


def default_resource() -> Resource:
    """The SDK's resource (it reads `OTEL_RESOURCE_ATTRIBUTES` / `OTEL_SERVICE_NAME`), with
    service.name "sits" unless one was configured."""
    resource = Resource.create()
    name = str(resource.attributes.get(SERVICE_NAME, ""))
    if not name or name.startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


class Tracing:
    """A tracer provider with the tail-sampling pipeline of `settings`.

    Args:
        settings: endpoint, ratio and (for tests) the exporter.

    Attributes:
        provider: the TracerProvider (not registered globally).
        tracer: the tracer every sits span is made with.
        sampler: the tail-sampling processor (its counters say what was kept).
    """

    def __init__(self, settings: TracingSettings) -> None:
        exporter = settings.exporter
        if exporter is None:
            exporter = _otlp_exporter(settings)
        self.settings = settings
        self.provider = TracerProvider(
            sampler=ALWAYS_ON, resource=default_resource(), shutdown_on_exit=False
        )
        self.sampler = TailSamplingProcessor(
            BatchSpanProcessor(exporter), settings.sample_ratio, settings.max_buffered_traces
        )
        self.provider.add_span_processor(self.sampler)
        self.tracer: Tracer = self.provider.get_tracer(TRACER_NAME)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every kept span now; False if the exporter did not finish in time."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporter (blocking; call from a worker thread)."""
        self.provider.shutdown()
