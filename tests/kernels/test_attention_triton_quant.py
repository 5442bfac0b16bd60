"""Triton paged attention over a quantized KV cache (fp8 e4m3, int8) vs `kv_quant_ref`.

Runs the kernels through Triton's CPU interpreter (or compiled, on a GPU machine). The write
kernel must store exactly the reference's bytes and scales (fp8 calibration included); the
attention kernels must match the reference attention over the same quantized cache (float32
and float16 queries; bf16 at real shapes is in the gpu-marked twin of this file).
Slots never written hold sentinels: int8 data 127 with NaN scales, fp8 bytes 0x7F (NaN in
e4m3fn; 480 in the interpreter's decoding), so a kernel reading them gives a wrong output.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.core.errors import InvalidParameterError  # noqa: E402
from sits.kernels.attention_ref import TorchPagedAttention  # noqa: E402
from sits.kernels.attention_triton import TritonAttentionConfig, TritonPagedAttention  # noqa: E402
from sits.kernels.kv_quant_ref import (  # noqa: E402
    FP8_DTYPE,
    FP8_HEADROOM,
    FP8_MAX,
    QuantizedKVCache,
    allocate_quantized_kv_cache,
    write_kv_quantized,
)
from sits.kernels.kv_write_triton import triton_write_kv_quantized  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.fail(
        "sits' Triton kernels were compiled (not interpreted) on a machine without a GPU: a "
        "module imported them before tests/kernels/conftest.py set TRITON_INTERPRET=1",
        pytrace=False,
    )

SMALL = {"prefill_block_m": 32, "prefill_block_n": 16, "decode_block_n_quantized": 16}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3}
FP8_NAN_BYTE = 0x7F
KINDS = ["fp8", "int8"]


def spread(num_tokens: int, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Normal values times 10^-4 .. 10^1 per (token, head): fp8 subnormals and normals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    magnitudes = 10.0 ** torch.randint(-4, 2, (num_tokens, num_kv_heads, 1), generator=gen)
    return x * magnitudes  # [num_tokens, num_kv_heads, head_dim]


def clone_cache(cache: QuantizedKVCache) -> QuantizedKVCache:
    return QuantizedKVCache(cache.kind, cache.data.clone(), cache.scales.clone())


def assert_same_cache(actual: QuantizedKVCache, expected: QuantizedKVCache) -> None:
    """Identical bytes and scales (NaN sentinels included)."""
    assert torch.equal(actual.data.view(torch.uint8), expected.data.view(torch.uint8))
    torch.testing.assert_close(actual.scales, expected.scales, rtol=0, atol=0, equal_nan=True)


def quantized_cache_of(kv_cache: torch.Tensor, kind: str) -> QuantizedKVCache:
    """A quantized copy of a paged batch's cache: its written slots quantized by the reference
    (one write: fp8 scales calibrated by them, or left 0 when there are none), sentinels in
    every other slot."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    cache = allocate_quantized_kv_cache(
        kind, num_blocks, block_size, num_kv_heads, head_dim, kv_cache.device
    )
    if kind == "fp8":
        cache.data.view(torch.uint8).fill_(FP8_NAN_BYTE)
    else:
        cache.data.fill_(127)
        cache.scales.fill_(float("nan"))
    slots_view = kv_cache.float().view(2, -1, num_kv_heads, head_dim)  # [2, slots, heads, dim]
    written = (~slots_view[0, :, 0, 0].isnan()).nonzero().squeeze(1)  # [num_written]
    write_kv_quantized(cache, slots_view[0, written], slots_view[1, written], written)
    return cache


def check_attention(batch, kind: str, config: TritonAttentionConfig) -> QuantizedKVCache:
    """Both backends' forward on copies of the quantized cache: same cache, close outputs."""
    cache = quantized_cache_of(batch.kv_cache, kind)
    ref_cache, tri_cache = clone_cache(cache), clone_cache(cache)
    scale = batch.query.shape[-1] ** -0.5
    args = (batch.query, batch.key, batch.value)
    expected = TorchPagedAttention().forward(*args, ref_cache, batch.metadata, scale)
    actual = TritonPagedAttention(config).forward(*args, tri_cache, batch.metadata, scale)
    assert actual.dtype == batch.query.dtype and actual.shape == batch.query.shape
    assert_same_cache(tri_cache, ref_cache)
    assert not expected.isnan().any(), "the reference read an unwritten slot: bad test input"
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    return tri_cache


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16])
def test_write_matches_reference_bytes_and_scales(kind: str, key_dtype: torch.dtype) -> None:
    num_kv_heads, head_dim, block_size, num_blocks = 3, 24, 8, 9
    fused = torch.cat([spread(37, num_kv_heads, head_dim, seed) for seed in (1, 2)], dim=1)
    fused = torch.cat([torch.zeros(37, 2, head_dim), fused], dim=1).to(DEVICE, key_dtype)
    key, value = fused[:, 2 : 2 + num_kv_heads], fused[:, 2 + num_kv_heads :]  # strided views
    key[4, 1] = 0.0  # an all-zero head: int8 scale 0
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:37]
    slots[[3, 30]] = -1  # skipped tokens (padding)
    slots = slots.to(DEVICE)
    expected = allocate_quantized_kv_cache(
        kind, num_blocks, block_size, num_kv_heads, head_dim, DEVICE
    )
    actual = clone_cache(expected)
    write_kv_quantized(expected, key, value, slots)
    triton_write_kv_quantized(actual, key, value, slots)
    assert_same_cache(actual, expected)
    assert int(actual.data.view(torch.uint8).count_nonzero()) > 0
    # A second write: fp8 keeps its calibrated scales (larger values saturate).
    write_kv_quantized(expected, 50 * value, key, slots.flip(0))
    triton_write_kv_quantized(actual, 50 * value, key, slots.flip(0))
    assert_same_cache(actual, expected)
    if kind == "fp8":
        first_amax = key.float()[slots >= 0].abs().amax(dim=(0, 2))  # [num_kv_heads]
        assert torch.equal(actual.scales[0], first_amax * (FP8_HEADROOM / FP8_MAX))
        assert bool((actual.data[0].float().abs() == FP8_MAX).any()), "no value saturated"


