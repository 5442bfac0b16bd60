"""Tensor-parallel model shards (issue 27): two gloo ranks, each loading its shard of a tiny
checkpoint, give the TP=1 model's logits and greedy tokens on all five architectures; shapes
the size does not fit are refused at build with the numbers.

One spawn of two processes serves every case (the machine has 2 cores): each rank loads each
checkpoint's shard, prefills a prompt and decodes 4 tokens through `PagedRunner`, and saves its
logits; the parent compares them with the TP=1 model's (float32, CPU).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sits.core.errors import InvalidParameterError
from sits.layers.moe_stats import DEFAULT_FREEZE_AFTER
from sits.models.loader import build_meta_model, load_model, load_weights_from
from sits.parallel import SINGLE, TensorParallel
from sits.testing.tiny import cached_tiny_checkpoint, tiny_config
from tests.models.paged import PagedRunner
from tests.waits import HANG_S

TP_SIZE = 2
ATOL = 1e-5
NUM_DECODE = 4
PROMPT = [5, 17, 300, 42, 9, 511, 128]

# (case id, arch, config overrides, load through transformers' in-memory names)
CASES = [
    ("llama", "llama", {}, False),
    ("qwen2", "qwen2", {}, False),
    ("qwen3", "qwen3", {}, False),
    ("qwen3_moe", "qwen3_moe", {}, False),
    ("mixtral", "mixtral", {}, False),
    # 2 ranks over 1 KV head: replicated; biases on o_proj and down_proj are added once.
    ("llama-kv1-biases", "llama", {"num_key_value_heads": 1, "attention_bias": True,
                                   "mlp_bias": True}, False),
    # a dense layer in an MoE model; fused in-memory expert tensors [E, 2I, H] / [E, H, I].
    ("qwen3_moe-dense0-fused", "qwen3_moe", {"mlp_only_layers": [0]}, True),
]  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _generate(model) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill PROMPT, then decode NUM_DECODE greedy tokens: (each step's logits, tokens)."""
    runner = PagedRunner(model)
    logits = runner.step([("s", PROMPT)])[0]  # [len(PROMPT), vocab]
    steps, tokens = [logits], []
    for _ in range(NUM_DECODE):
        tokens.append(int(steps[-1][-1].argmax()))
        steps.append(runner.step([("s", [tokens[-1]])])[0])  # [1, vocab]
    return steps, tokens


def _load(model_dir: str, from_hf: bool, tp: TensorParallel):
    """The shard of `model_dir`; with from_hf, its weights (zeroed first) written again from
    the transformers model's state dict (fused in-memory expert names)."""
    model = load_model(model_dir, torch.float32, "cpu", tp=tp)
    if from_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        load_weights_from(model, hf.state_dict().items())
    return model


def _poison_one_shard(model, rank: int) -> tuple[int, list[bool]]:
    """Make layer 0's busiest expert non-finite on rank 0's shard only, run 3 forwards
    (DEFAULT_FREEZE_AFTER) of fresh prompts; (that expert, layer 0's frozen mask)."""
    block = model.model.layers[0].mlp
    runner = PagedRunner(model)
    runner.step([("warm", PROMPT * 4)])
    expert = int(block.expert_state().num_tokens.argmax())
    if rank == 0:
        with torch.no_grad():
            block.w13[expert].fill_(float("nan"))
    for attempt in range(DEFAULT_FREEZE_AFTER):
        runner.step([(f"poisoned-{attempt}", PROMPT * 4)])
    return expert, block.expert_state().frozen.tolist()


def _rank_main(rank: int, port: int, cases: list[tuple[str, str, bool]], out_dir: str) -> None:
    """One rank: load each case's shard, generate, save {case: (logits, tokens, KV heads,
    parameter elements)}."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=TP_SIZE, init_method=f"tcp://127.0.0.1:{port}"
    )
    try:
        tp = TensorParallel(rank=rank, size=TP_SIZE)
        results = {}
        for case_id, model_dir, from_hf in cases:
            model = _load(model_dir, from_hf, tp)
            steps, tokens = _generate(model)
            numel = sum(param.numel() for param in model.parameters())
            results[case_id] = (steps, tokens, model.arch.num_kv_heads, numel)
            if case_id == "qwen3_moe":
                results["poisoned"] = _poison_one_shard(model, rank)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn_ranks(cases: list[tuple[str, str, bool]], out_dir: Path, rank_main=None) -> None:
    """Run `rank_main(rank, port, cases, out_dir)` (None: `_rank_main`, a module-level
    function) on TP_SIZE processes; join them all (killing any left at the hang ceiling or
    after a failure)."""
    context = mp.spawn(
        rank_main or _rank_main,
        args=(_free_port(), cases, str(out_dir)),
        nprocs=TP_SIZE,
        join=False,
    )
    try:
        deadline = time.monotonic() + HANG_S
        while not context.join(timeout=1.0):
            assert time.monotonic() < deadline, "tensor-parallel ranks hung"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def tiny_checkpoints(factory: pytest.TempPathFactory, name: str, cases) -> dict[str, str]:
    """Case id -> a tiny checkpoint of each (case_id, arch, overrides, from_hf) case."""
    base = factory.mktemp(f"{name}_tiny")
    return {
        case_id: str(cached_tiny_checkpoint(arch, base, with_tokenizer=False, **overrides))
        for case_id, arch, overrides, _ in cases
    }


def ranks_results(
    checkpoints: dict[str, str], factory: pytest.TempPathFactory, name: str, cases, rank_main=None
) -> list[dict]:
    """Every rank's saved results of `rank_main` (`_spawn_ranks`) over the cases."""
    out_dir = factory.mktemp(f"{name}_ranks")
    runs = [(case_id, checkpoints[case_id], from_hf) for case_id, _, _, from_hf in cases]
    _spawn_ranks(runs, out_dir, rank_main)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(TP_SIZE)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_checkpoints(tmp_path_factory, "tp", CASES)


