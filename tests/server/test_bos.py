"""C12: a tokenizer that adds BOS and a chat template that writes BOS give exactly one BOS."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from tests.server.live import LiveServer

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is two plus two?"},
]


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory):
    from sits.testing.tiny import make_tiny_checkpoint
    from sits.testing.tokenizer import save_tiny_tokenizer_with_bos

    path = tmp_path_factory.mktemp("tiny_bos")
    make_tiny_checkpoint("qwen3_moe", path, with_tokenizer=False)
    save_tiny_tokenizer_with_bos(path, 512)
    return path


@pytest.fixture(scope="module")
def bos_server(bos_model_dir, engine_factory):
    with LiveServer(engine_factory(bos_model_dir)) as live:
        yield live


def _tokenize(live: LiveServer, body: dict) -> list[int]:
    with live.http() as http:
        return http.post("/tokenize", json=body).json()["tokens"]


def test_c12_chat_has_one_bos(bos_server, bos_model_dir) -> None:
    bos = bos_server.engine.tokenizer.bos_token_id
    assert bos is not None
    ids = _tokenize(bos_server, {"messages": MESSAGES})
    assert ids[0] == bos and ids.count(bos) == 1
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bos_model_dir))
    rendered = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|begin_of_text|>")
    hf_ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    hf_ids = list(hf_ids["input_ids"] if isinstance(hf_ids, Mapping) else hf_ids)
    assert ids == hf_ids
    out = bos_server.client().chat.completions.create(
        model=bos_server.engine.model_name, messages=MESSAGES, max_tokens=2
    )
    assert out.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("prompt", ["Hello there", "<|begin_of_text|>Hello there"])
def test_c12_completion_has_one_bos(bos_server, prompt) -> None:
    bos = bos_server.engine.tokenizer.bos_token_id
    ids = _tokenize(bos_server, {"prompt": prompt})
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids == _tokenize(bos_server, {"prompt": "Hello there"})
    out = bos_server.client().completions.create(
        model=bos_server.engine.model_name, prompt=prompt, max_tokens=2
    )
    assert out.usage.prompt_tokens == len(ids)


def test_empty_prompt_with_bos_is_one_token(bos_server) -> None:
    out = bos_server.client().completions.create(
        model=bos_server.engine.model_name, prompt="", max_tokens=2
    )
    assert out.usage.prompt_tokens == 1
