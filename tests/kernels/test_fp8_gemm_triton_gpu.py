"""The Triton FP8 GEMM on an NVIDIA GPU (FP8 tensor cores, sm_89+) at real shapes.

Projections of Llama-3.1-8B (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down
4096 x 14336) and Qwen3-30B-A3B's attention (qkv 5120 x 2048, o 2048 x 4096), with 128 x 128
block scales (the Qwen3-*-FP8 format) and 1, 16, 256 and 4,096 tokens in bfloat16, against
the reference of the mode the kernel runs at that size (`fp8_linear_weight_only_reference` for
"w8a16", `fp8_linear_w8a8_reference` with activations quantized the same way for "w8a8"):
both are float32 sums of the same exact products, so after the cast to bfloat16 they differ by one
bf16 ulp where the summation order moves a rounding. In "w8a8" mode Hopper's FP8 tensor cores
add the products in fixed point with about 14 bits kept per product (DeepSeek-V3 report, sec.
3.5.2), so the tolerance there is a relative error norm of 5e-3 and 2 % of the output's largest
magnitude per element: far below the 3.7 % that FP8 activations cost against bf16, so a wrong
scale or tile still fails. Also: the activation quantization matches
torch's bit for bit, per-channel and per-tensor scales, `fp8_linear` dispatches to the kernel on
CUDA, the W8A8 result stays within FP8 activation rounding of the weight-only reference, and
the two kernels are captured in a CUDA graph and replayed over new inputs.

Run on the GPU machine: `pytest tests/kernels/test_fp8_gemm_triton_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs FP8 tensor cores (sm_89 or newer)", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.fp8_gemm_triton import (  # noqa: E402
    Fp8GemmConfig,
    fp8_gemm_mode,
    triton_fp8_linear,
    triton_quant_fp8_group,
)
from sits.kernels.fp8_ref import (  # noqa: E402
    dequantize_fp8,
    fp8_linear,
    fp8_linear_w8a8_reference,
    fp8_linear_weight_only_reference,
    quantize_fp8_block,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
)

DTYPE = torch.bfloat16
BLOCK = (128, 128)
SHAPES = {  # name: (N, K)
    "llama8b_qkv": (6144, 4096),
    "llama8b_o": (4096, 4096),
    "llama8b_gate_up": (28672, 4096),
    "llama8b_down": (4096, 14336),
    "qwen3_30b_qkv": (5120, 2048),
    "qwen3_30b_o": (2048, 4096),
}
MAX_MISMATCH_FRACTION = 2e-2  # elements one bf16 ulp apart (summation order)
W8A8_MAX_RELATIVE_ERROR = 5e-3  # Hopper FP8 tensor-core accumulation (module docstring)


def randn(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda") * std


def block_weight(num_cols: int, num_inner: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_block(randn(num_cols, num_inner, seed=seed, std=0.02), BLOCK)


def reference(x, weight, scale, bias, block, mode: str | None = None) -> torch.Tensor:
    """The reference of `mode` (default: the one the kernel picks for x's rows)."""
    mode = mode or fp8_gemm_mode(x.shape[0])
    if mode == "w8a16":
        return fp8_linear_weight_only_reference(x, weight, scale, bias, block)
    group = 128 if block is not None else x.shape[-1]  # per token for per-row scales
    return fp8_linear_w8a8_reference(x, weight, scale, bias, block, group_size=group)


def assert_bf16_close(out: torch.Tensor, expected: torch.Tensor, mode: str = "w8a16") -> None:
    """Weight-only: one bf16 ulp on few elements. W8A8: Hopper's FP8 accumulation (above)."""
    scale = expected.float().abs().max().item()
    if mode == "w8a8":
        error = (out.float() - expected.float()).norm() / expected.float().norm()
        assert error.item() <= W8A8_MAX_RELATIVE_ERROR
        torch.testing.assert_close(out, expected, rtol=0, atol=2e-2 * scale)
        return
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=1e-3 * scale)  # 1 bf16 ulp
    assert (out != expected).float().mean().item() <= MAX_MISMATCH_FRACTION


@pytest.mark.parametrize("num_rows", [1, 16, 256, 4096])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemm_matches_reference_at_real_shapes(shape: str, num_rows: int) -> None:
    num_cols, num_inner = SHAPES[shape]
    weight, scale = block_weight(num_cols, num_inner, seed=num_cols)
    x = randn(num_rows, num_inner, seed=num_rows).to(DTYPE)
    out = triton_fp8_linear(x, weight, scale, None, BLOCK)
    assert out.shape == (num_rows, num_cols) and out.dtype == DTYPE
    mode = fp8_gemm_mode(num_rows)
    assert_bf16_close(out, reference(x, weight, scale, None, BLOCK), mode)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("num_rows", [1, 64, 300])
