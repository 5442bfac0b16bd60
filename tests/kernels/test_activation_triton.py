"""The Triton SiLU-and-mul kernel vs its PyTorch reference (`silu_and_mul_reference`), in the
CPU interpreter (or compiled on a GPU): float32 and float16, strided rows, widths that are not
a multiple of the kernel's block, zero rows; and the errors it raises.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.activation_triton import BLOCK, triton_silu_and_mul  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402
from sits.layers.activation import silu_and_mul_reference  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 4).to(DEVICE, dtype)  # both tails of SiLU


@pytest.mark.parametrize(
    ("dtype", "num_tokens", "d"),
    [
        (torch.float32, 3, 40),  # d not a power of two: masked lanes
        (torch.float16, 5, 96),
        (torch.float16, 2, BLOCK + 24),  # two column blocks, the second partial
    ],
)
def test_silu_and_mul_matches_reference(dtype: torch.dtype, num_tokens: int, d: int) -> None:
    x = randn(num_tokens, 2 * d + 8, dtype=dtype, seed=d)[:, 4 : 4 + 2 * d]
    assert not x.is_contiguous()  # strided rows, as a view of a wider tensor
    before = x.clone()
    out = triton_silu_and_mul(x)
    expected = silu_and_mul_reference(x)
    assert out.shape == (num_tokens, d) and out.dtype == dtype and out.is_contiguous()
    # exp may differ by an ulp of float32 from torch's: float32 results differ by an ulp or
    # two; in float16 that moves a rounding of the SiLU output only rarely.
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out, expected, rtol=2 * ulp, atol=2 * ulp)
    if dtype == torch.float16:
        assert (out != expected).sum().item() <= max(1, out.numel() // 100)
    assert torch.equal(x, before)


def test_silu_and_mul_of_no_tokens_is_empty() -> None:
    out = triton_silu_and_mul(torch.empty(0, 64, device=DEVICE))
    assert out.shape == (0, 32)


@pytest.mark.parametrize("shape", [(4,), (2, 3, 8), (2, 7)])
def test_silu_and_mul_rejects_what_it_cannot_compute(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="2 \\* d"):
        triton_silu_and_mul(torch.zeros(shape, device=DEVICE))


def test_silu_and_mul_rejects_a_strided_last_dimension() -> None:
    x = torch.zeros(2, 16, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        triton_silu_and_mul(x)
