"""Per HTTP request: its receipt stamp, and one OpenTelemetry trace (`--otlp-traces-endpoint`;
off by default).

`TracingMiddleware` (pure ASGI, just inside the receipt stamp) starts the request's
SERVER span, named `{method} {route}`, as a child of the incoming W3C `traceparent` (when it
is valid), puts its own `traceparent` on the response, and ends the span when the app is done
with the request (a stream: after its last event and cleanup). The span tree of a generation
request:
    POST /v1/chat/completions     http.*, server.address/port, gen_ai.* (GenAI semantic
    |                             conventions, gen_ai.provider.name "sits"), sits.tenant,
    |                             sits.outcome, SLO figures
    |-- admission                 drain check, parsing and tokenizing, QoS admission
    |-- queue                     per engine request (one per prompt; `sits.prompt_index`),
    |-- prefill (chunk events)    built after the fact from the engine's timestamps
    |-- decode                    (`sits.obs.trace_spans`), so the engine thread does no
    `-- detokenize                tracing work
Other traced routes (the rest of /v1, /tokenize, /detokenize) have the HTTP span only;
/health, /metrics and the dashboard are not traced. Errors follow the HTTP conventions: the
span gets `error.type` (the status, "engine_error", or the exception's class) for any failed
request, and an ERROR status for server faults (5xx, engine failures, a failed stream);
`sits.slo.violated` marks a request over its tenant's TTFT or TPOT SLO. Either keeps the trace
whatever the sample ratio (`sits.obs.tracing.TailSamplingProcessor`).
With tracing off no tracing work runs: the choice is made once at startup (`ServerContext.tracer`
is None), the serving code then gets `NO_TRACE` without looking at the request (one check,
`ServerContext.trace_of`) and calls it as it would a trace, and the engine stamps no chunk or
detokenization times.

The receipt stamp runs whether or not tracing is on: `ReceivedAtMiddleware` is the outermost
middleware; its first act on an HTTP request is to store `time.monotonic()` in the request
state under `RECEIVED_STATE_KEY`, before the body is read or parsed and before any other
middleware runs. Times measured from it (the per-tenant
TTFT from receipt, `sits:tenant_http_time_to_first_token_seconds`) therefore include the HTTP
process's own work and queueing (parsing, validation, tokenization, admission), which the
engine's TTFT, measured from the hand-off to the engine, leaves out.

Every response carries that time as OpenAI's `openai-processing-ms` header: the whole
milliseconds from receipt to the response's start. A stream starts with its first token (the
server waits for it, so that a refusal can still be an HTTP error), so there it is the TTFT
from receipt. A client's TTFT minus it is the time the request and its first bytes spent
outside the server's app: connecting, the listen queue, the network, the client itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from fastapi import Request
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sits.core.outputs import RequestOutput
from sits.obs.output_observer import OutputObserver
from sits.obs.trace_spans import (
    GEN_AI_OPERATION_NAME,
    GEN_AI_PROVIDER,
    GEN_AI_PROVIDER_NAME,
    GEN_AI_REQUEST_CHOICE_COUNT,
    GEN_AI_REQUEST_MAX_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_REQUEST_TEMPERATURE,
    GEN_AI_REQUEST_TOP_P,
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_RESPONSE_ID,
    GEN_AI_RESPONSE_MODEL,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
    PROMPT_INDEX,
    SERVER_ADDRESS,
    SERVER_PORT,
    EngineTimeline,
    add_engine_spans,
    monotonic_offset_ns,
)
from sits.obs.tracing import ERROR_TYPE, SLO_VIOLATED, Tracing, TracingSettings
from sits.server.jobs import EnginePrompt, GenerationJob
from sits.server.qos.admit import TENANT_STATE_KEY, Outcome, outcome_of
from sits.tenancy import TenantConfig

logger = logging.getLogger(__name__)

TRACE_STATE_KEY = "sits_trace"
RECEIVED_STATE_KEY = "sits_received_s"
PROCESSING_MS_HEADER = "openai-processing-ms"
SPAN_ADMISSION = "admission"
TENANT = "sits.tenant"
OUTCOME = "sits.outcome"

_TRACED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
_SERVER_FAULTS = frozenset({Outcome.ERROR.value, Outcome.UNAVAILABLE.value})
_ERROR_TYPES = {Outcome.ERROR.value: "engine_error"}


class NoOpTrace:
    """The trace of a request that is not traced: `RequestTrace`'s calls of the serving code,
    each doing nothing (as OpenTelemetry's NoOpTracer stands in for a tracer), so that code
    runs the same lines with tracing on or off. One instance, `NO_TRACE`."""

    __slots__ = ()

    def admission(self) -> AbstractContextManager[None]:
        """A context that does nothing."""
        return nullcontext()

    def watch(self, job: GenerationJob) -> None:
        """Nothing to record."""

    def set_outcome(self, outcome: Outcome) -> None:
        """Nothing to record."""


NO_TRACE = NoOpTrace()


def request_trace(request: Request) -> RequestTrace | NoOpTrace:
    """The request's trace, or `NO_TRACE` when the route is not traced (or tracing is off;
    the serving code asks `ServerContext.trace_of`, which does not look then)."""
    return (request.scope.get("state") or {}).get(TRACE_STATE_KEY, NO_TRACE)


def _mark_failed(span: Span, error_type: str, server_fault: bool, description: str) -> None:
    """Set `error.type` and, for a server fault, the ERROR status."""
    span.set_attribute(ERROR_TYPE, error_type)
    if server_fault:
        span.set_status(Status(StatusCode.ERROR, description))


class TimelineRecorder(OutputObserver):
    """Keeps what one engine request's outputs say: timestamps, tokens, finish reasons.

    Args:
        num_prompt_tokens: its prompt's length.
        num_samples: n.
    """

    def __init__(self, num_prompt_tokens: int, num_samples: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.metrics = None
        self.num_cached_tokens = 0
        self.tokens_by_sample = [0] * num_samples
        self.finish_reasons: list[str | None] = [None] * num_samples

    def on_output(self, output: RequestOutput) -> None:
        self.metrics = output.metrics  # the engine's object for the request: always the latest
        self.num_cached_tokens = output.num_cached_tokens
        for sample in output.outputs:
            self.tokens_by_sample[sample.index] += len(sample.token_ids)
            if sample.finish_reason is not None:
                self.finish_reasons[sample.index] = sample.finish_reason

    def timeline(self, end_s: float) -> EngineTimeline | None:
        """Its timeline (phases still open end at `end_s`), or None without any output."""
        m = self.metrics
        if m is None:
            return None
        return EngineTimeline(
            arrival_s=m.arrival_time,
            first_scheduled_s=m.first_scheduled_time,
            first_token_s=m.first_token_time,
            last_token_s=m.last_token_time,
            finished_s=m.finished_time,
            end_s=end_s,
            prefill_chunks=tuple(getattr(m, "prefill_chunks", None) or ()),
            detokenize_s=getattr(m, "detokenize_s", 0.0),
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=sum(self.tokens_by_sample),
        )

    def ttft_s(self) -> float | None:
        """Arrival to first token, or None before a token."""
        m = self.metrics
        if m is None or m.first_token_time is None:
            return None
        return max(m.first_token_time - m.arrival_time, 0.0)

    def tpot_s(self) -> list[float]:
        """Mean time per output token after the first, per sample with more than one token
        (as `sits.obs.server_metrics` measures it)."""
        m = self.metrics
        if m is None or m.first_token_time is None or m.last_token_time is None:
            return []
        span_s = max(m.last_token_time - m.first_token_time, 0.0)
        return [span_s / (count - 1) for count in self.tokens_by_sample if count > 1]


class RequestTrace:
    """The trace of one HTTP request: its SERVER span and what is known of its job.

    Made by `RequestTracer.start`; the serving code calls `admission()`, `watch(job)` and
    `set_outcome(outcome)`; the middleware calls `inject` and `finish`.
    """

    def __init__(self, tracer: RequestTracer, span: Span, method: str, path: str) -> None:
        self.tracer = tracer
        self.span = span
        self.method = method
        self.path = path
        self.context: Context = set_span_in_context(span)
        self.outcome: str | None = None
        self.job: GenerationJob | None = None
        self.recorders: list[TimelineRecorder] = []

    @property
    def trace_id(self) -> str:
        """The trace id, 32 lowercase hex digits (for logs and the audit record)."""
        return format(self.span.get_span_context().trace_id, "032x")

    def inject(self, message: Message) -> None:
        """Put `traceparent` (and `tracestate`) on an `http.response.start` message.

        Its sampled flag is the head decision (the caller's flag, else the ratio by trace
        id), so a downstream service is not told "sampled" for a trace this server drops;
        a trace kept later for an error or an SLO miss cannot change headers already sent.
        """
        carrier: dict[str, str] = {}
        self.tracer.propagator.inject(carrier, context=self.context)
        if "traceparent" in carrier:
            ctx = self.span.get_span_context()
            sampled = self.tracer.tracing.sampler.head_sampled(ctx.trace_id, self.span.parent)
            head, flags = carrier["traceparent"].rsplit("-", 1)
            value = (int(flags, 16) & ~1) | int(sampled)
            carrier["traceparent"] = f"{head}-{value:02x}"
        headers = MutableHeaders(scope=message)
        for name, value in carrier.items():
            headers[name] = value

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Time the admission of a generation request as the `admission` span; a refusal
        marks it (and sets the request's outcome)."""
        span = self.tracer.tracer.start_span(SPAN_ADMISSION, context=self.context)
        try:
            yield
        except Exception as exc:
            self.outcome = outcome_of(exc).value
            span.record_exception(exc)
            error_type = _ERROR_TYPES.get(self.outcome, self.outcome)
            _mark_failed(span, error_type, self.outcome in _SERVER_FAULTS, str(exc))
            raise
        finally:
            span.end()

    def watch(self, job: GenerationJob) -> None:
        """Record the outputs of an admitted job (before it starts) and give it the trace id
        (its audit records carry it)."""
        self.job = job
        job.trace_id = self.trace_id
        self.recorders = [TimelineRecorder(len(p.token_ids), p.params.n) for p in job.prompts]
        index_of = {id(prompt): index for index, prompt in enumerate(job.prompts)}

        def make_observer(prompt: EnginePrompt) -> OutputObserver:
            return self.recorders[index_of[id(prompt)]]

        job.add_observer(make_observer)

    def set_outcome(self, outcome: Outcome) -> None:
        """How the admitted request ended (ok, client error, 503, engine error, abort)."""
        self.outcome = outcome.value

    def finish(self, scope: Scope, status: int | None, exc: BaseException | None) -> None:
        """Add the engine spans and the attributes, decide the error marks, end the span.

        Args:
            scope: the request's ASGI scope (route, tenant).
            status: the response status sent, or None when none was.
            exc: what the app raised, or None.
        """
        span = self.span
        route = getattr(scope.get("route"), "path", None) or self.path
        span.update_name(f"{self.method} {route}")
        span.set_attribute("http.route", route)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        tenant = (scope.get("state") or {}).get(TENANT_STATE_KEY)
        if tenant is not None:
            span.set_attribute(TENANT, tenant.id)
        operation = _OPERATIONS.get(route)
        if operation is not None:
            span.set_attribute(GEN_AI_OPERATION_NAME, operation)
            span.set_attribute(GEN_AI_PROVIDER_NAME, GEN_AI_PROVIDER)
            span.set_attribute(GEN_AI_REQUEST_MODEL, self.tracer.model_name)
        if self.job is not None:
            self._record_job(self.job, tenant)
        self._mark_errors(status, exc)
        if self.outcome is not None:
            span.set_attribute(OUTCOME, self.outcome)
        span.end()

    def _mark_errors(self, status: int | None, exc: BaseException | None) -> None:
        if isinstance(exc, asyncio.CancelledError):
            self.outcome = self.outcome or Outcome.ABORT.value
        elif exc is not None:
            _mark_failed(self.span, type(exc).__qualname__, True, str(exc))
        elif status is not None and status >= 400:
            _mark_failed(self.span, str(status), status >= 500, f"HTTP {status}")
        elif self.outcome not in (None, Outcome.OK.value, Outcome.ABORT.value):
            error_type = _ERROR_TYPES.get(self.outcome, self.outcome)
            fault = self.outcome in _SERVER_FAULTS
            _mark_failed(self.span, error_type, fault, f"the stream failed ({error_type})")

    def _record_job(self, job: GenerationJob, tenant: TenantConfig | None) -> None:
        span = self.span
        params = job.prompts[0].params
        if params.max_tokens is not None:
            span.set_attribute(GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens)
        span.set_attribute(GEN_AI_REQUEST_TEMPERATURE, float(params.temperature))
        span.set_attribute(GEN_AI_REQUEST_TOP_P, float(params.top_p))
        if params.n != 1:
            span.set_attribute(GEN_AI_REQUEST_CHOICE_COUNT, params.n)
        span.set_attribute(GEN_AI_RESPONSE_ID, job.request_id)
        span.set_attribute(GEN_AI_RESPONSE_MODEL, self.tracer.model_name)
        recorders = self.recorders
        span.set_attribute(GEN_AI_USAGE_INPUT_TOKENS, sum(len(p.token_ids) for p in job.prompts))
        span.set_attribute(
            GEN_AI_USAGE_OUTPUT_TOKENS, sum(sum(r.tokens_by_sample) for r in recorders)
        )
        reasons = [reason for r in recorders for reason in r.finish_reasons if reason is not None]
        span.set_attribute(GEN_AI_RESPONSE_FINISH_REASONS, reasons)
        offset_ns = monotonic_offset_ns()
        end_s = time.monotonic()
        for index, recorder in enumerate(recorders):
            timeline = recorder.timeline(end_s)
            if timeline is not None:
                tracer = self.tracer.tracer
                add_engine_spans(tracer, self.context, timeline, offset_ns, {PROMPT_INDEX: index})
        if tenant is not None:
            self._record_slo(tenant)

    def _record_slo(self, tenant: TenantConfig) -> None:
        """The request's worst TTFT and TPOT and whether they broke the tenant's SLOs."""
        span = self.span
        ttfts = [t for t in (r.ttft_s() for r in self.recorders) if t is not None]
        tpots = [t for r in self.recorders for t in r.tpot_s()]
        violated = []
        for kind, values, slo_ms in (
            ("ttft", ttfts, tenant.ttft_ms),
            ("tpot", tpots, tenant.tpot_ms),
        ):
            if not values:
                continue
            worst_ms = max(values) * 1000.0
            span.set_attribute(f"sits.{kind}_ms", worst_ms)
            if slo_ms is not None:
                span.set_attribute(f"sits.slo.{kind}_ms", float(slo_ms))
                if worst_ms > slo_ms:
                    violated.append(kind)
        if violated:
            span.set_attribute(SLO_VIOLATED, True)
            span.set_attribute("sits.slo.violations", violated)


