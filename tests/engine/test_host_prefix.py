"""Host-tier prefix cache end to end (`swap_space` with prefix caching): a shared prefix
evicted from a small device cache by other traffic comes back from the host tier.

Same tiny checkpoint (float32), same five requests one after another, three engines:
- "big": a cache that never evicts (the prefix hits on the device);
- "recompute": 12 blocks, no host tier (the prefix was evicted: recomputed);
- "host": 12 blocks and a host tier (the prefix is copied back in).
Outputs must be equal token for token (and logprobs within float32 noise); the host run must
hit exactly the prefix's 64 tokens on the host and prefill exactly 64 tokens fewer than the
recompute run; every device and host block must be free at the end.
"""

from __future__ import annotations

import json

import pytest

from sits import LLM, SamplingParams
from sits.obs.server_metrics import _host_tier_families
from sits.runner.swap import GIB_BYTES
from tests.engine.hf_reference import random_prompts

BLOCK_SIZE = 16
PREFIX_TOKENS = 64  # 4 full blocks
NUM_DEVICE_BLOCKS = 12  # 11 usable: one 74-token request or one 100-token one fits, not both


def _block_bytes(model_dir) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return (
        2 * cfg["num_hidden_layers"] * BLOCK_SIZE * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    )


def _llm(model_dir, num_blocks: int | None, num_host_blocks: int = 0) -> LLM:
    block_bytes = _block_bytes(model_dir)
    kwargs: dict = dict(model=str(model_dir), dtype="float32", max_model_len=512)
    if num_blocks is not None:
        kwargs["kv_cache_memory_bytes"] = num_blocks * block_bytes
    if num_host_blocks:
        kwargs["swap_space"] = (num_host_blocks + 0.5) * block_bytes / GIB_BYTES
    llm = LLM(**kwargs)
    assert llm.engine_core.runner.num_host_blocks == num_host_blocks
    assert llm.engine_core.runner.kv_bytes_per_block == block_bytes
    return llm


def _prompts(vocab_size: int) -> list[list[int]]:
    """The prefix with a 10-token tail, three unrelated 100-token prompts, the prefix again
    with a 12-token tail."""
    prefix, tail_a, tail_b, *others = random_prompts(
        [PREFIX_TOKENS, 10, 12, 100, 100, 100], vocab_size, seed=5
    )
    return [prefix + tail_a, *others, prefix + tail_b]


