"""`vllm serve`'s server flags with vLLM's meaning (issue 29): --served-model-name with several
names, --chat-template (file or inline), --generation-config, --max-logprobs, the CORS flags,
--root-path, request logging, and an unknown flag refused with `sits serve`'s usage."""

from __future__ import annotations

import argparse
import json
import logging

import httpx
import openai
import pytest

from sits.cli.main import build_parser, main
from sits.cli.vllm_flags import (
    chat_template_arg,
    cors_arg,
    sampling_defaults_arg,
    served_names_arg,
    uvicorn_kwargs_arg,
)
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.demo import packaged_demo_dir
from sits.server.context import CorsSettings, ServerSettings
from sits.server.params import chat_sampling_params
from sits.server.protocol_chat import ChatCompletionRequest
from tests.server.live import LiveServer

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_unknown_flag_prints_the_serve_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sits serve ")
    assert "sits serve: error: unrecognized arguments: --no-such-flag" in err


def test_served_model_names() -> None:
    assert served_names_arg(_serve_args()) == (None, ())
    assert served_names_arg(_serve_args("--served-model-name", "a", "b", "c")) == ("a", ("b", "c"))


def test_chat_template_file_inline_or_refused(tmp_path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert chat_template_arg(str(path)) == TEMPLATE
    assert chat_template_arg(TEMPLATE) == TEMPLATE
    assert chat_template_arg(None) is None
    with pytest.raises(InvalidParameterError) as err:
        chat_template_arg(str(tmp_path / "mistyped.jinja"))
    assert err.value.param == "chat_template"


def test_generation_config_modes(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7,
                    "top_k_unused": 1, "do_sample": True, "eos_token_id": 0})
    )  # fmt: skip
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7}
    assert sampling_defaults_arg("auto", str(tmp_path)) == defaults
    assert sampling_defaults_arg(str(tmp_path), str(packaged_demo_dir())) == defaults
    assert sampling_defaults_arg("vllm", str(tmp_path)) == {}
    # The demo model's generation_config.json holds only token ids: no sampling defaults.
    assert sampling_defaults_arg("auto", str(packaged_demo_dir())) == {}
    with pytest.raises(InvalidParameterError):
        sampling_defaults_arg(str(tmp_path / "absent"), str(tmp_path))


def test_unset_fields_take_the_defaults_set_ones_win() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = chat_sampling_params(req, None, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert params.repetition_penalty == 1.1
    set_req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], temperature=1.0, top_k=-1
    )
    params = chat_sampling_params(set_req, None, defaults)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, -1, 0.9)


def test_cors_flags() -> None:
    assert cors_arg(_serve_args()) is None
    one = cors_arg(_serve_args("--allowed-origins", '["http://a.example", "http://b.example"]'))
    assert one == CorsSettings(allowed_origins=("http://a.example", "http://b.example"))
    two = cors_arg(_serve_args("--allowed-origins", "http://a.example", "--allow-credentials"))
    assert two == CorsSettings(allowed_origins=("http://a.example",), allow_credentials=True)
    with pytest.raises(InvalidParameterError):
        cors_arg(_serve_args("--allowed-methods", "[GET"))


def test_uvicorn_options(tmp_path) -> None:
    assert uvicorn_kwargs_arg(_serve_args()) == {}
    assert uvicorn_kwargs_arg(_serve_args("--root-path", "/proxy")) == {"root_path": "/proxy"}
    key = tmp_path / "k.pem"
    key.write_text("x")
    with pytest.raises(InvalidParameterError) as err:
        uvicorn_kwargs_arg(_serve_args("--ssl-keyfile", str(key)))
    assert err.value.param == "ssl_certfile"
    with pytest.raises(InvalidParameterError, match="no such file"):
        uvicorn_kwargs_arg(_serve_args("--ssl-keyfile", str(key), "--ssl-certfile", "/nope"))


