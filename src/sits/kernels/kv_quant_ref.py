"""Quantized paged KV cache (fp8 e4m3 and int8): the PyTorch reference of the write and the read.

`--kv-cache-dtype` picks the storage of every layer's KV cache:
- "auto": the model dtype, a plain tensor (see `sits.kernels.attention_ref`); nothing here.
- "fp8": `torch.float8_e4m3fn` data with one float32 scale per (layer, K/V, KV head):
  `QuantizedKVCache.scales` is [2, num_kv_heads]. A stored value q means q * scale.
- "int8": `torch.int8` data with one float32 scale per (K/V, slot, KV head): `scales` is
  [2, num_blocks, block_size, num_kv_heads]. Symmetric: q = clamp(round(x / scale), -127, 127)
  with scale = amax(|x| over head_dim) / 127, so |x - q * scale| <= scale / 2.

How fp8 scales are set (static per head, calibrated once): a head's scale starts at 0 ("not
calibrated"). The first write whose kept tokens have a nonzero amax for that head (in practice
the first prefill batch) sets scale = FP8_HEADROOM * amax / FP8_MAX; it never changes after.
Values beyond FP8_MAX * scale later saturate to +-FP8_MAX * scale.
Why static and not a growing running amax or per-block scales: a scale that changes after a
value was stored would silently rescale that value (requantizing every block is too costly),
and per-block scales need an amax reduction over each block's tokens inside the write kernel
and still saturate on decode tokens appended to a partly filled block. A per-head scale is one
load per head in the Triton kernels. The cost of a generous headroom is small for a floating
format: the relative error stays 2^-4 over the whole normal range [2^-6, 448] * scale; only
values below 2^-6 * scale (the calibration amax / 7168) get the coarser subnormal spacing,
with an absolute error <= 2^-10 * scale. The one change of a scale, 0 -> positive, happens
only while every value of that head ever stored is 0 (amax was 0), so no stored value changes
meaning.
Trade-off: the scales depend on the first batch the engine serves (documented, deterministic
for a given request order).

Invariants:
- `data` is never read without its scales; attention dequantizes to float32 before the dot
  products (`gather_kv_dequantized`).
- Quantization is round-to-nearest (torch's float8 cast; `torch.round` for int8) with explicit
  clamping, so no NaN or inf is ever stored.
- fp8 data is allocated as float8_e4m3fn but scattered and gathered through a uint8 view of the
  same bytes: only the float32 <-> float8 casts touch float8 kernels (portable across torch
  versions and devices).

Formats: OCP 8-bit floating point specification (OFP8, E4M3: 3 mantissa bits, max 448, no inf);
symmetric absmax int8 quantization (Jacob et al. 2018, "Quantization and Training of Neural
Networks for Efficient Integer-Arithmetic-Only Inference").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_HEADROOM = 4.0  # calibrated scale maps 4x the first batch's amax to FP8_MAX
INT8_MAX = 127
SCALE_DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class QuantizedKVCache:
    """One layer's quantized paged KV cache (the tensors are written in place).

    Attributes:
        kind: "fp8" or "int8".
        data: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V),
            float8_e4m3fn for fp8, int8 for int8.
        scales: float32; fp8: [2, num_kv_heads] (0 = not calibrated yet); int8:
            [2, num_blocks, block_size, num_kv_heads], one per stored token and head.
    """

    kind: str
    data: Tensor
    scales: Tensor


def storage_dtype(kind: str) -> torch.dtype:
    """The data dtype of a quantized cache kind ("fp8" or "int8")."""
    assert kind in ("fp8", "int8"), kind
    return FP8_DTYPE if kind == "fp8" else torch.int8


def scale_bytes_per_block(kind: str, block_size: int, num_kv_heads: int) -> int:
    """Scale bytes one block takes in one layer (K and V): int8 stores one per slot and head."""
    if kind == "int8":
        return 2 * block_size * num_kv_heads * SCALE_DTYPE.itemsize
    return 0


def fixed_scale_bytes(kind: str, num_kv_heads: int) -> int:
    """Scale bytes of one layer that do not grow with the blocks (fp8's per-head scales)."""
    return 2 * num_kv_heads * SCALE_DTYPE.itemsize if kind == "fp8" else 0


def allocate_quantized_kv_cache(
    kind: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> QuantizedKVCache:
    """A zero-filled quantized cache of one layer (fp8 scales start uncalibrated, 0)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    data = torch.zeros(shape, dtype=storage_dtype(kind), device=device)
    scale_shape = (2, num_kv_heads) if kind == "fp8" else (2, num_blocks, block_size, num_kv_heads)
    scales = torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device)
    return QuantizedKVCache(kind, data, scales)


def _safe(scale: Tensor) -> Tensor:
    """The scale with zeros replaced by 1 (a zero scale only ever quantizes zeros)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _bytes(data: Tensor) -> Tensor:
    """fp8 data viewed as uint8 (same bytes), so indexing never needs float8 kernels."""
    return data.view(torch.uint8) if data.dtype == FP8_DTYPE else data


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale rounded to float8_e4m3fn, saturated at +-FP8_MAX.

    Args:
        x: [..., num_kv_heads, head_dim], any float dtype.
        scale: [num_kv_heads] float32 (0 only for heads whose x is all zero).

    Returns:
        x's shape, float8_e4m3fn.
    """
    scaled = x.float() / _safe(scale)[:, None]  # [..., num_kv_heads, head_dim]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: Tensor, scale: Tensor) -> Tensor:
    """q * scale in float32. q: [..., num_kv_heads, head_dim]; scale: [num_kv_heads]."""
    return q.float() * scale[:, None]


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token-per-head int8 quantization.

    Args:
        x: [..., num_kv_heads, head_dim], any float dtype.

    Returns:
        (q, scale): q is x's shape, int8 in [-127, 127]; scale is [..., num_kv_heads] float32,
        amax over head_dim / 127 (0 for an all-zero head).
    """
    x = x.float()
    amax = x.abs().amax(dim=-1)  # [..., num_kv_heads]
    # Divide by a tensor: CUDA turns division by a Python scalar into a multiply by its
    # reciprocal, one ulp off the IEEE quotient the kernels compute.
    scale = amax / torch.full_like(amax, INT8_MAX)
    q = torch.round(x / _safe(scale)[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """q * scale in float32. q: [..., num_kv_heads, head_dim]; scale: [..., num_kv_heads]."""
    return q.float() * scale[..., None]


def calibrate_fp8_scales(scales: Tensor, x: Tensor) -> None:
    """Set the scale of every still-uncalibrated head that x gives a nonzero amax.

    Args:
        scales: [num_kv_heads] float32, updated in place; calibrated (> 0) entries never change.
        x: [num_tokens, num_kv_heads, head_dim], the tokens about to be written.
    """
    if x.shape[0] == 0:
        return
    amax = x.float().abs().amax(dim=(0, 2))  # [num_kv_heads]
    fresh = amax * (FP8_HEADROOM / FP8_MAX)  # [num_kv_heads]
    scales.copy_(torch.where(scales > 0, scales, fresh))


def write_kv_quantized(
    cache: QuantizedKVCache, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    """Quantize the step's keys and values and store them (and int8 scales) into the cache.

    Args:
        cache: the layer's quantized cache, written in place (fp8 scales may be calibrated).
        key, value: [num_tokens, num_kv_heads, head_dim], model dtype.
        slot_mapping: [num_tokens] int64, block_id * block_size + offset; -1 = skip the token.
    """
    num_kv_heads, head_dim = cache.data.shape[3], cache.data.shape[4]
    keep = slot_mapping >= 0  # [num_tokens] bool
    slots = slot_mapping[keep]  # [num_kept]
    for index, x in enumerate((key[keep], value[keep])):  # [num_kept, num_kv_heads, head_dim]
        slot_data = _bytes(cache.data[index]).view(-1, num_kv_heads, head_dim)  # [slots, K, D]
        if cache.kind == "fp8":
            calibrate_fp8_scales(cache.scales[index], x)
            slot_data[slots] = _bytes(quantize_fp8(x, cache.scales[index]))
        else:
            q, scale = quantize_int8(x)  # [num_kept, K, D], [num_kept, K]
            slot_data[slots] = q
            cache.scales[index].view(-1, num_kv_heads)[slots] = scale


def gather_kv_dequantized(
    cache: QuantizedKVCache, block_table: Tensor, context_len: int
) -> tuple[Tensor, Tensor]:
    """Read one sequence's first `context_len` keys and values, dequantized.

    Args:
        cache: the layer's quantized cache.
        block_table: [max_num_blocks] int32, the sequence's block ids in order.
        context_len: tokens of the sequence in the cache (>= 1).

    Returns:
        (key, value), each [context_len, num_kv_heads, head_dim] float32.
    """
    block_size, num_kv_heads, head_dim = cache.data.shape[2:]
    num_blocks = -(-context_len // block_size)
    block_ids = block_table[:num_blocks].long()  # [num_blocks]
    out: list[Tensor] = []
    for index in (0, 1):
        q = _bytes(cache.data[index])[block_ids].reshape(-1, num_kv_heads, head_dim)[:context_len]
        if cache.kind == "fp8":
            q = q.view(FP8_DTYPE)
            out.append(dequantize_fp8(q, cache.scales[index]))  # [context_len, K, D]
        else:
            scale = cache.scales[index, block_ids].reshape(-1, num_kv_heads)[:context_len]
            out.append(dequantize_int8(q, scale))  # [context_len, K, D]
    return out[0], out[1]
