"""Triton kernels: store a step's keys and values into the paged KV cache by slot mapping.

Twins of `attention_ref.write_kv` (a copy with a dtype cast) and of
`kv_quant_ref.write_kv_quantized` (fp8 e4m3 with per-head scales calibrated by the first
nonzero write, int8 with per-token-per-head scales), which they match byte for byte.

KV cache layout of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K,
1 = V), head_dim contiguous; token slot s lives in block s // block_size at offset
s % block_size.

Invariants:
- One program per token writes all its kv heads of K and V; a slot of -1 writes nothing.
- Cache offsets are computed in int64 (a layer's cache may exceed 2**31 elements).
- Quantization is computed exactly as the reference: IEEE float32 divisions (`tl.div_rn`),
  round half to even in integer arithmetic (float32 -> e4m3 bits including subnormals, and
  int8's round), so the stored bytes do not depend on the device, the interpreter (whose
  float8 cast is wrong) or the compiler's fast paths.
- No host synchronisation: fp8 calibration is a device kernel that returns at once for heads
  already calibrated, so a decode step stays CUDA-graph capturable.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.attention_tile_triton import paged_kv
from sits.kernels.kv_quant_ref import FP8_HEADROOM, FP8_MAX, INT8_MAX, QuantizedKVCache
from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import next_power_of_2

CALIBRATION_BLOCK_TOKENS = 32  # tokens per step of the fp8 calibration loop
FP8_LIMIT = tl.constexpr(FP8_MAX)  # the reference's constants, visible inside kernels
INT8_LIMIT = tl.constexpr(INT8_MAX)


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program t copies key[t] and value[t] ([num_kv_heads, head_dim]) to slot_mapping[t]."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    dims = tl.arange(0, BLOCK_DIM)[None, :]  # [1, BLOCK_DIM]
    mask = (heads < num_kv_heads) & (dims < head_dim)  # [BLOCK_HEADS, BLOCK_DIM]
    dst = (
        cache_ptr
        + block_id * stride_cache_block
        + block_offset * stride_cache_offset
        + heads * stride_cache_head
        + dims
    )
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask
    )
    tl.store(dst + stride_cache_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def triton_write_kv(
    kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor, num_warps: int = 4
) -> None:
    """Store the step's keys and values into the paged cache (Triton twin of `write_kv`).

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], written in place; its
            last dimension must be contiguous.
        key, value: [num_tokens, num_kv_heads, head_dim], any strides with a contiguous last
            dimension (e.g. views into a fused QKV output); cast to the cache dtype.
        slot_mapping: [num_tokens] int64 (or int32), block_id * block_size + offset; -1 = skip.
        num_warps: warps per program.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "cache must be [2, blocks, ...]"
    assert tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim), "cache/key shape mismatch"
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert kv_cache.stride(4) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_HEADS=next_power_of_2(num_kv_heads),
        BLOCK_DIM=next_power_of_2(head_dim),
        num_warps=num_warps,
        **pdl_args(kv_cache),
    )


