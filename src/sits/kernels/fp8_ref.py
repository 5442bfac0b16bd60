"""Plain PyTorch FP8 (float8_e4m3fn) weights: quantize, dequantize and the reference linear.

This is the reference the Triton FP8 GEMM will sit beside (`fp8_linear` is the seam the
quantized linear layers call).

Invariants:
- A quantized weight is `q` [..., N, K] float8_e4m3fn with a float32 scale, w ~= q * scale, in
  one of two layouts:
  - block: scale [..., ceil(N / bn), ceil(K / bk)], element (i, j) of block (i // bn, j // bk)
    (the `weight_scale_inv` of FP8 block-scaled checkpoints, which despite its name multiplies);
  - per row: scale [..., N], one scale per output channel (per-channel checkpoints, and
    per-tensor ones whose scalar is repeated over the rows it covers).
- Dequantization is one float32 multiply of exact values (every e4m3 value is exact in float32),
  so the same q and scale always give bit-identical weights, on any device.
- Quantization maps amax(|w|) of each row / block onto the largest finite e4m3 value (448);
  all-zero rows / blocks get scale 1.

Algorithm: FP8 formats of Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (E4M3
without infinities, max 448); 128 x 128 weight blocks as in DeepSeek-V3 (2024) and the
Qwen3-*-FP8 checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_block_scale(
    scale: Tensor, num_rows: int, num_cols: int, block: tuple[int, int]
) -> Tensor:
    """Per-element scales of a block-scaled weight.

    Args:
        scale: [..., ceil(num_rows / bn), ceil(num_cols / bk)] float32.
        num_rows, num_cols: N and K of the weight.
        block: (bn, bk), rows and columns of one scale block.

    Returns:
        [..., num_rows, num_cols] float32 (the last blocks cut to the weight's edge).
    """
    block_rows, block_cols = block
    full = scale.repeat_interleave(block_rows, dim=-2)[..., :num_rows, :]
    return full.repeat_interleave(block_cols, dim=-1)[..., :num_cols]  # [..., N, K]


def dequantize_fp8(
    weight: Tensor, scale: Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> Tensor:
    """w = q * scale in float32, then cast to `dtype`.

    Args:
        weight: [..., N, K] float8_e4m3fn.
        scale: [..., ceil(N / bn), ceil(K / bk)] float32 when `block`, else [..., N] float32.
        block: (bn, bk) of a block-scaled weight, None for per-row scales.
        dtype: the result's dtype (the activations').

    Returns:
        [..., N, K] in `dtype`.
    """
    num_rows, num_cols = weight.shape[-2:]
    if block is None:
        full = scale.float()[..., :, None]  # [..., N, 1]
    else:
        full = expand_block_scale(scale.float(), num_rows, num_cols, block)  # [..., N, K]
    return (weight.float() * full).to(dtype)


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> Tensor:
    """y = x @ dequantize(weight).T (+ bias): the reference FP8 GEMM.

    The weight is dequantized to x's dtype and multiplied in that dtype (weight-only
    semantics). A kernel that also quantizes the activations (dynamic per-token-group scales,
    or a static `input_scale`) agrees with this within FP8 activation rounding.

    Args:
        x: [num_tokens, K], the model dtype.
        weight: [N, K] float8_e4m3fn.
        weight_scale: [ceil(N / bn), ceil(K / bk)] float32 when `block`, else [N] float32.
        bias: [N] in x's dtype, or None.
        block: (bn, bk) of a block-scaled weight, None for per-row scales.

    Returns:
        [num_tokens, N] in x's dtype.
    """
    return F.linear(x, dequantize_fp8(weight, weight_scale, block, x.dtype), bias)


def quantize_fp8_per_row(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel FP8 quantization (online `--quantization fp8`).

    Args:
        weight: [..., N, K], any float dtype.

    Returns:
        (q [..., N, K] float8_e4m3fn, scale [..., N] float32) with weight ~= q * scale[..., None].
    """
    w = weight.float()
    amax = w.abs().amax(dim=-1)  # [..., N]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_per_tensor(weight: Tensor) -> tuple[Tensor, Tensor]:
    """One scale for the whole tensor: (q [N, K] float8_e4m3fn, scale [] float32)."""
    w = weight.float()
    amax = w.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_fp8_block(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Block-scaled FP8 quantization, the layout of FP8 block checkpoints.

    Args:
        weight: [..., N, K], any float dtype.
        block: (bn, bk).

    Returns:
        (q [..., N, K] float8_e4m3fn, scale [..., ceil(N / bn), ceil(K / bk)] float32).
    """
    w = weight.float()
    num_rows, num_cols = w.shape[-2:]
    block_rows, block_cols = block
    pad_rows = _cdiv(num_rows, block_rows) * block_rows - num_rows
    pad_cols = _cdiv(num_cols, block_cols) * block_cols - num_cols
    padded = F.pad(w, (0, pad_cols, 0, pad_rows))  # [..., N', K'] multiples of the block
    lead = padded.shape[:-2]
    tiles = padded.reshape(
        *lead,
        padded.shape[-2] // block_rows,
        block_rows,
        padded.shape[-1] // block_cols,
        block_cols,
    )  # [..., nb, bn, kb, bk]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = expand_block_scale(scale, num_rows, num_cols, block)  # [..., N, K]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
