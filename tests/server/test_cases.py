"""Cases C01-C11 (shared/cases/README.md) at the HTTP level, each with its right value."""

from __future__ import annotations

import json
from collections.abc import Mapping

import openai
import pytest

from tests.server.greedy_probe import greedy_token_ids

PROMPT = "def fibonacci(n):"
MAX_MODEL_LEN = 1024


def _stop_across_tokens(server, text: str, token_ids: list[int]) -> str:
    """A 5-character stop string that straddles a token boundary where it first occurs."""
    tokenizer = server.engine.tokenizer
    for k in range(2, len(token_ids) - 2):
        boundary = len(tokenizer.decode(token_ids[:k]))
        if not text.startswith(tokenizer.decode(token_ids[:k])):
            continue
        stop = text[boundary - 2 : boundary + 3]
        if len(stop) == 5 and "\ufffd" not in stop and text.find(stop) == boundary - 2:
            return stop
    raise AssertionError("no stop string across tokens in this text")


def test_c01_stop_string_across_tokens_streamed(client, server, model_name) -> None:
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    token_ids = server.submit(greedy_token_ids(server.engine, prompt_ids, 40)).result(60)
    full = server.engine.tokenizer.decode(token_ids)
    stop = _stop_across_tokens(server, full, token_ids)
    expected = full[: full.find(stop)]
    kwargs = dict(
        model=model_name,
        prompt=PROMPT,
        temperature=0,
        max_tokens=40,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].text for c in chunks]
    assert "".join(deltas) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # No delta holds any part of the matched stop string.
    tail = full[len(expected) :]
    assert tail.startswith(stop)
    assert sum(len(d) for d in deltas) == len(expected)


def test_c02_held_back_stop_prefix_is_flushed_at_the_end(client, server, model_name) -> None:
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    token_ids = server.submit(greedy_token_ids(server.engine, prompt_ids, 30)).result(60)
    full = server.engine.tokenizer.decode(token_ids)
    stop = full[-3:] + "<never-produced-suffix>"
    kwargs = dict(
        model=model_name,
        prompt=PROMPT,
        temperature=0,
        max_tokens=30,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert whole.choices[0].text == full
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    chat_kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Count to ten."}],
        temperature=0,
        max_tokens=30,
        stop=[stop],
    )
    chat_whole = client.chat.completions.create(**chat_kwargs).choices[0].message.content
    chat_chunks = client.chat.completions.create(stream=True, **chat_kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_whole


def test_c03_echo_with_no_new_tokens(client, server, model_name) -> None:
    out = client.completions.create(
        model=model_name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert out.usage.completion_tokens == 0
    num_prompt = len(server.engine.tokenizer.encode(PROMPT))
    assert out.usage.prompt_tokens == num_prompt
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == PROMPT
    # The server keeps serving.
    again = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2)
    assert again.usage.completion_tokens <= 2


def test_c04_top_logprobs_count(client, model_name) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Say something."}],
        logprobs=True,
        top_logprobs=5,
        max_tokens=12,
        temperature=0.7,
        seed=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens > 0
    for position in content:
        alternatives = position.top_logprobs
        assert len(alternatives) == 5
        values = [a.logprob for a in alternatives]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values) and position.logprob <= 0
        same = [a for a in alternatives if a.token == position.token]
        if same and len({a.token for a in alternatives}) == 5:
            assert same[0].logprob == position.logprob