@triton.jit
def fp8_e4m3_bits(x):
    """float32 x with |x| <= 448 -> its float8_e4m3fn bits (int32 in [0, 255]).

    Round half to even on the e4m3 grid (3 mantissa bits; below 2^-6 the subnormal grid of
    step 2^-9), as torch's float8 cast; computed on the float32 bits, no float8 arithmetic.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    exponent = ((bits >> 23) & 0xFF) - 127  # unbiased
    mantissa = (bits & 0x7FFFFF) | 0x800000  # 24 bits with the implicit one
    # Bits to drop: 20 keeps 3 mantissa bits; below 2^-6 the grid step stays 2^-9. A shift
    # of 25 drops everything (|x| < 2^-10 rounds to 0; float32 zeros and subnormals too).
    shift = 20 + tl.minimum(tl.maximum(-6 - exponent, 0), 5)
    kept = mantissa >> shift
    rest = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    kept = kept + round_up.to(tl.int32)  # a carry into the exponent is still right below
    # Normal: byte = (exponent + 7) * 8 + mantissa3 = (exponent + 6) * 8 + kept (kept >= 8);
    # subnormal: byte = kept (kept = 8 is 2^-6, the smallest normal).
    code = (tl.maximum(exponent, -6) + 6) * 8 + kept
    return code | (sign << 7)


@triton.jit
def round_half_even(y):
    """float32 y (|y| < 2^22) rounded to the nearest integer, ties to even (torch.round)."""
    floor = tl.floor(y)
    frac = y - floor  # exact
    odd = (floor.to(tl.int32) & 1) == 1
    round_up = (frac > 0.5) | ((frac == 0.5) & odd)
    return floor + round_up.to(tl.float32)


@triton.jit
def quantize_store(
    x_ptr,
    dst,
    scale_ptrs,
    mask,
    head_mask,
    KV_QUANT: tl.constexpr,
):
    """Quantize one token's [BLOCK_HEADS, BLOCK_DIM] rows at x_ptr and store them at dst.

    fp8: scale_ptrs are the heads' (calibrated) scales, read; int8: the token's scale slots,
    written with amax / 127.
    """
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_DIM]
    if KV_QUANT == "fp8":
        scale = tl.load(scale_ptrs, mask=head_mask, other=0.0)  # [BLOCK_HEADS]
        safe = tl.where(scale > 0.0, scale, 1.0)
        scaled = tl.div_rn(x, tl.broadcast_to(safe[:, None], x.shape))
        scaled = tl.minimum(tl.maximum(scaled, -FP8_LIMIT), FP8_LIMIT)
        tl.store(dst, fp8_e4m3_bits(scaled).to(tl.uint8), mask=mask)
    else:
        amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_HEADS]
        scale = tl.div_rn(amax, tl.full(amax.shape, INT8_LIMIT, tl.float32))
        safe = tl.where(scale > 0.0, scale, 1.0)
        q = round_half_even(tl.div_rn(x, tl.broadcast_to(safe[:, None], x.shape)))
        q = tl.minimum(tl.maximum(q, -INT8_LIMIT), INT8_LIMIT)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scale_ptrs, scale, mask=head_mask)


@triton.jit
def write_kv_quantized_kernel(
    key_ptr,
    value_ptr,
    data_ptr,
    scales_ptr,
    slot_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scale_kv,
    stride_scale_block,
    stride_scale_offset,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    KV_QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program t quantizes key[t] and value[t] ([num_kv_heads, head_dim]) into slot_mapping[t].

    fp8 reads the per-head scales (stride_scale_block/offset are 0); int8 writes the slot's.
    """
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
    dims = tl.arange(0, BLOCK_DIM)[None, :]  # [1, BLOCK_DIM]
    head_mask = heads < num_kv_heads  # [BLOCK_HEADS]
    mask = head_mask[:, None] & (dims < head_dim)  # [BLOCK_HEADS, BLOCK_DIM]
    dst = (
        data_ptr
        + block_id * stride_cache_block
        + block_offset * stride_cache_offset
        + heads[:, None] * stride_cache_head
        + dims
    )
    scale_ptrs = (
        scales_ptr + block_id * stride_scale_block + block_offset * stride_scale_offset + heads
    )  # [BLOCK_HEADS]
    key = key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims
    quantize_store(key, dst, scale_ptrs, mask, head_mask, KV_QUANT)
    value = value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims
    quantize_store(
        value, dst + stride_cache_kv, scale_ptrs + stride_scale_kv, mask, head_mask, KV_QUANT
    )


