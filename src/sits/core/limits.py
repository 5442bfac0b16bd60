"""A request's token limits, resolved and checked in one place.

`resolve_limits` is the only code that turns a requested `max_tokens` (or None: "fill the
context") into the number of tokens a request may generate, and the only code that refuses a
request that can never run: an empty prompt, a prompt that leaves no room, prompt +
max_tokens over the context (OpenAI's wording, as vLLM and the HTTP tests have it), or more KV
blocks than the whole cache holds. The server calls it once per prompt (it knows the field
names and the tenant's default cap); the scheduler calls it once per engine request (it knows
the KV cache); every other layer only reads the resolved `Request.max_tokens`.

`check_cache_holds_context` refuses, at engine start, a KV cache smaller than the model's own
context when the user did not set max_model_len (vLLM's rule).

Invariants: pure (no state, no I/O); every refusal is an `InvalidParameterError` /
`PromptTooLongError` naming the field the user can change, with one wording per cause.
`max_tokens` values themselves (integer >= 0) are validated by `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sits.core.errors import InvalidParameterError, PromptTooLongError


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The token limits of one request (one sample).

    Attributes:
        num_prompt_tokens: the prompt's length in tokens (>= 1).
        max_tokens: the most tokens it may generate (>= 0); prompt + max_tokens fits the
            context (and the KV cache when it was checked).
    """

    num_prompt_tokens: int
    max_tokens: int

    @property
    def num_total_tokens(self) -> int:
        """Prompt and completion tokens at most."""
        return self.num_prompt_tokens + self.max_tokens


def resolve_limits(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    *,
    num_kv_blocks: int | None = None,
    block_size: int = 1,
    prompt_param: str = "prompt",
    default_cap: int | None = None,
) -> RequestLimits:
    """Resolve a request's `max_tokens` and refuse a request that could never run (vLLM's
    rule: None fills the context after the prompt, at most `default_cap`).

    Args:
        num_prompt_tokens: the prompt's length in tokens.
        max_tokens: as asked (an integer >= 0, validated by `SamplingParams`), or None.
        max_model_len: the context limit in tokens.
        num_kv_blocks: KV blocks a request may use in all (the cache less its null block);
            None skips the cache check (the server does not know the cache).
        block_size: tokens per KV block (with `num_kv_blocks`).
        prompt_param: the field to blame for the prompt ("prompt" or "messages").
        default_cap: the most a None stands for (the tenant's limits); None: no cap. A None
            never asks for more than the cache holds either (with `num_kv_blocks`).

    Returns:
        The resolved limits.

    Raises:
        InvalidParameterError: the prompt is empty (`prompt_param`).
        PromptTooLongError: prompt + max_tokens > max_model_len (param "max_tokens" when
            max_tokens alone reaches it, else `prompt_param`), no room is left for a None,
            or prompt + max_tokens needs more than `num_kv_blocks` blocks (`prompt_param`).
    """
    assert max_tokens is None or max_tokens >= 0, max_tokens  # SamplingParams validates it
    if num_prompt_tokens == 0:
        raise InvalidParameterError(
            prompt_param,
            f"{prompt_param} is empty: it must contain at least one token after tokenization.",
        )
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt has {num_prompt_tokens} tokens, which leaves no room for the "
                "completion. Please reduce the length of the prompt.",
                param=prompt_param,
            )
        room = max_model_len
        if num_kv_blocks is not None:  # a context longer than the whole cache: fill the cache
            room = min(room, num_kv_blocks * block_size)
        if num_prompt_tokens >= room:
            raise PromptTooLongError(
                f"The KV cache holds {room} tokens ({num_kv_blocks} blocks of {block_size}). "
                f"However, your prompt has {num_prompt_tokens} tokens, which leaves no room "
                "for the completion. Please reduce the length of the prompt.",
                param=prompt_param,
            )
        fill = room - num_prompt_tokens
        max_tokens = fill if default_cap is None else min(fill, default_cap)
    num_total_tokens = num_prompt_tokens + max_tokens
    if num_total_tokens > max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_total_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt or "
            "max_tokens.",
            param="max_tokens" if max_tokens >= max_model_len else prompt_param,
        )
    if num_kv_blocks is not None:
        num_blocks = -(-num_total_tokens // block_size)
        if num_blocks > num_kv_blocks:
            raise PromptTooLongError(
                f"The request needs {num_total_tokens} tokens ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion) = {num_blocks} KV blocks of "
                f"{block_size} tokens, but the KV cache holds only {num_kv_blocks} blocks "
                f"({num_kv_blocks * block_size} tokens). Please reduce the length of the "
                "prompt or max_tokens.",
                param=prompt_param,
            )
    return RequestLimits(num_prompt_tokens, max_tokens)


def check_cache_holds_context(
    max_model_len: int, num_kv_blocks: int, block_size: int, *, explicit: bool
) -> None:
    """Refuse to start an engine whose whole KV cache cannot hold one request of the model's
    own context length (vLLM's startup rule). A `max_model_len` the user set is kept: then a
    request's unset max_tokens fills only what the cache holds (`resolve_limits`).

    Args:
        max_model_len: the context length in tokens.
        num_kv_blocks: KV blocks requests may use (the cache less its null block).
        block_size: tokens per KV block.
        explicit: the user set max_model_len (--max-model-len).

    Raises:
        InvalidParameterError("max_model_len"): the cache holds fewer tokens than the model's
            context and max_model_len was not set; the message gives both numbers and what
            to change.
    """
    num_tokens = num_kv_blocks * block_size
    if explicit or max_model_len <= num_tokens:
        return
    raise InvalidParameterError(
        "max_model_len",
        f"the model's context length is {max_model_len} tokens "
        f"({-(-max_model_len // block_size)} KV blocks of {block_size} tokens), but the KV "
        f"cache holds only {num_kv_blocks} blocks ({num_tokens} tokens): give --max-model-len "
        f"{num_tokens} or less, or more KV cache memory (--kv-cache-memory-bytes, "
        "--gpu-memory-utilization)",
    )
