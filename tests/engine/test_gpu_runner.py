"""The GPU runner (Triton attention, fused MoE when available, decode CUDA graphs) gives
transformers' greedy tokens, and graph replay gives the eager path's tokens and expert counts.

Run on the GPU machine: `pytest -m gpu tests/engine/test_gpu_runner.py`.
"""

from __future__ import annotations

import pytest
import torch

from sits import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.engine.test_llm_parity import PROMPT_LENGTHS, _config

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)


def _llm(model_dir, **kwargs) -> LLM:
    """An engine with a fixed 64 MiB KV cache (engines of earlier tests may still hold theirs)."""
    return LLM(
        model=str(model_dir), dtype="float32", device="cuda", max_model_len=512, max_num_seqs=16,
        kv_cache_memory_bytes=64 << 20, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_gpu_greedy_equals_transformers(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = random_prompts(PROMPT_LENGTHS, _config(model_dir)["vocab_size"])
    llm = _llm(model_dir)
    runner = llm.engine_core.runner
    assert type(runner.attn_backend).__name__ == "TritonPagedAttention"
    if arch == "llama":
        assert runner.graphs is not None and runner.graphs.batch_sizes == [1, 2, 4, 8, 16]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = hf_greedy(model_dir, prompt, 12, None)
        sample = out.outputs[0]
        assert sample.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        ours = [sample.logprobs[i][t].logprob for i, t in enumerate(sample.token_ids)]
        assert ours == pytest.approx(ref_logprobs, abs=2e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_graph_replay_equals_eager(tiny_model_factory, arch: str) -> None:
    """5 requests (padded to the graph of 8): same tokens, same expert token counts."""
    model_dir = tiny_model_factory(arch)
    prompts = random_prompts([3, 9, 17, 30, 64], _config(model_dir)["vocab_size"], seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = _llm(model_dir, enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        counts = [
            m.expert_state().num_tokens.sum().item()
            for m in llm.engine_core.runner.model.modules()
            if hasattr(m, "expert_state")
        ]
        results[eager] = ([o.outputs[0].token_ids for o in outs], counts)
        if not eager and arch == "llama":
            assert llm.engine_core.runner.graphs is not None
    assert results[False][0] == results[True][0]
    assert results[False][1] == results[True][1]
    if arch == "qwen3_moe":  # each token of each request routed top_k times per MoE layer
        top_k = _config(model_dir)["num_experts_per_tok"]
        routed = (sum(len(p) for p in prompts) + 19 * len(prompts)) * top_k
        assert results[True][1] == [routed] * len(results[True][1])


def test_gpu_chunked_prefill_equals_transformers(tiny_model_factory) -> None:
    """A 16-token budget: long prompts run as chunks whose steps sample nothing (no device
    sync), so the host must not refill the pinned inputs before their copies ran."""
    model_dir = tiny_model_factory("qwen3_moe")
    prompts = random_prompts([200, 150, 90], _config(model_dir)["vocab_size"], seed=3)
    llm = _llm(model_dir, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ref_tokens, _ = hf_greedy(model_dir, prompt, 8, None)
        assert out.outputs[0].token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize(("arch", "budget"), [("llama", 64), ("qwen3_moe", 64), ("qwen3_moe", 256)])
def test_mixed_step_graphs_equal_eager(tiny_model_factory, arch: str, budget: int) -> None:
    """Steps with prompt chunks replayed from token-bucket graphs: same tokens and expert counts
    as eager steps (chunked prompts, mixed decode + prefill steps, token and sequence padding)."""
    model_dir = tiny_model_factory(arch)
    prompts = random_prompts([3, 40, 17, 130, 64], _config(model_dir)["vocab_size"], seed=6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = {}
    for mixed in (False, True):
        llm = _llm(model_dir, max_num_batched_tokens=budget, mixed_step_cuda_graphs=mixed)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        counts = [
            m.expert_state().num_tokens.sum().item()
            for m in llm.engine_core.runner.model.modules()
            if hasattr(m, "expert_state")
        ]
        results[mixed] = ([o.outputs[0].token_ids for o in outs], counts)
        graphs = llm.engine_core.runner.mixed_graphs
        if mixed and llm.engine_core.runner.graphs is not None:
            assert graphs is not None and graphs.token_buckets[-1] == budget
            assert graphs.num_replays > 0
            assert llm.engine_core.policy.pacer.token_buckets == tuple(graphs.token_buckets)
        elif not mixed:
            assert llm.engine_core.policy.pacer.token_buckets == ()
    assert results[True] == results[False]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_async_scheduling_equals_sync_on_gpu(tiny_model_factory, arch: str) -> None:
    """Async scheduling on CUDA (decode graphs, mixed-step graphs, the placeholder ids filled
    on the device): the same greedy tokens and seeded samples as synchronous steps, with
    requests ending at different steps on stop tokens and lengths."""
    model_dir = tiny_model_factory(arch)
    prompts = random_prompts([3, 9, 17, 30, 64, 5, 12], _config(model_dir)["vocab_size"], seed=6)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = _llm(model_dir).generate(inputs, free)
    params = []
    for i, out in enumerate(ref):
        stop = [out.outputs[0].token_ids[2 + 3 * i]] if i % 2 == 0 else []
        params.append(
            SamplingParams(temperature=0, max_tokens=14 + i, stop_token_ids=stop, ignore_eos=True)
        )
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=16) for i in range(3)]
    inputs += inputs[:3]
    results = {}
    for mode in (False, True):
        outs = _llm(model_dir, async_scheduling=mode).generate(inputs, params)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    assert results[True] == results[False]
    assert [r for _, r in results[True]].count("stop") >= 3
