"""The Triton SiLU-and-mul kernel on an NVIDIA GPU in bfloat16 at real shapes.

Llama-3.1-8B's MLP (intermediate 14,336) and Qwen2/Qwen3 dense widths, 1 to 8,192 tokens,
against `silu_and_mul_reference`: the kernel rounds where torch rounds, so only exp's last
float32 bit may move a rounding (rarely, by 1 bf16 ulp). Also: `silu_and_mul` dispatches to
the kernel on CUDA, and the kernel is captured in a CUDA graph and replayed over new inputs.

Run on the GPU machine: `pytest tests/kernels -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.activation_triton import triton_silu_and_mul  # noqa: E402
from sits.layers.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402

DTYPE = torch.bfloat16
MAX_MISMATCH_FRACTION = 1e-3


def randn(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).mul(3).to(DTYPE)


def assert_bf16_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)  # 2 bf16 ulp
    assert (out != expected).float().mean().item() <= MAX_MISMATCH_FRACTION


@pytest.mark.parametrize(("num_tokens", "d"), [(1, 14336), (256, 14336), (8192, 14336),
                                               (10, 18944), (33, 3072)])  # fmt: skip
def test_silu_and_mul_matches_reference_at_real_shapes(num_tokens: int, d: int) -> None:
    x = randn(num_tokens, 2 * d, seed=num_tokens)
    assert_bf16_close(triton_silu_and_mul(x), silu_and_mul_reference(x))


def test_layer_dispatches_to_the_kernel() -> None:
    x = randn(7, 2 * 4096, seed=3)
    out = silu_and_mul(x)
    assert_bf16_close(out, silu_and_mul_reference(x))
    assert out.is_contiguous()
    # the reference computes on CPU tensors; the kernel is not called for them
    assert torch.equal(silu_and_mul(x.cpu()), silu_and_mul_reference(x.cpu()))


def test_kernel_in_a_cuda_graph_replays_new_inputs() -> None:
    x = randn(64, 2 * 14336, seed=4)
    triton_silu_and_mul(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_silu_and_mul(x)
    x.copy_(randn(64, 2 * 14336, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert_bf16_close(out, silu_and_mul_reference(x))
