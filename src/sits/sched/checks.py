"""Per-request functions of the scheduler: refusing requests that can never run, stop rules,
and the engine output of a request's step.

Pure functions of a request and the config (no scheduler state).
"""

from __future__ import annotations

from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.outputs import EngineCoreOutput, TokenLogprobs
from sits.core.request import FinishReason, Request
from sits.kvcache.kv_manager import cdiv
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
    """Refuse a request that is malformed or could never run under `config`.

    Raises:
        InvalidParameterError: empty prompt ("prompt") or negative max_tokens ("max_tokens").
        PromptTooLongError: prompt + max_tokens exceeds max_model_len, or needs more KV blocks
            than the whole cache holds.
    """
    num_prompt_tokens = request.num_prompt_tokens
    if num_prompt_tokens == 0:
        raise InvalidParameterError("prompt", "prompt must contain at least one token")
    if request.max_tokens < 0:
        raise InvalidParameterError(
            "max_tokens", f"max_tokens must be >= 0, got {request.max_tokens}"
        )
    num_total_tokens = num_prompt_tokens + request.max_tokens
    max_model_len = config.max_model_len
    if num_total_tokens > max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_total_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{request.max_tokens} for max_tokens). Please reduce the prompt or max_tokens."
        )
    num_blocks = cdiv(num_total_tokens, config.block_size)
    if num_blocks > config.num_usable_blocks:
        raise PromptTooLongError(
            f"The request needs {num_total_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {request.max_tokens} for max_tokens) = {num_blocks} KV blocks of "
            f"{config.block_size} tokens, but the KV cache holds only "
            f"{config.num_usable_blocks} blocks. Please reduce the prompt or max_tokens."
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
