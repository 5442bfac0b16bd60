"""Spare expert slots (`num_spare_experts`) on the tiny Qwen3-MoE model: the same tokens as
without spares; a NaN injected into an expert while requests run is frozen within three steps,
then restored into a spare slot and unfrozen automatically between steps, with the routing
table pointing at the spare, counts kept in logical ids and the original outputs back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import SamplingParams
from sits.engine.llm import LLM

LAYER = 1
NUM_EXPERTS, TOP_K = 8, 2
ENGINE_KWARGS = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 2 << 20}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


def prompts_of(num_prompts: int, seed: int = 7) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (num_prompts, 3), generator=generator).tolist()
    return [{"prompt_token_ids": p} for p in ids]


def tokens_and_logprobs(outputs) -> list[tuple[list[int], list]]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


@torch.no_grad()
def test_spare_slots_give_the_same_outputs(moe_dir) -> None:
    prompts = prompts_of(6)
    plain = LLM(str(moe_dir), **ENGINE_KWARGS)
    spare = LLM(str(moe_dir), num_spare_experts=2, **ENGINE_KWARGS)
    assert plain.experts is None and spare.experts is not None
    expected = tokens_and_logprobs(plain.generate(prompts, GREEDY))
    assert tokens_and_logprobs(spare.generate(prompts, GREEDY)) == expected
    for layer_id, layer in enumerate(spare.engine_core.runner.model.model.layers):
        block = layer.mlp
        assert block.w13.shape[0] == block.w2.shape[0] == NUM_EXPERTS + 2
        plain_block = plain.engine_core.runner.model.model.layers[layer_id].mlp
        assert torch.equal(block.w13[:NUM_EXPERTS], plain_block.w13)
        assert not block.w13[NUM_EXPERTS:].any() and not block.w2[NUM_EXPERTS:].any()
        assert block.expert_slots().table.tolist() == list(range(NUM_EXPERTS))
        assert torch.equal(block.expert_state().num_tokens, plain_block.expert_state().num_tokens)
    with pytest.raises(InvalidParameterError):
        EngineConfig(model=str(moe_dir), num_spare_experts=-1)


class StepLog:
    """A forward hook on one MoE block: after its `inject_at`-th forward it writes NaN into
    the expert's slot (fault injection in the middle of a generate call), and it records
    (anomalous checks, frozen, slot) of the expert after every forward (test-side syncs)."""

    def __init__(self, block, expert_id: int, inject_at: int) -> None:
        self.block, self.expert_id, self.inject_at = block, expert_id, inject_at
        self.rows: list[tuple[int, bool, int]] = []
        block.register_forward_hook(self.hook)

    def hook(self, block, inputs, output) -> None:
        state = block.expert_state()
        self.rows.append(
            (
                int(state.num_anomalous[self.expert_id]),
                bool(state.frozen[self.expert_id]),
                int(block.expert_slots().table[self.expert_id]),
            )
        )
        if len(self.rows) == self.inject_at:
            block.w2.data[block.physical_slot(self.expert_id)] = float("nan")


@torch.no_grad()
def test_nan_expert_frozen_within_three_steps_then_restored_into_a_spare(moe_dir) -> None:
    llm = LLM(str(moe_dir), num_spare_experts=2, **ENGINE_KWARGS)
    prompts = prompts_of(8)
    baseline = tokens_and_logprobs(llm.generate(prompts, GREEDY))
    before = llm.experts.read()
    bad = max(range(NUM_EXPERTS), key=lambda e: before.layers[LAYER].num_tokens[e])
    block = llm.engine_core.runner.model.model.layers[LAYER].mlp
    log = StepLog(block, bad, inject_at=1)  # NaN right after the prefill forward
    steps_before = llm.engine_core.stats.num_steps
    read_after = [i for i in range(12) if (steps_before + i + 1) % 8 == 0]  # `LLM` reads

    during = llm.generate(prompts, GREEDY)  # one forward per step: 1 prefill + 11 decodes
    assert len(log.rows) == 12
    frozen_at = next(i for i, row in enumerate(log.rows) if row[1])
    assert frozen_at <= 3  # frozen within three steps of the fault
    assert log.rows[frozen_at][0] == 3  # by the third anomalous check
    # The first read after the freeze restores it into the first spare (slot 8), unfrozen.
    restored_after = next(i for i in read_after if i >= frozen_at)
    assert restored_after < 11  # some steps run with the restored expert
    assert all(row == (3, True, bad) for row in log.rows[frozen_at : restored_after + 1])
    assert all(row == (3, False, NUM_EXPERTS) for row in log.rows[restored_after + 1 :])
    stats = llm.experts.read()
    assert stats.num_auto_freezes == 1
    assert stats.num_restores == stats.num_spare_restores == 1
    layer = stats.layers[LAYER]
    assert layer.frozen == (False,) * NUM_EXPERTS
    assert layer.num_anomalous == tuple(3 * (e == bad) for e in range(NUM_EXPERTS))
    expected_table = [NUM_EXPERTS if e == bad else e for e in range(NUM_EXPERTS)]
    assert block.expert_slots().table.tolist() == expected_table == list(layer.expert_slots)
    assert list(block.expert_slots().free_slots) == [NUM_EXPERTS + 1, bad]
    assert (layer.num_free_slots, layer.num_relocated) == (2, 1)
    assert stats.layers[0].expert_slots == tuple(range(NUM_EXPERTS))
    # Counts stay logical: 2 x 8 prompts x (3 prompt tokens + 11 decoded inputs) x top-2.
    for layer_stats in stats.layers:
        assert len(layer_stats.num_tokens) == NUM_EXPERTS
        assert sum(layer_stats.num_tokens) == 2 * 8 * (3 + 11) * TOP_K
    assert layer.num_tokens[bad] > before.layers[LAYER].num_tokens[bad]  # routed again
    assert tokens_and_logprobs(during) != baseline  # the fault reached some requests
    assert tokens_and_logprobs(llm.generate(prompts, GREEDY)) == baseline


def test_async_llm_restores_into_a_spare_while_a_request_streams(moe_dir) -> None:
    from sits.engine.async_llm import AsyncLLM

    counter = iter(range(1000))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def run(engine, prompt: list[int]) -> list[int]:
        async for out in engine.generate(f"r{next(counter)}", prompt, params):
            last = out
        return list(last.outputs[0].token_ids)

    async def main() -> None:
        config = EngineConfig(model=str(moe_dir), num_spare_experts=1, **ENGINE_KWARGS)
        engine = AsyncLLM(config)  # no restore_frozen_experts: spares restore on their own
        try:
            prompts = [[9, 8, 7], [100, 200], [300, 301, 302, 303]]
            original = [await run(engine, p) for p in prompts]
            stats = await engine.expert_stats()
            bad = max(range(NUM_EXPERTS), key=lambda e: stats.layers[LAYER].num_tokens[e])
            block = engine.engine_core.runner.model.model.layers[LAYER].mlp
            long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
            stream = engine.generate("long", [5, 6, 7], long)
            await stream.__anext__()
            block.w13.data[block.physical_slot(bad)] = float("nan")  # while "long" runs
            for attempt in range(20):
                await run(engine, [50 + attempt, 60 + attempt])
                stats = await engine.expert_stats()
                if stats.num_restores:
                    break
            last = [out async for out in stream][-1]
            assert last.finished and len(last.outputs[0].token_ids) == 60
            assert stats.num_auto_freezes == 1 and stats.num_spare_restores == 1
            assert stats.layers[LAYER].num_anomalous[bad] == 3
            assert not any(stats.layers[LAYER].frozen)
            assert block.expert_slots().table.tolist()[bad] == NUM_EXPERTS
            assert list(block.expert_slots().free_slots) == [bad]
            body = stats.to_json()
            assert body["num_spare_experts"] == 1 and body["num_spare_restores"] == 1
            assert body["layers"][LAYER]["expert_slots"][bad] == NUM_EXPERTS
            assert body["layers"][LAYER]["num_free_slots"] == 1
            assert [await run(engine, p) for p in prompts] == original
            assert engine.stats().experts.num_spare_restores == 1
        finally:
            await engine.shutdown()

    asyncio.run(main())
