"""A text prompt longer than the context can hold in any tokenization is refused before it is
tokenized (400, param named); `Tokenizer.max_token_chars` is a true bound on characters per
token."""

from __future__ import annotations

import httpx
import pytest

from sits.engine.tokenizer import Tokenizer
from tests.server.conftest import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def tokenizer(tiny_moe_dir) -> Tokenizer:
    return Tokenizer(tiny_moe_dir)


def test_max_token_chars_bounds_the_characters_of_every_token(tokenizer) -> None:
    vocab = tokenizer.hf_tokenizer.get_vocab()
    assert tokenizer.max_token_chars == max(len(token) for token in vocab)
    decoded = max(len(tokenizer.decode_token(i)) for i in range(tokenizer.vocab_size))
    assert decoded <= tokenizer.max_token_chars
    for text in ("def f(x):\n    return x", " " * 500, "é€😀" * 50, "aaaa" * 300, "\n\t" * 99):
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert num_tokens * tokenizer.max_token_chars >= len(text), text[:20]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_prompts_beyond_any_tokenization_are_refused_unread(server, tokenizer) -> None:
    limit = MAX_MODEL_LEN * tokenizer.max_token_chars
    huge = "x" * (limit + 1)
    answer = _post(server, "/v1/completions", {"prompt": huge, "max_tokens": 1})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    at_least = -(-(limit + 1) // tokenizer.max_token_chars)
    assert f"has {limit + 1} characters, at least {at_least} tokens" in error["message"]
    messages = [{"role": "user", "content": huge}]
    answer = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages"
    # Within the bound but over the context: refused after tokenizing, by token count.
    answer = _post(server, "/v1/completions", {"prompt": "x " * MAX_MODEL_LEN, "max_tokens": 1})
    assert answer.status_code == 400
    assert "However, you requested" in answer.json()["error"]["message"]
    ok = _post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 2})
    assert ok.status_code == 200