def test_both_modes_at_every_size_with_per_row_scales(num_rows: int, mode: str) -> None:
    weight, scale = quantize_fp8_per_row(randn(4096, 14336, seed=12, std=0.02))
    x = randn(num_rows, 14336, seed=13).to(DTYPE)
    out = triton_fp8_linear(x, weight, scale, None, None, mode=mode)
    assert_bf16_close(out, reference(x, weight, scale, None, None, mode), mode)


@pytest.mark.parametrize("num_rows", [16, 4096])
def test_activation_quantization_matches_torch(num_rows: int) -> None:
    x = randn(num_rows, 4096 + 72, seed=1, std=3).to(DTYPE)  # a partial last group
    q, scale = triton_quant_fp8_group(x)
    expected_q, expected_scale = quantize_fp8_per_token_group(x)
    assert torch.equal(scale, expected_scale)
    mismatch = (q.view(torch.uint8) != expected_q.view(torch.uint8)).float().mean().item()
    assert mismatch <= 1e-5  # round to nearest even and saturation as torch's cast


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_per_channel_and_per_tensor_scales(scheme: str) -> None:
    w = randn(6144, 4096, seed=2, std=0.02)
    weight, scale = quantize_fp8_per_row(w) if scheme == "channel" else quantize_fp8_per_tensor(w)
    x = randn(256, 4096, seed=3).to(DTYPE)
    bias = randn(6144, seed=4).to(DTYPE)
    out = triton_fp8_linear(x, weight, scale, bias, None)
    assert_bf16_close(out, reference(x, weight, scale, bias, None), fp8_gemm_mode(256))


@pytest.mark.parametrize(
    "config",
    [Fp8GemmConfig(16, 128, 128, group_m=1, num_stages=5), Fp8GemmConfig(64, 64, 64, num_stages=4),
     Fp8GemmConfig(128, 256, 128, num_warps=8, num_stages=3)],
)  # fmt: skip
def test_other_launch_configs_compile_and_agree(config: Fp8GemmConfig) -> None:
    weight, scale = block_weight(5120 + 64, 2048 + 64, seed=5)  # ragged: half a scale block
    x = randn(300, 2048 + 64, seed=6).to(DTYPE)
    for mode in ("w8a16", "w8a8"):
        out = triton_fp8_linear(x, weight, scale, None, BLOCK, config=config, mode=mode)
        assert_bf16_close(out, reference(x, weight, scale, None, BLOCK, mode), mode)


def test_fp8_linear_dispatches_to_the_kernel_and_stays_near_weight_only() -> None:
    weight, scale = block_weight(4096, 4096, seed=7)
    x = randn(33, 4096, seed=8).to(DTYPE)
    out = fp8_linear(x, weight, scale, None, BLOCK)
    assert torch.equal(out, triton_fp8_linear(x, weight, scale, None, BLOCK))
    weight_only = x.float() @ dequantize_fp8(weight, scale, BLOCK, torch.float32).T
    error = (out.float() - weight_only).norm() / weight_only.norm()
    assert error.item() < 0.05  # e4m3 activation rounding (<= 2^-4 relative per element)
    # decode-sized batches keep the activations: the weight-only result up to summation order
    decode = fp8_linear(x[:4], weight, scale, None, BLOCK)
    assert_bf16_close(decode, reference(x[:4], weight, scale, None, BLOCK, "w8a16"))
    # CPU tensors take the reference path
    cpu = fp8_linear(x.cpu(), weight.cpu(), scale.cpu(), None, BLOCK)
    expected = torch.nn.functional.linear(
        x.cpu(), dequantize_fp8(weight.cpu(), scale.cpu(), BLOCK, DTYPE)
    )
    assert torch.equal(cpu, expected)


def test_kernels_in_a_cuda_graph_replay_new_inputs() -> None:
    weight, scale = block_weight(6144, 4096, seed=9)
    x = randn(16, 4096, seed=10).to(DTYPE)
    triton_fp8_linear(x, weight, scale, None, BLOCK)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, weight, scale, None, BLOCK)
    x.copy_(randn(16, 4096, seed=11).to(DTYPE))
    graph.replay()
    torch.cuda.synchronize()
    assert_bf16_close(out, reference(x, weight, scale, None, BLOCK))
