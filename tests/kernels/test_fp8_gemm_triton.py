"""The Triton W8A8 FP8 GEMM and its activation quantization vs their PyTorch references, in the
CPU interpreter (or compiled on a GPU).

Triton 3.9's interpreter runs float8_e4m3fn loads, stores and tl.dot of fp8 operands as they
are (no float16 emulation is needed); only its float32 -> fp8 cast does not round to nearest
even, so the quantization kernel rounds to the e4m3 grid itself when interpreted
(`EXACT_ROUND`) and its output is compared bit for bit with torch's. The GEMM is compared with
`fp8_linear_w8a8_reference` (activations quantized the same way: per token and 128-wide group
for block scales, per token for per-row ones) in its "w8a8" mode and with
`fp8_linear_weight_only_reference` in its "w8a16" mode: both add exact products in float32, so
they differ only by float32 summation order (relative 1e-5 of the output's magnitude; one ulp
of float16 at most after the final cast). Shapes are ragged in M, N and K.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.fp8_gemm_triton import (  # noqa: E402
    W8A16_MAX_ROWS,
    Fp8GemmConfig,
    config_file_name,
    default_config,
    fp8_gemm_mode,
    select_config,
    triton_fp8_linear,
    triton_quant_fp8_group,
)
from sits.kernels.fp8_ref import (  # noqa: E402
    fp8_linear,
    fp8_linear_w8a8_reference,
    fp8_linear_weight_only_reference,
    quantize_fp8_block,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
)
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
SMALL = Fp8GemmConfig(16, 32, 64, group_m=2, num_warps=4, num_stages=2)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 2).to(DEVICE, dtype)


def quantized_weight(num_cols: int, num_inner: int, scheme: str, seed: int):
    """(q, scale, block) of a random [N, K] weight in one of the three scale layouts."""
    w = randn(num_cols, num_inner, seed=seed) * torch.linspace(0.1, 3, num_inner, device=DEVICE)
    if scheme == "block":
        return (*quantize_fp8_block(w, (128, 128)), (128, 128))
    if scheme == "channel":
        return (*quantize_fp8_per_row(w), None)
    return (*quantize_fp8_per_tensor(w), None)


def reference(x, weight, scale, bias, block, mode: str) -> torch.Tensor:
    """The mode's reference (module docstring)."""
    if mode == "w8a16":
        return fp8_linear_weight_only_reference(x, weight, scale, bias, block)
    group = 128 if block is not None else x.shape[-1]  # per token for per-row scales
    return fp8_linear_w8a8_reference(x, weight, scale, bias, block, group_size=group)


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.float().abs().max().item()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * scale)
    else:  # one float16 ulp after the final cast
        torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_rows", "num_inner"), [(3, 128), (5, 328), (2, 40)])