def test_c05_usage_in_streams(server, model_name) -> None:
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with server.http() as http:
        whole = http.post(
            "/v1/chat/completions", json={**body, "stream": False, "stream_options": None}
        )
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            events = [
                line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")
            ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content_chunks, last = chunks[:-1], chunks[-1]
    assert content_chunks and all(c["choices"] and c["usage"] is None for c in content_chunks)
    assert last["choices"] == []
    assert last["usage"] == whole.json()["usage"]
    num_prompt = len(server.engine.tokenizer.apply_chat_template(body["messages"]))
    assert last["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 20,
        "total_tokens": num_prompt + 20,
        "prompt_tokens_details": None,
    }


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_c06_max_tokens_honoured(client, model_name, field) -> None:
    messages = [{"role": "user", "content": "Write a very long essay about the ocean."}]
    out = client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, **{field: 50}
    )
    usage, choice = out.usage, out.choices[0]
    assert usage.completion_tokens <= 50
    assert (choice.finish_reason == "length") == (usage.completion_tokens == 50)
    forced = client.chat.completions.create(
        model=model_name, messages=messages, extra_body={"ignore_eos": True}, **{field: 50}
    )
    assert forced.usage.completion_tokens == 50 and forced.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [""]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [[]]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
    ],
)
def test_c07_empty_input(server, model_name, endpoint, body, param) -> None:
    with server.http() as http:
        resp = http.post(endpoint, json={"model": model_name, "max_tokens": 4, **body})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("num_prompt_tokens", "max_tokens"),
    [(MAX_MODEL_LEN - 16 + 1, 16), (MAX_MODEL_LEN + 1, 16), (MAX_MODEL_LEN, None), (2000, None)],
)
def test_c08_prompt_too_long(client, model_name, num_prompt_tokens, max_tokens) -> None:
    prompt = [40 + (i % 200) for i in range(num_prompt_tokens)]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens)
    message = err.value.body["message"]
    assert err.value.body["param"] == "prompt"
    assert str(MAX_MODEL_LEN) in message and str(num_prompt_tokens) in message
    # A prompt that just fits gets every token it asked for; the server is alive.
    fits = client.completions.create(
        model=model_name,
        prompt=prompt[: MAX_MODEL_LEN - 16],
        max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    assert fits.usage.completion_tokens == 16


def test_c08_chat_prompt_too_long(client, model_name) -> None:
    messages = [{"role": "user", "content": "word " * 1100}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=messages)
    assert err.value.body["param"] == "messages"
    assert str(MAX_MODEL_LEN) in err.value.body["message"]


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        ("completions", {"top_k": 0.01}, "top_k"),
        ("completions", {"temperature": -1}, "temperature"),
        ("completions", {"top_p": 0}, "top_p"),
        ("completions", {"top_p": 1.5}, "top_p"),
        ("completions", {"n": 0}, "n"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"max_tokens": -5}, "max_tokens"),
        ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo (C03)
        ("completions", {"min_p": 2}, "min_p"),
        ("completions", {"stop": [""]}, "stop"),
        ("completions", {"seed": 2**64}, "seed"),
        ("chat/completions", {"seed": -(2**63) - 1}, "seed"),
        ("chat/completions", {"top_k": 0.01}, "top_k"),
        ("chat/completions", {"temperature": -1}, "temperature"),
        ("chat/completions", {"n": 0}, "n"),
        ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"max_tokens": -5}, "max_tokens"),
        ("chat/completions", {"max_completion_tokens": -5}, "max_completion_tokens"),
        ("chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_c09_invalid_sampling_parameters(server, model_name, endpoint, extra, param) -> None:
    body = {"model": model_name, "max_tokens": 3, **extra}
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    with server.http() as http:
        resp = http.post(f"/v1/{endpoint}", json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert (
            http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        )


@pytest.mark.parametrize("n", [2, 4, 8])
def test_c10_n_choices(client, server, model_name, n) -> None:
    num_prompt = len(server.engine.tokenizer.encode(PROMPT))
    for attempt in range(10):
        if attempt % 2 == 0:
            out = client.completions.create(
                model=model_name, prompt=PROMPT, n=n, temperature=1.0, max_tokens=6, logprobs=0
            )
            per_choice = [len(c.logprobs.tokens) for c in out.choices]
            assert out.usage.prompt_tokens == num_prompt
        else:
            out = client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": "Pick a word."}],
                n=n,
                temperature=1.0,
                max_tokens=6,
                logprobs=True,
            )
            per_choice = [len(c.logprobs.content) for c in out.choices]
        assert [c.index for c in out.choices] == list(range(n))
        assert out.usage.completion_tokens == sum(per_choice)


def _transformers_chat_ids(model_dir, messages) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def test_c11_chat_template(client, server, model_name, tiny_moe_dir) -> None:
    messages = [
        {"role": "system", "content": "You are a pirate who loves the sea."},
        {"role": "user", "content": "Where is the treasure?"},
    ]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    expected = _transformers_chat_ids(tiny_moe_dir, messages)
    assert out.usage.prompt_tokens == len(expected)
    with server.http() as http:
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids == expected
    rendered = server.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert "You are a pirate who loves the sea." in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
