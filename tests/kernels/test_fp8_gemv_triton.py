"""The FP8 weight-only GEMV kernels (dense and fused MoE) vs their PyTorch references, in
Triton's CPU interpreter (or compiled on a GPU).

Both sides add exact fp8 x float32 products in float32, so they differ by summation order
only (relative 1e-5 in float32) and by where the weight scale is applied: the reference
dequantizes the weight (w * s) and the kernel scales the activations (x * s), both exact for
power-of-two scales but not in general (one float32 rounding per product). Shapes are ragged
in M, N and K; block (32, 32) scales give tiny shapes several scale blocks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.fp8_gemv_triton import (  # noqa: E402
    MOE_GEMV_MAX_TOKENS,
    GemvConfig,
    fused_moe_fp8_gemv,
    moe_configs,
    triton_fp8_gemv,
)
from sits.kernels.fp8_ref import (  # noqa: E402
    fp8_linear_weight_only_reference,
    quantize_fp8_block,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
)
from sits.kernels.moe_fp8_triton import fused_moe_fp8  # noqa: E402
from sits.kernels.moe_ref import moe_forward_fp8, select_experts  # noqa: E402
from sits.kernels.moe_triton import TritonMoe  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
SMALL = GemvConfig(block_n=8, block_k=32, num_warps=2, num_stages=1)
BLOCK = (32, 32)
TIGHT = 1e-5


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def randn(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE)


def quantized(num_cols: int, num_inner: int, scheme: str, seed: int):
    """(q, scale, block) of a random [N, K] weight in one of the three scale layouts."""
    w = randn(num_cols, num_inner, seed=seed) * torch.linspace(0.1, 3, num_inner, device=DEVICE)
    if scheme == "block":
        return (*quantize_fp8_block(w, BLOCK), BLOCK)
    if scheme == "channel":
        return (*quantize_fp8_per_row(w), None)
    return (*quantize_fp8_per_tensor(w), None)


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
@pytest.mark.parametrize(
    ("num_rows", "num_cols", "num_inner"), [(1, 64, 96), (3, 72, 80), (4, 40, 64)]
)
def test_gemv_matches_weight_only_reference(scheme, num_rows, num_cols, num_inner) -> None:
    weight, scale, block = quantized(num_cols, num_inner, scheme, seed=num_cols)
    x = randn(num_rows, num_inner, seed=1)
    bias = randn(num_cols, seed=2)
    for b in (None, bias):
        out = triton_fp8_gemv(x, weight, scale, b, block, SMALL)
        expected = fp8_linear_weight_only_reference(x, weight, scale, b, block)
        assert out.shape == (num_rows, num_cols) and out.dtype == x.dtype
        assert relative_error(out, expected) < TIGHT


def test_gemv_rows_are_independent_and_half_precision_rounds_once() -> None:
    weight, scale, block = quantized(64, 64, "block", seed=5)
    x = randn(3, 64, seed=6)
    together = triton_fp8_gemv(x, weight, scale, None, block, SMALL)
    for row in range(3):
        alone = triton_fp8_gemv(x[row : row + 1], weight, scale, None, block, SMALL)
        assert torch.equal(alone[0], together[row])
    half = triton_fp8_gemv(x.half(), weight, scale, None, block, SMALL)
    expected = fp8_linear_weight_only_reference(x.half().float(), weight, scale, None, block)
    assert half.dtype == torch.float16
    assert torch.allclose(half.float(), expected, rtol=1e-3, atol=1e-3)


def test_gemv_refuses_tiles_across_scale_rows() -> None:
    weight, scale, block = quantized(64, 64, "block", seed=7)
    with pytest.raises(ValueError, match="BLOCK_N 64 must divide the weight's scale block 32"):
        triton_fp8_gemv(randn(1, 64, seed=0), weight, scale, None, block, GemvConfig(64, 32))
    with pytest.raises(ValueError, match="weight_scale of shape"):
        triton_fp8_gemv(randn(1, 64, seed=0), weight, scale[:1], None, block, SMALL)
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=12)


def make_experts(num_tokens, num_experts, top_k, hidden, inter, block, seed):
    """(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids): float32 activations, FP8
    experts with block scales (block) or per-row scales (None)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    quantize = quantize_fp8_per_row if block is None else lambda w: quantize_fp8_block(w, block)
    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    return tuple(t.to(DEVICE) for t in (x, q13, s13, q2, s2, weights, ids))


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter"),
    [(1, 8, 2, 64, 64), (2, 16, 4, 80, 32), (3, 6, 3, 96, 96)],
)
def test_moe_gemv_matches_reference(block, num_tokens, num_experts, top_k, hidden, inter) -> None:
    x, q13, s13, q2, s2, weights, ids = make_experts(
        num_tokens, num_experts, top_k, hidden, inter, block, seed=num_tokens
    )
    flags = torch.zeros(num_experts, dtype=torch.bool, device=DEVICE)
    out = fused_moe_fp8_gemv(x, q13, s13, q2, s2, block, weights, ids, flags, SMALL, SMALL)
    expected = moe_forward_fp8(x, q13, s13, q2, s2, block, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert relative_error(out, expected) < TIGHT
    assert not flags.any()


def test_moe_gemv_padding_tokens_and_nonfinite_experts() -> None:
    x, q13, s13, q2, s2, weights, ids = make_experts(3, 8, 2, 64, 32, BLOCK, seed=9)
    ids[2], weights[2] = -1, 0.0  # a padding token: no expert, a zero row
    ids[1, 1] = -1  # an expert another rank holds (expert parallelism): this pair adds nothing
    flags = torch.zeros(8, dtype=torch.bool, device=DEVICE)

    def run(*args, flags=None):
        return fused_moe_fp8_gemv(*args, flags, SMALL, SMALL)

    out = run(x, q13, s13, q2, s2, BLOCK, weights, ids, flags=flags)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    real = run(x[:2], q13, s13, q2, s2, BLOCK, weights[:2], ids[:2])
    assert torch.equal(out[:2], real) and not flags.any()
    alone = ids[1:2].clone()
    alone[0, 1] = ids[1, 0]  # token 1's one local expert, given weight 0 the second time
    one_weights = weights[1:2].clone()
    one_weights[0, 1] = 0.0
    torch.testing.assert_close(
        out[1:2], run(x[1:2], q13, s13, q2, s2, BLOCK, one_weights, alone), rtol=0, atol=0
    )
    bad = int(ids[0, 0])
    s2_bad = s2.clone()
    s2_bad[bad] = float("nan")  # one expert's weights are broken: its pairs' rows are NaN
    run(x, q13, s13, q2, s2_bad, BLOCK, weights, ids, flags=flags)
    assert flags.nonzero().flatten().tolist() == [bad]
    flags.zero_()
    x_bad = x.clone()
    x_bad[0, 3] = float("inf")  # a poisoned input row never counts against its experts
    ids_bad = ids.clone()
    ids_bad[1:] = -1
    run(x_bad, q13, s13, q2, s2_bad, BLOCK, weights, ids_bad, flags=flags)
    assert not flags.any()


def test_moe_gemv_refuses_tiles_across_the_gate_up_boundary() -> None:
    x, q13, s13, q2, s2, weights, ids = make_experts(1, 4, 2, 64, 48, None, seed=1)
    x2, b13, bs13, b2, bs2, *_ = make_experts(1, 4, 2, 64, 64, BLOCK, seed=1)
    with pytest.raises(ValueError, match="part boundaries"):
        fused_moe_fp8_gemv(x2, b13, bs13, b2, bs2, BLOCK, weights, ids, None, GemvConfig(64, 32))
    out = fused_moe_fp8_gemv(x, q13, s13, q2, s2, None, weights, ids, None, SMALL, SMALL)
    assert relative_error(out, moe_forward_fp8(x, q13, s13, q2, s2, None, weights, ids)) < TIGHT


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
def test_experts_fp8_runs_the_gemv_up_to_its_token_bound(block) -> None:
    """TritonMoe's default grouped configs step K by 128: whole 128-wide scale blocks."""
    backend = TritonMoe()
    num = MOE_GEMV_MAX_TOKENS
    x, q13, s13, q2, s2, weights, ids = make_experts(num + 1, 8, 2, 128, 128, block, seed=4)
    up, down = moe_configs(block, 128)
    small = backend.experts_fp8(x[:num], q13, s13, q2, s2, block, weights[:num], ids[:num])
    gemv = fused_moe_fp8_gemv(
        x[:num], q13, s13, q2, s2, block, weights[:num], ids[:num], None, up, down
    )
    assert torch.equal(small, gemv)
    large = backend.experts_fp8(x, q13, s13, q2, s2, block, weights, ids)
    config = backend.launch_config(x, q2, 2, q2.dtype)
    assert torch.equal(large, fused_moe_fp8(x, q13, s13, q2, s2, block, weights, ids, config))
    assert moe_configs((40, 128), 128) is None  # 16-row tiles would cross 40-row scale blocks
