"""Unseeded sampling through the engine: the runner's shared generator follows the engine seed,
so the same seed and the same batches give the same tokens, another seed others."""

from __future__ import annotations

import json

from sits import LLM, SamplingParams
from tests.engine.hf_reference import random_prompts


def _generate(model_dir, seed: int) -> list[list[int]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts([12, 30, 7], vocab, seed=9)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, seed=seed)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=12, ignore_eos=True),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_unseeded_requests_follow_the_engine_seed(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama")
    first = _generate(model_dir, seed=0)
    assert _generate(model_dir, seed=0) == first
    other = _generate(model_dir, seed=1)
    assert other[0] != first[0]  # unseeded: follows the engine seed
    assert other[1:] == first[1:]  # greedy and seeded requests do not
    assert all(len(t) == 12 for t in first)