def test_activation_quantization_matches_reference_bit_for_bit(
    dtype: torch.dtype, num_rows: int, num_inner: int
) -> None:
    x = randn(num_rows, num_inner, dtype=dtype, seed=num_inner) * 30  # past 448 / scale edges
    x[0, :64] = 0  # an all-zero group (scale 1) when K >= 128, else a partly zero one
    q, scale = triton_quant_fp8_group(x)
    expected_q, expected_scale = quantize_fp8_per_token_group(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (num_rows, -(-num_inner // 128))
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
@pytest.mark.parametrize(
    ("num_rows", "num_cols", "num_inner", "dtype"),
    [
        (1, 64, 128, torch.float32),  # one token (decode)
        (5, 200, 328, torch.float16),  # ragged N and K: partial tiles and scale blocks
        (37, 130, 256, torch.float32),  # ragged M over three row tiles, N just past a block
    ],
)
@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_gemm_matches_the_reference_of_its_mode(
    scheme: str, num_rows: int, num_cols: int, num_inner: int, dtype: torch.dtype, mode: str
) -> None:
    weight, scale, block = quantized_weight(num_cols, num_inner, scheme, seed=num_cols)
    x = randn(num_rows, num_inner, dtype=dtype, seed=num_rows)
    out = triton_fp8_linear(x, weight, scale, None, block, config=SMALL, mode=mode)
    expected = reference(x, weight, scale, None, block, mode)
    assert out.shape == (num_rows, num_cols) and out.dtype == dtype
    assert_matches_reference(out, expected)


@pytest.mark.parametrize(
    "config",
    [
        Fp8GemmConfig(16, 16, 128, group_m=1),
        Fp8GemmConfig(32, 64, 32, group_m=3),  # K tiles of 32 inside the 128 groups
        Fp8GemmConfig(16, 128, 128, group_m=8),  # one scale block per tile, the second partial
        Fp8GemmConfig(16, 256, 64, group_m=1),  # a column tile over two scale row blocks
    ],
)
@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_gemm_with_bias_matches_reference_for_each_tile_shape(
    config: Fp8GemmConfig, mode: str
) -> None:
    weight, scale, block = quantized_weight(200, 328, "block", seed=3)
    x = randn(19, 328, dtype=torch.float16, seed=4)
    bias = randn(200, dtype=torch.float16, seed=5)
    out = triton_fp8_linear(x, weight, scale, bias, block, config=config, mode=mode)
    assert_matches_reference(out, reference(x, weight, scale, bias, block, mode))


def test_gemm_takes_leading_dimensions_and_strided_rows() -> None:
    weight, scale, block = quantized_weight(96, 256, "channel", seed=6)
    wide = randn(2, 3, 300, seed=7)
    x = wide[..., 10:266]  # [2, 3, 256], strided rows
    out = triton_fp8_linear(x, weight, scale, None, block, config=SMALL, mode="w8a8")
    expected = reference(x.reshape(6, 256), weight, scale, None, block, "w8a8")
    assert out.shape == (2, 3, 96)
    assert_matches_reference(out.reshape(6, 96), expected)


def test_w8a8_reference_is_close_to_the_weight_only_reference() -> None:
    weight, scale, block = quantized_weight(160, 384, "block", seed=8)
    x = randn(7, 384, seed=9)
    w8a8 = fp8_linear_w8a8_reference(x, weight, scale, None, block)
    weight_only = fp8_linear(x.cpu(), weight.cpu(), scale.cpu(), None, block)
    # e4m3 rounds activations by at most 2^-4 relative; over K = 384 terms the errors average
    error = (w8a8.cpu() - weight_only).norm() / weight_only.norm()
    assert error.item() < 0.05


def test_gemm_of_no_tokens_is_empty() -> None:
    weight, scale, block = quantized_weight(64, 128, "block", seed=10)
    out = triton_fp8_linear(randn(0, 128), weight, scale, None, block, config=SMALL)
    assert out.shape == (0, 64)


def test_gemm_rejects_what_it_cannot_compute() -> None:
    weight, scale, block = quantized_weight(64, 128, "block", seed=11)
    x = randn(2, 128)
    with pytest.raises(ValueError, match="columns"):
        triton_fp8_linear(randn(2, 96), weight, scale, None, block)
    with pytest.raises(ValueError, match="block scales"):
        triton_fp8_linear(x, weight, scale[:, :0], None, block)
    with pytest.raises(ValueError, match="per-row"):
        triton_fp8_linear(x, weight, torch.ones(3, device=DEVICE), None, None)
    with pytest.raises(ValueError, match="float8"):
        triton_fp8_linear(x, weight.float(), scale, None, block)
    with pytest.raises(ValueError, match="BLOCK_K"):
        triton_fp8_linear(x, weight, scale, None, block, config=Fp8GemmConfig(16, 32, 256))
    with pytest.raises(ValueError, match="mode"):
        triton_fp8_linear(x, weight, scale, None, block, mode="w4a8")


def test_the_mode_follows_the_number_of_tokens() -> None:
    assert fp8_gemm_mode(1) == fp8_gemm_mode(W8A16_MAX_ROWS) == "w8a16"
    assert fp8_gemm_mode(W8A16_MAX_ROWS + 1) == "w8a8"
    weight, scale, block = quantized_weight(64, 128, "channel", seed=12)
    for num_rows in (2, W8A16_MAX_ROWS + 3):
        x = randn(num_rows, 128, seed=num_rows)
        out = triton_fp8_linear(x, weight, scale, None, block, config=SMALL)
        assert_matches_reference(
            out, reference(x, weight, scale, None, block, fp8_gemm_mode(num_rows))
        )


def test_config_by_shape_and_from_a_tuned_file(tmp_path) -> None:
    assert default_config(1, 4096).block_m == 16
    assert default_config(4096, 4096).block_m == 128
    name = config_file_name(6144, 4096, "NVIDIA H200")
    assert name == "fp8_gemm_N6144_K4096_NVIDIA_H200.json"
    channel = config_file_name(6144, 4096, "NVIDIA H200", "channel")
    assert channel == "fp8_gemm_channel_N6144_K4096_NVIDIA_H200.json"
    entries = {"16": {"BLOCK_M": 16, "BLOCK_N": 32}, "512": {"BLOCK_M": 64, "BLOCK_N": 256}}
    (tmp_path / name).write_text(json.dumps(entries))
    pick = lambda m: select_config(m, 6144, 4096, "NVIDIA H200", tmp_path)  # noqa: E731
    assert pick(1) == Fp8GemmConfig(16, 32)
    assert pick(17).block_n == 256 and pick(10_000).block_m == 64
    assert select_config(1, 6144, 4096, "other GPU", tmp_path) == default_config(1, 6144)
    with pytest.raises(ValueError, match="power of two"):
        Fp8GemmConfig(24, 32)
