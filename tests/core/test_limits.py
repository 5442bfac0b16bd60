"""`resolve_limits`: vLLM's max_tokens rule and the one wording of each refusal."""

from __future__ import annotations

import pytest

from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.limits import RequestLimits, resolve_limits


def test_max_tokens_follows_vllm() -> None:
    assert resolve_limits(100, 16, 1024) == RequestLimits(100, 16)
    assert resolve_limits(100, None, 1024) == RequestLimits(100, 924)  # fills the context
    assert resolve_limits(1000, 24, 1024).num_total_tokens == 1024  # exactly the context
    assert resolve_limits(100, None, 1024, default_cap=50).max_tokens == 50
    assert resolve_limits(1000, None, 1024, default_cap=50).max_tokens == 24
    assert resolve_limits(3, 0, 4).max_tokens == 0  # echo with max_tokens 0 (case C03)


def test_over_the_context_is_openais_400() -> None:
    with pytest.raises(PromptTooLongError) as err:
        resolve_limits(1000, 25, 1024, prompt_param="messages")
    assert err.value.param == "messages"
    assert str(err.value) == (
        "This model's maximum context length is 1024 tokens. However, you requested 1025 "
        "tokens (1000 in the prompt, 25 for the completion). Please reduce the length of the "
        "prompt or max_tokens."
    )
    with pytest.raises(PromptTooLongError) as err:  # max_tokens alone is over the limit
        resolve_limits(5, 10**12, 1024)
    assert err.value.param == "max_tokens"
    with pytest.raises(PromptTooLongError, match="leaves no room") as err:
        resolve_limits(1024, None, 1024)
    assert err.value.param == "prompt"


def test_empty_prompt_is_refused_before_anything_else() -> None:
    with pytest.raises(InvalidParameterError) as err:
        resolve_limits(0, None, 0, prompt_param="messages")
    assert type(err.value) is InvalidParameterError and err.value.param == "messages"
    assert str(err.value) == (
        "messages is empty: it must contain at least one token after tokenization."
    )


def test_the_kv_cache_bounds_prompt_plus_max_tokens_in_blocks() -> None:
    # 4 blocks of 4 tokens: 16 tokens fit, 17 need a 5th block.
    assert resolve_limits(12, 4, 20, num_kv_blocks=4, block_size=4) == RequestLimits(12, 4)
    with pytest.raises(PromptTooLongError) as err:
        resolve_limits(13, 4, 20, num_kv_blocks=4, block_size=4)
    assert err.value.param == "prompt"
    assert str(err.value) == (
        "The request needs 17 tokens (13 in the prompt, 4 for the completion) = 5 KV blocks of "
        "4 tokens, but the KV cache holds only 4 blocks (16 tokens). Please reduce the length "
        "of the prompt or max_tokens."
    )
    # The context is checked first: its error names what the client can change.
    with pytest.raises(PromptTooLongError, match="maximum context length is 20"):
        resolve_limits(18, 4, 20, num_kv_blocks=4, block_size=4)
    # A None fills the context, or the cache when the cache holds less.
    assert resolve_limits(12, None, 20, num_kv_blocks=4, block_size=4) == RequestLimits(12, 4)
    with pytest.raises(PromptTooLongError, match="The KV cache holds 16 tokens"):
        resolve_limits(16, None, 20, num_kv_blocks=4, block_size=4)
