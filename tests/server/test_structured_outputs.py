"""Structured outputs over HTTP with the official `openai` client: `response_format`
(json_object, json_schema), vLLM's `guided_*` and `structured_outputs` fields on chat and
completions, streaming, max_tokens, and the 400s of invalid constraints.

The server runs the demo checkpoint (a trained model, so JSON strings end: a random model's
run to max_tokens).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

import sits

DEMO_DIR = Path(sits.__file__).parent / "demo_model"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def demo_server(engine_factory):
    from tests.server.live import LiveServer

    with LiveServer(engine_factory(DEMO_DIR)) as live:
        yield live


@pytest.fixture(scope="module")
def demo_client(demo_server) -> openai.OpenAI:
    return demo_server.client()


@pytest.fixture(scope="module")
def demo_model(demo_client) -> str:
    return demo_client.models.list().data[0].id


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_validates(demo_client, demo_model, temperature: float) -> None:
    for seed in range(3):
        out = demo_client.chat.completions.create(
            model=demo_model,
            messages=MESSAGES,
            response_format=_json_schema_format(SCHEMA),
            temperature=temperature,
            seed=seed,
            max_tokens=800,  # sampled, this model writes much whitespace (32 a gap at most)
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_is_an_object(demo_client, demo_model) -> None:
    """A code model loops on free-form JSON keys at times (two such cases are kept): every
    finished answer is an object, an unfinished one a cut object."""
    outcomes = []
    for text in ("Describe a person as JSON.", "config", "{}"):
        out = demo_client.chat.completions.create(
            model=demo_model,
            messages=[{"role": "user", "content": text}],
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=100,
        )
        outcomes.append((out.choices[0].finish_reason, out.choices[0].message.content))
    done = demo_client.completions.create(
        model=demo_model,
        prompt="def f(x):",
        max_tokens=100,
        extra_body={"response_format": {"type": "json_object"}},
    )
    outcomes.append((done.choices[0].finish_reason, done.choices[0].text))
    assert [reason for reason, _ in outcomes] == ["length", "length", "stop", "stop"]
    for reason, text in outcomes:
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


def test_streamed_json_schema_joins_to_a_valid_object(demo_client, demo_model) -> None:
    stream = demo_client.chat.completions.create(
        model=demo_model,
        messages=MESSAGES,
        response_format=_json_schema_format(SCHEMA),
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_fields_on_chat_and_completions(demo_client, demo_model) -> None:
    choices = ["yes", "no", "maybe so"]
    chat = demo_client.chat.completions.create(
        model=demo_model,
        messages=MESSAGES,
        max_tokens=20,
        extra_body={"guided_choice": choices},
    )
    assert chat.choices[0].message.content in choices
    assert chat.choices[0].finish_reason == "stop"
    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    done = demo_client.completions.create(
        model=demo_model,
        prompt="x = ",
        max_tokens=30,
        temperature=1.0,
        seed=4,
        n=3,
        extra_body={"guided_regex": regex},
    )
    assert all(re.fullmatch(regex, c.text) for c in done.choices), [c.text for c in done.choices]
    grammar = 'root ::= "def " [a-z]+ "(" [a-z]? "):"'
    done = demo_client.completions.create(
        model=demo_model, prompt="\n", max_tokens=30, extra_body={"guided_grammar": grammar}
    )
    assert re.fullmatch(r"def [a-z]+\([a-z]?\):", done.choices[0].text)
    done = demo_client.completions.create(
        model=demo_model,
        prompt="person = ",
        max_tokens=200,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )
    text = done.choices[0].text
    assert " " not in text.replace('": ', "").replace(", ", ""), text  # no free whitespace
    jsonschema.validate(json.loads(text), SCHEMA)
    done = demo_client.completions.create(
        model=demo_model, prompt="x", max_tokens=200, extra_body={"guided_json": SCHEMA}
    )
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_max_tokens_cuts_the_output_with_length(demo_client, demo_model) -> None:
    out = demo_client.chat.completions.create(
        model=demo_model,
        messages=MESSAGES,
        response_format=_json_schema_format(SCHEMA),
        temperature=0,
        max_tokens=4,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 4
    assert choice.message.content.startswith("{")  # the partial output, as OpenAI returns it
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.mark.parametrize(
    ("extra", "param", "reason"),
    [
        (
            {"response_format": _json_schema_format({"type": "object", "properties": 3})},
            "response_format.json_schema.schema",
            "invalid json",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "needs json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
        ({"guided_regex": "(a"}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "root ::= nope"}, "guided_grammar", "not defined"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "only one output constraint",
        ),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(
    demo_server, demo_model, extra, param, reason
) -> None:
    body = {"model": demo_model, "messages": MESSAGES, "max_tokens": 4, **extra}
    with demo_server.http() as http:
        resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert reason in error["message"]


def test_invalid_constraints_through_the_openai_client(demo_client, demo_model) -> None:
    bad_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 9,
                                                        "maximum": 1}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as err:
        demo_client.chat.completions.create(
            model=demo_model,
            messages=MESSAGES,
            response_format=_json_schema_format(bad_schema),
        )
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert "minimum greater than maximum" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        demo_client.chat.completions.create(
            model=demo_model, messages=MESSAGES, extra_body={"guided_choice": "yes"}
        )
    assert err.value.body["param"] == "guided_choice"
    with pytest.raises(openai.BadRequestError) as err:
        demo_client.completions.create(
            model=demo_model, prompt="x", extra_body={"guided_json": {"type": "nope"}}
        )
    assert err.value.body["param"] == "guided_json"


def test_engine_process_serves_the_same_constrained_answers(demo_client, demo_model) -> None:
    """The spec crosses to an engine in its own process (`AsyncMPLLM`) and gives the same
    tokens as the thread engine."""
    from sits.config import EngineConfig
    from sits.engine.async_mp import AsyncMPLLM
    from tests.server.live import LiveServer

    def ask(client: openai.OpenAI) -> list[str]:
        chat = client.chat.completions.create(
            model=demo_model,
            messages=MESSAGES,
            response_format=_json_schema_format(SCHEMA),
            temperature=0,
            max_tokens=200,
        )
        done = client.completions.create(
            model=demo_model, prompt="x", max_tokens=10, extra_body={"guided_choice": ["a", "b"]}
        )
        return [chat.choices[0].message.content, done.choices[0].text]

    want = ask(demo_client)

    def make_engine() -> AsyncMPLLM:
        return AsyncMPLLM(EngineConfig(model=str(DEMO_DIR), dtype="float32", max_model_len=1024))

    with LiveServer(make_engine) as live:
        assert ask(live.client()) == want
    jsonschema.validate(json.loads(want[0]), SCHEMA)