def test_fp8_write_rounds_every_grid_point_and_midpoint_like_torch() -> None:
    # Scale 1 (already calibrated): every finite e4m3 value, every midpoint between neighbours
    # (ties to even), values just off the midpoints, and values past 448 (saturate).
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[~grid.isnan()].unique()  # [253] sorted, -448 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    extra = torch.tensor([460.0, 1000.0, -1.0e6, 1.0e-30, -1.0e-30, 2.0**-10, 3 * 2.0**-11])
    x = torch.cat([grid, mids, near, extra])
    x = torch.cat([x, torch.zeros(-x.numel() % 16)]).view(-1, 1, 16)  # [tokens, 1 head, 16]
    num_tokens = x.shape[0]
    expected = allocate_quantized_kv_cache("fp8", num_tokens, 1, 1, 16, DEVICE)
    expected.scales.fill_(1.0)
    actual = clone_cache(expected)
    slots = torch.arange(num_tokens, device=DEVICE)
    x = x.to(DEVICE)
    write_kv_quantized(expected, x, -x, slots)
    triton_write_kv_quantized(actual, x, -x, slots)
    assert_same_cache(actual, expected)
    stored = actual.data[0].view(-1).float().cpu()[: grid.numel()]
    assert torch.equal(stored, grid), "representable values must round-trip exactly"


def test_int8_write_rounds_ties_to_even() -> None:
    # amax 127 gives scale exactly 1, so x / scale hits the .5 ties.
    row = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.49, -3.51, 0.0, 5.5, 6.5]
    x = torch.tensor(row + [0.0, 0.0]).view(1, 1, 16).to(DEVICE)
    expected = allocate_quantized_kv_cache("int8", 1, 1, 1, 16, DEVICE)
    actual = clone_cache(expected)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    write_kv_quantized(expected, x, x, slots)
    triton_write_kv_quantized(actual, x, x, slots)
    assert_same_cache(actual, expected)
    stored = actual.data[0].view(-1)[: len(row)].tolist()
    assert stored == [127, 0, 2, 2, 0, -2, -2, 126, -126, 3, -4, 0, 6, 6]
    assert actual.scales.view(-1).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_from_an_empty_cache(paged_batch, kind: str, dtype: torch.dtype) -> None:
    # Nothing cached: fp8 scales are calibrated by this step's write, in the Triton kernel.
    chunks = [(0, 21), (0, 5), (0, 34)]
    batch = paged_batch(chunks, 4, 2, 32, 8, dtype, DEVICE, seed=3, num_padding_tokens=2)
    cache = check_attention(batch, kind, TritonAttentionConfig(**SMALL))
    if kind == "fp8":
        assert bool((cache.scales > 0).all()), "the first write must calibrate every head"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_prefill_and_decode_over_cached_prefix(
    paged_batch, kind: str, dtype: torch.dtype
) -> None:
    # Chunks over cached prefixes (two physical blocks shared by every sequence), a 2-token
    # chunk, and decodes with split-K over up to 90 tokens (3 splits, a ragged last tile).
    chunks = [(13, 7), (32, 16), (8, 30), (50, 2), (89, 1), (21, 1)]
    batch = paged_batch(chunks, 8, 2, 32, 4, dtype, DEVICE, seed=7, num_shared_blocks=2)
    check_attention(batch, kind, TritonAttentionConfig(**SMALL, decode_num_splits=3))


@pytest.mark.parametrize("kind", KINDS)
def test_decode_gqa_group_3_padded_head_dim(paged_batch, kind: str) -> None:
    # Group 3 (padded rows), head_dim 48 (padded columns), one split, the default 128-key
    # tiles (one full tile and a ragged one at 141 tokens).
    chunks = [(0, 1), (16, 1), (140, 1), (5, 1)]
    batch = paged_batch(chunks, 6, 2, 48, 16, torch.float32, DEVICE, seed=9)
    check_attention(batch, kind, TritonAttentionConfig(decode_num_splits=1))


def test_backend_declares_quantized_support() -> None:
    assert TritonPagedAttention.supports_quantized_kv is True
    with pytest.raises(InvalidParameterError) as info:
        TritonAttentionConfig(decode_block_n_quantized=48)
    assert info.value.param == "decode_block_n_quantized"
