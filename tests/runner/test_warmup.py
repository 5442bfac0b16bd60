"""Kernel warm-up (`sits.runner.warmup`): the exact dummy steps for a budget, and no trace left:
greedy outputs, expert counters and health, fp8 KV scales and the block pool are what they are
without a warm-up. Runs on the CPU through the function itself; the GPU test
(`pytest -m gpu tests/runner/test_warmup.py`) checks the default CUDA startup path."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import pytest
import torch

from sits import LLM, SamplingParams
from sits.kernels.attention_ref import TorchPagedAttention
from sits.kernels.kv_quant_ref import QuantizedKVCache
from sits.models.loader import load_model
from sits.parallel import TensorParallel
from sits.runner import tp_executor as tp_executor_module
from sits.runner.expert_health import ExpertMonitor
from sits.runner.input_buffers import InputBuffers
from sits.runner.kv_cache_alloc import allocate_kv_caches
from sits.runner.model_runner import ModelRunner
from sits.runner.warmup import (
    decode_split_counts,
    local_num_heads,
    warm_up_kernels,
    warmup_token_counts,
)
from tests.engine.hf_reference import random_prompts

# Budget 64 (max_num_seqs 8 keeps InputBuffers.max_num_tokens at 64), 128-token sequences.
ENGINE_KWARGS = {
    "device": "cpu",  # also on the GPU machine, where the default device is CUDA
    "dtype": "float32",
    "max_model_len": 128,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
    "kv_cache_memory_bytes": 2 << 20,
}
COUNTS_64 = [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64]
MIXED_TOKENS = 16  # a 15-token chunk plus one decode
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
PROMPT_LENGTHS = [3, 17, 40, 70, 100]  # 70 and 100 exceed the budget: chunked prefill


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


def _warmed_llm(monkeypatch: pytest.MonkeyPatch, model_dir, warm_up: bool, **kwargs) -> LLM:
    """An engine whose runner is built with `warm_up` (the real setup path)."""
    with monkeypatch.context() as patch:
        patch.setattr(  # `make_runner` builds the one-rank runner
            tp_executor_module, "ModelRunner", functools.partial(ModelRunner, warm_up=warm_up)
        )
        return LLM(str(model_dir), **kwargs)


def _outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _expert_counts(llm: LLM) -> dict[int, tuple[int, ...]]:
    stats = ExpertMonitor.of_model(llm.engine_core.runner.model).read()
    return {layer.layer_id: layer.num_tokens for layer in stats.layers}


def test_token_counts_of_a_budget() -> None:
    assert warmup_token_counts(64) == COUNTS_64
    assert warmup_token_counts(1) == [1]
    assert warmup_token_counts(2) == [1, 2]
    # Not a power of two: the budget, and the other divisibility class in (64, 100].
    assert warmup_token_counts(100) == [*COUNTS_64, 96, 100]
    assert warmup_token_counts(96) == [*COUNTS_64, 95, 96]
    assert warmup_token_counts(20) == [1, 2, 3, 4, 7, 8, 15, 16, 20]  # no multiple of 16 > 16
    counts = warmup_token_counts(8192)
    assert len(counts) == 26 and counts[-2:] == [8191, 8192]
    assert len(warmup_token_counts(2048)) == 22
    with pytest.raises(ValueError):
        warmup_token_counts(0)


def test_decode_split_counts() -> None:
    assert decode_split_counts(32, num_heads=32) == [1, 2, 3, 5, 9, 16, 17, 32]
    # 4 heads: the partial buffers' stride 4 * s is a multiple of 16 when s % 4 == 0.
    assert decode_split_counts(32, num_heads=4) == [1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 20, 32]
    assert decode_split_counts(1, num_heads=32) == [1]


def test_warm_up_runs_the_listed_steps_and_restores_expert_state(moe_dir) -> None:
    llm = LLM(str(moe_dir), **ENGINE_KWARGS)
    runner = llm.engine_core.runner
    assert runner.warmup is None  # the CPU does not warm up by default
    model = runner.model
    monitor = ExpertMonitor.of_model(model)
    # Non-zero counters, a streak and a frozen expert: "unchanged" is not "reset".
    with torch.inference_mode():
        for layer_id, block in monitor.blocks.items():
            state = block.expert_state()
            state.num_tokens.copy_(torch.arange(8) + 10 * layer_id)
            state.num_anomalous[3] = 2
            state.streak[3] = 2
    monitor.freeze(1, 5)
    before = monitor.read()
    raw_before = [
        [t.clone() for t in (s.num_tokens, s.num_anomalous, s.streak, s.frozen)]
        for s in (b.expert_state() for b in monitor.blocks.values())
    ]
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(args[0].numel()))
    report = warm_up_kernels(
        model, runner.buffers, runner.kv_caches, runner.attn_backend, max_model_len=128
    )
    hook.remove()
    assert report.token_counts == (*COUNTS_64, MIXED_TOKENS)
    # ... and one more full-budget step, compiled by then, timed for the prefill rate
    assert seen == [*report.token_counts, max(COUNTS_64)]
    assert report.prefill_tokens_per_s is not None and report.prefill_tokens_per_s > 0
    assert monitor.read() == before
    for block, saved in zip(monitor.blocks.values(), raw_before, strict=True):
        state = block.expert_state()
        live = (state.num_tokens, state.num_anomalous, state.streak, state.frozen)
        assert all(torch.equal(a, b) for a, b in zip(live, saved, strict=True))
        assert not state.checked.any() and not state.anomalous.any()
    # A forward after the warm-up counts exactly its own tokens.
    monitor.unfreeze(1, 5)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1))
    after = monitor.read()
    for layer, old in zip(after.layers, before.layers, strict=True):
        assert sum(layer.num_tokens) - sum(old.num_tokens) == 3 * 2  # 3 tokens x top_k 2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_outputs_equal_an_engine_without_warm_up(
    moe_dir, monkeypatch, caplog, kv_cache_dtype: str
) -> None:
    kwargs = {**ENGINE_KWARGS, "kv_cache_dtype": kv_cache_dtype}
    plain = LLM(str(moe_dir), **kwargs)
    with caplog.at_level(logging.INFO, logger="sits.runner.warmup"):
        warmed = _warmed_llm(monkeypatch, moe_dir, True, **kwargs)
    runner = warmed.engine_core.runner
    assert plain.engine_core.runner.warmup is None
    assert runner.warmup is not None
    assert runner.warmup.token_counts == (*COUNTS_64, MIXED_TOKENS)
    assert any(r.getMessage().startswith("warmed up 13 prefill shapes in ") for r in caplog.records)
    # No trace: uncalibrated fp8 scales, zero expert counters, an untouched block pool.
    for cache in runner.kv_caches:
        if isinstance(cache, QuantizedKVCache):
            assert not cache.scales.any()
    assert all(not any(counts) for counts in _expert_counts(warmed).values())
    kv = warmed.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks == runner.num_blocks - 1
    assert kv.pool.free_block_ids() == list(range(1, runner.num_blocks))
    assert all(kv.pool.block_hash(b) is None for b in range(runner.num_blocks))

    prompts = random_prompts(PROMPT_LENGTHS, 512, seed=5)
    prompts.append(prompts[2][:33] + [9, 9, 9])  # shares a cached 32-token prefix
    assert _outputs(warmed, prompts) == _outputs(plain, prompts)
    assert _expert_counts(warmed) == _expert_counts(plain)
    assert kv.stats == plain.engine_core.scheduler.kv.stats  # same prefix-cache hits


@dataclass(frozen=True, slots=True)
class _AloneRank(TensorParallel):
    """Rank 0 of 2 whose collectives stay in this process (the sum is its own part, the
    gather its part repeated): a real rank's shapes in every layer, not its values."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)


