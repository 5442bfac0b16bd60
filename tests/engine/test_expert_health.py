"""MoE expert load and self-healing on the tiny Qwen3-MoE model: exact per-expert counts, a NaN
expert frozen within three checks, routing around it, and the AsyncLLM commands."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import SamplingParams
from sits.engine.llm import LLM
from sits.kernels.moe_ref import select_experts
from sits.runner.expert_health import ExpertMonitor

LAYER = 1  # the last layer: a NaN there reaches the logits but no later KV cache
ENGINE_KWARGS = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 2 << 20}
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


class RoutingProbe:
    """Forward hooks on every MoE block: the reference routing of each forward's input, with
    `masked` experts' logits at -inf (what the router must do once they are frozen)."""

    def __init__(self, model) -> None:
        self.blocks = {i: layer.mlp for i, layer in enumerate(model.model.layers)}
        self.masked: dict[int, set[int]] = {i: set() for i in self.blocks}
        self.routed: dict[int, list[torch.Tensor]] = {i: [] for i in self.blocks}
        self.handles = [
            block.register_forward_hook(self._hook(i)) for i, block in self.blocks.items()
        ]

    def _hook(self, layer_id: int):
        def hook(block, inputs, output) -> None:
            logits = block.gate(inputs[0])
            if self.masked[layer_id]:
                logits[:, sorted(self.masked[layer_id])] = float("-inf")
            ids = select_experts(logits, block.config.top_k, block.config.renormalize)[1]
            self.routed[layer_id].append(ids)

        return hook

    def take(self, layer_id: int) -> set[int]:
        used = {int(e) for ids in self.routed[layer_id] for e in ids.flatten()}
        self.routed[layer_id].clear()
        return used

    def counts(self, num_experts: int) -> dict[int, list[int]]:
        return {
            layer_id: sum(
                (torch.bincount(ids.flatten(), minlength=num_experts) for ids in routed),
                torch.zeros(num_experts, dtype=torch.int64),
            ).tolist()
            for layer_id, routed in self.routed.items()
        }


def prompts_of(num_prompts: int) -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 512, (num_prompts, 2), generator=generator).tolist()
    return [{"prompt_token_ids": p} for p in ids]


