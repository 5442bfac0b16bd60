"""The shipped demo checkpoint as a real-weights test: greedy tokens and held-out perplexity
through our engine equal transformers' (issue 5)."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch

from sits import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, hf_model

DEMO_DIR = Path(__file__).resolve().parents[2] / "src" / "sits" / "demo_model"
# Held out from training (see the model card); present in every CPython 3.11+ stdlib.
HELD_OUT_FILES = ["functools.py", "unittest/suite.py"]
NUM_TOKENS = 768


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(DEMO_DIR), dtype="float32", max_model_len=1024)


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n"])
def test_greedy_equals_transformers(llm: LLM, prompt: str) -> None:
    ids = llm.tokenizer.encode(prompt)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32))
    ref_tokens, _ = hf_greedy(DEMO_DIR, ids, 32, eos_id=0)
    assert out[0].outputs[0].token_ids == ref_tokens


def _held_out_ids(llm: LLM, name: str) -> list[int]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")
    return llm.tokenizer.encode(text)[:NUM_TOKENS]


@pytest.mark.parametrize("name", HELD_OUT_FILES)
def test_held_out_perplexity_matches_transformers(llm: LLM, name: str) -> None:
    ids = _held_out_ids(llm, name)
    assert len(ids) == NUM_TOKENS
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    entries = out.prompt_logprobs
    assert len(entries) == NUM_TOKENS and entries[0] is None
    ours = [entries[i][ids[i]].logprob for i in range(1, NUM_TOKENS)]
    with torch.inference_mode():
        logits = hf_model(DEMO_DIR)(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[torch.arange(NUM_TOKENS - 1), ids[1:]]
    ppl_ours = math.exp(-sum(ours) / len(ours))
    ppl_ref = math.exp(-ref.mean().item())
    assert ppl_ours == pytest.approx(ppl_ref, rel=0.01)
    assert 1.5 < ppl_ours < 100  # trained: random weights give about 8192 (the vocabulary)