class RequestTracer:
    """The server's tracing: the OTLP pipeline and the per-request traces.

    Args:
        settings: endpoint, sample ratio (and a test exporter).
        model_name: the served model's name (`gen_ai.request.model`).
    """

    def __init__(self, settings: TracingSettings, model_name: str) -> None:
        self.tracing = Tracing(settings)
        self.tracer = self.tracing.tracer
        self.model_name = model_name
        self.propagator = TraceContextTextMapPropagator()

    @staticmethod
    def traces(path: str) -> bool:
        """Is a request to `path` traced?"""
        return path.startswith(_TRACED_PREFIXES)

    def start(self, scope: Scope) -> RequestTrace:
        """Start the trace of an HTTP request and store it in the request's state."""
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope.get("headers", ())
        }
        parent = self.propagator.extract(headers)
        method, path = scope["method"], scope["path"]
        attributes: dict[str, str | int] = {"http.request.method": method, "url.path": path}
        attributes.update(_server_attributes(headers.get("host"), scope.get("server")))
        span = self.tracer.start_span(
            f"{method} {path}", context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        trace = RequestTrace(self, span, method, path)
        scope.setdefault("state", {})[TRACE_STATE_KEY] = trace
        return trace

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every kept span now."""
        return self.tracing.force_flush(timeout_s)

    async def shutdown(self) -> None:
        """Flush and stop the exporter (in a worker thread: an OTLP export may block)."""
        await asyncio.to_thread(self.tracing.shutdown)


def _server_attributes(host: str | None, server: tuple[str, int] | None) -> dict[str, str | int]:
    """`server.address` and `server.port` of a request: the Host header's (what the client
    called, as the HTTP semantic conventions ask), else the listening socket's."""
    if host:
        address, sep, port = host.rpartition(":")
        if sep and port.isdigit() and (not address.startswith("[") or address.endswith("]")):
            return {SERVER_ADDRESS: address.strip("[]"), SERVER_PORT: int(port)}
        return {SERVER_ADDRESS: host.strip("[]")}  # no port: the scheme's default
    if server is None:
        return {}
    return {SERVER_ADDRESS: server[0], SERVER_PORT: int(server[1])}


