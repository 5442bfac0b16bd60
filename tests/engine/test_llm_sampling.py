"""Seeded sampling, n > 1, batch invariance (C13) and requests that can never fit."""

from __future__ import annotations

import json

import pytest

from sits import LLM, SamplingParams
from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.request import Request
from tests.engine.hf_reference import random_prompts


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def llm(moe_dir) -> LLM:
    return LLM(model=str(moe_dir), dtype="float32", max_model_len=512)


def _vocab(moe_dir) -> int:
    return json.loads((moe_dir / "config.json").read_text())["vocab_size"]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batch_invariance_c13(llm: LLM, moe_dir) -> None:
    prompts = random_prompts([9, 30, 5, 64, 12, 100, 3, 41], _vocab(moe_dir), seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    as_input = [{"prompt_token_ids": p} for p in prompts]
    alone = _tokens(llm.generate(as_input[:1], params))[0]
    with_one = _tokens(llm.generate(as_input[:2], params))[0]
    with_seven = _tokens(llm.generate(as_input, params))[0]
    assert len(alone) == 16
    assert alone == with_one == with_seven


def test_seeded_sampling_alone_batched_and_preempted(moe_dir) -> None:
    prompts = random_prompts([20, 90, 45, 130], _vocab(moe_dir), seed=4)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    big = LLM(model=str(moe_dir), dtype="float32", max_model_len=512)
    alone = _tokens(big.generate(inputs[:1], seeded))[0]
    batched = _tokens(big.generate(inputs, [seeded, other, other, other]))[0]
    cfg = json.loads((moe_dir / "config.json").read_text())
    block_bytes = (
        2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    )
    small = LLM(
        model=str(moe_dir),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=14 * block_bytes,
    )
    preempted = _tokens(small.generate(inputs, [other, other, other, seeded]))[3]
    alone_last = _tokens(big.generate(inputs[3:], seeded))[0]
    assert small.engine_core.scheduler.num_preemptions > 0
    assert alone == batched
    assert preempted == alone_last
    assert alone != alone_last  # different prompts really give different samples


def test_n_samples_differ_and_repeat_with_seed(llm: LLM, moe_dir) -> None:
    prompt = {"prompt_token_ids": random_prompts([37], _vocab(moe_dir), seed=5)[0]}
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert all(len(s) == 16 for s in samples)
    assert len(set(samples)) == 4
    assert samples == [tuple(c.token_ids) for c in again.outputs]


def test_n_samples_share_prompt_blocks(llm: LLM, moe_dir) -> None:
    prompt = {"prompt_token_ids": random_prompts([70], _vocab(moe_dir), seed=6)[0]}
    before = llm.engine_core.scheduler.prefix_cache_stats.num_hit_tokens
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4))[0]
    hits = llm.engine_core.scheduler.prefix_cache_stats.num_hit_tokens - before
    assert len(out.outputs) == 3
    # Samples 1 and 2 reuse sample 0's full prompt blocks: 64 of the 70 tokens each.
    assert hits == 2 * 64


def test_request_that_can_never_fit_fails_at_once(moe_dir) -> None:
    llm = LLM(model=str(moe_dir), dtype="float32", max_model_len=128)
    core = llm.engine_core
    ok = Request("ok", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), 0, 0.0, 4)
    too_long = Request("bad", list(range(3, 120)), SamplingParams(max_tokens=20), 0, 0.0, 20)
    core.add_request(ok)
    with pytest.raises(PromptTooLongError, match="128"):
        core.add_request(too_long)
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    tokens = [t for o in outputs if o.request_id == "ok" for t in o.new_token_ids]
    assert len(tokens) == 4
    assert {o.request_id for o in outputs} == {"ok"}
    with pytest.raises(PromptTooLongError):
        llm.generate({"prompt_token_ids": list(range(3, 200))}, SamplingParams(max_tokens=1))


def test_token_ids_outside_vocabulary_are_rejected(llm: LLM, moe_dir) -> None:
    vocab = _vocab(moe_dir)
    for bad in (vocab, -1):
        with pytest.raises(InvalidParameterError, match="vocabulary") as info:
            llm.generate({"prompt_token_ids": [5, bad]}, SamplingParams(max_tokens=2))
        assert info.value.param == "prompt"
    out = llm.generate({"prompt_token_ids": [5, vocab - 1]}, SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) <= 2


def test_huge_seed_is_served(llm: LLM, moe_dir) -> None:
    params = SamplingParams(temperature=1.0, seed=2**70, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
    again = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
    assert len(first) == 4 and first == again
