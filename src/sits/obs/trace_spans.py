"""The engine-side spans of one engine request, built after the fact from its timeline.

The engine thread does no tracing work: it stamps `time.monotonic()` times on the request
(arrival, first scheduled, each prefill chunk, first and last token, finished) and the front
end sums its detokenization time; when the HTTP request ends, `add_engine_spans` turns those
numbers into child spans of the request's span with explicit start and end times:
- `queue`: arrival -> first scheduled (or -> the end, when never scheduled);
- `prefill`: first scheduled -> first token (or -> the end); one `prefill_chunk` event per
  prompt chunk computed before the first token, at the end of the step that computed it;
- `decode`: first token -> finished (or -> the end); prompt chunks recomputed after a
  preemption are `recompute_chunk` events here;
- `detokenize`: incremental detokenization runs on the front end after each step, interleaved
  with decoding; the span's duration is the total time spent in it and it ends when the last
  token was detokenized (`sits.detokenize.aggregated` says so).
Spans appear only for phases that began. Attribute names follow the OpenTelemetry GenAI
semantic conventions where one exists (`GEN_AI_*`), else carry the `sits.` prefix.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Tracer
from opentelemetry.util.types import AttributeValue

# OpenTelemetry GenAI semantic conventions (gen_ai.*).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_PROVIDER = "sits"  # the value of gen_ai.provider.name: who serves the model
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

PROMPT_INDEX = "sits.prompt_index"
NUM_TOKENS = "sits.num_tokens"
NUM_CACHED_TOKENS = "sits.num_cached_tokens"

SPAN_QUEUE = "queue"
SPAN_PREFILL = "prefill"
SPAN_DECODE = "decode"
SPAN_DETOKENIZE = "detokenize"
EVENT_PREFILL_CHUNK = "prefill_chunk"
EVENT_RECOMPUTE_CHUNK = "recompute_chunk"


@dataclass(frozen=True, slots=True)
class EngineTimeline:
    """What happened to one engine request, in `time.monotonic()` seconds.

    Attributes:
        arrival_s: reached the engine front end.
        first_scheduled_s: first given tokens by the scheduler; None = never.
        first_token_s: its first output token was produced; None = none yet.
        last_token_s: its latest token was produced; None = none yet.
        finished_s: it finished; None = it did not (abort, failure).
        end_s: when the HTTP request ended (the end of every phase still open).
        prefill_chunks: (time computed, tokens) per prompt chunk computed (recomputes too).
        detokenize_s: seconds spent detokenizing its tokens on the front end, >= 0.
        num_prompt_tokens: tokens of its prompt.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_output_tokens: tokens generated (all samples).
    """

    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    last_token_s: float | None
    finished_s: float | None
    end_s: float
    prefill_chunks: Sequence[tuple[float, int]] = ()
    detokenize_s: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


def monotonic_offset_ns() -> int:
    """Nanoseconds to add to a `time.monotonic()` reading to get Unix-epoch nanoseconds now."""
    return time.time_ns() - time.monotonic_ns()


def add_engine_spans(
    tracer: Tracer,
    parent: Context,
    timeline: EngineTimeline,
    offset_ns: int,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> list[str]:
    """Record the queue, prefill, decode and detokenize spans of one engine request.

    Args:
        tracer: makes the spans.
        parent: context holding the parent span (the HTTP request's).
        timeline: the request's times.
        offset_ns: `monotonic_offset_ns()` of the moment (one per trace, so spans align).
        attributes: set on every span (e.g. `sits.prompt_index`).

    Returns:
        The names of the spans recorded, in order.
    """
    common = dict(attributes or {})

    def epoch_ns(t_s: float) -> int:
        return round(t_s * 1e9) + offset_ns

    def span(name: str, start_s: float, end_s: float, extra: Mapping[str, AttributeValue]):
        made = tracer.start_span(
            name, context=parent, attributes={**common, **extra}, start_time=epoch_ns(start_s)
        )
        return made, epoch_ns(max(end_s, start_s))

    t = timeline
    names: list[str] = []
    queue_end_s = t.first_scheduled_s if t.first_scheduled_s is not None else t.end_s
    queue, queue_end = span(SPAN_QUEUE, t.arrival_s, queue_end_s, {})
    queue.end(queue_end)
    names.append(SPAN_QUEUE)
    if t.first_scheduled_s is None:
        return names
    prefill_end_s = t.first_token_s if t.first_token_s is not None else t.end_s
    first_chunks = [c for c in t.prefill_chunks if c[0] <= prefill_end_s]
    prefill, prefill_end = span(
        SPAN_PREFILL,
        t.first_scheduled_s,
        prefill_end_s,
        {
            GEN_AI_USAGE_INPUT_TOKENS: t.num_prompt_tokens,
            NUM_CACHED_TOKENS: t.num_cached_tokens,
            "sits.prefill.num_chunks": len(first_chunks),
        },
    )
    for index, (chunk_s, num_tokens) in enumerate(first_chunks):
        prefill.add_event(
            EVENT_PREFILL_CHUNK,
            {"sits.chunk_index": index, NUM_TOKENS: num_tokens},
            timestamp=epoch_ns(chunk_s),
        )
    prefill.end(prefill_end)
    names.append(SPAN_PREFILL)
    if t.first_token_s is None:
        return names
    decode_end_s = t.finished_s if t.finished_s is not None else t.end_s
    decode, decode_end = span(
        SPAN_DECODE,
        t.first_token_s,
        decode_end_s,
        {GEN_AI_USAGE_OUTPUT_TOKENS: t.num_output_tokens},
    )
    for chunk_s, num_tokens in t.prefill_chunks:
        if chunk_s > prefill_end_s:
            decode.add_event(EVENT_RECOMPUTE_CHUNK, {NUM_TOKENS: num_tokens}, epoch_ns(chunk_s))
    decode.end(decode_end)
    names.append(SPAN_DECODE)
    detok_end_s = t.last_token_s if t.last_token_s is not None else decode_end_s
    detok_end_s = max(detok_end_s, t.first_token_s)
    detok_start_s = max(detok_end_s - max(t.detokenize_s, 0.0), t.first_token_s)
    detok, detok_end = span(
        SPAN_DETOKENIZE,
        detok_start_s,
        detok_end_s,
        {"sits.detokenize.aggregated": True, "sits.detokenize.busy_s": max(t.detokenize_s, 0.0)},
    )
    detok.end(detok_end)
    names.append(SPAN_DETOKENIZE)
    return names
