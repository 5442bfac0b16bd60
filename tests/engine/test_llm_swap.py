"""Swap preemption end to end (`swap_space`): outputs equal the no-preemption outputs.

A tiny model with a KV cache too small for the batch preempts requests; with a host tier the
victims' blocks are copied to host tensors and back (`sits.runner.swap`) instead of being
recomputed. Greedy tokens and logprobs, and seeded samples, must equal a run with a cache
large enough to never preempt, and the recomputed prefill tokens must drop to zero.
"""

from __future__ import annotations

import json

import pytest
import torch

from sits import LLM, SamplingParams
from sits.core.errors import InvalidParameterError
from sits.runner.kv_cache_alloc import kv_bytes_per_block, kv_fixed_bytes
from sits.runner.swap import GIB_BYTES
from tests.engine.hf_reference import random_prompts

PROMPT_LENGTHS = [7, 50, 17, 128, 3, 90]
NUM_HOST_BLOCKS = 64


def _block_bytes(model_dir, block_size: int = 16) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * kv_heads * head_dim * 4


def _llm(model_dir, num_blocks: int | None, num_host_blocks: int = 0) -> LLM:
    block_bytes = _block_bytes(model_dir)
    kwargs: dict = dict(model=str(model_dir), dtype="float32", max_model_len=512)
    if num_blocks is not None:
        kwargs["kv_cache_memory_bytes"] = num_blocks * block_bytes
    if num_host_blocks:
        # Half a block of slack so float rounding cannot lose a block.
        kwargs["swap_space"] = (num_host_blocks + 0.5) * block_bytes / GIB_BYTES
    llm = LLM(**kwargs)
    assert llm.engine_core.runner.num_host_blocks == num_host_blocks
    return llm


def _run(llm: LLM, prompts, params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


def test_greedy_swap_equals_no_preemption_and_recomputes_less(model_dir) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    prompts = random_prompts(PROMPT_LENGTHS, cfg["vocab_size"], seed=11)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=0, ignore_eos=True)
    reference = _run(_llm(model_dir, None), prompts, params)

    recompute = _llm(model_dir, 18)
    recompute_outs = _run(recompute, prompts, params)
    swap = _llm(model_dir, 18, NUM_HOST_BLOCKS)
    swap_outs = _run(swap, prompts, params)

    for ref, rec, swp in zip(reference, recompute_outs, swap_outs):
        assert swp.token_ids == ref.token_ids == rec.token_ids
        ours = [swp.logprobs[i][t].logprob for i, t in enumerate(swp.token_ids)]
        theirs = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
        assert ours == pytest.approx(theirs, abs=1e-5)
    rec_sched, swap_sched = recompute.engine_core.scheduler, swap.engine_core.scheduler
    rec_stats, swap_stats = rec_sched.swap_stats, swap_sched.swap_stats
    assert rec_sched.num_preemptions > 0 and rec_stats.num_recomputed_tokens > 0
    assert rec_stats.num_swap_preemptions == 0
    assert swap_stats.num_swap_preemptions > 0 and swap_stats.num_recompute_preemptions == 0
    assert swap_stats.num_swap_in_blocks == swap_stats.num_swap_out_blocks > 0
    block_bytes = swap.engine_core.runner.kv_bytes_per_block
    assert swap_stats.num_swapped_bytes == 2 * swap_stats.num_swap_out_blocks * block_bytes
    assert swap_stats.num_recomputed_tokens == 0 < rec_stats.num_recomputed_tokens
    # Fewer prefill tokens computed in all (prompts once, nothing again).
    assert swap.engine_core.stats.num_prefill_tokens == sum(PROMPT_LENGTHS)
    assert recompute.engine_core.stats.num_prefill_tokens > sum(PROMPT_LENGTHS)
    assert swap_sched.num_free_blocks == swap_sched.num_total_blocks
    assert swap_sched.host.num_free_blocks == NUM_HOST_BLOCKS


def test_seeded_sampling_with_swap_equals_alone(model_dir) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    prompts = random_prompts([20, 90, 45, 130], cfg["vocab_size"], seed=4)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    params = [other, other, other, seeded]
    big = _llm(model_dir, None)
    alone = [s.token_ids for s in _run(big, prompts[3:], seeded)][0]
    batched = [s.token_ids for s in _run(big, prompts, params)]
    small = _llm(model_dir, 14, NUM_HOST_BLOCKS)
    swapped = [s.token_ids for s in _run(small, prompts, params)]
    stats = small.engine_core.scheduler.swap_stats
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions == 0
    assert swapped[3] == alone
    assert swapped == batched  # every request is seeded: the batch is reproduced exactly


def _quantized_llm(model_dir, kind: str, num_blocks: int | None, num_host_blocks: int) -> LLM:
    """An engine with an fp8/int8 KV cache of `num_blocks` blocks (None: large)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    block_bytes = kv_bytes_per_block(layers, 16, kv_heads, head_dim, torch.float32, kind)
    kwargs: dict = dict(model=str(model_dir), dtype="float32", max_model_len=512)
    kwargs["kv_cache_dtype"] = kind
    if num_blocks is not None:
        kwargs["kv_cache_memory_bytes"] = num_blocks * block_bytes + kv_fixed_bytes(
            layers, kv_heads, kind
        )
    if num_host_blocks:
        kwargs["swap_space"] = (num_host_blocks + 0.5) * block_bytes / GIB_BYTES
    llm = LLM(**kwargs)
    assert llm.engine_core.runner.num_host_blocks == num_host_blocks
    if num_blocks is not None:
        assert llm.engine_core.runner.num_blocks == num_blocks
    return llm


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_kv_swaps_exact_bytes(model_dir, kind: str) -> None:
    """Swapped fp8/int8 blocks (data and int8 scales) come back bit for bit: the swap run
    equals the recompute run on the same small cache (same first batch, so the same fp8
    calibration), and for int8 (scales per token) the large-cache run too."""
    cfg = json.loads((model_dir / "config.json").read_text())
    prompts = random_prompts(PROMPT_LENGTHS, cfg["vocab_size"], seed=11)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=0, ignore_eos=True)
    recompute = _run(_quantized_llm(model_dir, kind, 18, 0), prompts, params)
    swap_llm = _quantized_llm(model_dir, kind, 18, NUM_HOST_BLOCKS)
    swap = _run(swap_llm, prompts, params)
    stats = swap_llm.engine_core.scheduler.swap_stats
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions == 0
    assert stats.num_recomputed_tokens == 0
    outputs = [recompute]
    if kind == "int8":
        outputs.append(_run(_quantized_llm(model_dir, kind, None, 0), prompts, params))
    for other in outputs:
        for swp, ref in zip(swap, other):
            assert swp.token_ids == ref.token_ids
            ours = [swp.logprobs[i][t].logprob for i, t in enumerate(swp.token_ids)]
            theirs = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
            assert ours == pytest.approx(theirs, abs=1e-5)


def test_host_tier_refuses_a_negative_size(model_dir) -> None:
    with pytest.raises(InvalidParameterError) as info:
        LLM(model=str(model_dir), dtype="float32", swap_space=-1)
    assert info.value.param == "swap_space"
