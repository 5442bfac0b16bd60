"""Norm, fused linear and MoE block vs transformers' modules on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from sits.layers.activation import silu_and_mul
from sits.layers.linear import QKVLinear
from sits.layers.moe import MoeConfig, SparseMoeBlock
from sits.layers.norm import RMSNorm
from sits.testing.tiny import tiny_config


def test_rms_norm_equals_transformers_in_bfloat16() -> None:
    hf = LlamaRMSNorm(64, eps=1e-5)
    ours = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64) + 0.5)
        ours.weight.copy_(hf.weight)
    hf, ours = hf.bfloat16(), ours.bfloat16()
    x = (torch.randn(7, 64) * 3).bfloat16()
    residual = torch.randn(7, 64).bfloat16()
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, hf(x + residual))
    first, carried = ours(x)
    assert torch.equal(first, hf(x)) and carried is x


def test_qkv_linear_splits_heads_in_q_k_v_order() -> None:
    qkv = QKVLinear(hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=3, bias=True)
    assert qkv.weight.shape == (24, 8) and qkv.bias.shape == (24,)
    assert [qkv.part_rows(i) for i in range(3)] == [slice(0, 12), slice(12, 18), slice(18, 24)]
    with torch.no_grad():
        qkv.weight.zero_()
        qkv.bias.copy_(torch.arange(24.0))
    q, k, v = qkv.forward_split(torch.zeros(5, 8))
    assert q.shape == (5, 4, 3) and k.shape == (5, 2, 3) and v.shape == (5, 2, 3)
    assert q[0, 3].tolist() == [9.0, 10.0, 11.0]
    assert k[0, 1].tolist() == [15.0, 16.0, 17.0]
    assert v[0, 0].tolist() == [18.0, 19.0, 20.0]


def test_silu_and_mul_uses_the_first_half_as_gate() -> None:
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    expected = torch.nn.functional.silu(torch.tensor([[1.0, -2.0]])) * torch.tensor([[3.0, 4.0]])
    assert torch.equal(silu_and_mul(x), expected)


def hf_moe_block(arch: str, **overrides):
    config = tiny_config(arch, **overrides)
    block = (Qwen3MoeSparseMoeBlock if arch == "qwen3_moe" else MixtralSparseMoeBlock)(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
        block.gate.weight[:, 0] = -3.0  # with hidden[:, 0] = 4: router logits about -12 (C15)
    return config, block.eval()


@pytest.mark.parametrize(
    ("arch", "overrides", "renormalize"),
    [
        ("qwen3_moe", {"norm_topk_prob": True}, True),
        ("qwen3_moe", {"norm_topk_prob": False}, False),
        ("mixtral", {}, True),
    ],
)
def test_sparse_moe_block_equals_transformers(arch, overrides, renormalize) -> None:
    config, hf = hf_moe_block(arch, **overrides)
    inter = config.moe_intermediate_size if arch == "qwen3_moe" else config.intermediate_size
    moe_config = MoeConfig(num_experts=8, top_k=2, intermediate_size=inter, renormalize=renormalize)
    ours = SparseMoeBlock(64, moe_config)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.w13.copy_(hf.experts.gate_up_proj)  # [E, 2I, H], gate rows first
        ours.w2.copy_(hf.experts.down_proj)  # [E, H, I]
    hidden = torch.randn(1, 13, 64, generator=torch.Generator().manual_seed(6))
    hidden[..., 0] = 4.0
    logits = ours.gate(hidden[0])
    assert logits.max() < -5  # strongly negative router logits (case C15)
    with torch.no_grad():
        expected = hf(hidden)[0]
        got = ours(hidden[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