@pytest.fixture(scope="module")
def flags_server(tiny_moe_dir):
    """Names a, b, c; a custom chat template; generation defaults temperature 0 and at most
    3 new tokens; at most 2 logprobs; CORS for one origin; request logging; /proxy root."""
    from sits.engine.async_llm import AsyncLLM

    def make_engine():
        config = EngineConfig(
            model=str(tiny_moe_dir), served_model_name="a", dtype="float32", max_model_len=256
        )
        engine = AsyncLLM(config)
        engine.tokenizer.use_chat_template(TEMPLATE)
        return engine

    settings = ServerSettings(
        served_model_name="a",
        served_model_aliases=("b", "c"),
        sampling_defaults={"temperature": 0.0, "max_tokens": 3},
        max_logprobs=2,
        log_requests=True,
        max_log_len=4,
        cors=CorsSettings(allowed_origins=("http://a.example",)),
    )
    with LiveServer(make_engine, settings, uvicorn_kwargs={"root_path": "/proxy"}) as live:
        yield live


def test_every_served_name_is_listed_and_accepted(flags_server) -> None:
    client = flags_server.client()
    assert [m.id for m in client.models.list().data] == ["a", "b", "c"]
    out = client.completions.create(model="c", prompt="hi", max_tokens=2)
    assert out.model == "a"
    assert client.models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="d", prompt="hi", max_tokens=2)


def test_chat_template_renders_the_prompt(flags_server) -> None:
    tokenizer = flags_server.engine.tokenizer
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]
    with flags_server.http() as http:
        tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == tokenizer.encode("<<hi>><<there>>", add_special_tokens=False)
    chat = flags_server.client().chat.completions.create(model="a", messages=messages)
    assert chat.usage.prompt_tokens == len(tokens)


def test_generation_defaults_apply_to_unset_fields(flags_server) -> None:
    client = flags_server.client()
    kwargs = dict(model="a", prompt="hello", extra_body={"ignore_eos": True})
    unset = client.completions.create(**kwargs)  # temperature 0 and 3 tokens by default
    greedy = client.completions.create(temperature=0, **kwargs)
    assert unset.usage.completion_tokens == 3
    assert unset.choices[0].text == greedy.choices[0].text
    asked = client.completions.create(max_tokens=10, **kwargs)
    assert asked.usage.completion_tokens == 3  # max_new_tokens bounds max_tokens, as in vLLM
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 3


def test_max_logprobs(flags_server) -> None:
    client = flags_server.client()
    ok = client.completions.create(model="a", prompt="hi", max_tokens=1, logprobs=2)
    assert len(ok.choices[0].logprobs.top_logprobs[0]) >= 2
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="a", prompt="hi", max_tokens=1, logprobs=3)
    assert err.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3
        )
    assert err.value.body["param"] == "top_logprobs"


def test_cors_headers(flags_server, server) -> None:
    preflight = {"origin": "http://a.example", "access-control-request-method": "POST"}
    with flags_server.http() as http:
        resp = http.options("/v1/completions", headers=preflight)
        assert resp.status_code == 200
        assert resp.headers["access-control-allow-origin"] == "http://a.example"
        other = http.get("/v1/models", headers={"origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        same = http.get("/v1/models", headers={"origin": "http://a.example"})
        assert same.headers["access-control-allow-origin"] == "http://a.example"
    with server.http() as http:  # no CORS flag: no CORS headers
        plain = http.get("/v1/models", headers={"origin": "http://a.example"})
        assert "access-control-allow-origin" not in plain.headers


def test_root_path_names_the_proxys_prefix(flags_server, server) -> None:
    """Behind a proxy that strips /proxy, requests arrive unprefixed and the app's own URLs
    (the OpenAPI document's server) carry the prefix."""
    base = flags_server.base_url
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "a"
    assert httpx.get(f"{base}/openapi.json").json()["servers"] == [{"url": "/proxy"}]
    assert "servers" not in httpx.get(f"{server.base_url}/openapi.json").json()


def test_requests_are_logged(flags_server, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="sits.server.serving_common"):
        out = flags_server.client().completions.create(model="a", prompt="hello world")
    lines = [r.getMessage() for r in caplog.records if "received request" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"received request {out.id} (tenant ")
    assert "prompt 'hell'," in lines[0] and "temperature=0.0" in lines[0]
