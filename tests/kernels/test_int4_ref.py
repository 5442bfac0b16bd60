"""The INT4 (w4a16) reference: our packing (the compressed-tensors order) against a packer
written here from the documented layout, online quantization, the reference linear and the
INT4 MoE reference against `moe_forward` on the dequantized experts (exact)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sits.kernels.int4_ref import (
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
    w4a16_linear,
)
from sits.kernels.moe_ref import moe_forward, moe_forward_int4


def _words(codes: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, C] codes -> [R, C / 8] int32; nibble j of word w holds column 8 w + order[j]."""
    groups = codes.long().reshape(codes.shape[0], -1, 8)
    value = sum(groups[..., order[j]] << (4 * j) for j in range(8))
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


SEQUENTIAL = list(range(8))
AWQ = [0, 2, 4, 6, 1, 3, 5, 7]


def _codes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    codes = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(seed))
    edge = torch.tensor([15, 0, 15, 0, 8, 7, 1, 14])  # bit 31 set: a negative word
    codes[0, : min(8, cols)] = edge[: min(8, cols)]
    return codes


def test_our_packing_is_compressed_tensors_sequential_order_and_round_trips() -> None:
    codes = _codes(6, 32)
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (6, 4)
    assert torch.equal(packed, _words(codes, SEQUENTIAL)) and packed[0, 0] < 0
    assert torch.equal(unpack_int4(packed).long(), codes)
    assert torch.equal(unpack_int4(pack_int4(codes.T, dim=0), dim=0).long(), codes.T)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(codes[:, :12])


def test_online_quantization_round_trip_and_the_linear() -> None:
    weight = torch.randn(24, 64)
    weight[3, :16] = 0  # an all-zero group gets scale 1 and stays zero
    packed, scale = quantize_int4(weight, 16)
    assert packed.shape == (24, 8) and scale.shape == (24, 4) and scale[3, 0].item() == 1.0
    codes = unpack_int4(packed)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15  # symmetric: -8 .. 7 plus 8
    back = dequantize_int4(packed, scale, None, 16, torch.float32)
    assert torch.equal(back[3, :16], torch.zeros(16))
    groups = weight.reshape(24, 4, 16)
    amax = groups.abs().amax(dim=-1)
    ratio = torch.where(amax > 0, scale * 7 / amax, torch.ones_like(amax))
    assert ((ratio >= 0.7 - 1e-6) & (ratio <= 1.0 + 1e-6)).all()
    # each group's squared error is the least over the clipping grid, at most plain amax / 7's
    plain = torch.where(amax > 0, amax / 7, torch.ones_like(amax))[..., None]
    plain_error = (((groups / plain).round().clamp(-8, 7) * plain - groups) ** 2).sum(-1)
    error = ((back.reshape(24, 4, 16) - groups) ** 2).sum(-1)
    assert (error <= plain_error + 1e-6).all() and (error < plain_error).any()
    x, bias = torch.randn(5, 64), torch.randn(24)
    assert torch.equal(w4a16_linear(x, packed, scale, None, 16, bias), F.linear(x, back, bias))


def test_zero_points_and_g_idx_dequantize_per_column_group() -> None:
    codes, zero = _codes(8, 32), _codes(8, 4, seed=3)
    scale = torch.rand(8, 4)
    g_idx = torch.randperm(32, generator=torch.Generator().manual_seed(4)) // 8
    got = dequantize_int4(pack_int4(codes), scale, zero.to(torch.uint8), 8, torch.float32, g_idx)
    want = (codes - zero[:, g_idx]).float() * scale[:, g_idx]
    assert torch.equal(got, want)


def test_int4_moe_equals_moe_forward_on_the_dequantized_experts() -> None:
    num_experts, hidden, inter, group = 4, 32, 16, 8
    w13 = quantize_int4(torch.randn(num_experts, 2 * inter, hidden), group)
    w2 = quantize_int4(torch.randn(num_experts, hidden, inter), group)
    x = torch.randn(6, hidden)
    topk_ids = torch.tensor([[0, 2], [2, 3], [0, -1], [3, 0], [2, 2], [0, 3]])
    topk_weights = torch.rand(6, 2)
    got = moe_forward_int4(x, (*w13, None), (*w2, None), group, topk_weights, topk_ids)
    dense13 = dequantize_int4(*w13, None, group, torch.float32)
    dense2 = dequantize_int4(*w2, None, group, torch.float32)
    assert torch.equal(got, moe_forward(x, dense13, dense2, topk_weights, topk_ids))
