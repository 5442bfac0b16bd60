"""The official `openai` client against a live server: completions, chat, streaming, n,
logprobs, echo, usage, models, tokenize, and the OpenAI error shapes."""

from __future__ import annotations

import openai
import pytest

PROMPT = "def fibonacci(n):"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a haiku about the sea."},
]


def _prompt_len(server, text: str) -> int:
    with server.http() as http:
        return http.post("/tokenize", json={"prompt": text}).json()["count"]


def test_models_lists_the_served_model(client, server) -> None:
    models = client.models.list().data
    assert len(models) == 1
    card = models[0]
    assert card.id == server.engine.model_name
    assert card.model_extra["max_model_len"] == server.engine.max_model_len == 1024
    assert card.model_extra["random_weights"] is False
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


def test_completion_counts_and_default_max_tokens(client, server, model_name) -> None:
    out = client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion"
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == _prompt_len(server, PROMPT) == 12
    assert out.usage.completion_tokens == 16  # OpenAI's default max_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + 16


def test_completion_stream_joins_to_the_non_streamed_text(client, model_name) -> None:
    kwargs = dict(model=model_name, prompt=PROMPT, temperature=0, max_tokens=40)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    joined = "".join(c.choices[0].text for c in chunks)
    assert joined == whole.choices[0].text
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1


def test_chat_stream_joins_to_the_non_streamed_text(client, model_name) -> None:
    kwargs = dict(model=model_name, messages=MESSAGES, temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    joined = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.role == "assistant"
    assert joined == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n3_gives_three_choices_and_sums_usage(client, model_name) -> None:
    out = client.completions.create(
        model=model_name, prompt=PROMPT, n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    per_choice = [len(c.logprobs.tokens) for c in out.choices]
    assert out.usage.completion_tokens == sum(per_choice)
    assert out.usage.prompt_tokens == 12  # the prompt is counted once
    again = client.completions.create(
        model=model_name, prompt=PROMPT, n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=0
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_completion_logprobs_shape(client, model_name) -> None:
    out = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        temperature=0,
        max_tokens=10,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert len(lp.text_offset) == 10 and lp.text_offset[0] == len(PROMPT)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0
        # the top 3 plus the chosen token, keyed by text (tokens with equal text collapse)
        assert 1 <= len(top) <= 4
        assert len(top) >= 3 or "\ufffd" in top
        assert top[token] == chosen
        # greedy: the chosen token is the most likely one
        assert chosen == max(top.values())


def test_echo_with_generation(client, model_name) -> None:
    out = client.completions.create(
        model=model_name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=5, temperature=0
    )
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    assert len(choice.logprobs.tokens) == 12 + out.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.top_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])


def test_batch_of_prompts_with_n(client, server, model_name) -> None:
    prompts = ["Hello there", "The quick brown fox"]
    out = client.completions.create(
        model=model_name, prompt=prompts, n=2, max_tokens=4, temperature=0.8, seed=1, logprobs=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == sum(_prompt_len(server, p) for p in prompts)
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)


def test_token_id_prompts(client, model_name) -> None:
    ids = [[40, 41, 42, 43], [50, 51]]
    out = client.completions.create(model=model_name, prompt=ids, max_tokens=3, temperature=0)
    assert len(out.choices) == 2
    assert out.usage.prompt_tokens == 6


def test_stop_token_ids_and_include_stop_str(client, model_name) -> None:
    base = client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=0
    )
    # The first token that is whole characters (not "bytes:\xNN", a part of one).
    first_text = next(t for t in base.choices[0].logprobs.tokens if not t.startswith("bytes:"))
    with_stop = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        temperature=0,
        max_tokens=8,
        stop=[first_text],
        extra_body={"include_stop_str_in_output": True},
    )
    assert with_stop.choices[0].finish_reason == "stop"
    assert with_stop.choices[0].text.endswith(first_text)


