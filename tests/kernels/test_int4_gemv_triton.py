"""The INT4 weight-only GEMV kernels of the fused MoE vs `moe_ref.moe_forward_int4`, in
Triton's CPU interpreter (or compiled on a GPU).

Codes, zero points and scales are exact in float32, so the kernels differ from the references
by float32 summation order and the factored zero point (sum(u * x) - z * sum(x), one rounding
each) only: relative 1e-5. Symmetric (zero None) and asymmetric (uint8 zero points, AWQ/GPTQ)
weights; group sizes 32 and 64; K spanning several steps.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.int4_gemv_triton import (  # noqa: E402
    Int4GemvConfig,
    fused_moe_int4_gemv,
    int4_gemv_fits,
)
from sits.kernels.int4_ref import pack_int4  # noqa: E402
from sits.kernels.moe_ref import moe_forward_int4, select_experts  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
SMALL = Int4GemvConfig(block_n=8, groups=2, num_warps=2, num_stages=1)
TIGHT = 1e-5


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def int4_weight(*shape: int, group_size: int, zeros: bool, seed: int):
    """(packed, scale, zero or None) of random codes for a weight [..., N, K]."""
    gen = torch.Generator().manual_seed(seed)
    *lead, num_cols, num_inner = shape
    codes = torch.randint(0, 16, shape, generator=gen)
    groups = (*lead, num_cols, num_inner // group_size)
    scale = torch.rand(groups, generator=gen) * 0.1 + 0.01
    zero = torch.randint(0, 16, groups, generator=gen).to(torch.uint8) if zeros else None
    parts = (pack_int4(codes), scale, zero)
    return tuple(t.to(DEVICE) if t is not None else None for t in parts)


def test_gemv_refuses_layouts_it_does_not_compute() -> None:
    assert not int4_gemv_fits(32, 96, SMALL)  # 3 groups: not whole steps of 2
    assert not int4_gemv_fits(24, 96, Int4GemvConfig(groups=1))  # G / 8 = 3 words
    assert int4_gemv_fits(32, 128, SMALL)
    x, w13, w2, weights, ids = make_experts(1, 4, 2, 96, 64, 32, False, seed=0)
    with pytest.raises(ValueError, match="does not fit the GEMVs"):
        fused_moe_int4_gemv(x, w13, w2, 32, weights, ids, None, SMALL, SMALL)
    with pytest.raises(ValueError, match="scale must be float32"):
        bad = (w2[0], w2[1][..., :1], None)
        fused_moe_int4_gemv(x, w13, bad, 32, weights, ids, None, SMALL, SMALL)
    with pytest.raises(ValueError, match="power of two"):
        Int4GemvConfig(groups=3)


def make_experts(num_tokens, num_experts, top_k, hidden, inter, group_size, zeros, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    w13 = int4_weight(num_experts, 2 * inter, hidden, group_size=group_size, zeros=zeros, seed=seed)
    w2 = int4_weight(num_experts, hidden, inter, group_size=group_size, zeros=zeros, seed=seed + 1)
    return x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("zeros", [False, True], ids=["symmetric", "zero_points"])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter", "group_size"),
    [(1, 8, 2, 128, 64, 32), (3, 6, 3, 128, 128, 64)],
)
def test_moe_gemv_matches_reference(
    num_tokens, num_experts, top_k, hidden, inter, group_size, zeros
) -> None:
    x, w13, w2, weights, ids = make_experts(
        num_tokens, num_experts, top_k, hidden, inter, group_size, zeros, seed=num_tokens
    )
    flags = torch.zeros(num_experts, dtype=torch.bool, device=DEVICE)
    out = fused_moe_int4_gemv(x, w13, w2, group_size, weights, ids, flags, SMALL, SMALL)
    expected = moe_forward_int4(x, w13, w2, group_size, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert relative_error(out, expected) < TIGHT
    assert not flags.any()


def test_moe_gemv_padding_tokens_get_zero_rows() -> None:
    x, w13, w2, weights, ids = make_experts(3, 8, 2, 128, 64, 32, True, seed=5)
    ids[1], weights[1] = -1, 0.0
    out = fused_moe_int4_gemv(x, w13, w2, 32, weights, ids, None, SMALL, SMALL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = torch.tensor([0, 2], device=DEVICE)
    alone = fused_moe_int4_gemv(x[keep], w13, w2, 32, weights[keep], ids[keep], None, SMALL, SMALL)
    assert torch.equal(out[keep], alone)


def test_experts_int4_runs_the_gemv_up_to_its_token_bound() -> None:
    from sits.kernels.int4_gemv_triton import (
        MOE_DOWN_CONFIG,
        MOE_INT4_GEMV_MAX_TOKENS,
        MOE_UP_CONFIG,
    )
    from sits.kernels.moe_int4_triton import fused_moe_int4
    from sits.kernels.moe_triton import TritonMoe

    num = MOE_INT4_GEMV_MAX_TOKENS  # H 512 and I 256: whole steps of the shipped configs
    x, w13, w2, weights, ids = make_experts(num + 1, 8, 2, 512, 256, 128, True, seed=2)
    small = TritonMoe().experts_int4(x[:num], w13, w2, 128, weights[:num], ids[:num])
    gemv = fused_moe_int4_gemv(
        x[:num], w13, w2, 128, weights[:num], ids[:num], None, MOE_UP_CONFIG, MOE_DOWN_CONFIG
    )
    assert torch.equal(small, gemv)
    large = TritonMoe().experts_int4(x, w13, w2, 128, weights, ids)
    grouped = fused_moe_int4(x, w13, w2, 128, weights, ids)
    assert relative_error(large, grouped) < TIGHT  # the grouped kernel: tf32 dots on a GPU
    assert relative_error(large, moe_forward_int4(x, w13, w2, 128, weights, ids)) < 1e-2
