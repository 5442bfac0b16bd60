"""Plain PyTorch INT4 weight-only (w4a16) weights: pack, unpack, quantize, dequantize and the
reference linear.

This is the reference a Triton w4a16 GEMM will sit beside (`w4a16_linear` is the seam the
INT4 linear layers call). Every checkpoint format (compressed-tensors `pack-quantized`, GPTQ,
AWQ) is converted at load into the one layout below (`layers.quant.int4_formats`).

Invariants (our layout):
- `packed` [..., N, K // 8] int32: the unsigned 4-bit codes u in [0, 15] of row n, column k at
  bits 4 * (k % 8) .. 4 * (k % 8) + 3 of word k // 8 (sequential nibbles, the compressed-tensors
  `pack_to_int32` order; bit 31 is the sign bit of the int32, so words may be negative).
- `scale` [..., N, K // G] float32 and `zero` [..., N, K // G] uint8 codes (None: symmetric,
  zero point 8): w[n, k] = (u[n, k] - zero[n, g]) * scale[n, g] with g = k // G, or
  g = g_idx[k] when a GPTQ `desc_act` permutation `g_idx` [K] is given.
- Dequantization is exact in float32 (small integers times a float32), so the same codes and
  scales give bit-identical weights on any device.
- `quantize_int4` (online `--quantization int4`) is symmetric: scale = amax(|w|) / 7 of each
  group of G columns, u = clamp(round(w / scale), -7, 7) + 8 (code 0 unused); an all-zero
  group gets scale 1.

Algorithm: group-wise round-to-nearest weight quantization as in GPTQ (Frantar et al. 2022)
and AWQ (Lin et al. 2023) checkpoints, without their calibration (online RTN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

PACK = 8  # 4-bit codes per int32 word
SYMMETRIC_ZERO = 8
_SHIFTS = torch.arange(PACK, dtype=torch.int32) * 4  # [8] bit offsets, sequential order


def pack_int4(codes: Tensor, dim: int = -1) -> Tensor:
    """Pack unsigned 4-bit codes 8 to an int32 word along `dim`, sequentially.

    Args:
        codes: [..., M, ...] integer values in [0, 15], M (the size of `dim`) a multiple of 8.
        dim: the packed dimension.

    Returns:
        int32 with `dim` of size M // 8; code j of a word at bits 4 * j.

    Raises:
        ValueError: M is not a multiple of 8.
    """
    codes = codes.movedim(dim, -1).to(torch.int64)
    if codes.shape[-1] % PACK:
        raise ValueError(f"packing 4-bit codes needs a multiple of 8 values, got {codes.shape[-1]}")
    words = codes.reshape(*codes.shape[:-1], -1, PACK) << _SHIFTS.to(codes.device, torch.int64)
    packed = words.sum(dim=-1)  # [..., M // 8] in [0, 2^32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim)


def unpack_int4(packed: Tensor, dim: int = -1) -> Tensor:
    """The inverse of `pack_int4`: int32 words -> uint8 codes in [0, 15], `dim` 8x longer."""
    words = packed.movedim(dim, -1).to(torch.int64)
    codes = (words[..., None] >> _SHIFTS.to(words.device, torch.int64)) & 0xF  # [..., W, 8]
    num_codes = words.shape[-1] * PACK  # explicit: an empty tensor (no expert used) unpacks too
    return codes.reshape(*words.shape[:-1], num_codes).to(torch.uint8).movedim(-1, dim)


def dequantize_int4(
    packed: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    group_size: int,
    dtype: torch.dtype,
    g_idx: Tensor | None = None,
) -> Tensor:
    """w = (u - zero) * scale in float32, then cast to `dtype`.

    Args:
        packed: [..., N, K // 8] int32 (our layout, see the module docstring).
        scale: [..., N, K // G] float32.
        zero: [..., N, K // G] uint8 codes, or None (symmetric: 8).
        group_size: G, columns per group.
        dtype: the result's dtype (the activations').
        g_idx: [K] int group of each column (GPTQ desc_act), or None (k // G).

    Returns:
        [..., N, K] in `dtype`.
    """
    codes = unpack_int4(packed).float()  # [..., N, K]
    num_cols = codes.shape[-1]
    if g_idx is None:
        groups = torch.arange(num_cols, device=codes.device) // group_size
    else:
        groups = g_idx.to(device=codes.device, dtype=torch.int64)
    offset = SYMMETRIC_ZERO if zero is None else zero.float()[..., groups]
    return ((codes - offset) * scale.float()[..., groups]).to(dtype)


def w4a16_linear(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
    g_idx: Tensor | None = None,
) -> Tensor:
    """y = x @ dequantize(packed).T (+ bias): the reference w4a16 GEMM.

    Args:
        x: [num_tokens, K], the model dtype.
        packed, scale, zero, group_size, g_idx: the weight [N, K], as `dequantize_int4`.
        bias: [N] in x's dtype, or None.

    Returns:
        [num_tokens, N] in x's dtype.
    """
    weight = dequantize_int4(packed, scale, zero, group_size, x.dtype, g_idx)
    return F.linear(x, weight, bias)


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # scale = ratio * amax / 7, searched


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric group-wise INT4 (online `--quantization int4`), with the clipping ratio of
    least squared error per group.

    Each group of G weights gets scale = ratio * amax(|group|) / 7 for the ratio in
    CLIP_RATIOS whose round-to-nearest codes in -8 .. 7 reconstruct the group with the least
    squared error (ratio 1 first, so ties keep the plain amax scale; an all-zero group gets
    scale 1). Clipping a group's few largest weights buys a finer grid for the rest: on the
    demo model's held-out Python it halves int4's perplexity loss against plain amax / 7
    (bench/RESULTS.md, 2026-12-01).

    Args:
        weight: [..., N, K], any float dtype, K a multiple of `group_size` and of 8.
        group_size: G.

    Returns:
        (packed [..., N, K // 8] int32, scale [..., N, K // G] float32), zero point 8.

    Raises:
        ValueError: K is not a multiple of G.

    Algorithm: MSE-optimal clipping of a uniform quantizer (Banner et al. 2019, "Post training
    4-bit quantization of convolutional networks for rapid-deployment"), searched on a grid
    per group as the weight clipping of AWQ (Lin et al. 2024) searches per channel.
    """
    w = weight.float()
    num_cols = w.shape[-1]
    if num_cols % group_size:
        raise ValueError(f"group size {group_size} does not divide {num_cols} columns")
    groups = w.reshape(*w.shape[:-1], num_cols // group_size, group_size)  # [..., N, K/G, G]
    amax = groups.abs().amax(dim=-1)  # [..., N, K/G]
    best_scale = best_error = None
    for ratio in CLIP_RATIOS:
        scale = torch.where(amax > 0, amax * ratio / 7, torch.ones_like(amax))
        values = (groups / scale[..., None]).round().clamp(-8, 7)
        error = ((values * scale[..., None] - groups) ** 2).sum(dim=-1)  # [..., N, K/G]
        if best_scale is None:
            best_scale, best_error = scale, error
            continue
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    codes = (groups / best_scale[..., None]).round().clamp(-8, 7) + SYMMETRIC_ZERO
    return pack_int4(codes.reshape(w.shape)), best_scale
