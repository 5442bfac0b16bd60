"""The host KV tier's swap counters reach /metrics."""

from __future__ import annotations

import asyncio

from sits.config import EngineConfig
from sits.core.sampling_params import SamplingParams
from sits.engine.async_llm import AsyncLLM
from sits.obs.server_metrics import _host_tier_families


def test_swap_counters_are_exported(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen2")
    probe = AsyncLLM(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=512))
    block_bytes = probe.engine_core.runner.kv_bytes_per_block
    asyncio.run(probe.shutdown())
    engine = AsyncLLM(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=18 * block_bytes,
            swap_space=0.01,
        )
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    lengths = (1, 3, 7, 16, 17, 50, 128, 200)

    async def run_all() -> None:
        async def one(i: int) -> None:
            ids = [3 + (i * 31 + k) % 400 for k in range(lengths[i])]
            async for _ in engine.generate(f"r{i}", ids, params):
                pass

        await asyncio.gather(*(one(i) for i in range(len(lengths))))
        for _ in range(200):  # the engine thread refreshes its snapshot after freeing blocks
            if engine.stats().num_host_blocks_used == 0 and engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(run_all())
    stats = engine.stats()
    asyncio.run(engine.shutdown())
    assert stats.swap.num_swap_out_blocks > 0
    assert stats.swap.num_swap_in_blocks == stats.swap.num_swap_out_blocks
    assert stats.num_host_blocks_total > 0 and stats.num_host_blocks_used == 0
    samples = {family.name: family.samples[0].value for family in _host_tier_families(stats, "m")}
    assert samples["sits:kv_swap_out_blocks"] == stats.swap.num_swap_out_blocks
    assert samples["sits:kv_swapped_bytes"] == stats.swap.num_swapped_bytes
    assert samples["sits:host_kv_blocks_capacity"] == stats.num_host_blocks_total
