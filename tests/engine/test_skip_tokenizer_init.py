"""`skip_tokenizer_init`: token ids in, token ids out, equal to the normal path; what needs a
tokenizer is refused."""

from __future__ import annotations

import pytest

from sits import LLM, SamplingParams
from sits.core.errors import InvalidParameterError

PROMPTS = [[5, 17, 99, 260, 3], [400, 2, 2, 2, 71, 8, 9, 10, 11], [1]]


def test_token_ids_equal_the_normal_path(tiny_model_factory) -> None:
    model_dir = str(tiny_model_factory("qwen3"))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    normal = LLM(model_dir, dtype="float32").generate(inputs, params)
    skip_llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True)
    assert skip_llm.get_tokenizer() is None
    skipped = skip_llm.generate(inputs, params)
    assert any(o.outputs[0].text for o in normal)  # the normal path does detokenize
    for a, b in zip(normal, skipped):
        assert b.prompt_token_ids == a.prompt_token_ids
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == 10
        assert b.outputs[0].text == ""
        assert b.outputs[0].finish_reason == "length"
        for entry_a, entry_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert entry_b.keys() == entry_a.keys()
            assert all(lp.decoded_token is None for lp in entry_b.values())
            assert [lp.logprob for lp in entry_b.values()] == [
                lp.logprob for lp in entry_a.values()
            ]


def test_text_prompts_stop_strings_and_chat_are_refused(tiny_model_factory) -> None:
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", skip_tokenizer_init=True)
    with pytest.raises(InvalidParameterError) as info:
        llm.generate("hello")
    assert info.value.param == "prompt"
    with pytest.raises(InvalidParameterError) as info:
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]))
    assert info.value.param == "stop"
    with pytest.raises(InvalidParameterError) as info:
        llm.chat([{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"
    prompt = {"prompt_token_ids": [1, 2]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    first = free[0].outputs[0].token_ids[0]
    stop_ids = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[first])
    stopped = llm.generate(prompt, stop_ids)[0].outputs[0]  # stop token ids need no tokenizer
    assert (stopped.token_ids, stopped.finish_reason) == ([first], "stop")
