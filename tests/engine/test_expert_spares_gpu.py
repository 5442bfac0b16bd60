"""Spare expert slots in the GPU engine (Triton attention, fused MoE, decode CUDA graphs): the
same tokens as without spares, and a NaN expert frozen, restored into a spare slot by the
periodic read of `LLM` and unfrozen, after which the original tokens come back.

Run on the GPU machine: `pytest -m gpu tests/engine/test_expert_spares_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from sits import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

LAYER, NUM_EXPERTS = 1, 8
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(
        model=str(model_dir), dtype="float32", device="cuda", max_model_len=256, max_num_seqs=8,
        kv_cache_memory_bytes=32 << 20, **kwargs,
    )  # fmt: skip


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_gpu_spares_same_tokens_and_restore_under_graphs(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    prompts = [{"prompt_token_ids": [5 + i, 90 + 3 * i, 200 + i]} for i in range(6)]
    plain = _tokens(_llm(model_dir).generate(prompts, PARAMS))
    llm = _llm(model_dir, num_spare_experts=2)
    assert llm.engine_core.runner.graphs is not None  # decode steps replay CUDA graphs
    assert _tokens(llm.generate(prompts, PARAMS)) == plain

    stats = llm.experts.read()
    bad = max(range(NUM_EXPERTS), key=lambda e: stats.layers[LAYER].num_tokens[e])
    block = llm.engine_core.runner.model.model.layers[LAYER].mlp
    assert block._use_fused_kernels(torch.empty(1, 1, device="cuda"))
    with torch.no_grad():
        block.w2[block.physical_slot(bad)] = float("nan")
    llm.generate(prompts, PARAMS)  # frozen after 3 anomalous steps, restored at a read
    stats = llm.experts.read()
    assert stats.num_auto_freezes == 1 and stats.num_spare_restores == 1
    assert stats.layers[LAYER].num_anomalous[bad] == 3
    assert not any(stats.layers[LAYER].frozen)
    assert block.expert_slots().table.tolist()[bad] == NUM_EXPERTS
    assert _tokens(llm.generate(prompts, PARAMS)) == plain
