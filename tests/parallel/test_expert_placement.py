"""Load-aware expert placement under expert parallelism (issue 27, `runner.expert_placement`)
on two gloo ranks: re-placing the experts, with redundant slots, replicas across the ranks
and replicas sharing a rank, leaves the logits and tokens those of TP=1, and the weights move
between the ranks by point-to-point sends into exactly the slots the placement names; an
engine with `expert_router_policy="load-aware"` re-places while requests run (at least twice,
between steps) with greedy tokens equal to TP=1's, the imbalance after the re-placement no
higher than before (both the pure function's figures on the same window), and the figures
reach the expert stats and `/metrics`.

The model-level case spawns two processes once (`test_tp_model._spawn_ranks`); each engine
spawns one worker and is shut down in a finally.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sits import LLM
from sits.config import EngineConfig
from sits.engine.stats import EngineStats
from sits.layers.moe import SparseMoeBlock
from sits.layers.moe_stats import DEFAULT_FREEZE_AFTER
from sits.models.loader import load_model
from sits.obs.server_metrics import ServerMetrics
from sits.parallel import TensorParallel
from sits.parallel.placement import (
    combined_imbalance,
    contiguous_placement,
    imbalance,
    rebalance,
)
from sits.runner.expert_health import ExpertMonitor
from sits.runner.expert_placement import ExpertPlacer, move_expert_weights
from sits.testing.tiny import cached_tiny_checkpoint
from tests.engine.hf_reference import random_prompts
from tests.models.paged import PagedRunner
from tests.parallel.test_tp_engine import _add
from tests.parallel.test_tp_model import ATOL, NUM_DECODE, PROMPT, TP_SIZE, _spawn_ranks
from tests.server.live import metric_samples

NUM_REDUNDANT = 2  # 8 experts + 2 on 2 ranks: 5 slots each
# Per MoE layer (the tiny qwen3_moe has 2), the loads each re-placement is computed from:
# the first before the prefill, the second between two decode steps.
FIRST_LOADS = ([100, 5, 5, 5, 60, 5, 5, 5], [1000, 0, 0, 0, 0, 0, 0, 0])  # 3 replicas of e0
SECOND_LOADS = ([5, 5, 5, 5, 5, 5, 80, 90], [0, 0, 0, 0, 0, 0, 0, 1])
PLACE_BEFORE_DECODE = 2  # the second re-placement runs before this decode step


def _moe_blocks(model) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@torch.inference_mode()
def _place(blocks: list[SparseMoeBlock], loads, rank: int) -> None:
    """Re-place every block by `rebalance` of its load, moving the weights between ranks."""
    for block, load in zip(blocks, loads, strict=True):
        old = block.replicas().placement
        new = rebalance(load, old)
        move_expert_weights(block, old, new, rank)
        block.replicas().set_placement(new)


def _rank_main(rank: int, port: int, model_dirs: list[str], out_dir: str) -> None:
    """One rank: load the EP shard with redundant slots, re-place, prefill PROMPT, decode
    NUM_DECODE tokens re-placing again midway; save (logits, tokens, per block (placement,
    w13, w2))."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=TP_SIZE, init_method=f"tcp://127.0.0.1:{port}"
    )
    try:
        tp = TensorParallel(rank=rank, size=TP_SIZE, expert_parallel=True)
        model = load_model(model_dirs[0], torch.float32, "cpu", tp=tp)
        blocks = _moe_blocks(model)
        for block in blocks:
            block.enable_replicas(NUM_REDUNDANT)
        _place(blocks, FIRST_LOADS, rank)
        runner = PagedRunner(model)
        steps, tokens = [runner.step([("s", PROMPT)])[0]], []
        for step in range(NUM_DECODE):
            if step == PLACE_BEFORE_DECODE:
                _place(blocks, SECOND_LOADS, rank)
            tokens.append(int(steps[-1][-1].argmax()))
            steps.append(runner.step([("s", [tokens[-1]])])[0])
        held = [(b.replicas().placement.slots, b.w13.clone(), b.w2.clone()) for b in blocks]
        torch.save((steps, tokens, held), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    base = tmp_path_factory.mktemp("placement_tiny")
    return str(cached_tiny_checkpoint("qwen3_moe", base, with_tokenizer=False))


def test_re_placement_mid_run_keeps_tp1_logits(moe_dir, tmp_path: Path) -> None:
    """Both ranks agree on the placements; every rank's logits equal TP=1 within 1e-5 and the
    greedy tokens are equal; each rank's slot s holds exactly the TP=1 weights of the expert
    the final placement puts there."""
    _spawn_ranks([moe_dir], tmp_path, _rank_main)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(TP_SIZE)]
    whole = load_model(moe_dir, torch.float32, "cpu")
    runner = PagedRunner(whole)
    want_steps, want_tokens = [runner.step([("s", PROMPT)])[0]], []
    for _ in range(NUM_DECODE):
        want_tokens.append(int(want_steps[-1][-1].argmax()))
        want_steps.append(runner.step([("s", [want_tokens[-1]])])[0])
    whole_blocks = _moe_blocks(whole)
    # the placements the two re-placements give, from the contiguous start
    want_placements = []
    for first, second in zip(FIRST_LOADS, SECOND_LOADS, strict=True):
        placed = rebalance(first, contiguous_placement(8, TP_SIZE, 5))
        want_placements.append(rebalance(second, placed))
    assert want_placements[1].replica_counts() == [1] * 7 + [3]  # e7 on both, twice on one
    assert any(len({r for r, _ in reps}) == 2 for reps in want_placements[0].replicas())
    for rank, (steps, tokens, held) in enumerate(results):
        assert tokens == want_tokens, f"rank {rank}"
        for step, (got, want) in enumerate(zip(steps, want_steps, strict=True)):
            torch.testing.assert_close(
                got, want, atol=ATOL, rtol=0, msg=lambda m, r=rank, s=step: f"rank {r} {s}: {m}"
            )
        for (slots, w13, w2), want, whole_block in zip(
            held, want_placements, whole_blocks, strict=True
        ):
            assert slots == want.slots
            for slot, expert in enumerate(slots[rank]):
                assert torch.equal(w13[slot], whole_block.w13[expert]), (rank, slot, expert)
                assert torch.equal(w2[slot], whole_block.w2[expert]), (rank, slot, expert)


