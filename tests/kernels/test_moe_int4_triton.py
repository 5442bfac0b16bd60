"""Fused INT4 MoE (`fused_moe_int4`) vs `moe_ref.moe_forward_int4`, in the CPU interpreter in
float32 (or compiled, on a GPU machine).

The kernels' dequantized weights are bit-identical to `dequantize_int4`'s and both sides
accumulate in float32, so outputs agree within 1e-5 of their magnitude (summation order).
Small launch blocks (16-32) give several row and column tiles, K loops with a ragged last step,
padding rows and experts without tokens; symmetric and zero-point experts, groups 16 and 32,
the one-token path (`pair_blocks`), -1 ids and the non-finite flags.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.int4_ref import pack_int4, quantize_int4  # noqa: E402
from sits.kernels.moe_config import GemmConfig, MoeLaunchConfig  # noqa: E402
from sits.kernels.moe_int4_triton import fused_moe_int4  # noqa: E402
from sits.kernels.moe_ref import moe_forward_int4, select_experts  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
SMALL = MoeLaunchConfig(16, GemmConfig(16, 128, 1), GemmConfig(32, 128, 2))  # ragged H step
WIDE = MoeLaunchConfig(32, GemmConfig(32, 256, 4), GemmConfig(16, 128, 1))  # ragged I step
E, H, I, TOP_K = 6, 192, 64, 2


def int4_experts(rows: int, cols: int, group: int, zero_points: bool, gen: torch.Generator):
    """(packed [E, rows, cols / 8], scale [E, rows, cols / G], zero or None) on DEVICE."""
    if not zero_points:
        weight = torch.randn(E, rows, cols, generator=gen) * cols**-0.5
        packed, scale = quantize_int4(weight, group)
        return packed.to(DEVICE), scale.to(DEVICE), None
    codes = torch.randint(0, 16, (E, rows, cols), generator=gen)
    scale = (torch.rand(E, rows, cols // group, generator=gen) + 0.5) * 0.1 * cols**-0.5
    zero = torch.randint(4, 12, (E, rows, cols // group), generator=gen, dtype=torch.uint8)
    return pack_int4(codes).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


def make_inputs(num_tokens: int, group: int, zero_points: bool, seed: int):
    """(hidden, w13, w2, topk_weights, topk_ids) in float32, routing by softmax top-k."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen).to(DEVICE)
    w13 = int4_experts(2 * I, H, group, zero_points, gen)
    w2 = int4_experts(H, I, group, zero_points, gen)
    weights, ids = select_experts(torch.randn(num_tokens, E, generator=gen), TOP_K, True)
    return x, w13, w2, weights.to(DEVICE), ids.to(DEVICE)


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(
    ("config", "zero_points", "group"),
    [(SMALL, False, 16), (SMALL, True, 32), (WIDE, True, 16), (WIDE, False, 32)],
    ids=["small-symmetric-g16", "small-zero-g32", "wide-zero-g16", "wide-symmetric-g32"],
)
def test_matches_reference(config: MoeLaunchConfig, zero_points: bool, group: int) -> None:
    x, w13, w2, weights, ids = make_inputs(11, group, zero_points, seed=group)
    out = fused_moe_int4(x, w13, w2, group, weights, ids, config)
    assert out.shape == (11, H) and out.dtype == torch.float32
    assert_matches(out, moe_forward_int4(x, w13, w2, group, weights, ids))


@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero_point"])
def test_one_token_path(zero_points: bool) -> None:
    x, w13, w2, weights, ids = make_inputs(1, 16, zero_points, seed=3)
    out = fused_moe_int4(x, w13, w2, 16, weights, ids, SMALL)
    assert_matches(out, moe_forward_int4(x, w13, w2, 16, weights, ids))


def test_padding_ids_give_zero_rows_and_default_config() -> None:
    x, w13, w2, weights, ids = make_inputs(7, 16, True, seed=4)
    ids[2] = -1  # a padding token
    ids[5, 1] = -1  # one choice of another token dropped
    out = fused_moe_int4(x, w13, w2, 16, weights, ids)  # the default config
    assert torch.equal(out[2], torch.zeros(H, device=DEVICE))
    assert_matches(out, moe_forward_int4(x, w13, w2, 16, weights, ids))
    one = fused_moe_int4(x[:1], w13, w2, 16, weights[:1], torch.full_like(ids[:1], -1), SMALL)
    assert torch.equal(one, torch.zeros(1, H, device=DEVICE))


def test_nonfinite_flags_only_for_finite_inputs() -> None:
    x, w13, w2, weights, ids = make_inputs(9, 16, False, seed=5)
    bad = int(ids[0, 0])
    w2[1][bad, 3, 0] = float("inf")  # an infinite scale: output column 3 of expert `bad`
    poisoned = int((ids != bad).all(dim=1).nonzero()[0])  # a token not routed to `bad`
    x[poisoned, 0] = float("nan")
    flags = torch.zeros(E, dtype=torch.bool, device=DEVICE)
    ref_flags = torch.zeros_like(flags)
    out = fused_moe_int4(x, w13, w2, 16, weights, ids, SMALL, flags)
    expected = moe_forward_int4(x, w13, w2, 16, weights, ids, ref_flags)
    assert torch.equal(flags, ref_flags)
    assert flags[bad] and flags.sum() >= 1
    finite = torch.isfinite(expected).all(dim=1)
    assert_matches(out[finite], expected[finite])


def test_refuses_other_layouts() -> None:
    x, w13, w2, weights, ids = make_inputs(2, 16, True, seed=6)
    with pytest.raises(ValueError, match="group size"):
        fused_moe_int4(x, w13, w2, 12, weights, ids, SMALL)
    with pytest.raises(ValueError, match="w13 scale"):
        fused_moe_int4(x, (w13[0], w13[1][:, :, :1], w13[2]), w2, 16, weights, ids, SMALL)
    with pytest.raises(ValueError, match="w2 zero"):
        fused_moe_int4(x, w13, (*w2[:2], w2[2].float()), 16, weights, ids, SMALL)
    narrow_k = MoeLaunchConfig(16, GemmConfig(16, 64), GemmConfig(16, 128))
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe_int4(x, w13, w2, 16, weights, ids, narrow_k)


def test_the_triton_backend_runs_int4_experts_and_stays_graph_safe() -> None:
    from sits.kernels.moe_triton import TritonMoe

    x, w13, w2, weights, ids = make_inputs(5, 16, True, seed=7)
    backend = TritonMoe()
    out = backend.experts_int4(x, w13, w2, 16, weights, ids)
    assert_matches(out, moe_forward_int4(x, w13, w2, 16, weights, ids))
    assert backend.cuda_graph_safe


def test_int4_moe_block_keeps_the_triton_backend() -> None:
    from sits.kernels.moe_triton import TritonMoe
    from sits.layers.moe import MoeConfig
    from sits.layers.quant.config import QuantConfig
    from sits.layers.quant.int4_moe import Int4SparseMoeBlock
    from sits.runner.backends import graph_safe

    quant = QuantConfig(method="compressed-tensors", strategy="group", group_size=16)
    config = MoeConfig(num_experts=E, top_k=TOP_K, intermediate_size=I, renormalize=True)
    block = Int4SparseMoeBlock(H, config, quant, TritonMoe())
    assert isinstance(block.moe_backend, TritonMoe)
    triton_attention = type("TritonPagedAttention", (), {})()  # graph_safe reads its name
    assert graph_safe(torch.nn.Sequential(block), triton_attention)