@pytest.fixture(scope="module")
def rank_results(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return ranks_results(checkpoints, tmp_path_factory, "tp", CASES)


@pytest.mark.parametrize("case_id", [case[0] for case in CASES])
def test_tp2_ranks_equal_tp1(checkpoints, rank_results, case_id: str) -> None:
    """Every rank's prefill and decode logits equal TP=1 within 1e-5; greedy tokens equal."""
    whole = load_model(checkpoints[case_id], torch.float32, "cpu")
    want_steps, want_tokens = _generate(whole)
    whole_numel = sum(param.numel() for param in whole.parameters())
    _, arch, overrides, _ = next(case for case in CASES if case[0] == case_id)
    num_kv_heads = tiny_config(arch, **overrides).num_key_value_heads
    for rank, results in enumerate(rank_results):
        steps, tokens, rank_kv_heads, rank_numel = results[case_id]
        assert tokens == want_tokens, f"rank {rank}"
        assert rank_kv_heads == max(1, num_kv_heads // TP_SIZE)
        assert rank_numel < 0.7 * whole_numel  # a shard: only norms and routers replicated
        for step, (got, want) in enumerate(zip(steps, want_steps, strict=True)):
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(
                got,
                want,
                atol=ATOL,
                rtol=0,
                msg=lambda m, r=rank, s=step: f"rank {r}, step {s}: {m}",
            )


def test_an_expert_faulty_on_one_shard_freezes_on_every_rank(rank_results) -> None:
    """The experts' non-finite flags are OR-ed over the ranks: both freeze the expert whose
    weights are non-finite on rank 0's shard only, and nothing else."""
    (expert, frozen_0), (expert_1, frozen_1) = (r["poisoned"] for r in rank_results)
    assert expert == expert_1
    assert frozen_0 == frozen_1 == [e == expert for e in range(len(frozen_0))]


def _config_dir(tmp_path: Path, arch: str, **overrides: object) -> str:
    tiny_config(arch, **overrides).save_pretrained(tmp_path)
    return str(tmp_path)


REFUSED = [
    pytest.param("llama", {"vocab_size": 513}, 3, r"num_attention_heads \(4\)", id="heads"),
    pytest.param(
        "llama",
        {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 6},
        4,
        r"neither divides num_key_value_heads \(6\)",
        id="kv_heads",
    ),
    pytest.param(
        "llama",
        {"vocab_size": 513, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
        3,
        r"intermediate_size \(128\)",
        id="intermediate",
    ),
    pytest.param(
        "qwen3_moe",
        {"vocab_size": 513, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
        3,
        r"the experts' intermediate_size \(32\)",
        id="experts",
    ),
    pytest.param("llama", {}, 3, r"vocab_size \(512\)", id="vocab"),
]


@pytest.mark.parametrize(("arch", "overrides", "size", "message"), REFUSED)
def test_shapes_the_size_does_not_divide_are_refused(
    tmp_path: Path, arch: str, overrides: dict, size: int, message: str
) -> None:
    model_dir = _config_dir(tmp_path, arch, **overrides)
    with pytest.raises(InvalidParameterError, match=rf"tensor parallel size {size}.*{message}"):
        build_meta_model(model_dir, tp=TensorParallel(rank=0, size=size))


def test_spare_experts_are_refused_with_expert_parallel(tmp_path: Path) -> None:
    model_dir = _config_dir(tmp_path, "qwen3_moe")
    ep = TensorParallel(rank=1, size=2, expert_parallel=True)
    with pytest.raises(InvalidParameterError, match="sit on the rank holding its expert"):
        load_model(model_dir, torch.float32, "cpu", num_spare_experts=1, tp=ep)


def test_tensor_parallel_state() -> None:
    tp = TensorParallel(rank=1, size=4)
    assert tp.split(12, "heads") == 3 and tp.shard(12, "heads") == slice(3, 6)
    with pytest.raises(InvalidParameterError, match=r"size 4 does not divide heads \(6\)"):
        tp.split(6, "heads")
    x = torch.arange(3.0)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x
    with pytest.raises(InvalidParameterError):
        TensorParallel(rank=2, size=2)