def tokens_of(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def all_finite(outputs) -> bool:
    return all(
        math.isfinite(lp.logprob)
        for out in outputs
        for position in out.outputs[0].logprobs
        for lp in position.values()
    )


@torch.no_grad()
def test_counts_equal_reference_routing(moe_dir) -> None:
    llm = LLM(str(moe_dir), **ENGINE_KWARGS)
    model = llm.engine_core.runner.model
    probe = RoutingProbe(model)
    monitor = ExpertMonitor.of_model(model)
    assert sorted(monitor.blocks) == [0, 1]
    for batch in ([0, 1, 2], [3], [4, 5, 6, 7, 8]):
        llm.generate([prompts_of(9)[i] for i in batch], GREEDY)
        stats = monitor.read()
        expected = probe.counts(8)
        for layer in stats.layers:
            assert list(layer.num_tokens) == expected[layer.layer_id]
            assert layer.imbalance == max(layer.num_tokens) * 8 / sum(layer.num_tokens)
    # 9 prompts x (2 prompt tokens + 2 decoded inputs) x top_k 2
    assert sum(stats.layers[0].num_tokens) == 9 * 4 * 2


@torch.no_grad()
def test_nan_expert_frozen_within_three_checks_and_routed_around(moe_dir) -> None:
    llm = LLM(str(moe_dir), **ENGINE_KWARGS)
    model = llm.engine_core.runner.model
    probe = RoutingProbe(model)
    monitor = ExpertMonitor.of_model(model, freeze_after=3)
    prompts = prompts_of(24)
    baseline = llm.generate(prompts, GREEDY)
    assert all_finite(baseline)
    probe.take(LAYER)
    used = []
    for prompt in prompts:  # one at a time: which experts each prompt's tokens reach
        llm.generate([prompt], GREEDY)
        used.append(probe.take(LAYER))
    bad = max(range(8), key=lambda e: (sum(e not in u for u in used), -e))
    touched = [i for i, u in enumerate(used) if bad in u]
    untouched = [i for i, u in enumerate(used) if bad not in u]
    assert len(touched) >= 3 and untouched
    model.model.layers[LAYER].mlp.w2[bad] = float("nan")

    num_checks = 0
    for i in touched:
        if monitor.read().layers[LAYER].frozen[bad]:
            break
        out = llm.generate([prompts[i]], GREEDY)
        assert not all_finite(out)  # the broken expert reached this request
        layer = monitor.read().layers[LAYER]
        num_checks = layer.num_anomalous[bad]
        assert layer.frozen[bad] == (num_checks >= 3)
        assert sum(layer.num_anomalous) == num_checks  # no healthy expert blamed
    stats = monitor.read()
    assert stats.layers[LAYER].frozen[bad] and num_checks == 3
    assert stats.num_auto_freezes == 1
    assert sum(stats.layers[0].num_anomalous) == 0

    probe.masked[LAYER] = {bad}
    probe.take(LAYER)
    before = stats.layers[LAYER].num_tokens[bad]
    block = model.model.layers[LAYER].mlp
    routed = []
    original = block.moe_backend.select_experts

    def recording(logits, top_k, renormalize):
        weights, ids = original(logits, top_k, renormalize)
        routed.append(ids)
        return weights, ids

    block.moe_backend.select_experts = recording
    after = llm.generate(prompts, GREEDY)
    assert all_finite(after)
    assert monitor.read().layers[LAYER].num_tokens[bad] == before
    reference = probe.routed[LAYER]
    assert len(routed) == len(reference) > 0
    assert all(torch.equal(got, want) for got, want in zip(routed, reference, strict=True))
    for i in untouched:
        assert tokens_of(after)[i] == tokens_of(baseline)[i]
    assert any(tokens_of(after)[i] != tokens_of(baseline)[i] for i in touched)

    block.moe_backend.select_experts = original
    monitor.restore(LAYER, bad, llm.info.model_dir)
    stats = monitor.read()
    assert not any(stats.layers[LAYER].frozen) and stats.num_restores == 1
    restored = llm.generate(prompts, GREEDY)
    assert tokens_of(restored) == tokens_of(baseline)
    for got, want in zip(restored, baseline, strict=True):
        assert got.outputs[0].logprobs == want.outputs[0].logprobs


def test_async_llm_restores_a_frozen_expert_from_the_checkpoint(moe_dir) -> None:
    from sits.config import EngineConfig
    from sits.engine.async_llm import AsyncLLM

    async def run(engine, prompt: list[int]) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async for out in engine.generate(f"r{next(counter)}", prompt, params):
            last = out
        return list(last.outputs[0].token_ids)

    counter = iter(range(1000))

    async def main() -> None:
        engine = AsyncLLM(
            EngineConfig(model=str(moe_dir), **ENGINE_KWARGS), restore_frozen_experts=True
        )
        try:
            prompts = [[9, 8, 7], [100, 200], [300, 301, 302, 303]]
            original = [await run(engine, p) for p in prompts]
            stats = await engine.expert_stats()
            bad = max(range(8), key=lambda e: stats.layers[LAYER].num_tokens[e])
            block = engine.engine_core.runner.model.model.layers[LAYER].mlp
            block.w13.data[bad] = float("nan")
            for attempt in range(20):
                await run(engine, [50 + attempt, 60 + attempt])
                stats = await engine.expert_stats()
                if stats.num_restores:
                    break
            assert stats.num_auto_freezes == 1 and stats.num_restores == 1
            assert stats.layers[LAYER].num_anomalous[bad] == 3
            assert not any(stats.layers[LAYER].frozen)
            assert torch.isfinite(block.w13[bad]).all()
            assert [await run(engine, p) for p in prompts] == original
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_async_llm_reads_freezes_and_unfreezes(moe_dir) -> None:
    from sits.config import EngineConfig
    from sits.engine.async_llm import AsyncLLM

    async def main() -> None:
        engine = AsyncLLM(EngineConfig(model=str(moe_dir), **ENGINE_KWARGS))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
            stream = engine.generate("r1", [5, 6, 7], params)
            first = await stream.__anext__()
            frozen = await engine.freeze_expert(LAYER, 2)  # while r1 runs
            assert frozen.layers[LAYER].frozen == tuple(e == 2 for e in range(8))
            last = first
            async for output in stream:
                last = output
            assert last.finished and len(last.outputs[0].token_ids) == 20
            stats = await engine.expert_stats()
            assert sum(stats.layers[0].num_tokens) == (3 + 19) * 2
            assert stats.num_auto_freezes == 0
            assert engine.stats().experts == stats
            with pytest.raises(InvalidParameterError):
                await engine.freeze_expert(5, 0)
            unfrozen = await engine.unfreeze_expert(LAYER, 2)
            assert not any(unfrozen.layers[LAYER].frozen)
        finally:
            await engine.shutdown()

    asyncio.run(main())
