"""Fused INT4 MoE (`fused_moe_int4`) on an NVIDIA GPU at the Qwen3-30B-A3B expert shape.

E=128, H=2048, I=768, top-8, group 128 (symmetric, and zero points at one size), bfloat16
activations, 1, 16 and 512 tokens, against `moe_ref.moe_forward_int4` (the same weights
dequantized, bf16 expert outputs): relative error below 1e-2 (bf16 rounding of the expert
outputs and summation order). Also: a call captured in a CUDA graph and replayed on new inputs
and routing equals the eager call bit for bit, and the non-finite flags.

Run on the GPU machine: `pytest tests/kernels/test_moe_int4_triton_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.int4_ref import quantize_int4  # noqa: E402
from sits.kernels.moe_int4_triton import fused_moe_int4  # noqa: E402
from sits.kernels.moe_ref import moe_forward_int4, select_experts  # noqa: E402

DTYPE = torch.bfloat16
E, H, I, TOP_K, GROUP = 128, 2048, 768, 8, 128


@pytest.fixture(scope="module")
def experts():
    """(w13, w2) INT4 expert tuples (symmetric), scaled so activations stay O(1)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    w13 = torch.randn(E, 2 * I, H, generator=gen, device="cuda") * H**-0.5
    w2 = torch.randn(E, H, I, generator=gen, device="cuda") * I**-0.5
    return (*quantize_int4(w13, GROUP), None), (*quantize_int4(w2, GROUP), None)


def with_zero_points(experts_tuple, seed: int):
    """The same packed codes and scales with random zero points in [6, 10]."""
    packed, scale, _ = experts_tuple
    gen = torch.Generator(device="cuda").manual_seed(seed)
    zero = torch.randint(6, 11, scale.shape, generator=gen, device="cuda", dtype=torch.uint8)
    return packed, scale, zero


def routed_inputs(num_tokens: int, seed: int):
    """(hidden [T, H] bf16, topk_weights, topk_ids) with softmax top-k routing."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen, device="cuda", dtype=DTYPE)
    logits = torch.randn(num_tokens, E, generator=gen, device="cuda")
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    return x, weights, ids


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("num_tokens", [1, 16, 512])
def test_matches_reference(experts, num_tokens: int) -> None:
    w13, w2 = experts
    x, topk_weights, topk_ids = routed_inputs(num_tokens, seed=num_tokens)
    out = fused_moe_int4(x, w13, w2, GROUP, topk_weights, topk_ids)
    reference = moe_forward_int4(x, w13, w2, GROUP, topk_weights, topk_ids)
    assert out.dtype == DTYPE and out.shape == x.shape and torch.isfinite(out).all()
    assert relative_error(out, reference) < 1e-2


def test_zero_points_match_reference(experts) -> None:
    w13, w2 = (with_zero_points(e, seed) for e, seed in zip(experts, (1, 2), strict=True))
    x, topk_weights, topk_ids = routed_inputs(64, seed=3)
    topk_ids[5] = -1  # a padding token
    out = fused_moe_int4(x, w13, w2, GROUP, topk_weights, topk_ids)
    reference = moe_forward_int4(x, w13, w2, GROUP, topk_weights, topk_ids)
    assert relative_error(out, reference) < 1e-2
    assert torch.equal(out[5], torch.zeros_like(out[5]))


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_cuda_graph_replay_matches_eager(experts, num_tokens: int) -> None:
    w13, w2 = experts
    x, topk_weights, topk_ids = routed_inputs(num_tokens, seed=4)
    flags = torch.zeros(E, dtype=torch.bool, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fused_moe_int4(x, w13, w2, GROUP, topk_weights, topk_ids, None, flags)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = fused_moe_int4(x, w13, w2, GROUP, topk_weights, topk_ids, None, flags)
    for seed in (5, 6):
        new_x, new_weights, new_ids = routed_inputs(num_tokens, seed=seed)
        x.copy_(new_x)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        eager = fused_moe_int4(new_x, w13, w2, GROUP, new_weights, new_ids)
        assert torch.equal(graph_out, eager)
        reference = moe_forward_int4(new_x, w13, w2, GROUP, new_weights, new_ids)
        assert relative_error(graph_out, reference) < 1e-2
    assert not flags.any()


def test_nonfinite_flags_on_gpu(experts) -> None:
    (w13, (packed, scale, zero)) = experts
    x, topk_weights, topk_ids = routed_inputs(32, seed=7)
    bad = int(topk_ids[0, 0])
    poisoned_row = int((topk_ids != bad).all(dim=1).nonzero()[0])  # a row not routed to bad
    x[poisoned_row, 0] = float("nan")
    scale = scale.clone()
    scale[bad, 7, 0] = float("inf")  # output column 7 of expert `bad` overflows
    w2 = (packed, scale, zero)
    flags = torch.zeros(E, dtype=torch.bool, device="cuda")
    ref_flags = torch.zeros_like(flags)
    fused_moe_int4(x, w13, w2, GROUP, topk_weights, topk_ids, None, flags)
    moe_forward_int4(x, w13, w2, GROUP, topk_weights, topk_ids, ref_flags)
    assert torch.equal(flags, ref_flags) and flags[bad]