class TracingMiddleware:
    """Traces the requests of traced routes (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        tracer: the server's request tracer.
    """

    def __init__(self, app: ASGIApp, tracer: RequestTracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tracer.traces(scope["path"]):
            await self.app(scope, receive, send)
            return
        trace = self.tracer.start(scope)
        status: list[int] = []

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                trace.inject(message)
            await send(message)

        failure: BaseException | None = None
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            try:
                trace.finish(scope, status[0] if status else None, failure)
            except Exception:  # noqa: BLE001 - tracing never breaks serving
                logger.exception("could not record the trace of %s", scope["path"])


class ReceivedAtMiddleware:
    """Stamps each HTTP request's receipt time and adds `openai-processing-ms` to its response
    (see the module docstring).

    Args:
        app: the wrapped ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received_s = time.monotonic()
        scope.setdefault("state", {})[RECEIVED_STATE_KEY] = received_s

        async def send_with_processing_time(message: Message) -> None:
            if message["type"] == "http.response.start":
                ms = int((time.monotonic() - received_s) * 1000.0)
                headers = [*message.get("headers", ()), (PROCESSING_MS_HEADER.encode(), b"%d" % ms)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_processing_time)


def received_at(request: Request) -> float | None:
    """The request's receipt time (time.monotonic() seconds), None when it did not pass
    through `ReceivedAtMiddleware`."""
    return (request.scope.get("state") or {}).get(RECEIVED_STATE_KEY)
