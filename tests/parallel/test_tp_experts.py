"""MoE expert health, operator expert operations and spare experts under tensor and expert
parallelism (issue 27; `runner.expert_ops`, `ExpertMonitor.of_runner`), two gloo ranks against
TP=1 on the tiny Qwen3-MoE:

- an expert whose weights are NaN on the worker's shard only freezes on both ranks at the
  same step as with one rank (the flags are OR-ed in the MoE all-reduce), rank 0's monitor
  reports it, the unpoisoned requests keep TP=1's tokens, and its restore from the checkpoint
  (each rank its own slice, or its own whole expert; into a spare slot with spares, on its
  own) brings the clean tokens back: TP slices, TP slices with spares, expert parallelism
  (the expert on the worker only), and with the load-aware placement's replica tables;
- freeze, unfreeze and restore through `AsyncLLM` give TP=1's tokens and the same
  `ExpertStats`, with a spare slot;
- the ops reach the workers before the next step, and spares with expert parallelism are
  refused with the reason.

Each rank's state is recorded after every non-empty step: in this process by patching
`ModelRunner.run`, in the worker by starting it through `_recording_worker` (the executor's
`run_worker` replaced in this process; the spawned worker imports this module), which also
poisons the worker's part of the expert.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch

from sits import LLM, SamplingParams
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.engine.async_llm import AsyncLLM
from sits.runner import tp_executor
from sits.runner.expert_health import ExpertMonitor
from sits.runner.expert_ops import moe_blocks
from sits.runner.model_runner import ModelRunner

LAYER = 1  # the last MoE layer: a NaN there reaches the logits only, no later KV
NUM_EXPERTS = 8
TIMEOUT_S = 60.0
ENGINE_KWARGS = {
    "dtype": "float32",
    "max_model_len": 128,
    "kv_cache_memory_bytes": 2**21,
    "skip_tokenizer_init": True,
    "tensor_parallel_timeout_s": TIMEOUT_S,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("qwen3_moe"))


@pytest.fixture(autouse=True)
def _no_worker_left():
    """No tensor-parallel worker outlives its test."""
    yield
    import multiprocessing

    left = [p for p in multiprocessing.active_children() if p.name.startswith("sits-tp-rank")]
    assert not left, f"workers left running: {left}"


@dataclasses.dataclass(frozen=True)
class Poison:
    """Make `expert` of `layer` NaN in this rank's slots before non-empty step `after_steps`
    + 1 (counted from the engine's start)."""

    layer: int
    expert: int
    after_steps: int


def _expert_record(model) -> list:
    """Per MoE layer, (frozen, num_anomalous) of every expert, as plain lists."""
    record = []
    for block in moe_blocks(model).values():
        state = block.expert_state()
        record.append([state.frozen.tolist(), state.num_anomalous.tolist()])
    return record


def _poison(model, layer: int, expert: int) -> None:
    """NaN into every slot of this rank holding the expert (its slice, or its whole expert)."""
    block = moe_blocks(model)[layer]
    with torch.no_grad():
        for slot in block.local_slots(expert):
            block.w2.data[slot] = float("nan")


def _recording_run(original, sink, poison: Poison | None = None):
    """`ModelRunner.run` (`original`) wrapped: `sink(_expert_record(...))` after every
    non-empty step; `poison` applied once, before its step."""
    done = {"steps": 0, "poisoned": poison is None}

    def run(self, plan, while_gpu_runs=None):
        if not plan.is_empty and not done["poisoned"] and done["steps"] == poison.after_steps:
            _poison(self.model, poison.layer, poison.expert)
            done["poisoned"] = True
        result = original(self, plan, while_gpu_runs)
        if not plan.is_empty:
            done["steps"] += 1
            sink(_expert_record(self.model))
        return result

    return run


def _recording_worker(record_path: str, poison: Poison | None, *args) -> None:
    """The worker's entry in these tests: `run_worker` with its steps recorded as JSON lines
    in `record_path` (flushed per step: the worker ends with os._exit) and `poison` applied."""

    def sink(record: list) -> None:
        with open(record_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    ModelRunner.run = _recording_run(ModelRunner.run, sink, poison)
    tp_executor.run_worker(*args)


def _worker_records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def _finite(output) -> bool:
    return all(
        math.isfinite(lp.logprob)
        for position in output.outputs[0].logprobs
        for lp in position.values()
    )


def _prompts(num_prompts: int = 12, seed: int = 7) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (num_prompts, 3), generator=generator).tolist()
    return [{"prompt_token_ids": p} for p in ids]


def _poison_scenario(llm: LLM, bad: int | None = None) -> dict:
    """Clean pass, poisoned pass (expert `bad` of LAYER NaN from its start: None = poisoned
    here, the busiest of the clean pass among NUM_EXPERTS // 2 .. NUM_EXPERTS - 1 (the
    worker's half under expert parallelism); else by the worker's hook), restore (by the
    LLM's own monitor with spares, else by one of the test), clean pass again."""
    prompts = _prompts()
    monitor = llm.experts or ExpertMonitor.of_runner(llm.engine_core.runner)
    clean = llm.generate(prompts, GREEDY, use_tqdm=False)
    if bad is None:
        counts = monitor.read().layers[LAYER].num_tokens
        bad = max(range(NUM_EXPERTS // 2, NUM_EXPERTS), key=lambda e: counts[e])
        _poison(llm.engine_core.runner.model, LAYER, bad)
    poisoned = llm.generate(prompts, GREEDY, use_tqdm=False)
    frozen_stats = monitor.read()
    if llm.experts is None:
        monitor.restore(LAYER, bad, llm.info.model_dir)
    after = llm.generate(prompts, GREEDY, use_tqdm=False)
    return {
        "bad": bad,
        "clean": _tokens(clean),
        "poisoned": _tokens(poisoned),
        "finite": [_finite(out) for out in poisoned],
        "frozen_stats": frozen_stats,
        "after": _tokens(after),
        "stats": monitor.read(),
    }


CASES = {
    "tp": {},
    "tp-spares": {"num_spare_experts": 2},
    "ep": {"enable_expert_parallel": True},
    "ep-replicas": {
        "enable_expert_parallel": True,
        "expert_router_policy": "load-aware",
        "num_redundant_experts": 2,
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_expert_poisoned_on_the_workers_shard_freezes_everywhere_then_is_restored(
    moe_dir, monkeypatch, tmp_path: Path, case: str
) -> None:
    options = CASES[case]
    spares = options.get("num_spare_experts", 0)
    one_records: list = []
    two_records: list = []
    records = [one_records]  # where this process's steps go now
    run = _recording_run(ModelRunner.run, lambda record: records[0].append(record))
    monkeypatch.setattr(ModelRunner, "run", run)
    clean_steps = 6  # one prefill and five decode steps
    one = two = None
    try:
        one = LLM(moe_dir, num_spare_experts=spares, **ENGINE_KWARGS)
        expected = _poison_scenario(one)
        one.shutdown()
        bad = expected["bad"]
        record_path = tmp_path / "rank1.jsonl"
        poison = Poison(LAYER, bad, after_steps=clean_steps)
        worker = functools.partial(_recording_worker, str(record_path), poison)
        monkeypatch.setattr(tp_executor, "run_worker", worker)
        records[0] = two_records
        two = LLM(moe_dir, tensor_parallel_size=2, **options, **ENGINE_KWARGS)
        got = _poison_scenario(two, bad)
    finally:
        for llm in (one, two):
            if llm is not None:
                llm.shutdown()
    worker_records = _worker_records(record_path)
    # every rank froze the expert at the same step as one rank did, and nothing else
    assert two_records == worker_records == one_records
    frozen_at = [step for step, record in enumerate(one_records) if record[LAYER][0][bad]]
    assert frozen_at and clean_steps < frozen_at[0] <= clean_steps + 3
    assert all(not any(record[0][0]) for record in one_records)  # layer 0: never
    assert got["clean"] == expected["clean"] and got["after"] == expected["after"]
    assert got["after"] == got["clean"]  # restored: the clean tokens again
    assert got["finite"] == expected["finite"]
    assert not all(got["finite"]) and any(got["finite"])
    for request, finite in enumerate(expected["finite"]):
        if finite:
            assert got["poisoned"][request] == expected["poisoned"][request]
    for name in ("frozen_stats", "stats"):
        two_stats = dataclasses.replace(got[name], placement=None)  # TP=1 has no placer
        assert two_stats == expected[name]
    frozen = got["frozen_stats"]
    assert frozen.num_auto_freezes == 1
    assert frozen.layers[LAYER].num_anomalous[bad] == 3
    assert sum(frozen.layers[LAYER].num_anomalous) == 3
    stats = got["stats"]
    assert stats.num_restores == 1 and not any(stats.layers[LAYER].frozen)
    assert stats.num_spare_restores == (1 if spares else 0)
    expected_slot = NUM_EXPERTS if spares else bad
    assert stats.layers[LAYER].expert_slots[bad] == expected_slot
    if spares:  # restored on its own by the LLM's read, then unfrozen
        assert not frozen.layers[LAYER].frozen[bad]
    else:
        assert frozen.layers[LAYER].frozen[bad]
    if "expert_router_policy" in options:
        assert got["stats"].placement is not None


async def _operations(engine: AsyncLLM) -> tuple[list, list]:
    """Requests one at a time around freeze, unfreeze, freeze + restore of LAYER's busiest
    expert: (tokens of each pass, stats after each operation)."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[9, 8, 7], [100, 200], [300, 301, 302, 303], [41, 42]]
    counter = iter(range(1000))

    async def run_all() -> list[list[int]]:
        tokens = []
        for prompt in prompts:
            async for out in engine.generate(f"r{next(counter)}", prompt, params):
                last = out
            tokens.append(list(last.outputs[0].token_ids))
        return tokens

    passes = [await run_all()]
    stats = [await engine.expert_stats()]
    busy = max(range(NUM_EXPERTS), key=lambda e: stats[0].layers[LAYER].num_tokens[e])
    stats.append(await engine.freeze_expert(LAYER, busy))
    passes.append(await run_all())
    stats.append(await engine.unfreeze_expert(LAYER, busy))
    passes.append(await run_all())
    stats.append(await engine.freeze_expert(LAYER, busy))
    stats.append(await engine.restore_expert(LAYER, busy))
    passes.append(await run_all())
    stats.append(await engine.expert_stats())
    return passes, stats


def test_operator_operations_through_async_llm_give_one_ranks_tokens_and_stats(moe_dir):
    def run(tensor_parallel_size: int) -> tuple[list, list]:
        config = EngineConfig(
            model=moe_dir,
            tensor_parallel_size=tensor_parallel_size,
            num_spare_experts=1,
            **ENGINE_KWARGS,
        )

        async def main() -> tuple[list, list]:
            engine = AsyncLLM(config)
            try:
                return await _operations(engine)
            finally:
                await engine.shutdown()

        return asyncio.run(main())

    expected_passes, expected_stats = run(1)
    passes, stats = run(2)
    assert passes == expected_passes
    assert stats == expected_stats
    base, frozen, unfrozen, restored = passes
    assert frozen != base and unfrozen == base and restored == base
    busy = next(e for e in range(NUM_EXPERTS) if stats[1].layers[LAYER].frozen[e])
    assert stats[1].layers[LAYER].frozen == tuple(e == busy for e in range(NUM_EXPERTS))
    assert stats[2].layers[LAYER].frozen == (False,) * NUM_EXPERTS
    last = stats[-1]
    assert last.num_restores == last.num_spare_restores == 1 and last.num_auto_freezes == 0
    assert last.layers[LAYER].expert_slots[busy] == NUM_EXPERTS  # the spare
    assert last.layers[LAYER].frozen == (False,) * NUM_EXPERTS


def test_spare_experts_with_tensor_parallel_config() -> None:
    """Spares with TP slices are accepted; with expert parallelism refused with the reason."""
    assert EngineConfig(model="m", tensor_parallel_size=2, num_spare_experts=2).num_spare_experts
    with pytest.raises(InvalidParameterError, match="sit on the rank holding its expert") as info:
        EngineConfig(
            model="m", tensor_parallel_size=2, enable_expert_parallel=True, num_spare_experts=1
        )
    assert info.value.param == "num_spare_experts"
