"""The Triton w4a16 GEMM vs `int4_ref.w4a16_linear`, in the CPU interpreter (or compiled on a
GPU), and its launch-config lookup.

The kernel dequantizes with the reference's float32 arithmetic, so its weights are bit-identical
to `dequantize_int4`'s and the outputs differ only by float32 summation order: within 1e-5 of
the output's magnitude in float32, within one float16 ulp (rtol 1e-3) after the float16 cast.
Shapes are ragged in M and N, K a multiple of G but not of BLOCK_K; symmetric and zero-point
weights, groups 32 and 128, split-K 1 and 3 (the decode path), one-token inputs and a bias.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.int4_ref import (  # noqa: E402
    dequantize_int4,
    pack_int4,
    quantize_int4,
    w4a16_linear,
)
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402
from sits.kernels.w4a16_gemm_triton import (  # noqa: E402
    W4a16Config,
    config_file_name,
    default_config,
    select_config,
    triton_dequantize_int4,
    triton_w4a16_linear,
)

DEVICE = "cpu" if kernels_interpreted() else "cuda"
SMALL = W4a16Config(16, 16, 128, split_k=1, group_m=2, num_warps=4, num_stages=2)
SPLIT = W4a16Config(16, 32, 128, split_k=3, group_m=1, num_warps=4, num_stages=2)


def int4_weight(num_cols: int, num_inner: int, group: int, zero_points: bool, seed: int):
    """(packed, scale, zero or None) of a random [N, K] weight in the int4_ref layout."""
    gen = torch.Generator().manual_seed(seed)
    if not zero_points:
        packed, scale = quantize_int4(torch.randn(num_cols, num_inner, generator=gen), group)
        return packed.to(DEVICE), scale.to(DEVICE), None
    codes = torch.randint(0, 16, (num_cols, num_inner), generator=gen)
    scale = torch.rand(num_cols, num_inner // group, generator=gen) * 0.1 + 0.01
    zero = torch.randint(0, 16, (num_cols, num_inner // group), generator=gen, dtype=torch.uint8)
    return pack_int4(codes).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.float().abs().max().item()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * scale)
    else:  # one float16 ulp after the final cast
        torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3 * scale)


@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["one_split", "split_k3"])
@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero_point"])
@pytest.mark.parametrize(("group", "num_inner"), [(32, 160), (128, 384)])
def test_gemm_matches_reference(
    config: W4a16Config, zero_points: bool, group: int, num_inner: int
) -> None:
    packed, scale, zero = int4_weight(40, num_inner, group, zero_points, seed=num_inner)
    x = randn(19, num_inner, dtype=torch.float32, seed=1)  # two row tiles, the second ragged
    out = triton_w4a16_linear(x, packed, scale, zero, group, None, config)
    assert out.shape == (19, 40) and out.dtype == torch.float32
    assert_matches_reference(out, w4a16_linear(x, packed, scale, zero, group))


@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["one_split", "split_k3"])
def test_one_token_float16_with_bias(config: W4a16Config) -> None:
    packed, scale, zero = int4_weight(24, 192, 64, True, seed=2)
    x = randn(1, 192, dtype=torch.float16, seed=3)
    bias = randn(24, dtype=torch.float16, seed=4)
    out = triton_w4a16_linear(x, packed, scale, zero, 64, bias, config)
    assert out.dtype == torch.float16
    assert_matches_reference(out, w4a16_linear(x, packed, scale, zero, 64, bias))


@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero_point"])
def test_dequantize_first_path_matches_reference(zero_points: bool) -> None:
    packed, scale, zero = int4_weight(40, 192, 32, zero_points, seed=9)
    assert torch.equal(
        triton_dequantize_int4(packed, scale, zero, 32, torch.float16),
        dequantize_int4(packed, scale, zero, 32, torch.float16),
    )  # bit for bit
    x = randn(5, 192, dtype=torch.float32, seed=10)
    config = W4a16Config(16, 16, dequantize_first=True)
    out = triton_w4a16_linear(x, packed, scale, zero, 32, None, config)
    assert_matches_reference(out, w4a16_linear(x, packed, scale, zero, 32))


def test_leading_dimensions_and_default_config() -> None:
    packed, scale, _ = int4_weight(32, 128, 32, False, seed=5)
    x = randn(2, 3, 128, dtype=torch.float32, seed=6)
    out = triton_w4a16_linear(x, packed, scale, None, 32)  # default config: split-K off here
    assert out.shape == (2, 3, 32)
    assert_matches_reference(
        out.reshape(6, 32), w4a16_linear(x.reshape(6, 128), packed, scale, None, 32)
    )


def test_zero_rows_and_bad_shapes() -> None:
    packed, scale, zero = int4_weight(16, 64, 32, True, seed=7)
    empty = torch.empty(0, 64, device=DEVICE)
    assert triton_w4a16_linear(empty, packed, scale, zero, 32).shape == (0, 16)
    x = randn(2, 64, dtype=torch.float32, seed=8)
    with pytest.raises(ValueError, match="columns"):
        triton_w4a16_linear(x[:, :56], packed, scale, zero, 32)
    with pytest.raises(ValueError, match="group size"):
        triton_w4a16_linear(x, packed, scale, zero, 12)
    with pytest.raises(ValueError, match="scale / zero"):
        triton_w4a16_linear(x, packed, scale[:, :1], zero, 32)
    with pytest.raises(ValueError, match="power of two"):
        W4a16Config(16, 24)
    with pytest.raises(ValueError, match="block_k"):
        W4a16Config(16, 32, 64)


def test_default_config_splits_k_for_decode_only() -> None:
    decode = default_config(1, 4096, 4096, num_sms=132)
    assert decode.block_m == 16 and decode.split_k == 8  # 64 column tiles -> 528 programs
    assert default_config(1, 28672, 4096, num_sms=132).split_k == 2
    assert default_config(16, 4096, 256, num_sms=132).split_k == 1  # K too short to split
    assert not default_config(64, 4096, 4096, num_sms=132).dequantize_first
    assert default_config(4096, 4096, 4096, num_sms=132).dequantize_first  # prefill: cuBLAS


def test_tuned_file_is_looked_up_by_rows(tmp_path) -> None:
    name = config_file_name(4096, 4096, 128, "NVIDIA H200")
    assert name == "w4a16_gemm_N4096_K4096_G128_NVIDIA_H200.json"
    entries = {
        "1": {"BLOCK_M": 16, "BLOCK_N": 32, "SPLIT_K": 4},
        "64": {"BLOCK_M": 64, "BLOCK_N": 64, "DEQUANTIZE_FIRST": True},
    }
    (tmp_path / config_file_name(4096, 4096, 128, "cpu")).write_text(json.dumps(entries))
    cpu = torch.device("cpu")
    assert select_config(1, 4096, 4096, 128, cpu, tmp_path) == W4a16Config(16, 32, split_k=4)
    assert select_config(20, 4096, 4096, 128, cpu, tmp_path).dequantize_first
    assert select_config(5000, 4096, 4096, 128, cpu, tmp_path).block_m == 64  # largest key
    assert select_config(5000, 2048, 4096, 128, cpu, tmp_path) == default_config(
        5000, 2048, 4096, 1
    )
