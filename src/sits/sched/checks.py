"""Per-request functions of the scheduler: refusing requests that can never run, stop rules,
and the engine output of a request's step.

Pure functions of a request and the config (no scheduler state).
"""

from __future__ import annotations

from sits.core.limits import resolve_limits
from sits.core.outputs import EngineCoreOutput, TokenLogprobs
from sits.core.request import FinishReason, Request
from sits.sched.config import SchedulerConfig


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Stop check after a token was appended to `request`.

    Order: a stop token id, then EOS (unless `ignore_eos`) -- both only once
    `num_output_tokens >= min_tokens` -- then the length limits (`max_tokens` outputs or
    `max_model_len` tokens in all).

    Returns:
        (FinishReason.STOP, the stop token id) for a stop token, (STOP, None) for EOS,
        (LENGTH, None) at a limit, or None to keep going.
    """
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    token_id = output_token_ids[-1]
    num_output_tokens = len(output_token_ids)  # the properties, read once (every decode, step)
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if not params.ignore_eos and token_id == request.eos_token_id:
            return FinishReason.STOP, None
    if reaches_length_limit(request, max_model_len):
        return FinishReason.LENGTH, None
    return None


def reaches_length_limit(request: Request, max_model_len: int) -> bool:
    """True when the request has `max_tokens` outputs or `max_model_len` tokens in all (its
    last token, possibly a placeholder of async scheduling, counted)."""
    return (
        len(request.output_token_ids) >= request.max_tokens
        or len(request.all_token_ids) >= max_model_len
    )


def validate_request(request: Request, config: SchedulerConfig) -> None:
    """Refuse a request that is malformed or could never run under `config` (its context and
    whole KV cache, `sits.core.limits.resolve_limits`: the engine's one check of a request).

    Raises:
        InvalidParameterError: empty prompt ("prompt").
        PromptTooLongError: prompt + max_tokens exceeds max_model_len, or needs more KV blocks
            than the whole cache holds.
    """
    resolve_limits(
        request.num_prompt_tokens,
        request.max_tokens,
        config.max_model_len,
        num_kv_blocks=config.num_usable_blocks,
        block_size=config.block_size,
    )


def engine_output(
    request: Request,
    new_token_ids: list[int],
    logprobs: list[TokenLogprobs] | None,
    prompt_logprobs: list[TokenLogprobs | None] | None,
) -> EngineCoreOutput:
    """What one step (or a finish from outside) produced for `request`.

    Built for every request in every step, so with positional arguments (half the cost of
    keywords here), in `EngineCoreOutput`'s field order.
    """
    num_cached_tokens = request.num_cached_tokens
    return EngineCoreOutput(
        request.request_id,
        new_token_ids,
        logprobs,  # new_logprobs
        prompt_logprobs,  # new_prompt_logprobs
        request.finish_reason,
        request.stop_reason,
        num_cached_tokens if num_cached_tokens > 0 else 0,
    )


def is_decode(request: Request) -> bool:
    """True when the request's next work is one decode token (not a prompt chunk/recompute)."""
    return bool(request.output_token_ids) and request.num_tokens - request.num_computed_tokens == 1