@dataclass(frozen=True, slots=True)
class _SplitConfig:
    decode_num_splits: int | None = None
    decode_max_splits: int = 8


class _SplitSpy:
    """A backend with a Triton-like split config: records each instance's split count and
    the query heads its forwards see, and attends with the PyTorch reference."""

    made: list[int | None] = []
    query_heads: set[int] = set()

    def __init__(self, config: _SplitConfig) -> None:
        self.config = config
        _SplitSpy.made.append(config.decode_num_splits)

    def forward(self, query, key, value, kv_cache, metadata, scale):
        _SplitSpy.query_heads.add(query.shape[1])
        return TorchPagedAttention().forward(query, key, value, kv_cache, metadata, scale)


def test_tensor_parallel_warm_up_uses_the_ranks_heads(tiny_model_factory) -> None:
    """Rank 0 of 2 of a 4-head model runs 2 heads: the mixed steps cover the split classes
    of 2 heads ([1, 2, 3, 5, 8] up to 8 splits), not of the checkpoint's 4 ([1, 2, 3, 4, 5,
    8]), and the KV heads of its cache are the rank's one."""
    model_dir = tiny_model_factory("llama")
    tp = _AloneRank(rank=0, size=2)
    model = load_model(str(model_dir), dtype=torch.float32, device="cpu", tp=tp).eval()
    assert (model.config.attention.num_heads, local_num_heads(model)) == (4, 2)
    arch = model.arch
    buffers = InputBuffers(
        max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=8, block_size=16,
        device=torch.device("cpu"),
    )  # fmt: skip
    kv_caches = allocate_kv_caches(
        arch.num_layers, 8, 16, arch.num_kv_heads, arch.head_dim, torch.float32,
        torch.device("cpu"),
    )  # fmt: skip
    assert kv_caches[0].shape[3] == 1  # 2 KV heads over 2 ranks
    _SplitSpy.made.clear()
    _SplitSpy.query_heads.clear()
    report = warm_up_kernels(
        model, buffers, kv_caches, _SplitSpy(_SplitConfig()), max_model_len=128
    )
    assert decode_split_counts(8, 2) == [1, 2, 3, 5, 8] != decode_split_counts(8, 4)
    assert _SplitSpy.made == [None, 1, 2, 3, 5, 8]  # the runner's backend, then one per class
    assert _SplitSpy.query_heads == {2}
    assert report.token_counts == (*warmup_token_counts(16), *[MIXED_TOKENS] * 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_startup_warm_up_keeps_outputs(moe_dir, monkeypatch) -> None:
    """The default CUDA startup warms up (Triton attention and MoE) before the decode graphs;
    its greedy tokens, logprobs and expert counts equal an engine built without it."""
    kwargs = {
        "dtype": "float32",
        "device": "cuda",
        "max_model_len": 512,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "kv_cache_memory_bytes": 64 << 20,
    }
    warmed = LLM(str(moe_dir), **kwargs)
    runner = warmed.engine_core.runner
    assert runner.warmup is not None
    assert type(runner.attn_backend).__name__ == "TritonPagedAttention"
    num_heads = runner.model.config.attention.num_heads
    max_splits = runner.attn_backend.config.decode_max_splits
    mixed = [MIXED_TOKENS] * len(decode_split_counts(max_splits, num_heads))
    assert runner.warmup.token_counts == (*warmup_token_counts(256), *mixed)
    assert all(not any(counts) for counts in _expert_counts(warmed).values())
    plain = _warmed_llm(monkeypatch, moe_dir, False, **kwargs)
    assert plain.engine_core.runner.warmup is None
    prompts = random_prompts([3, 17, 40, 300, 120], 512, seed=6)
    got, want = _outputs(warmed, prompts), _outputs(plain, prompts)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_lp), (_, want_lp) in zip(got, want, strict=True):
        for got_pos, want_pos in zip(got_lp, want_lp, strict=True):
            assert got_pos.keys() == want_pos.keys()
            for token, lp in got_pos.items():
                assert lp.logprob == pytest.approx(want_pos[token].logprob, abs=1e-4)
    assert _expert_counts(warmed) == _expert_counts(plain)
