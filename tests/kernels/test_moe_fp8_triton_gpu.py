"""`TritonMoe.experts_fp8` (fused FP8 MoE) on an NVIDIA GPU at real shapes, in bfloat16.

Shape: Qwen3-30B-A3B (E=128, H=2048, I=768, top-8) with 128 x 128 block scales (the
Qwen3-*-FP8 checkpoints) and per-row scales, at 1, 16 and 512 tokens with the tuned configs
(or the fp8 default) and the default explicitly; a call captured in a CUDA graph and replayed
on new inputs and routing; the non-finite flags.

Up to `MOE_GEMV_MAX_TOKENS` tokens the call runs the weight-only GEMV (`fp8_gemv_triton`):
it is compared with the weight-only `moe_forward_fp8` within 1e-2 (the reference rounds the
dequantized weights to bf16, the GEMV scales in float32: ~5e-3 measured on the H200).
Past it, the W8A8 kernels:
Tolerances: vs `moe_forward_fp8_w8a8_reference` (same activation quantization) 1e-2 relative:
bf16 roundings of the intermediate that the summation order flips move an fp8 value by one
step now and then; vs the weight-only `moe_forward_fp8` 6e-2 (FP8 rounding of hidden and
the intermediate, ~4% measured on the CPU).

Run on the GPU machine: `pytest tests/kernels/test_moe_fp8_triton_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.fp8_gemv_triton import MOE_GEMV_MAX_TOKENS  # noqa: E402
from sits.kernels.fp8_ref import (  # noqa: E402
    FP8_DTYPE,
    quantize_fp8_block,
    quantize_fp8_per_row,
)
from sits.kernels.moe_config import default_config  # noqa: E402
from sits.kernels.moe_fp8_triton import moe_forward_fp8_w8a8_reference  # noqa: E402
from sits.kernels.moe_ref import moe_forward_fp8, select_experts  # noqa: E402
from sits.kernels.moe_triton import TritonMoe  # noqa: E402

DTYPE = torch.bfloat16
NUM_EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B
BLOCK = (128, 128)


@pytest.fixture(scope="module", params=["block", "channel"])
def experts(request):
    """(block, w13, w13_scale, w2, w2_scale) FP8 on the GPU, scaled for O(1) activations."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda")
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen, device="cuda")
    w13.mul_(HIDDEN**-0.5)
    w2.mul_(INTER**-0.5)
    if request.param == "block":
        return (BLOCK, *quantize_fp8_block(w13, BLOCK), *quantize_fp8_block(w2, BLOCK))
    return (None, *quantize_fp8_per_row(w13), *quantize_fp8_per_row(w2))


def routed_inputs(num_tokens: int, seed: int):
    """(hidden [T, H] bf16, topk_weights, topk_ids) with softmax top-k routing."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen, device="cuda", dtype=DTYPE)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen, device="cuda")
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    return x, weights, ids


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def reference_of(num_tokens: int, *args) -> tuple[torch.Tensor, float]:
    """(what the call at num_tokens computes, in plain PyTorch; its tolerance): the
    weight-only reference for the GEMV sizes, the activation-quantized one past them."""
    if num_tokens <= MOE_GEMV_MAX_TOKENS:
        return moe_forward_fp8(*args), 1e-2
    return moe_forward_fp8_w8a8_reference(*args), 1e-2


@pytest.mark.parametrize("num_tokens", [1, 16, 512])
@pytest.mark.parametrize("config_kind", ["tuned", "default"])
def test_fp8_matches_references(experts, num_tokens: int, config_kind: str) -> None:
    block, w13, s13, w2, s2 = experts
    x, topk_weights, topk_ids = routed_inputs(num_tokens, seed=num_tokens)
    backend = TritonMoe()
    if config_kind == "default":
        backend = TritonMoe(default_config(num_tokens, TOP_K, NUM_EXPERTS, FP8_DTYPE))
    out = backend.experts_fp8(x, w13, s13, w2, s2, block, topk_weights, topk_ids)
    assert out.dtype == DTYPE and out.shape == x.shape and torch.isfinite(out).all()
    w8a8 = moe_forward_fp8_w8a8_reference(x, w13, s13, w2, s2, block, topk_weights, topk_ids)
    weight_only = moe_forward_fp8(x, w13, s13, w2, s2, block, topk_weights, topk_ids)
    if num_tokens <= MOE_GEMV_MAX_TOKENS:  # the weight-only GEMV
        assert relative_error(out, weight_only) < 1e-2
        return
    # Hopper's FP8 tensor cores accumulate in fixed point, ~14 bits per product (DeepSeek-V3
    # report, sec. 3.5.2): two GEMMs of K = 2,048 and 768 reach ~1.3e-2 at 512 tokens
    assert relative_error(out, w8a8) < 2e-2
    assert relative_error(out, weight_only) < 6e-2


@pytest.mark.parametrize("num_tokens", [1, 4, 16, 256])
def test_cuda_graph_replay_matches_eager(experts, num_tokens: int) -> None:
    block, w13, s13, w2, s2 = experts
    backend = TritonMoe()
    x, topk_weights, topk_ids = routed_inputs(num_tokens, seed=1)
    flags = torch.zeros(NUM_EXPERTS, dtype=torch.bool, device="cuda")
    args = (w13, s13, w2, s2, block)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        backend.experts_fp8(x, *args, topk_weights, topk_ids, flags)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.experts_fp8(x, *args, topk_weights, topk_ids, flags)
    for seed in (2, 3):
        new_x, new_weights, new_ids = routed_inputs(num_tokens, seed=seed)
        if seed == 3 and num_tokens > 1:
            new_ids[-1], new_weights[-1] = -1, 0.0  # a padding token, as decode graphs have
        x.copy_(new_x)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        eager = backend.experts_fp8(new_x, *args, new_weights, new_ids)
        assert torch.equal(graph_out, eager)
        reference, tolerance = reference_of(num_tokens, new_x, *args, new_weights, new_ids)
        assert relative_error(graph_out, reference) < tolerance
    assert not flags.any()


def test_nonfinite_flags_on_gpu(experts) -> None:
    block, w13, s13, w2, s2 = experts
    x, topk_weights, topk_ids = routed_inputs(32, seed=4)
    bad = int(topk_ids[0, 0])
    poisoned_row = int((topk_ids != bad).all(dim=1).nonzero()[0])  # a row not routed to bad
    x[poisoned_row, 0] = float("nan")
    s2 = s2.clone()
    s2[bad, 0] = float("inf")  # the first output rows of expert `bad` overflow
    flags = torch.zeros(NUM_EXPERTS, dtype=torch.bool, device="cuda")
    ref_flags = torch.zeros_like(flags)
    out = TritonMoe().experts_fp8(x, w13, s13, w2, s2, block, topk_weights, topk_ids, flags)
    expected = moe_forward_fp8(x, w13, s13, w2, s2, block, topk_weights, topk_ids, ref_flags)
    assert torch.equal(flags, ref_flags)
    assert flags.nonzero().flatten().tolist() == [bad]
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))
