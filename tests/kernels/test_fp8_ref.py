"""The FP8 reference: quantize / dequantize round trips, ragged blocks, the reference linear,
and the FP8 MoE reference against `moe_forward` on the dequantized experts (exact)."""

from __future__ import annotations

import torch

from sits.kernels.fp8_ref import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    expand_block_scale,
    fp8_linear,
    quantize_fp8_block,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
)
from sits.kernels.moe_ref import moe_forward, moe_forward_fp8


def test_block_quantization_round_trip_with_ragged_edges() -> None:
    weight = torch.randn(40, 70)
    q, scale = quantize_fp8_block(weight, (16, 32))
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 3) and scale.dtype == torch.float32
    # Each block's largest |w| maps onto 448 exactly.
    assert q[:16, :32].float().abs().max().item() == FP8_MAX
    back = dequantize_fp8(q, scale, (16, 32), torch.float32)
    full = expand_block_scale(scale, 40, 70, (16, 32))
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of each element's block scale.
    assert ((back - weight).abs() <= full * FP8_MAX * 2**-4 + 1e-12).all()


def test_per_row_and_per_tensor_round_trips() -> None:
    weight = torch.randn(24, 48)
    weight[3] = 0  # an all-zero row gets scale 1 and stays zero
    q, scale = quantize_fp8_per_row(weight)
    assert scale.shape == (24,) and scale[3].item() == 1.0
    back = dequantize_fp8(q, scale, None, torch.float32)
    assert torch.equal(back[3], torch.zeros(48))
    assert ((back - weight).abs() <= scale[:, None] * FP8_MAX * 2**-4).all()
    q_t, scale_t = quantize_fp8_per_tensor(weight)
    assert scale_t.shape == ()
    back_t = dequantize_fp8(q_t, scale_t.expand(24), None, torch.float32)
    assert (back_t - weight).abs().max() <= scale_t * FP8_MAX * 2**-4


def test_fp8_linear_is_the_matmul_of_the_dequantized_weight() -> None:
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    q, scale = quantize_fp8_block(torch.randn(48, 64), (16, 16))
    bias = torch.randn(48, dtype=torch.bfloat16)
    out = fp8_linear(x, q, scale, bias, (16, 16))
    assert out.dtype == torch.bfloat16 and out.shape == (5, 48)
    w = (q.float() * expand_block_scale(scale, 48, 64, (16, 16))).to(torch.bfloat16)
    assert torch.equal(out, torch.nn.functional.linear(x, w, bias))


def test_moe_fp8_reference_equals_moe_forward_on_dequantized_experts() -> None:
    num_experts, hidden, inter = 6, 32, 16
    w13, s13 = quantize_fp8_block(torch.randn(num_experts, 2 * inter, hidden), (16, 16))
    w2, s2 = quantize_fp8_block(torch.randn(num_experts, hidden, inter), (16, 16))
    x = torch.randn(7, hidden)
    topk_ids = torch.tensor([[0, 3], [3, 5], [5, 0], [0, 3], [-1, -1], [5, 3], [0, 5]])
    topk_weights = torch.rand(7, 2)
    x[2, 0] = float("nan")  # a non-finite input row does not flag its experts
    got_flags = torch.zeros(num_experts, dtype=torch.bool)
    got = moe_forward_fp8(x, w13, s13, w2, s2, (16, 16), topk_weights, topk_ids, got_flags)
    want_flags = torch.zeros(num_experts, dtype=torch.bool)
    want = moe_forward(
        x,
        dequantize_fp8(w13, s13, (16, 16), torch.float32),
        dequantize_fp8(w2, s2, (16, 16), torch.float32),
        topk_weights,
        topk_ids,
        want_flags,
    )
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got_flags, want_flags) and not got_flags.any()
    assert torch.equal(got[4], torch.zeros(hidden))  # all -1: no expert, zero row