MAX_TOKENS = 8
INTERVAL = 3


def _llm(model_dir, tensor_parallel_size: int, **kwargs) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=8,  # the prompts are prefilled in chunks
        kv_cache_memory_bytes=2**21,
        skip_tokenizer_init=True,
        tensor_parallel_size=tensor_parallel_size,
        tensor_parallel_timeout_s=60.0,
        **kwargs,
    )


def _serve(llm: LLM, prompts: list[list[int]]) -> tuple[dict[str, list[int]], list]:
    """Requests r0, r1 from the start, r2, r3 once r0 has finished (the load shifts);
    (tokens by request, every placement check that ran, in order)."""
    core = llm.engine_core
    placer = core.runner.expert_placer
    _add(core, "r0", prompts[0])
    _add(core, "r1", prompts[1])
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    checks, added = [], False
    while core.has_unfinished_requests() or not added:
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.request_id == "r0" and out.finished and not added:
                _add(core, "r2", prompts[2])
                _add(core, "r3", prompts[3])
                added = True
        if placer is not None and placer.last is not None and placer.last not in checks:
            checks.append(placer.last)
    return tokens, checks


def test_load_aware_engine_re_places_while_serving(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts([6, 21, 17, 11], vocab, seed=5)
    one = two = None
    try:
        one = _llm(model_dir, 1)
        expected, _ = _serve(one, prompts)
        one.shutdown()
        two = _llm(
            model_dir,
            2,
            enable_expert_parallel=True,
            expert_router_policy="load-aware",
            num_redundant_experts=NUM_REDUNDANT,
            expert_rebalance_interval=INTERVAL,
        )
        placer = two.engine_core.runner.expert_placer
        assert isinstance(placer, ExpertPlacer)
        got, checks = _serve(two, prompts)
        stats = ExpertMonitor.of_runner(two.engine_core.runner).read()
    finally:
        for llm in (one, two):
            if llm is not None:
                llm.shutdown()
    assert got == expected
    assert all(len(tokens) == MAX_TOKENS for tokens in got.values())
    replaced = [check for check in checks if check.changed]
    assert len(replaced) >= 2 and placer.num_replacements == len(replaced)
    assert replaced[0].before == (contiguous_placement(8, 2, 5),) * 2
    for check in checks:
        assert check.num_steps % INTERVAL == 0
        for load, before, after in zip(check.window_tokens, check.before, check.after):
            new = rebalance(load, before)
            assert after == (new if imbalance(new, load) < imbalance(before, load) else before)
            assert imbalance(after, load) <= imbalance(before, load)
        assert check.imbalance_before == combined_imbalance(
            list(zip(check.before, check.window_tokens))
        )
        assert check.imbalance_after == combined_imbalance(
            list(zip(check.after, check.window_tokens))
        )
        assert check.imbalance_after <= check.imbalance_before
    for earlier, later in zip(checks, checks[1:]):
        assert later.before == earlier.after  # each check starts from the previous one's
    last = replaced[-1]
    assert last.imbalance_after < last.imbalance_before
    placement = stats.placement
    assert placement is not None and placement.num_replacements == len(replaced)
    assert (placement.imbalance_before, placement.imbalance_after) == (
        last.imbalance_before,
        last.imbalance_after,
    )
    assert placement.layers == tuple(p.slots for p in checks[-1].after)
    assert stats.to_json()["placement"]["num_replacements"] == len(replaced)
    metrics = ServerMetrics(_Engine(EngineStats(experts=stats)), "m")
    samples = metric_samples(metrics.render().decode())
    assert samples[("sits:moe_expert_replacements_total", ())] == len(replaced)
    imbalances = {
        when: samples[("sits:moe_expert_placement_imbalance", (("when", when),))]
        for when in ("before", "after")
    }
    assert imbalances == {"before": last.imbalance_before, "after": last.imbalance_after}
    print(
        f"\nre-placements: {len(replaced)} of {len(checks)} checks; last: imbalance "
        f"{last.imbalance_before:.4f} -> {last.imbalance_after:.4f} (worst layer "
        f"{last.worst_before:.4f} -> {last.worst_after:.4f}), "
        f"{last.num_moved_experts} experts moved"
    )


class _Engine:
    """The stats source of `ServerMetrics`: a fixed snapshot."""

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def test_a_placer_only_with_load_aware_on_moe_layers(tiny_model_factory) -> None:
    """`ExpertPlacer.of_model` (no process group: nothing runs a collective): the static
    policy keeps today's contiguous shard; load-aware enables every MoE layer's replicas; a
    dense model gets no placer; with two ranks the health check keeps its freeze_after."""
    model_dir = str(tiny_model_factory("qwen3_moe"))
    tp = TensorParallel(rank=1, size=2, expert_parallel=True)
    static = EngineConfig(model=model_dir, tensor_parallel_size=2, enable_expert_parallel=True)
    load_aware = static.with_changes(
        expert_router_policy="load-aware", num_redundant_experts=2, expert_rebalance_interval=7
    )
    model = load_model(model_dir, torch.float32, "cpu", tp=tp)
    assert ExpertPlacer.of_model(model, static, rank=1) is None
    assert all(b.replicas() is None and b.w13.shape[0] == 4 for b in _moe_blocks(model))
    assert all(
        int(b.expert_state().freeze_after) == DEFAULT_FREEZE_AFTER for b in _moe_blocks(model)
    )
    placer = ExpertPlacer.of_model(model, load_aware, rank=1)
    assert isinstance(placer, ExpertPlacer) and list(placer.blocks) == [0, 1]
    assert (placer.size, placer.num_redundant, placer.interval_steps) == (2, 2, 7)
    for block in _moe_blocks(model):
        assert block.w13.shape[0] == 5
        assert block.replicas().placement == contiguous_placement(8, 2, 5)
    dense = load_model(str(tiny_model_factory("llama")), torch.float32, "cpu", tp=tp)
    assert ExpertPlacer.of_model(dense, load_aware, rank=1) is None
