"""`LLM.chat`: its outputs carry the rendered prompt text."""

from __future__ import annotations

import pytest

from sits import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama")), dtype="float32")


def test_chat_outputs_carry_the_rendered_prompt(llm: LLM) -> None:
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}],
    ]
    outputs = llm.chat(conversations, PARAMS)
    assert [o.prompt for o in outputs] == [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhy?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ]
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    for output, conversation in zip(outputs, conversations):
        assert output.prompt_token_ids == tokenizer.apply_chat_template(conversation)
        assert len(output.outputs[0].token_ids) == 5
