"""Quantized KV cache reference: round-trip error bounds of fp8 e4m3 and int8, fp8 scale
calibration, quantized paged writes, capacity accounting, and paged attention over a quantized
cache against the unquantized reference under a derived error bound.

Bounds used:
- fp8 e4m3 (3 mantissa bits, round to nearest): for |x / s| in the normal range [2^-6, 448],
  |deq - x| <= 2^-4 |x|; below it (subnormal spacing 2^-9) |deq - x| <= 2^-10 s; plus float32
  rounding of the division and product (relative 2^-22 at most).
- int8: |deq - x| <= s / 2 with s = amax / 127, plus float32 rounding (<= 2e-5 s).
- attention: with dK = K' - K, dV = V' - V and softmax scale c, one query row q and one head:
  delta = c * max_j sum_d |q_d| |dK_jd| bounds every score change, so p'_j / p_j lies in
  [e^-2delta, e^2delta] and sum_j |p'_j - p_j| <= e^2delta - 1. Then
  |o' - o| = |sum_j p'_j dV_j + sum_j (p'_j - p_j) V_j| <= max|dV| + max|V| (e^2delta - 1).
"""

from __future__ import annotations

import math

import pytest
import torch

from sits.kernels.attention_ref import TorchPagedAttention, gather_kv
from sits.kernels.kv_quant_ref import (
    FP8_HEADROOM,
    FP8_MAX,
    QuantizedKVCache,
    allocate_quantized_kv_cache,
    calibrate_fp8_scales,
    dequantize_fp8,
    dequantize_int8,
    gather_kv_dequantized,
    quantize_fp8,
    quantize_int8,
    write_kv_quantized,
)
from sits.runner.kv_cache_alloc import kv_bytes_per_block, kv_fixed_bytes, num_kv_blocks

FLOAT32_SLACK = 2.0**-22


def _spread_values(num_tokens: int, num_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Normal values times magnitudes 10^-4 .. 10^1, so normals and subnormals both occur."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    magnitudes = 10.0 ** torch.randint(-4, 2, (num_tokens, num_heads, 1), generator=gen)
    return x * magnitudes  # [num_tokens, num_heads, head_dim]


def test_fp8_round_trip_error_bound() -> None:
    x = _spread_values(64, 3, 16, seed=0)
    scale = x.abs().amax(dim=(0, 2)) * (FP8_HEADROOM / FP8_MAX)  # [3]
    deq = dequantize_fp8(quantize_fp8(x, scale), scale)
    err = (deq - x).abs()
    s = scale[:, None]  # [3, 1]
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s) * (1 + FLOAT32_SLACK)
    assert bool((err <= bound).all())
    normal = x.abs() >= 2.0**-6 * s
    rel = err[normal] / x.abs()[normal]
    # 3 mantissa bits: the worst relative error is close to 2^-4, far above a finer format's.
    assert rel.max().item() > 2.0**-5
    assert bool((err[~normal] > 0).any()), "no subnormal value was rounded"


