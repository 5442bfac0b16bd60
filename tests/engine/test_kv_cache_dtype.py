"""`--kv-cache-dtype fp8|int8` at the engine level: capacity in blocks, teacher-forced logprobs
against the unquantized (float32) cache, greedy agreement, and validation.

Logprob bound (mean |logprob_quantized - logprob_auto| of the actual prompt tokens, over the
199 positions of a fixed 200-token prompt, teacher-forced so positions line up): at most the
format's worst-case relative error of one stored K/V element in the upper half of its range,
fp8: 2^-4 (3 mantissa bits, round to nearest); int8: (scale / 2) / (amax / 2) = 1/127.
Why that bound: scaling every K (or V) by a coherent 1 + eps changes the scores by the same
factor, a softmax temperature change of eps, which moves a logprob by eps times its
sensitivity to the logit scale (below 1 nat for these tiny models, whose logprobs are a few
nats); rounding errors have random signs and are smaller than eps on average, so they move the
mean less than that coherent worst case. Measured (seed-0 tiny models, this prompt): fp8
0.025 / 0.023 / 0.028 and int8 0.0033 / 0.0035 / 0.0050 for llama / qwen2 / qwen3.
MoE models: a perturbation can flip a token's top-k experts, a discontinuous jump the smooth
argument does not cover (qwen3_moe: fp8 mean 0.060, int8 mean 0.031 and max 1.26 at a few
positions); the bound is asserted on the dense models only.

Greedy tokens: not asserted equal. A quantized run may pick another token only where the
reference's top-1 logprob leads that token by at most FLIP_MARGIN_BOUND nats: a flip needs
the two logprobs to move towards each other by the margin, and each moves by at most the max
|dlogprob| seen above (0.135 nats for fp8), so 0.25 nats.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from sits import LLM, SamplingParams
from sits.cli.main import build_parser
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.engine.arg_utils import engine_kwargs
from tests.engine.hf_reference import random_prompts

LOGPROB_BOUNDS = {"fp8": 2.0**-4, "int8": 1.0 / 127}
FLIP_MARGIN_BOUND = 0.25  # nats


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _llm(model_dir, kv_cache_dtype: str, **kwargs) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype=kwargs.pop("dtype", "float32"),
        max_model_len=512,
        kv_cache_dtype=kv_cache_dtype,
        **kwargs,
    )


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    entries = out.prompt_logprobs[1:]
    return torch.tensor([e[t].logprob for e, t in zip(entries, prompt[1:])], dtype=torch.float64)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_quantized_kv_prompt_logprobs_within_bound(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    prompt = random_prompts([200], _config(model_dir)["vocab_size"], seed=3)[0]
    reference = _prompt_logprobs(_llm(model_dir, "auto"), prompt)  # [199]
    assert reference.shape == (199,)
    for kind, bound in LOGPROB_BOUNDS.items():
        diff = (_prompt_logprobs(_llm(model_dir, kind), prompt) - reference).abs()
        print(f"{arch} {kind}: |dlogprob| mean {diff.mean():.5f}, max {diff.max():.5f}")
        assert diff.mean().item() <= bound, kind
        assert diff.max().item() > 0, f"{kind} cache gave bit-identical logprobs: not quantized?"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_quantized_kv_greedy_flips_only_at_near_ties(tiny_model_factory, arch: str) -> None:
    """Counts greedy agreement (printed); a divergence must start at a near-tie."""
    model_dir = tiny_model_factory(arch)
    prompts = random_prompts([5, 17, 40, 64], _config(model_dir)["vocab_size"], seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    batch = [{"prompt_token_ids": p} for p in prompts]
    reference = [o.outputs[0] for o in _llm(model_dir, "auto").generate(batch, params)]
    for kind in LOGPROB_BOUNDS:
        outs = [o.outputs[0].token_ids for o in _llm(model_dir, kind).generate(batch, params)]
        num_equal = 0
        for ours, ref in zip(outs, reference):
            assert len(ours) == 16
            first = next((i for i, (a, b) in enumerate(zip(ours, ref.token_ids)) if a != b), None)
            if first is None:
                num_equal += 1
                continue
            top = ref.logprobs[first]  # the reference's top-5 at the first divergence
            assert ours[first] in top, f"{kind}: picked a token outside the reference's top 5"
            margin = top[ref.token_ids[first]].logprob - top[ours[first]].logprob
            assert 0 <= margin <= FLIP_MARGIN_BOUND, f"{kind}: flip at a margin of {margin}"
        print(f"{arch} {kind}: {num_equal}/{len(prompts)} greedy outputs equal")


def _block_counts(model_dir, memory_bytes: int) -> dict[str, int]:
    counts = {}
    for name, dtype, kind in [
        ("float32", "float32", "auto"),
        ("bfloat16", "bfloat16", "auto"),
        ("fp8", "float32", "fp8"),
        ("int8", "float32", "int8"),
    ]:
        llm = _llm(model_dir, kind, dtype=dtype, kv_cache_memory_bytes=memory_bytes)
        counts[name] = llm.engine_core.runner.num_blocks
    return counts


def test_quantized_kv_block_capacity(tiny_model_factory, caplog) -> None:
    # tiny llama: 2 layers, 2 KV heads, head_dim 16, block 16. Bytes per block:
    #   float32 2*2*16*2*16*4 = 8192; bfloat16 4096; fp8 data 2048 (+ 2*2*2*4 = 32 fixed scale
    #   bytes for the whole cache); int8 2048 data + 2*2*16*2*4 = 512 scale bytes = 2560.
    model_dir = tiny_model_factory("llama")
    memory_bytes = 1 << 20
    with caplog.at_level(logging.INFO, logger="sits.runner.model_runner"):
        counts = _block_counts(model_dir, memory_bytes)
    assert counts == {
        "float32": memory_bytes // 8192,  # 128
        "bfloat16": memory_bytes // 4096,  # 256
        "fp8": (memory_bytes - 32) // 2048,  # 511: 2x bf16 less the 32 fixed scale bytes
        "int8": memory_bytes // 2560,  # 409: 2x bf16 less head_dim 16's 4-byte scale per 16
    }
    assert counts["fp8"] == 2 * counts["bfloat16"] - 1 == 4 * counts["float32"] - 1
    assert "KV cache dtype fp8 (float8_e4m3fn, per-head scales): 511 blocks" in caplog.text
    assert "KV cache dtype int8 (per-token-per-head scales): 409 blocks" in caplog.text
    assert "KV cache dtype bfloat16: 256 blocks" in caplog.text


def test_invalid_kv_cache_dtype_is_rejected() -> None:
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(model="m", kv_cache_dtype="fp4")
    assert info.value.param == "kv_cache_dtype"
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "x", "--kv-cache-dtype", "bogus"]
    )
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(**engine_kwargs(args))
    assert info.value.param == "kv_cache_dtype"
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "x", "--kv-cache-dtype", "int8"]
    )
    assert EngineConfig(**engine_kwargs(args)).kv_cache_dtype == "int8"