def test_tokenize_and_detokenize(server) -> None:
    with server.http() as http:
        tok = http.post("/tokenize", json={"prompt": "hello world"}).json()
        assert tok["tokens"] == server.engine.tokenizer.encode("hello world")
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
        detok = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()
        assert detok == {"prompt": "hello world"}
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        expected = server.engine.tokenizer.apply_chat_template(MESSAGES)
        assert chat["tokens"] == expected
        bad = http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert err.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_chat_refuses_unsupported_fields(server, model_name, extra, param) -> None:
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 2, **extra}
    with server.http() as http:
        resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"1": 1}}, "logit_bias"),
    ],
)
def test_completion_refuses_unsupported_fields(server, model_name, extra, param) -> None:
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 2, **extra}
    with server.http() as http:
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_bad_types_are_400_not_422(server) -> None:
    with server.http() as http:
        resp = http.post("/v1/chat/completions", json={"messages": "hello"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
        resp = http.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert resp.status_code == 400 and "error" in resp.json()
        # Valid JSON without its content type, and no body at all: say what to send.
        send = "send a JSON object with the header Content-Type: application/json."
        resp = http.post("/v1/completions", content=b'{"prompt": "x"}')
        assert resp.status_code == 400
        message = f"The request's Content-Type is missing, not application/json: {send}"
        assert resp.json()["error"]["message"] == message
        headers = {"content-type": "text/plain; charset=utf-8"}
        resp = http.post("/v1/completions", content=b'{"prompt": "x"}', headers=headers)
        message = f"The request's Content-Type is 'text/plain', not application/json: {send}"
        assert resp.status_code == 400 and resp.json()["error"]["message"] == message
        resp = http.post("/v1/completions", json=["not", "an", "object"])  # JSON, not an object
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == f"The request body is not a JSON object: {send}"
        resp = http.post("/v1/completions", headers={"content-type": "application/json"})
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == f"The request has no body: {send}"
        resp = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]}
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
        # A union field names every type it takes, not pydantic's first branch ("prompt.str").
        resp = http.post("/v1/completions", json={"prompt": 123})
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == (
            "prompt: expected one of str, list[str], list[int], list[list[int]]."
        )
        assert resp.json()["error"]["param"] == "prompt"
        resp = http.post("/v1/completions", json={"prompt": "x", "stop": 5})
        assert resp.json()["error"]["message"] == "stop: expected one of str, list[str]."
        # ...also inside a list: the message names the element, the param its field.
        bad_content = {"messages": [{"role": "user", "content": 5}]}
        resp = http.post("/v1/chat/completions", json=bad_content)
        assert resp.json()["error"]["message"] == (
            "messages.0.content: expected one of str, list[ContentPart]."
        )
        assert resp.json()["error"]["param"] == "messages"
        resp = http.post(
            "/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": "x"}}
        )
        assert resp.json()["error"]["message"].startswith("stream_options.include_usage: ")
        # No coercion of strings, as OpenAI's API: "5" is not an integer, "yes" not a boolean.
        for field, value in (("max_tokens", "5"), ("stream", "yes"), ("n", 1.5)):
            resp = http.post("/v1/completions", json={"prompt": "x", field: value})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == field
        # A null where null is no value means the default (OpenAI): "n": null is one choice.
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": None})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 1


def test_content_parts_are_joined(client, server, model_name) -> None:
    parts = [{"type": "text", "text": "Write a haiku"}, {"type": "text", "text": "about the sea."}]
    messages = [{"role": "user", "content": parts}]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    expected = server.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku\nabout the sea."}]
    )
    assert out.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_name,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
            max_tokens=1,
        )
    assert err.value.body["param"] == "messages"


def test_health_and_metrics_are_up(server) -> None:
    with server.http() as http:
        assert http.get("/health").status_code == 200
        head = http.head("/health")
        assert (head.status_code, head.content) == (200, b"")
        text = http.get("/metrics").text
    assert "sits:num_requests_running" in text and "sits:kv_cache_usage_perc" in text


def test_health_is_503_while_a_step_is_stalled_and_200_after(server, monkeypatch) -> None:
    """A stalled step (`AsyncLLM.stall_reason`, unit-tested in tests/engine/test_engine_health)
    turns /health to 503 "engine_stalled" with the reason; the engine is not dead: the
    probe after the step is 200 again."""
    reason = "an engine step has run for 6.0 s, past its stall limit of 5.0 s"
    monkeypatch.setattr(server.engine, "stall_reason", lambda: reason)
    with server.http() as http:
        resp = http.get("/health")
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert error["code"] == "engine_stalled" and reason in error["message"]
        assert http.head("/health").status_code == 503
        monkeypatch.setattr(server.engine, "stall_reason", lambda: None)
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "hi", "top_k": 10**9}, 200, None),
        ({"prompt": "hi", "repetition_penalty": 1e-30}, 200, None),
        ({"prompt": "hi", "temperature": 1e9}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 1e-12, "min_p": 1.0}, 200, None),
        ({"prompt": "hi", "stop_token_ids": [10**12], "min_tokens": 2}, 400, "stop_token_ids"),
        ({"prompt": "hi", "stop": ["a" * 1024] * 64}, 200, None),
        ({"prompt": "hi", "stop": ["a" * 5000]}, 400, "stop"),
        ({"prompt": "hi", "stop": ["a"] * 100_000}, 400, "stop"),
        ({"prompt": "hi", "n": 64, "logprobs": 20}, 200, None),
        ({"prompt": "hi", "echo": True, "logprobs": 20, "prompt_logprobs": 20}, 200, None),
        ({"prompt": [511, 0, 1, 2]}, 200, None),
        ({"prompt": [512]}, 400, "prompt"),
        ({"prompt": [-1]}, 400, "prompt"),
        ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ],
)
def test_hostile_requests_never_hurt_the_engine(server, body, status, param) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", json={"max_tokens": 4, **body})
        assert resp.status_code == status, resp.text
        if status == 200:
            assert len(resp.json()["choices"]) == body.get("n", 1)
        else:
            assert resp.json()["error"]["param"] == param
        assert http.get("/health").status_code == 200
        assert (
            http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200
        )


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "a\\udcff", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a\\udcff"}], "max_tokens": 2}',
            "messages",
        ),
    ],
)
def test_lone_surrogates_are_400(server, endpoint, body, param) -> None:
    with server.http() as http:
        resp = http.post(endpoint, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
