"""Streaming sends one chunk per generated token, even when the token's text is empty.

As in vLLM, every engine step that generated tokens makes an SSE chunk: a token that decodes
to "" (a byte of a character not yet complete) or whose text is held back because it may start
a stop string sends `text: ""` (completions) or `delta: {"content": ""}` (chat), so a client
sees each token arrive. Before commit 6ab0802 such tokens made no chunk unless logprobs were
asked for; then the chunk counts below fall short of the generated token count.

The expected chunks are derived from the engine's own greedy token ids by a reference that
decodes whole prefixes (`_reference_deltas`), not by the server's window detokenizer. The
prompts were picked by experiment on the shared tiny MoE (seed 0): their greedy outputs hold
byte tokens of characters that never complete. Texts are not written out because the tiny
tokenizer's vocabulary depends on the Python version (its corpus has stdlib docstrings); each
test first checks that its prompt still gives tokens with empty text.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.server.greedy_probe import greedy_token_ids

MAX_TOKENS = 12
# Greedy continuations hold lone UTF-8 lead bytes (pieces "\ufffd"): tokens with text "".
COMPLETION_PROMPT = "The quick brown fox"
CHAT_MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]
STOP_PROMPT = "Once upon a time"
_REPLACEMENT_CHAR = "\ufffd"


def _engine_token_ids(server: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return server.submit(greedy_token_ids(server.engine, prompt_ids, max_tokens)).result(60)


def _reference_deltas(tokenizer: Any, token_ids: list[int], stop: str = "") -> list[str]:
    """The streamed text of each token by whole-prefix decoding.

    After token k the visible text is decode(ids[:k]) unless that ends in an incomplete
    character (U+FFFD), then it stays as before; the last len(stop) - 1 characters are held
    back; a stop match cuts the text at its start and ends the stream; the last token flushes
    everything (U+FFFD included).
    """
    num_holdback_chars = max(len(stop) - 1, 0)
    text, sent, deltas = "", "", []
    for k in range(1, len(token_ids) + 1):
        full = tokenizer.decode(token_ids[:k])
        if not full.endswith(_REPLACEMENT_CHAR):
            text = full
        if stop and stop in text:
            deltas.append(text[: text.find(stop)][len(sent) :])
            return deltas
        if k == len(token_ids):
            shown = full
        else:
            shown = text[: max(len(text) - num_holdback_chars, len(sent))]
        deltas.append(shown[len(sent) :])
        sent = shown
    return deltas


def _sse_chunks(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of one streamed request; checks it ends with [DONE]."""
    chunks: list[dict[str, Any]] = []
    done = False
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            assert not done, "data after [DONE]"
            if line == "data: [DONE]":
                done = True
            else:
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert done
    return chunks


def _greedy_deltas(server, prompt_ids: list[int]) -> tuple[list[int], list[str]]:
    """The engine's greedy MAX_TOKENS tokens for the prompt and the reference text delta of
    each; checks that one of them (not the last) decodes to "" (what the tests are about)."""
    tokenizer = server.engine.tokenizer
    token_ids = _engine_token_ids(server, prompt_ids, MAX_TOKENS)
    expected = _reference_deltas(tokenizer, token_ids)
    assert len(expected) == MAX_TOKENS
    assert "" in expected[:-1], "the prompt no longer yields a token with empty text"
    return token_ids, expected


def test_completion_stream_sends_a_chunk_per_token(server, model_name) -> None:
    tokenizer = server.engine.tokenizer
    token_ids, expected = _greedy_deltas(server, tokenizer.encode(COMPLETION_PROMPT))
    body = {
        "model": model_name,
        "prompt": COMPLETION_PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.http() as http:
        whole = http.post("/v1/completions", json=body).json()
        options = {"include_usage": True, "continuous_usage_stats": True}
        chunks = _sse_chunks(http, "/v1/completions", {**body, "stream_options": options})
    assert whole["choices"][0]["text"] == tokenizer.decode(token_ids)
    assert whole["usage"]["completion_tokens"] == MAX_TOKENS

    *token_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == MAX_TOKENS
    assert all(len(c["choices"]) == 1 for c in token_chunks)
    choices = [c["choices"][0] for c in token_chunks]
    texts = [c["text"] for c in choices]
    assert texts == expected  # one chunk per generated token, "" ones included
    assert "".join(texts) == whole["choices"][0]["text"]
    # Each chunk carries exactly one more generated token.
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == list(range(1, MAX_TOKENS + 1))
    assert [c["finish_reason"] for c in choices] == [None] * (MAX_TOKENS - 1) + ["length"]
    assert all(c["logprobs"] is None for c in choices)


def test_chat_stream_sends_a_chunk_per_token(server, model_name) -> None:
    tokenizer = server.engine.tokenizer
    prompt_ids = tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True)
    token_ids, expected = _greedy_deltas(server, prompt_ids)
    body = {
        "model": model_name,
        "messages": CHAT_MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.http() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        chunks = _sse_chunks(http, "/v1/chat/completions", body)
    content = whole["choices"][0]["message"]["content"]
    assert content == tokenizer.decode(token_ids)
    assert whole["usage"]["completion_tokens"] == MAX_TOKENS

    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in chunks)
    role_chunk, *token_chunks = [c["choices"][0] for c in chunks]
    assert role_chunk["delta"] == {"role": "assistant", "content": ""}
    assert role_chunk["finish_reason"] is None
    # One chunk per generated token, each with a `content` string ("" for empty text).
    assert [c["delta"] for c in token_chunks] == [{"content": text} for text in expected]
    assert "".join(c["delta"]["content"] for c in token_chunks) == content
    assert [c["finish_reason"] for c in token_chunks] == [None] * (MAX_TOKENS - 1) + ["length"]


def test_stop_string_holdback_sends_empty_chunks(server, model_name) -> None:
    tokenizer = server.engine.tokenizer
    max_tokens = 16
    token_ids = _engine_token_ids(server, tokenizer.encode(STOP_PROMPT), max_tokens)
    full = tokenizer.decode(token_ids)
    # The stop string is the text of tokens 2-5 (whole characters), first found right after
    # token 1's text: it is longer than the text before it, so the first tokens' text is held
    # back as a possible stop-string prefix, and it matches when token 5 is generated.
    head, stop = tokenizer.decode(token_ids[:1]), tokenizer.decode(token_ids[1:5])
    assert _REPLACEMENT_CHAR not in head + stop and full.find(stop) == len(head)
    num_tokens = 5
    expected = _reference_deltas(tokenizer, token_ids, stop)
    assert len(expected) == num_tokens
    assert "".join(expected) == head
    # Chunks with text "" although their tokens decoded to whole characters: held back.
    held = [
        k
        for k, delta in enumerate(expected)
        if delta == "" and not tokenizer.decode(token_ids[: k + 1]).endswith(_REPLACEMENT_CHAR)
    ]
    assert held, "no token's text is held back as a stop-string prefix"
    body = {
        "model": model_name,
        "prompt": STOP_PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stop": [stop],
    }
    with server.http() as http:
        whole = http.post("/v1/completions", json=body).json()
        chunks = _sse_chunks(http, "/v1/completions", body)
    choice = whole["choices"][0]
    assert choice["text"] == head
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert whole["usage"]["completion_tokens"] == num_tokens

    assert all(len(c["choices"]) == 1 for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert [c["text"] for c in choices] == expected  # one chunk per token up to the match
    assert "".join(c["text"] for c in choices) == head
    assert [c["finish_reason"] for c in choices] == [None] * (num_tokens - 1) + ["stop"]
    assert choices[-1]["stop_reason"] == stop
