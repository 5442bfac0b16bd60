"""Prompt makers and how a prompt form is chosen (canned server answers)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from sits.bench.client import CHAT_COMPLETIONS, COMPLETIONS
from sits.bench.probe import normalize_base_url, plan_prompts
from sits.bench.prompts import WORDS, TextPrompts, TokenIdPrompts
from sits.core.errors import InvalidParameterError


def test_token_id_prompts_have_exact_length_from_the_pool() -> None:
    maker = TokenIdPrompts((3, 9, 40))
    a = maker.make(50, random.Random(1))
    assert len(a) == 50 and set(a) <= {3, 9, 40}
    assert maker.make(50, random.Random(1)) == a  # seeded
    assert maker.describe() == {"mode": "token_ids", "pool_size": 3}


def test_text_prompts_size_by_the_linear_fit() -> None:
    maker = TextPrompts(tokens_per_word=2.0, overhead_tokens=10.0)
    assert (maker.num_words(110), maker.num_words(11), maker.num_words(5)) == (50, 1, 1)
    text = maker.make(110, random.Random(0))
    assert len(text.split()) == 50 and set(text.split()) <= set(WORDS)


class FakeServer:
    """Answers /tokenize (optionally) and 1-token probes whose prompt costs 5 + 2 per word."""

    def __init__(self, has_tokenize: bool) -> None:
        self.has_tokenize = has_tokenize
        self.paths: list[str] = []
        self.words: list[int] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            if not self.has_tokenize:
                return httpx.Response(404, json={"detail": "Not Found"})
            assert body["add_special_tokens"] is False
            return httpx.Response(200, json={"tokens": [7, 3, 7, 11], "count": 4})
        assert body["max_tokens"] == 1 and "stream" not in body
        prompt = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
        self.words.append(len(prompt.split()))
        return httpx.Response(200, json={"usage": {"prompt_tokens": 5 + 2 * len(prompt.split())}})


def _plan(server: FakeServer, endpoint: str, prompt_format: str):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await plan_prompts(client, "http://s", endpoint, {}, "m", prompt_format, 0, 100)

    return asyncio.run(go())


def test_auto_uses_token_ids_when_tokenize_works() -> None:
    server = FakeServer(has_tokenize=True)
    assert _plan(server, COMPLETIONS, "auto") == TokenIdPrompts((3, 7, 11))
    assert server.paths == ["/tokenize"]


def test_text_prompts_are_calibrated_by_two_probes() -> None:
    for endpoint, has_tokenize in ((COMPLETIONS, False), (CHAT_COMPLETIONS, True)):
        server = FakeServer(has_tokenize)
        maker = _plan(server, endpoint, "auto")
        assert maker == TextPrompts(tokens_per_word=2.0, overhead_tokens=5.0)
        assert server.paths[-2:] == [endpoint, endpoint]
        assert server.words == [8, 50]  # the second probe: input_len / 2 words


def test_token_ids_refused_where_they_cannot_be_used() -> None:
    with pytest.raises(InvalidParameterError, match="need /v1/completions"):
        _plan(FakeServer(True), CHAT_COMPLETIONS, "token-ids")
    with pytest.raises(InvalidParameterError, match="/tokenize is not available"):
        _plan(FakeServer(False), COMPLETIONS, "token-ids")


def test_base_url_accepts_a_v1_suffix() -> None:
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url("http://h:8000") == "http://h:8000"
