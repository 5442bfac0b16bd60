"""A KV cache smaller than the context (issue 29, fault 2) and stop_token_ids out of the
vocabulary.

Without --max-model-len such an engine refuses to start (vLLM's rule) with the cache's real
numbers; with it, an unset max_tokens fills only what the cache holds.
"""

from __future__ import annotations

import json

import openai
import pytest

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.limits import check_cache_holds_context, resolve_limits

NUM_BLOCKS = 20  # the whole cache: 19 usable blocks of 16 tokens (one is the null block)


def _block_bytes(model_dir) -> int:
    """float32 K and V of every layer for one block of 16 tokens."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def test_check_cache_holds_context() -> None:
    check_cache_holds_context(304, 19, 16, explicit=False)  # fits exactly
    check_cache_holds_context(1024, 19, 16, explicit=True)  # the user asked for it
    with pytest.raises(InvalidParameterError) as err:
        check_cache_holds_context(1024, 19, 16, explicit=False)
    assert err.value.param == "max_model_len"
    assert "1024 tokens (64 KV blocks of 16 tokens)" in str(err.value)
    assert "holds only 19 blocks (304 tokens): give --max-model-len 304 or less" in str(err.value)


def test_unset_max_tokens_fills_the_cache_not_the_context() -> None:
    assert resolve_limits(10, None, 1024, num_kv_blocks=19, block_size=16).max_tokens == 294
    assert resolve_limits(10, None, 1024).max_tokens == 1014
    assert resolve_limits(10, None, 100, num_kv_blocks=19, block_size=16).max_tokens == 90
    with pytest.raises(PromptTooLongError) as err:
        resolve_limits(10, 300, 1024, num_kv_blocks=19, block_size=16)
    assert "holds only 19 blocks (304 tokens)" in str(err.value)


def test_engine_refuses_to_start_without_max_model_len(tiny_moe_dir) -> None:
    from sits.engine.llm import LLM

    with pytest.raises(InvalidParameterError) as err:
        LLM(
            model=str(tiny_moe_dir),
            dtype="float32",
            kv_cache_memory_bytes=NUM_BLOCKS * _block_bytes(tiny_moe_dir),
        )
    assert err.value.param == "max_model_len"
    assert "context length is 1024 tokens" in str(err.value)
    assert "holds only 19 blocks (304 tokens)" in str(err.value)


@pytest.fixture(scope="module")
def small_cache_server(tiny_moe_dir):
    """max_model_len 1024 set explicitly over a cache of 304 tokens."""
    from sits.engine.async_llm import AsyncLLM
    from tests.server.live import LiveServer

    config = EngineConfig(
        model=str(tiny_moe_dir),
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=NUM_BLOCKS * _block_bytes(tiny_moe_dir),
    )
    with LiveServer(lambda: AsyncLLM(config)) as live:
        yield live


def test_unset_max_tokens_is_capped_to_the_cache(small_cache_server) -> None:
    client = small_cache_server.client()
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.total_tokens == 304
    assert chat.choices[0].finish_reason == "length"
    text = client.completions.create(  # a null max_tokens: fill (the default is 16)
        model=model,
        prompt="hello",
        temperature=0,
        extra_body={"ignore_eos": True, "max_tokens": None},
    )
    assert text.usage.total_tokens == 304
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="hello", max_tokens=400)
    assert "holds only 19 blocks (304 tokens)" in err.value.message


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stop_token_ids_outside_the_vocabulary(client, model_name, endpoint) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={"stop_token_ids": [5, 512]},
            )
        else:
            client.completions.create(
                model=model_name, prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [-1]}
            )
    assert err.value.body["param"] == "stop_token_ids"
    ok = client.completions.create(
        model=model_name, prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [511]}
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
