"""Expert-parallel model shards (issue 27, `TensorParallel(expert_parallel=True)`): two gloo
ranks, each holding half of every MoE layer's experts whole, give the TP=1 model's logits,
greedy tokens and expert token counts on qwen3_moe and mixtral; an expert poisoned on the rank
that holds it freezes on both; an expert count the size does not divide is refused with the
numbers; a rank's weight coverage is exact for its own experts; a dense model under expert
parallelism loads as without it, saying so.

One spawn of two processes serves every case (`test_tp_model._spawn_ranks`): each rank loads
each checkpoint's expert-parallel shard, prefills a prompt and decodes 4 tokens, and saves
what the parent compares with the TP=1 model (float32, CPU).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from sits.core.errors import InvalidParameterError, UnsupportedModelError
from sits.layers.moe import SparseMoeBlock
from sits.layers.moe_stats import DEFAULT_FREEZE_AFTER
from sits.models.loader import build_meta_model, load_model, load_weights_from, safetensors_files
from sits.parallel import TensorParallel
from sits.testing.tiny import cached_tiny_checkpoint, tiny_config
from tests.models.paged import PagedRunner
from tests.parallel.test_tp_model import (
    ATOL,
    PROMPT,
    TP_SIZE,
    _generate,
    _load,
    ranks_results,
    tiny_checkpoints,
)

# (case id, arch, config overrides, load through transformers' in-memory names)
CASES = [
    ("qwen3_moe", "qwen3_moe", {}, False),
    ("mixtral", "mixtral", {}, False),
    # a dense layer in an MoE model; fused in-memory expert tensors [E, 2I, H] / [E, H, I].
    ("qwen3_moe-dense0-fused", "qwen3_moe", {"mlp_only_layers": [0]}, True),
]  # fmt: skip


def _moe_blocks(model) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def _poison_on_holder(model, rank: int) -> tuple[int, list[bool]]:
    """Make the last MoE layer's busiest expert non-finite on the rank that holds it, run 3
    forwards (DEFAULT_FREEZE_AFTER) of fresh prompts; (that expert, the layer's frozen mask)."""
    block = _moe_blocks(model)[-1]
    runner = PagedRunner(model)
    runner.step([("warm", PROMPT * 4)])
    expert = int(block.expert_state().num_tokens.argmax())
    shard = block.expert_shard
    if shard.start <= expert < shard.stop:
        with torch.no_grad():
            block.w13[expert - shard.start].fill_(float("nan"))
    for attempt in range(DEFAULT_FREEZE_AFTER):
        runner.step([(f"poisoned-{attempt}", PROMPT * 4)])
    return expert, block.expert_state().frozen.tolist()


def _ep_rank_main(rank: int, port: int, cases: list[tuple[str, str, bool]], out_dir: str) -> None:
    """One rank: load each case's expert-parallel shard, generate, save {case: (logits,
    tokens, per-layer expert counts, per-layer (experts held, w13, w2))}."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=TP_SIZE, init_method=f"tcp://127.0.0.1:{port}"
    )
    try:
        tp = TensorParallel(rank=rank, size=TP_SIZE, expert_parallel=True)
        results = {}
        for case_id, model_dir, from_hf in cases:
            model = _load(model_dir, from_hf, tp)
            steps, tokens = _generate(model)
            blocks = _moe_blocks(model)
            counts = [block.expert_state().num_tokens.clone() for block in blocks]
            held = [
                ((b.expert_shard.start, b.expert_shard.stop), b.w13.clone(), b.w2.clone())
                for b in blocks
            ]
            results[case_id] = (steps, tokens, counts, held)
            if case_id == "qwen3_moe":
                results["poisoned"] = _poison_on_holder(model, rank)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_checkpoints(tmp_path_factory, "ep", CASES)


@pytest.fixture(scope="module")
def rank_results(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return ranks_results(checkpoints, tmp_path_factory, "ep", CASES, _ep_rank_main)


@pytest.mark.parametrize("case_id", [case[0] for case in CASES])
def test_ep2_ranks_equal_tp1(checkpoints, rank_results, case_id: str) -> None:
    """Every rank's prefill and decode logits equal TP=1 within 1e-5, greedy tokens and every
    expert's token count equal (routing is replicated, counts are over all experts)."""
    whole = load_model(checkpoints[case_id], torch.float32, "cpu")
    want_steps, want_tokens = _generate(whole)
    want_counts = [block.expert_state().num_tokens for block in _moe_blocks(whole)]
    for rank, results in enumerate(rank_results):
        steps, tokens, counts, _ = results[case_id]
        assert tokens == want_tokens, f"rank {rank}"
        assert len(counts) == len(want_counts)
        for got, want in zip(counts, want_counts, strict=True):
            assert got.tolist() == want.tolist(), f"rank {rank}"
        for step, (got, want) in enumerate(zip(steps, want_steps, strict=True)):
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(
                got,
                want,
                atol=ATOL,
                rtol=0,
                msg=lambda m, r=rank, s=step: f"rank {r}, step {s}: {m}",
            )


@pytest.mark.parametrize("case_id", [case[0] for case in CASES])
def test_each_rank_holds_half_the_experts_whole(checkpoints, rank_results, case_id) -> None:
    """Rank r holds experts [r * E / 2, (r + 1) * E / 2) of every MoE layer, each whole: its
    w13 / w2 equal those rows of the TP=1 model's, half its expert parameters."""
    whole_blocks = _moe_blocks(load_model(checkpoints[case_id], torch.float32, "cpu"))
    num_experts = whole_blocks[0].config.num_experts
    local = num_experts // TP_SIZE
    for rank, results in enumerate(rank_results):
        held = results[case_id][3]
        assert len(held) == len(whole_blocks)
        for (span, w13, w2), whole in zip(held, whole_blocks, strict=True):
            assert span == (rank * local, (rank + 1) * local)
            assert w13.numel() + w2.numel() == (whole.w13.numel() + whole.w2.numel()) // 2
            assert torch.equal(w13, whole.w13[span[0] : span[1]])
            assert torch.equal(w2, whole.w2[span[0] : span[1]])


def test_an_expert_faulty_on_its_rank_freezes_on_every_rank(rank_results) -> None:
    """The holder's non-finite flags reach the other rank in the layer's all-reduce: both
    freeze the poisoned expert, and nothing else."""
    (expert, frozen_0), (expert_1, frozen_1) = (r["poisoned"] for r in rank_results)
    assert expert == expert_1
    assert frozen_0 == frozen_1 == [e == expert for e in range(len(frozen_0))]


def test_num_experts_the_size_does_not_divide_is_refused(tmp_path: Path) -> None:
    tiny_config("qwen3_moe", num_experts=6).save_pretrained(tmp_path)
    build_meta_model(str(tmp_path), tp=TensorParallel(rank=0, size=4))  # slices 32 columns
    with pytest.raises(
        InvalidParameterError,
        match=r"tensor parallel size 4 does not divide num_experts with expert parallelism \(6\)",
    ):
        build_meta_model(str(tmp_path), tp=TensorParallel(rank=0, size=4, expert_parallel=True))


def test_a_dense_model_under_expert_parallelism_loads_as_without(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = str(cached_tiny_checkpoint("llama", tmp_path, with_tokenizer=False))
    with caplog.at_level(logging.INFO, logger="sits"):
        model = load_model(
            model_dir, torch.float32, "cpu", tp=TensorParallel(0, 1, expert_parallel=True)
        )
    assert "no MoE layers" in caplog.text
    plain = load_model(model_dir, torch.float32, "cpu")
    for (name, got), (_, want) in zip(
        model.state_dict().items(), plain.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name


def test_coverage_is_exact_per_rank(tmp_path: Path) -> None:
    """Rank 1 of 2 needs experts 4..7 only: a checkpoint without expert 0 loads, one without
    expert 5 is refused as missing it (no process group: loading runs no collective)."""
    model_dir = str(cached_tiny_checkpoint("qwen3_moe", tmp_path, with_tokenizer=False))
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        tensors.update(load_file(path))
    tp = TensorParallel(rank=1, size=2, expert_parallel=True)
    model = load_model(model_dir, torch.float32, "cpu", tp=tp)
    assert any(".experts.0." in name for name in tensors)  # per-expert checkpoint names
    load_weights_from(model, ((n, t) for n, t in tensors.items() if ".experts.0." not in n))
    with pytest.raises(UnsupportedModelError, match=r"missing \[model\.layers\.0\.mlp\.w13"):
        load_weights_from(model, ((n, t) for n, t in tensors.items() if ".experts.5." not in n))
