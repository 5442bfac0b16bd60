"""Plain PyTorch FP8 (float8_e4m3fn) weights: quantize, dequantize and the reference linear.

This is the reference the Triton FP8 GEMM (`fp8_gemm_triton`) sits beside: `fp8_linear` is
the seam the quantized linear layers call, and dispatches to the kernel on CUDA;
`fp8_linear_w8a8_reference` is the kernel's own reference (activations quantized too).

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

from sits.kernels.triton_utils import has_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


def _scale_of(amax: Tensor) -> Tensor:
    """amax / 448 (1 where amax is 0), float32, correctly rounded on every device: a Python
    scalar divisor makes CUDA multiply by its reciprocal instead (one ulp off at times), so
    the divisor is a tensor, as the Triton kernels' div_rn."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


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

    Off CUDA: the weight is dequantized to x's dtype and multiplied in that dtype (weight-only
    semantics). On CUDA (FP8-capable sm_89+, Triton installed): up to
    `fp8_gemv_triton.GEMV_MAX_ROWS` tokens the weight-only GEMV; past them `fp8_gemm_triton`,
    weight-only for decode-sized batches and, past them, with the activations quantized to
    FP8 per token (and 128-wide K group for block scales; `fp8_linear_w8a8_reference`),
    which agrees with this within FP8 activation rounding.

    Args:
        x: [num_tokens, K], the model dtype.
        weight: [N, K] float8_e4m3fn.
        weight_scale: [ceil(N / bn), ceil(K / bk)] float32 when `block`, else [N] float32.
        bias: [N] in x's dtype, or None.
        block: (bn, bk) of a block-scaled weight, None for per-row scales.

    Returns:
        [num_tokens, N] in x's dtype.
    """
    if x.is_cuda and has_triton():  # the FP8 GEMM (activations quantized per token group)
        from sits.kernels.fp8_gemm_triton import fp8_gemm_supported, triton_fp8_linear
        from sits.kernels.fp8_gemv_triton import (
            DENSE_CONFIG,
            GEMV_MAX_ROWS,
            gemv_fits,
            triton_fp8_gemv,
        )

        if fp8_gemm_supported(x.device):
            if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and gemv_fits(DENSE_CONFIG, block):
                return triton_fp8_gemv(x, weight, weight_scale, bias, block, DENSE_CONFIG)
            return triton_fp8_linear(x, weight, weight_scale, bias, block)
    return F.linear(x, dequantize_fp8(weight, weight_scale, block, x.dtype), bias)


def quantize_fp8_per_token_group(x: Tensor, group_size: int = 128) -> tuple[Tensor, Tensor]:
    """Dynamic activation quantization: one scale per token and `group_size`-wide K group.

    Args:
        x: [M, K], any float dtype.
        group_size: K elements per scale (the last group may be shorter).

    Returns:
        (q [M, K] float8_e4m3fn, scale [M, ceil(K / group_size)] float32), x ~= q * scale;
        scale = amax(|group|) / 448, 1 for an all-zero group.
    """
    return quantize_fp8_block(x, (1, group_size))


def fp8_linear_w8a8_reference(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    block: tuple[int, int] | None = None,
    group_size: int = 128,
) -> Tensor:
    """The W8A8 FP8 GEMM's reference: x quantized as `quantize_fp8_per_token_group`, both
    operands dequantized and multiplied in float32, the bias added in float32, one cast to x's
    dtype (what `kernels.fp8_gemm_triton` computes, up to float32 summation order).

    Args: as `fp8_linear`; weight_scale may also be one element (per-tensor).

    Returns:
        [num_tokens, N] in x's dtype.
    """
    q, scale = quantize_fp8_per_token_group(x, group_size)
    x32 = dequantize_fp8(q, scale, (1, group_size), torch.float32)  # [M, K]
    if block is None and weight_scale.numel() == 1:
        weight_scale = weight_scale.reshape(1).expand(weight.shape[0])
    w32 = dequantize_fp8(weight, weight_scale, block, torch.float32)  # [N, K]
    y = x32 @ w32.T  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_linear_weight_only_reference(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> Tensor:
    """The W8A16 FP8 GEMM's reference: x and the dequantized weight multiplied in float32, the
    bias added in float32, one cast to x's dtype (what `kernels.fp8_gemm_triton` computes in
    its "w8a16" mode, up to float32 summation order).

    Args: as `fp8_linear`; weight_scale may also be one element (per-tensor).

    Returns:
        [num_tokens, N] in x's dtype.
    """
    if block is None and weight_scale.numel() == 1:
        weight_scale = weight_scale.reshape(1).expand(weight.shape[0])
    w32 = dequantize_fp8(weight, weight_scale, block, torch.float32)  # [N, K]
    y = x.float() @ w32.T  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_fp8_per_row(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel FP8 quantization (online `--quantization fp8`).

    Args:
        weight: [..., N, K], any float dtype.

    Returns:
        (q [..., N, K] float8_e4m3fn, scale [..., N] float32) with weight ~= q * scale[..., None].
    """
    w = weight.float()
    amax = w.abs().amax(dim=-1)  # [..., N]
    scale = _scale_of(amax)
    q = (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_per_tensor(weight: Tensor) -> tuple[Tensor, Tensor]:
    """One scale for the whole tensor: (q [N, K] float8_e4m3fn, scale [] float32)."""
    w = weight.float()
    amax = w.abs().amax()
    scale = _scale_of(amax)
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
    scale = _scale_of(amax)
    full = expand_block_scale(scale, num_rows, num_cols, block)  # [..., N, K]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