@triton.jit
def calibrate_fp8_kernel(
    key_ptr,
    value_ptr,
    scales_ptr,
    slot_ptr,
    num_tokens,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_scale_kv,
    head_dim,
    scale_per_amax,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program h: calibrate kv head h's K and V scales if still 0 (`calibrate_fp8_scales`).

    scale = amax(|x|) over the kept tokens (slot >= 0) and head_dim times scale_per_amax
    (FP8_HEADROOM / FP8_MAX); a calibrated (> 0) scale is left unchanged, and a program whose
    two scales are calibrated returns after two loads.
    """
    pdl_enter(USE_PDL)
    head = tl.program_id(0)
    key_scale = tl.load(scales_ptr + head)
    value_scale = tl.load(scales_ptr + stride_scale_kv + head)
    if (key_scale > 0.0) & (value_scale > 0.0):
        return
    key_amax = tl.zeros([BLOCK_TOKENS], dtype=tl.float32)
    value_amax = tl.zeros([BLOCK_TOKENS], dtype=tl.float32)
    dims = tl.arange(0, BLOCK_DIM)[None, :]  # [1, BLOCK_DIM]
    for start in range(0, num_tokens, BLOCK_TOKENS):
        tokens = start + tl.arange(0, BLOCK_TOKENS)  # [BLOCK_TOKENS]
        in_batch = tokens < num_tokens
        slots = tl.load(slot_ptr + tokens, mask=in_batch, other=-1)
        mask = (in_batch & (slots >= 0))[:, None] & (dims < head_dim)
        tokens = tokens.to(tl.int64)[:, None]  # [BLOCK_TOKENS, 1]
        key = tl.load(
            key_ptr + tokens * stride_key_token + head * stride_key_head + dims,
            mask=mask,
            other=0.0,
        )  # [BLOCK_TOKENS, BLOCK_DIM]
        key_amax = tl.maximum(key_amax, tl.max(tl.abs(key.to(tl.float32)), axis=1))
        value = tl.load(
            value_ptr + tokens * stride_value_token + head * stride_value_head + dims,
            mask=mask,
            other=0.0,
        )
        value_amax = tl.maximum(value_amax, tl.max(tl.abs(value.to(tl.float32)), axis=1))
    if key_scale == 0.0:
        tl.store(scales_ptr + head, tl.max(key_amax, axis=0) * scale_per_amax)
    if value_scale == 0.0:
        tl.store(scales_ptr + stride_scale_kv + head, tl.max(value_amax, axis=0) * scale_per_amax)


def triton_write_kv_quantized(
    cache: QuantizedKVCache,
    key: Tensor,
    value: Tensor,
    slot_mapping: Tensor,
    num_warps: int = 4,
) -> None:
    """Quantize the step's keys and values into the cache (Triton twin of `write_kv_quantized`).

    fp8 launches the calibration kernel first (one program per kv head; it returns at once for
    calibrated heads), then the write kernel; int8 launches the write kernel only.

    Args:
        cache: the layer's `QuantizedKVCache` (data [2, num_blocks, block_size, num_kv_heads,
            head_dim] fp8/int8 with a contiguous last dimension; float32 scales, contiguous),
            written in place (fp8 scales may be calibrated).
        key, value: [num_tokens, num_kv_heads, head_dim], any float dtype and strides with a
            contiguous last dimension.
        slot_mapping: [num_tokens] int64 (or int32), block_id * block_size + offset; -1 = skip.
        num_warps: warps per program of the write kernel.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    kv = paged_kv(cache)
    data = kv.data  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    assert tuple(data.shape[3:]) == (num_kv_heads, head_dim), "cache/key shape mismatch"
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert data.stride(4) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    assert kv.scales.is_contiguous(), "scales must be contiguous"
    if num_tokens == 0:
        return
    block_dim = next_power_of_2(head_dim)
    if kv.kind == "fp8":
        calibrate_fp8_kernel[(num_kv_heads,)](
            key, value, kv.scales, slot_mapping, num_tokens,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kv.scale_strides[0], head_dim, FP8_HEADROOM / FP8_MAX,
            BLOCK_TOKENS=CALIBRATION_BLOCK_TOKENS,
            BLOCK_DIM=block_dim,
            num_warps=4,
            **pdl_args(data),
        )  # fmt: skip
    write_kv_quantized_kernel[(num_tokens,)](
        key, value, data, kv.scales, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        data.stride(0), data.stride(1), data.stride(2), data.stride(3), *kv.scale_strides,
        num_kv_heads, head_dim,
        BLOCK_SIZE=data.shape[2],
        BLOCK_HEADS=next_power_of_2(num_kv_heads),
        BLOCK_DIM=block_dim,
        KV_QUANT=kv.kind,
        num_warps=num_warps,
        **pdl_args(data),
    )  # fmt: skip
