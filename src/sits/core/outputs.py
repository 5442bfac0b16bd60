"""What the engine gives back: per-step `EngineCoreOutput`s and the user-facing `RequestOutput`.

`RequestOutput`, `CompletionOutput` and `Logprob` carry vLLM's names and fields so code written
for vLLM's offline API reads them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sits.core.request import FinishReason


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one position.

    Attributes:
        logprob: natural-log probability under the model's raw distribution (float32 log-softmax
            of the logits, before penalties, temperature or truncation, as vLLM returns).
        rank: 1-based rank of the token among the vocabulary at that position.
        decoded_token: the token's text, filled in by the detokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N alternatives).
SampleLogprobs = list[dict[int, Logprob]]
# Like SampleLogprobs for the prompt; the first position has no logprob (None).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs at one position as the runner computes them.

    Attributes:
        token_ids: the chosen (or actual prompt) token first, then the top-N ids by logprob.
        logprobs: logprob of each id in `token_ids`, same order.
        ranks: 1-based rank of each id in `token_ids`.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass(slots=True)
class EngineCoreOutput:
    """What one engine step produced for one request (a plain, serialisable message).

    Attributes:
        request_id: the engine request (a child id such as "abc-1" when n > 1).
        new_token_ids: tokens sampled this step (empty during a non-final prefill chunk).
        new_logprobs: one entry per new token when the request asked for logprobs.
        new_prompt_logprobs: prompt-position logprobs computed this step (first position None).
        finish_reason: set once the request is finished.
        stop_reason: the stop token id that ended it, or None.
        num_cached_tokens: prompt tokens served from the prefix cache.
        error: a message when the request failed inside the engine.
        first_scheduled_time: time.monotonic() when the request was first scheduled (sent
            once, on its first output).
        prefill_chunks: (step end time.monotonic(), tokens) of each prompt chunk or recompute
            computed since the request's previous output; only while the engine records them
            (`StepStats.record_request_chunks`, for tracing), else None.
        precision: the weight set of the step (`PrecisionState.current` then); None without
            a precision switch.
        num_precision_switches: precision switches between the request's first step and
            this one (0 without a switch).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    first_scheduled_time: float | None = None
    prefill_chunks: list[tuple[float, int]] | None = None
    precision: str | None = None
    num_precision_switches: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps of one request in seconds (time.monotonic()), as vLLM's RequestMetrics.

    Attributes:
        arrival_time: when the request reached the engine front end.
        first_scheduled_time: when the scheduler first gave it tokens (queue time ends).
        first_token_time: when its first output token was produced (TTFT = this - arrival).
        last_token_time: when its latest token was produced.
        finished_time: when it finished.
        prefill_chunks: (time computed, tokens) of each prompt chunk or recompute of its first
            sample, when the engine records them (tracing); else None.
        detokenize_s: seconds the front end spent detokenizing it (all samples), when timed
            (`OutputProcessor.time_detokenize`, for tracing); else 0.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    prefill_chunks: list[tuple[float, int]] | None = None
    detokenize_s: float = 0.0


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput).

    Attributes:
        index: sample index in 0..n-1.
        text: generated text (with the stop string removed unless asked to keep it).
        token_ids: generated token ids (a matched stop token id is included).
        cumulative_logprob: sum of the chosen tokens' logprobs, when logprobs were asked for.
        logprobs: per generated token, the chosen token and the top-N alternatives.
        finish_reason: "stop", "length", "abort" or "error"; None while running.
        stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_delta(self, delta: CompletionOutput) -> None:
        """Append a DELTA output of the same sample (its new text, token ids and logprobs;
        its finish and stop reasons once it ends)."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class RequestOutput:
    """The result (or a streamed update) of one user request (vLLM's RequestOutput).

    Attributes:
        request_id: the user request id.
        prompt: prompt text, when it was given as text.
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt token, its logprob and the top-N (first entry None).
        outputs: one CompletionOutput per sample (n of them).
        finished: True once every sample is finished.
        metrics: timestamps for TTFT, TPOT and E2E.
        num_cached_tokens: prompt tokens served from the prefix cache.
        precision: the weight set (`PrecisionState.current`) of the step that made the latest
            token; None without a precision switch (`EngineConfig.precision_switch`).
        num_precision_switches: precision switches while the request ran (between its first
            scheduled step and its latest one; the most of its samples).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    precision: str | None = None
    num_precision_switches: int = 0
