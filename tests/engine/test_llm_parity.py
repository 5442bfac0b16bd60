"""Greedy outputs of the engine equal transformers token for token, for every architecture.

Also under forced chunked prefill (a 7-token budget) and under a KV cache so small that
requests are preempted and recomputed.
"""

from __future__ import annotations

import json

import pytest

from sits import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.engine.hf_reference import hf_greedy, random_prompts

PROMPT_LENGTHS = [1, 3, 7, 16, 17, 50, 128, 200]
MAX_TOKENS = 12


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _block_bytes(model_dir, block_size: int = 16) -> int:
    cfg = _config(model_dir)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * kv_heads * head_dim * 4


def _check_against_hf(
    llm: LLM, model_dir, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, ignore_eos=False
) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=ignore_eos)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    eos = None if ignore_eos else _config(model_dir).get("eos_token_id")
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = hf_greedy(model_dir, prompt, max_tokens, eos)
        sample = out.outputs[0]
        assert sample.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        ours = [sample.logprobs[i][t].logprob for i, t in enumerate(sample.token_ids)]
        assert ours == pytest.approx(ref_logprobs, abs=1e-4)
        expected_reason = "stop" if ref_tokens and ref_tokens[-1] == eos else "length"
        assert sample.finish_reason == expected_reason


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_equals_transformers(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = random_prompts(PROMPT_LENGTHS, _config(model_dir)["vocab_size"])
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=512)
    _check_against_hf(llm, model_dir, prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_chunked_prefill_equals_transformers(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = random_prompts(PROMPT_LENGTHS, _config(model_dir)["vocab_size"], seed=1)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=512, max_num_batched_tokens=7)
    _check_against_hf(llm, model_dir, prompts)


@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])
def test_preemption_equals_transformers(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = random_prompts(PROMPT_LENGTHS, _config(model_dir)["vocab_size"], seed=2)
    # 18 blocks of 16 tokens (17 usable): the longest request needs 15, all together 58.
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=18 * _block_bytes(model_dir),
    )
    assert llm.engine_core.runner.num_blocks == 18
    _check_against_hf(llm, model_dir, prompts, max_tokens=40, ignore_eos=True)
    assert llm.engine_core.scheduler.num_preemptions > 0
    assert llm.engine_core.scheduler.num_free_blocks == llm.engine_core.scheduler.num_total_blocks
