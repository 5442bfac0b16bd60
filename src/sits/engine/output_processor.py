"""A user request's way in and out: its engine requests, and their outputs back as its own.

In: `make_engine_requests` turns one user request into the engine requests of its n samples.
Sample i of request R runs as engine request "R" when n == 1, else "R-i"
(`child_request_ids`). Each sample gets n=1 and, when seeded, the seed `seed + i` (so n
samples differ but repeat exactly for the same seed). Samples 1..n-1 name sample 0 as their
prefix leader so they reuse its cached prompt blocks. EOS ids beyond the tokenizer's (from
generation_config) become stop token ids unless `ignore_eos`.

Out: `OutputProcessor` turns `EngineCoreOutput`s into user-facing `RequestOutput`s. It runs on
the front-end side (never on the step loop's thread): detokenizes incrementally, matches stop
strings, joins the n samples of a request, converts logprobs, and stamps the request's timing
metrics. A stop-string match finishes the sample here; the caller must then finish the engine
request (`stop_requests` of the returned batch).
Invariant: in DELTA mode the concatenation of all text deltas of a sample equals its final text,
and no delta ever holds part of a matched stop string. Without a tokenizer (the engine's
`skip_tokenizer_init`) nothing is detokenized: texts stay "" and logprobs carry no token text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from sits.core.limits import resolve_limits
from sits.core.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    TokenLogprobs,
)
from sits.core.request import FinishReason, Request
from sits.core.sampling_params import RequestOutputKind, SamplingParams
from sits.engine.tokenizer import IncrementalDetokenizer, Tokenizer


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Engine request ids of a user request's samples."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def make_engine_requests(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    enable_prefix_caching: bool,
    arrival_time: float | None = None,
    tenant_id: str = "default",
    priority: int = 0,
    cache_salt: str | None = None,
    start_deadline_s: float | None = None,
) -> list[Request]:
    """Build the engine requests of one user request (one per sample); `start_deadline_s`
    (time.monotonic()) drops those not started by then (`Request.start_deadline_s`).

    Each carries one resolved `max_tokens`: `params.max_tokens` as given (the server resolved
    it), or, when None (the offline API's "fill the context"), what `resolve_limits` leaves
    after the prompt. The limits are checked once, when the scheduler queues the request.

    Raises:
        InvalidParameterError, PromptTooLongError: max_tokens is None and the prompt is empty
            or leaves no room in `max_model_len` (`resolve_limits`).
    """
    arrival = time.monotonic() if arrival_time is None else arrival_time
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = resolve_limits(len(prompt_token_ids), None, max_model_len).max_tokens
    eos = eos_token_ids[0] if eos_token_ids else None
    extra_stop_ids = [] if params.ignore_eos else [t for t in eos_token_ids[1:]]
    ids = child_request_ids(request_id, params.n)
    requests = []
    for i, child_id in enumerate(ids):
        child_params = replace(
            params,
            n=1,
            seed=None if params.seed is None else params.seed + i,
            stop_token_ids=params.stop_token_ids
            + [t for t in extra_stop_ids if t not in params.stop_token_ids],
            prompt_logprobs=params.prompt_logprobs if i == 0 else None,
        )
        leader = ids[0] if i > 0 and enable_prefix_caching else None
        requests.append(
            Request(
                request_id=child_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=child_params,
                eos_token_id=eos,
                arrival_time=arrival,
                max_tokens=max_tokens,
                cache_salt=cache_salt,
                tenant_id=tenant_id,
                priority=priority,
                prefix_leader_id=leader,
                start_deadline_s=start_deadline_s,
            )
        )
    return requests


@dataclass(slots=True)
class _Sample:
    """Front-end state of one sample (one engine request)."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0
    num_text_chars_sent: int = 0
    finish_sent: bool = False


@dataclass(slots=True)
class _Parent:
    """Front-end state of one user request (n samples)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    sink: Any
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    child_ids: list[str] = field(default_factory=list)  # engine request id of each sample
    precision: str | None = None  # the weight set of its latest token (precision switch)
    num_precision_switches: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(slots=True)
class ProcessedOutputs:
    """Result of processing one step's outputs.

    Attributes:
        request_outputs: (sink given at add_request, output) pairs to deliver.
        stop_requests: (engine request id, stop string) of samples a stop string finished.
    """

    request_outputs: list[tuple[Any, RequestOutput]] = field(default_factory=list)
    stop_requests: list[tuple[str, str]] = field(default_factory=list)


class OutputProcessor:
    """Builds RequestOutputs for the requests it was told about.

    Args:
        tokenizer: used for detokenization and logprob token texts; None: token ids only.

    Attributes:
        time_detokenize: when True (tracing), the time spent applying each engine output
            (detokenization, stop strings, logprob texts) is added to the request's
            `RequestMetrics.detokenize_s`, and its prompt chunks to `prefill_chunks`.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.time_detokenize = False
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Sample]] = {}

    def add_request(
        self,
        request_id: str,
        child_ids: list[str],
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        sink: Any = None,
    ) -> None:
        """Track a user request whose samples run as the engine requests `child_ids`."""
        tokenizer = self.tokenizer
        samples = [
            _Sample(
                i,
                None
                if tokenizer is None
                else IncrementalDetokenizer(tokenizer, prompt_token_ids, params),
            )
            for i in range(len(child_ids))
        ]
        if params.logprobs is not None:
            for s in samples:
                s.logprobs, s.cumulative_logprob = [], 0.0
        parent = _Parent(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            samples,
            RequestMetrics(arrival_time),
            sink,
            child_ids=list(child_ids),
        )
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = []
        self._parents[request_id] = parent
        for child_id, sample in zip(child_ids, samples):
            self._children[child_id] = (parent, sample)

    def remove_request(self, request_id: str) -> list[str]:
        """Forget a user request; returns the engine ids of its unfinished samples."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        open_ids = []
        for child_id, sample in zip(parent.child_ids, parent.samples):
            entry = self._children.get(child_id)
            if entry is not None and entry[0] is parent:
                del self._children[child_id]
                if sample.finish_reason is None:
                    open_ids.append(child_id)
        return open_ids

    def sink_of(self, request_id: str) -> Any:
        """The sink given at add_request, or None for an unknown request."""
        parent = self._parents.get(request_id)
        return None if parent is None else parent.sink

    def request_ids(self) -> list[str]:
        """Ids of the user requests being tracked."""
        return list(self._parents)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    @property
    def num_requests(self) -> int:
        return len(self._parents)

    def process(
        self, outputs: list[EngineCoreOutput], now_s: float | None = None
    ) -> ProcessedOutputs:
        """Apply one step's engine outputs; returns what to deliver and what to stop.

        Args:
            outputs: the step's engine outputs.
            now_s: time.monotonic() seconds when the step ended, for the token times in
                the request metrics (default: now).
        """
        batch = ProcessedOutputs()
        now = time.monotonic() if now_s is None else now_s
        touched: dict[str, _Parent] = {}
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue  # aborted on the front end while the step ran
            parent, sample = entry
            if sample.finish_reason is not None:
                continue
            if self.time_detokenize:
                self._apply_timed(parent, sample, out, now, batch)
            else:
                self._apply(parent, sample, out, now, batch)
            touched[parent.request_id] = parent
        for parent in touched.values():
            finished = parent.finished
            request_output = self._make_output(parent, finished)
            if request_output is not None:
                batch.request_outputs.append((parent.sink, request_output))
            if finished:
                parent.metrics.finished_time = now
                self.remove_request(parent.request_id)
        return batch

    def _apply_timed(
        self,
        parent: _Parent,
        sample: _Sample,
        out: EngineCoreOutput,
        now: float,
        batch: ProcessedOutputs,
    ) -> None:
        """`_apply`, timed into `detokenize_s`; keeps the first sample's prompt chunks."""
        metrics = parent.metrics
        if out.prefill_chunks and sample.index == 0:
            metrics.prefill_chunks = (metrics.prefill_chunks or []) + out.prefill_chunks
        start_s = time.perf_counter()
        self._apply(parent, sample, out, now, batch)
        metrics.detokenize_s += time.perf_counter() - start_s

    def _apply(
        self,
        parent: _Parent,
        sample: _Sample,
        out: EngineCoreOutput,
        now: float,
        batch: ProcessedOutputs,
    ) -> None:
        metrics = parent.metrics
        if out.first_scheduled_time is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        if sample.index == 0:
            parent.num_cached_tokens = max(out.num_cached_tokens, 0)
        if out.new_prompt_logprobs and parent.prompt_logprobs is not None and sample.index == 0:
            parent.prompt_logprobs.extend(self._convert(e) for e in out.new_prompt_logprobs)
        if out.num_precision_switches > parent.num_precision_switches:
            parent.num_precision_switches = out.num_precision_switches
        if out.new_token_ids:
            if out.precision is not None:
                parent.precision = out.precision
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            sample.token_ids.extend(out.new_token_ids)
            if out.new_logprobs and sample.logprobs is not None:
                for entry in out.new_logprobs:
                    sample.logprobs.append(self._convert(entry))
                    sample.cumulative_logprob += entry.logprobs[0]
            stop_terminated = (
                out.finish_reason is FinishReason.STOP
                and not parent.params.include_stop_str_in_output
            )
            detokenizer = sample.detokenizer
            stop_str = None
            if detokenizer is not None:
                stop_str = detokenizer.update(out.new_token_ids, stop_terminated)
            if stop_str is not None:
                sample.finish_reason, sample.stop_reason = FinishReason.STOP, stop_str
                if out.finish_reason is None:  # the engine still runs it: stop it there
                    batch.stop_requests.append((out.request_id, stop_str))
        if out.finish_reason is not None and sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        if sample.detokenizer is not None:
            sample.text += sample.detokenizer.get_delta(finished=sample.finish_reason is not None)

    def _convert(self, entry: TokenLogprobs | None) -> dict[int, Logprob] | None:
        if entry is None:
            return None
        tokenizer = self.tokenizer
        return {
            token_id: Logprob(
                logprob, rank, None if tokenizer is None else tokenizer.decode_token(token_id)
            )
            for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)
        }

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput | None:
        kind = parent.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = []
        for s in parent.samples:
            new_tokens = len(s.token_ids) > s.num_tokens_sent
            just_finished = s.finish_reason is not None and not s.finish_sent
            if delta and not (new_tokens or just_finished or len(s.text) > s.num_text_chars_sent):
                continue
            completions.append(self._completion(s, delta))
        prompt_logprobs = None
        complete = parent.prompt_logprobs is not None and len(parent.prompt_logprobs) >= len(
            parent.prompt_token_ids
        )
        if complete and not (delta and parent.prompt_logprobs_sent):
            prompt_logprobs = parent.prompt_logprobs
            parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            precision=parent.precision,
            num_precision_switches=parent.num_precision_switches,
        )

    @staticmethod
    def _completion(s: _Sample, delta: bool) -> CompletionOutput:
        start_tok = s.num_tokens_sent if delta else 0
        start_chr = s.num_text_chars_sent if delta else 0
        out = CompletionOutput(
            index=s.index,
            text=s.text[start_chr:],
            token_ids=s.token_ids[start_tok:],
            cumulative_logprob=s.cumulative_logprob,
            logprobs=s.logprobs[start_tok:] if s.logprobs is not None else None,
            finish_reason=str(s.finish_reason) if s.finish_reason is not None else None,
            stop_reason=s.stop_reason,
        )
        s.num_tokens_sent = len(s.token_ids)
        s.num_text_chars_sent = len(s.text)
        s.finish_sent = s.finish_reason is not None
        return out
