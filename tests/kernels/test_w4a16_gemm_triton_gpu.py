"""The Triton w4a16 GEMM on an NVIDIA GPU at real shapes.

Projections of Llama-3.1-8B (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down
4096 x 14336) and Qwen3-30B-A3B's attention (qkv 5120 x 2048, o 2048 x 4096), symmetric INT4
with group 128 (the online `--quantization int4` layout), at 1, 16, 256 and 4,096 tokens in
bfloat16, against `int4_ref.w4a16_linear` (the same weights dequantized, cuBLAS): both are
float32 sums of the same bf16 products, so after the cast to bfloat16 they differ by one bf16
ulp where the summation order moves a rounding. Also: zero points with group 32, a bias, other
launch shapes (split-K included), `Int4FusedLinear` dispatching to the kernel, and the kernels
captured in a CUDA graph and replayed over new inputs.

Run on the GPU machine: `pytest tests/kernels/test_w4a16_gemm_triton_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.int4_ref import pack_int4, quantize_int4, w4a16_linear  # noqa: E402
from sits.kernels.w4a16_gemm_triton import W4a16Config, triton_w4a16_linear  # noqa: E402
from sits.layers.quant.config import QuantConfig  # noqa: E402
from sits.layers.quant.int4_linear import Int4FusedLinear  # noqa: E402

DTYPE = torch.bfloat16
SHAPES = {  # name: (N, K)
    "llama8b_qkv": (6144, 4096),
    "llama8b_o": (4096, 4096),
    "llama8b_gate_up": (28672, 4096),
    "llama8b_down": (4096, 14336),
    "qwen3_30b_qkv": (5120, 2048),
    "qwen3_30b_o": (2048, 4096),
}
MAX_MISMATCH_FRACTION = 2e-2  # elements one bf16 ulp apart (summation order)


def randn(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda") * std


def zero_point_weight(num_cols: int, num_inner: int, group: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 16, (num_cols, num_inner), generator=gen, device="cuda")
    scale = torch.rand(num_cols, num_inner // group, generator=gen, device="cuda") * 4e-3
    zero = torch.randint(
        0, 16, (num_cols, num_inner // group), generator=gen, device="cuda", dtype=torch.uint8
    )
    return pack_int4(codes), scale, zero


def assert_bf16_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=1e-3 * scale)  # 1 bf16 ulp
    assert (out != expected).float().mean().item() <= MAX_MISMATCH_FRACTION


@pytest.mark.parametrize("num_rows", [1, 16, 256, 4096])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemm_matches_reference_at_real_shapes(shape: str, num_rows: int) -> None:
    num_cols, num_inner = SHAPES[shape]
    packed, scale = quantize_int4(randn(num_cols, num_inner, seed=num_cols, std=0.02), 128)
    x = randn(num_rows, num_inner, seed=num_rows).to(DTYPE)
    out = triton_w4a16_linear(x, packed, scale, None, 128)
    assert out.shape == (num_rows, num_cols) and out.dtype == DTYPE
    assert_bf16_close(out, w4a16_linear(x, packed, scale, None, 128))


@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_zero_points_group_32_and_bias(num_rows: int) -> None:
    packed, scale, zero = zero_point_weight(5120 + 40, 2048 + 96, 32, seed=1)  # ragged tiles
    x = randn(num_rows, 2048 + 96, seed=2).to(DTYPE)
    bias = randn(5120 + 40, seed=3).to(DTYPE)
    out = triton_w4a16_linear(x, packed, scale, zero, 32, bias)
    assert_bf16_close(out, w4a16_linear(x, packed, scale, zero, 32, bias))


@pytest.mark.parametrize(
    "config",
    [W4a16Config(16, 32, 256, split_k=4), W4a16Config(16, 128, 128, split_k=16, num_stages=2),
     W4a16Config(64, 64, 128, num_stages=3), W4a16Config(64, 128, 128, num_stages=3),
     W4a16Config(64, 64, dequantize_first=True)],
)  # fmt: skip
@pytest.mark.parametrize("num_rows", [3, 200])
def test_other_launch_configs_compile_and_agree(config: W4a16Config, num_rows: int) -> None:
    packed, scale = quantize_int4(randn(4096, 4096, seed=4, std=0.02), 128)
    x = randn(num_rows, 4096, seed=5).to(DTYPE)
    out = triton_w4a16_linear(x, packed, scale, None, 128, None, config)
    assert_bf16_close(out, w4a16_linear(x, packed, scale, None, 128))


def test_int4_linear_dispatches_to_the_kernel() -> None:
    quant = QuantConfig("int4", "group", group_size=128, online=True)
    layer = Int4FusedLinear(4096, [6144], False, quant).cuda()
    packed, scale = quantize_int4(randn(6144, 4096, seed=6, std=0.02), 128)
    layer.weight.data.copy_(packed)
    layer.weight_scale.data.copy_(scale)
    x = randn(33, 4096, seed=7).to(DTYPE)
    assert torch.equal(layer(x), triton_w4a16_linear(x, packed, scale, None, 128))


@pytest.mark.parametrize("num_rows", [1, 64])
def test_cuda_graph_replay_matches_eager(num_rows: int) -> None:
    packed, scale = quantize_int4(randn(4096, 4096, seed=8, std=0.02), 128)
    x = randn(num_rows, 4096, seed=9).to(DTYPE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        triton_w4a16_linear(x, packed, scale, None, 128)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = triton_w4a16_linear(x, packed, scale, None, 128)
    for seed in (10, 11):
        x.copy_(randn(num_rows, 4096, seed=seed).to(DTYPE))
        graph.replay()
        assert torch.equal(graph_out, triton_w4a16_linear(x, packed, scale, None, 128))