def _run_one_by_one(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    return [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in prompts]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def runs(model_dir) -> dict[str, tuple[LLM, list]]:
    """name -> (engine, outputs) of the same five requests, one after another."""
    cfg = json.loads((model_dir / "config.json").read_text())
    prompts = _prompts(cfg["vocab_size"])
    runs = {}
    for name, num_blocks, num_host_blocks in (
        ("big", None, 0),
        ("recompute", NUM_DEVICE_BLOCKS, 0),
        ("host", NUM_DEVICE_BLOCKS, 32),
        ("small_host", NUM_DEVICE_BLOCKS, 6),
    ):
        llm = _llm(model_dir, num_blocks, num_host_blocks)
        runs[name] = (llm, _run_one_by_one(llm, prompts))
    return runs


def test_evicted_prefix_comes_back_from_the_host_tier(runs) -> None:
    prompts = _prompts(runs["big"][0].engine_core.runner.model.arch.vocab_size)
    reference = runs["big"][1]
    for name in ("recompute", "host"):
        for ref, out in zip(reference, runs[name][1]):
            assert out.token_ids == ref.token_ids, name
            ours = [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]
            theirs = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
            assert ours == pytest.approx(theirs, abs=1e-5)

    big, recompute, host = (runs[n][0].engine_core for n in ("big", "recompute", "host"))
    num_prompt_tokens = sum(len(p) for p in prompts)
    assert num_prompt_tokens == 450
    # The big cache hits the prefix on the device; the small one lost it to the others.
    assert big.scheduler.prefix_cache_stats.num_hit_tokens == PREFIX_TOKENS
    assert big.stats.num_prefill_tokens == num_prompt_tokens - PREFIX_TOKENS
    assert recompute.scheduler.prefix_cache_stats.num_hit_tokens == 0
    assert recompute.stats.num_prefill_tokens == num_prompt_tokens
    # With the host tier: the same 64 tokens hit on the host, exactly 64 fewer prefilled.
    stats = host.scheduler.swap_stats
    assert host.scheduler.prefix_cache_stats.num_hit_tokens == 0
    assert stats.num_host_hit_tokens == PREFIX_TOKENS
    assert recompute.stats.num_prefill_tokens - host.stats.num_prefill_tokens == PREFIX_TOKENS
    assert host.stats.num_prefill_tokens == big.stats.num_prefill_tokens
    assert stats.num_host_loaded_blocks == PREFIX_TOKENS // BLOCK_SIZE
    # Every eviction of a cached device block is copied out (32 host blocks never fill up):
    # 1 by the first 100-token prompt, 6 + 6 by the next two, 4 + 1 by the last request
    # (admission, then its decode crossing token 80).
    assert stats.num_host_stored_blocks == 18
    block_bytes = host.runner.kv_bytes_per_block
    assert stats.num_host_cache_bytes == (18 + 4) * block_bytes
    assert stats.num_swap_preemptions == stats.num_recompute_preemptions == 0
    # Everything is free at the end (cached blocks count as free on both tiers).
    for core in (recompute, host):
        assert core.scheduler.num_free_blocks == core.scheduler.num_total_blocks == 11
    assert host.scheduler.host.num_free_blocks == 32 and host.scheduler.host.num_used_blocks == 0
    assert host.scheduler.host.num_cached_blocks == 18
    # /metrics exports the host prefix counters.
    snapshot = type("Stats", (), {"swap": stats, "num_host_blocks_used": 0})()
    snapshot.num_host_blocks_total = 32
    samples = {f.name: f.samples[0].value for f in _host_tier_families(snapshot, "m")}
    assert samples["sits:host_prefix_cache_hits"] == PREFIX_TOKENS
    assert samples["sits:host_prefix_cache_stored_blocks"] == 18
    assert samples["sits:host_prefix_cache_loaded_blocks"] == 4


def test_host_tier_too_small_to_keep_the_prefix(runs) -> None:
    """With 6 host blocks the later evictions push the prefix out of the host LRU too: no host
    hit, the prefix is recomputed, outputs are unchanged."""
    expected = [o.token_ids for o in runs["recompute"][1]]
    assert [o.token_ids for o in runs["small_host"][1]] == expected
    recompute, small = runs["recompute"][0].engine_core, runs["small_host"][0].engine_core
    stats = small.scheduler.swap_stats
    assert stats.num_host_hit_tokens == 0 and stats.num_host_stored_blocks == 18
    assert small.stats.num_prefill_tokens == recompute.stats.num_prefill_tokens
    assert small.scheduler.host.num_cached_blocks == 6
    assert small.scheduler.host.num_free_blocks == 6


def test_batched_shared_prefix_with_preemption_equals_no_eviction(model_dir) -> None:
    """Many requests sharing a prefix on a tight cache: swaps, offloads and host hits mix in
    one run (through the staged copies); greedy outputs equal the big-cache run and all blocks
    come back."""
    cfg = json.loads((model_dir / "config.json").read_text())
    prefix, *tails = random_prompts([48, 5, 30, 17, 60, 9, 41, 3, 25], cfg["vocab_size"], seed=8)
    prompts = [prefix + t for t in tails]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    big = _llm(model_dir, None)
    expected = [o.outputs[0].token_ids for o in big.generate(_as_inputs(prompts), params)]
    small = _llm(model_dir, 14, 24)
    # The staged copy path (CUDA's algorithm, synchronous here) in chunks of 2 blocks.
    small.engine_core.runner.host_kv.staged = True
    small.engine_core.runner.host_kv.max_staged_blocks = 2
    outs = [o.outputs[0].token_ids for o in small.generate(_as_inputs(prompts), params)]
    assert outs == expected
    sched = small.engine_core.scheduler
    stats = sched.swap_stats
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions == 0
    assert stats.num_host_stored_blocks > 0 and stats.num_host_hit_tokens > 0
    assert sched.num_free_blocks == sched.num_total_blocks
    assert sched.host.num_free_blocks == 24 and sched.host.num_used_blocks == 0


def _as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]