def test_fp8_saturates_and_keeps_zeros() -> None:
    scale = torch.tensor([0.5, 0.0])
    x = torch.tensor([[[1000.0, -1000.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])  # [1, 2, 4]
    deq = dequantize_fp8(quantize_fp8(x, scale), scale)
    assert deq.tolist() == [[[FP8_MAX * 0.5, -FP8_MAX * 0.5, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]


def test_fp8_scales_are_calibrated_once_per_head() -> None:
    scales = torch.zeros(2)
    first = torch.zeros(3, 2, 4)
    first[:, 0] = torch.tensor([1.0, -7.0, 2.0, 0.5])  # head 0 amax 7; head 1 all zero
    calibrate_fp8_scales(scales, first)
    assert scales.tolist() == [0.0625, 0.0]  # 7 * 4 / 448
    second = torch.full((2, 2, 4), 100.0)
    calibrate_fp8_scales(scales, second)  # head 0 keeps its scale; head 1 calibrates now
    assert scales.tolist() == pytest.approx([0.0625, 100.0 * 4 / 448], rel=1e-7, abs=0)
    assert scales[0].item() == 0.0625


def test_int8_round_trip_error_bound() -> None:
    x = _spread_values(64, 3, 16, seed=1)
    x[5, 1] = 0.0  # an all-zero head gets scale 0 and round-trips exactly
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (64, 3)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert bool((q.abs().amax(dim=-1)[scale > 0] == 127).all()), "amax must map to 127"
    assert scale[5, 1].item() == 0.0
    err = (dequantize_int8(q, scale) - x).abs()
    assert bool((err <= scale[..., None] * (0.5 + 2e-5)).all())
    assert (err / scale[..., None].clamp_min(1e-30)).max().item() > 0.45  # the bound is tight
    assert err[5, 1].abs().max().item() == 0.0


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_write_and_gather(kind: str) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    cache = allocate_quantized_kv_cache(kind, num_blocks, block_size, num_kv_heads, head_dim, "cpu")
    key = _spread_values(6, num_kv_heads, head_dim, seed=2)
    value = _spread_values(6, num_kv_heads, head_dim, seed=3)
    # Token 2 is skipped (-1); the others go to blocks 3 and 1 (a sequence with table [3, 1]).
    slot_mapping = torch.tensor([12, 13, -1, 14, 15, 4])
    write_kv_quantized(cache, key, value, slot_mapping)
    kept = torch.tensor([0, 1, 3, 4, 5])
    got_key, got_value = gather_kv_dequantized(cache, torch.tensor([3, 1, 0]), context_len=5)
    for index, (got, x) in enumerate(((got_key, key[kept]), (got_value, value[kept]))):
        assert got.dtype == torch.float32 and got.shape == (5, num_kv_heads, head_dim)
        if kind == "fp8":  # calibrated by this first write from its kept tokens
            scale = x.abs().amax(dim=(0, 2)) * (FP8_HEADROOM / FP8_MAX)  # [num_kv_heads]
            assert torch.equal(cache.scales[index], scale)
            assert torch.equal(got, dequantize_fp8(quantize_fp8(x, scale), scale))
        else:
            assert torch.equal(got, dequantize_int8(*quantize_int8(x)))
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[torch.tensor([3, 1])] = False
    assert int(cache.data.view(torch.uint8)[:, untouched].count_nonzero()) == 0
    if kind == "int8":
        expected = key[kept].abs().amax(dim=-1) / 127  # [5, num_kv_heads]
        assert torch.equal(cache.scales[0].view(-1, num_kv_heads)[slot_mapping[kept]], expected)
        assert int(cache.scales[:, untouched].count_nonzero()) == 0


def _attention_error_bound(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_q: torch.Tensor,
    value_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The module docstring's bound for one sequence: [num_query, num_heads] (all head_dim)."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    dk = (key_q - key).abs().repeat_interleave(group, dim=1)  # [context, num_heads, head_dim]
    dv = (value_q - value).abs().repeat_interleave(group, dim=1)
    v_max = value.abs().repeat_interleave(group, dim=1).amax(dim=(0, 2))  # [num_heads]
    delta = scale * torch.einsum("qhd,khd->qhk", query.abs(), dk).amax(dim=-1)  # [q, heads]
    return dv.amax(dim=(0, 2))[None] + v_max[None] * torch.expm1(2 * delta)


def _within_format_bound(
    cache: QuantizedKVCache, index: int, x: torch.Tensor, x_q: torch.Tensor
) -> bool:
    """Whether dequantized x_q is within the format's round-trip bound of x ([n, heads, dim])."""
    err = (x_q - x).abs()
    if cache.kind == "fp8":
        s = cache.scales[index][:, None]  # [num_kv_heads, 1]
        bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s) * (1 + FLOAT32_SLACK)
    else:
        bound = x.abs().amax(dim=-1, keepdim=True) / 127 * (0.5 + 2e-5)
    return bool((err <= bound).all())


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_paged_attention_quantized_within_derived_bound(paged_batch, kind: str) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    chunks = [(0, 9), (8, 5), (12, 1)]  # a prefill, a chunk after cached tokens, a decode
    batch = paged_batch(chunks, num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    reference = batch.kv_cache.clone()  # NaN where never written
    quantized = allocate_quantized_kv_cache(
        kind, reference.shape[1], block_size, num_kv_heads, head_dim, "cpu"
    )
    written = ~reference[0].view(-1, num_kv_heads, head_dim)[:, 0, 0].isnan()  # [num_slots]
    cached_slots = written.nonzero().squeeze(1)  # the cached prefixes, quantized as a step
    write_kv_quantized(
        quantized,
        reference[0].view(-1, num_kv_heads, head_dim)[cached_slots],
        reference[1].view(-1, num_kv_heads, head_dim)[cached_slots],
        cached_slots,
    )
    scale = head_dim**-0.5
    backend = TorchPagedAttention()
    args = (batch.query, batch.key, batch.value)
    out_ref = backend.forward(*args, reference, batch.metadata, scale)
    out_q = backend.forward(*args, quantized, batch.metadata, scale)
    assert out_q.dtype == torch.float32 and out_q.shape == out_ref.shape
    starts, max_err = batch.metadata.query_start_loc_cpu, 0.0
    for i, context_len in enumerate(batch.metadata.seq_lens_cpu):
        table = batch.metadata.block_tables[i]
        key, value = gather_kv(reference, table, context_len)
        key_q, value_q = gather_kv_dequantized(quantized, table, context_len)
        assert _within_format_bound(quantized, 0, key, key_q)
        assert _within_format_bound(quantized, 1, value, value_q)
        rows = slice(starts[i], starts[i + 1])
        bound = _attention_error_bound(batch.query[rows], key, value, key_q, value_q, scale)
        err = (out_q[rows] - out_ref[rows]).abs().amax(dim=-1)  # [num_query, num_heads]
        assert bool((err <= bound * (1 + 1e-4) + 1e-6).all()), f"sequence {i}"
        max_err = max(max_err, err.max().item())
    assert max_err > 0, "quantized attention gave the exact unquantized output"
    if kind == "fp8":  # scales were calibrated by the cached prefixes, not changed after
        cached_amax = reference[:, written.view(reference.shape[1], block_size)]
        expected = cached_amax.abs().amax(dim=(1, 3)) * (FP8_HEADROOM / FP8_MAX)  # [2, kv_heads]
        assert torch.equal(quantized.scales, expected)


def test_quantized_capacity_accounting() -> None:
    # 2 layers, block 16, 2 KV heads, head_dim 16.
    args = (2, 16, 2, 16)
    assert kv_bytes_per_block(*args, torch.float32) == 8192
    assert kv_bytes_per_block(*args, torch.bfloat16) == 4096
    assert kv_bytes_per_block(*args, torch.float32, "fp8") == 2048
    assert kv_bytes_per_block(*args, torch.bfloat16, "int8") == 2048 + 2 * 2 * 16 * 2 * 4
    assert kv_fixed_bytes(2, 2, "fp8") == 2 * 2 * 2 * 4
    assert kv_fixed_bytes(2, 2, "int8") == kv_fixed_bytes(2, 2, "auto") == 0
    common = dict(
        device=torch.device("cpu"),
        gpu_memory_utilization=0.9,
        max_model_len=64,
        max_num_seqs=2,
        block_size=16,
    )
    budget = 2048 * 10 + 32
    assert num_kv_blocks(bytes_per_block=2048, kv_cache_memory_bytes=budget, **common) == 10
    got = num_kv_blocks(
        bytes_per_block=2048, kv_cache_memory_bytes=budget - 1, fixed_bytes=32, **common
    )
    assert got == 9  # the fixed scale bytes come out of the budget first
    # Default CPU sizing: max_num_seqs full-length sequences (2 * 4 blocks) plus fixed bytes.
    got = num_kv_blocks(bytes_per_block=2048, kv_cache_memory_bytes=None, fixed_bytes=32, **common)
    assert got == 8


def test_quantized_cache_layout() -> None:
    fp8 = allocate_quantized_kv_cache("fp8", 3, 4, 2, 8, "cpu")
    int8 = allocate_quantized_kv_cache("int8", 3, 4, 2, 8, "cpu")
    assert isinstance(fp8, QuantizedKVCache) and fp8.kind == "fp8"
    assert fp8.data.dtype == torch.float8_e4m3fn and fp8.data.shape == (2, 3, 4, 2, 8)
    assert fp8.scales.dtype == torch.float32 and fp8.scales.shape == (2, 2)
    assert int8.data.dtype == torch.int8 and int8.scales.shape == (2, 3, 4, 2)
    assert math.isclose(FP8_MAX, torch.finfo(torch.float8_e4m3fn).max)
