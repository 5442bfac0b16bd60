"""Triton kernels: INT4 weight-only (w4a16) GEMV for decode-sized steps of the fused MoE.

The INT4 twin of `fp8_gemv_triton`: at one to a few tokens a projection is a memory-bound
matrix-vector product, and the tiled w4a16 kernels (`w4a16_gemm_triton`, `moe_int4_triton`)
pad M to a 16-row tensor-core tile and dequantize each nibble plane for a tl.dot. Here each
program owns BLOCK_N weight rows of one token (or one token-expert pair) and walks K in steps
of GROUPS quantization groups: it loads the packed words [BLOCK_N, GROUPS * G / 8] once, and
for each nibble position j adds codes_j * x_j (x at columns 8 * word + j, float32) into a
float32 tile; the group's sums are then scaled once:

    sum_k w[n, k] x[k] = sum_g s[n, g] * (sum_{k in g} u[n, k] x[k] - z[n, g] * sum_{k in g} x[k])

so the zero point and scale cost one multiply per group, not per weight.

Kernels: `moe_int4_gemv_up_kernel` (program
(pair, n tile): SiLU(gate) * up of the pair's expert, rounded to hidden's dtype) and
`moe_int4_gemv_down_kernel` (program (pair, n tile): the pair's expert output row); then
`moe_triton.launch_topk_sum` weighs and sums each token's rows (non-finite flags included).

Invariants:
- The weight layout of `kernels.int4_ref` (packed [N, K / 8] int32, scale [N, K / G] float32,
  zero [N, K / G] uint8 or None = 8), G a multiple of 8 with G / 8 a power of two, K a
  multiple of G. The result is `moe_ref.moe_forward_int4` up to
  float32 summation order (codes, zero points and scales are exact in float32).
- Pairs of expert id -1 return at once (no row written; the top-k sum never reads it).
- No host synchronisation, launches fixed by the shapes: CUDA-graph capturable.

Algorithm: group-wise weight-only INT4 GEMV with the zero point factored out of the group sum
(as in the GEMV kernels of AWQ, Lin et al. 2023, and llama.cpp's Q4 dot products), one
program per output row tile as in `fp8_gemv_triton`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.int4_ref import PACK
from sits.kernels.moe_triton import launch_topk_sum
from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import cdiv, check_launch_fields

MOE_INT4_GEMV_MAX_TOKENS = 8  # fused MoE: up to this many tokens the per-pair GEMV runs
# H200 (bench/kernels/int4_gemv_bench.py, 2026-12-02): with the configs below the MoE GEMV is
# 1.6x the grouped w4a16 kernel at 1 and 4 tokens. A dense GEMV built the same way was 0.7-1.2x
# the tiled w4a16 GEMM at one token (nibble unpacking bounds it on long rows), so dense INT4
# projections keep the tiled kernel.
Int4Weight = tuple[Tensor, Tensor, Tensor | None]  # (packed, scale, zero or None)


@dataclass(frozen=True, slots=True)
class Int4GemvConfig:
    """Launch shape of an INT4 GEMV.

    Attributes:
        block_n: weight rows per program (power of two).
        groups: quantization groups per K step (power of two).
        num_warps, num_stages: Triton launch parameters.
    """

    block_n: int = 16
    groups: int = 2
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_launch_fields(self, ("block_n", "groups"), ("num_warps", "num_stages"))


MOE_UP_CONFIG = Int4GemvConfig(32, 4, 4, 3)
MOE_DOWN_CONFIG = Int4GemvConfig(32, 2, 4, 2)


@triton.jit
def int4_rows_dot(
    x_row,
    w_rows,
    s_rows,
    z_rows,
    mask_n,
    num_words,
    HAS_ZERO: tl.constexpr,
    GROUP_WORDS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[BLOCK_N] float32: x (one row, K = 8 * num_words) times BLOCK_N dequantized weight rows.

    x_row: the row's first element; w_rows [BLOCK_N, 1] pointers to each row's first packed
    word; s_rows / z_rows [BLOCK_N, 1] pointers to each row's first group scale / zero code.
    """
    BLOCK_W: tl.constexpr = GROUPS * GROUP_WORDS
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for w0 in range(0, num_words, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)  # [BLOCK_W] word index; K is a multiple of G
        words = tl.load(w_rows + offs_w[None, :], mask=mask_n[:, None], other=0)
        dots = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_row + offs_w * 8 + j).to(tl.float32)  # columns 8 * word + j
            dots += ((words >> (4 * j)) & 0xF).to(tl.float32) * x[None, :]
            x_sum += x
        group_dots = tl.sum(tl.reshape(dots, (BLOCK_N, GROUPS, GROUP_WORDS)), axis=2)
        group_x = tl.sum(tl.reshape(x_sum, (GROUPS, GROUP_WORDS)), axis=1)  # [GROUPS]
        offs_g = w0 // GROUP_WORDS + tl.arange(0, GROUPS)
        scale = tl.load(s_rows + offs_g[None, :], mask=mask_n[:, None], other=0.0)
        if HAS_ZERO:
            zero = tl.load(z_rows + offs_g[None, :], mask=mask_n[:, None], other=0).to(tl.float32)
        else:
            zero = tl.full((BLOCK_N, GROUPS), 8.0, tl.float32)
        acc += scale * (group_dots - zero * group_x[None, :])
    return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["top_k"])
def moe_int4_gemv_up_kernel(
    hidden_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    ids_ptr,
    inter_ptr,
    top_k,
    I,
    num_words,
    stride_ht,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_ip,
    HAS_ZERO: tl.constexpr,
    GROUP_WORDS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (pair, n tile): inter[pair, n] = SiLU(x @ gate[n].T) * (x @ up[n].T)."""
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    x_row = hidden_ptr + (pair // top_k) * stride_ht
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    gate = offs_n.to(tl.int64)[:, None]
    up = gate + I
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
    g = int4_rows_dot(
        x_row, w_e + gate * stride_wn, s_e + gate * stride_sn, z_e + gate * stride_zn, mask_n,
        num_words, HAS_ZERO, GROUP_WORDS, GROUPS, BLOCK_N,
    )  # fmt: skip
    u = int4_rows_dot(
        x_row, w_e + up * stride_wn, s_e + up * stride_sn, z_e + up * stride_zn, mask_n,
        num_words, HAS_ZERO, GROUP_WORDS, GROUPS, BLOCK_N,
    )  # fmt: skip
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(inter_ptr + pair * stride_ip + offs_n, act.to(inter_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def moe_int4_gemv_down_kernel(
    inter_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    ids_ptr,
    out_ptr,
    H,
    num_words,
    stride_ip,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_op,
    HAS_ZERO: tl.constexpr,
    GROUP_WORDS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (pair, n tile): pair_out[pair, n] = inter[pair] @ dequantize(w2[expert])[n].T."""
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    rows = offs_n.to(tl.int64)[:, None]
    out = int4_rows_dot(
        inter_ptr + pair * stride_ip,
        w_ptr + expert * stride_we + rows * stride_wn,
        s_ptr + expert * stride_se + rows * stride_sn,
        z_ptr + expert * stride_ze + rows * stride_zn,
        mask_n, num_words, HAS_ZERO, GROUP_WORDS, GROUPS, BLOCK_N,
    )  # fmt: skip
    tl.store(out_ptr + pair * stride_op + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


def int4_gemv_fits(group_size: int, num_inner: int, config: Int4GemvConfig) -> bool:
    """True when the GEMV computes this layout: G / 8 a power of two, K a multiple of
    `config.groups` groups (each K step covers whole groups, no ragged step)."""
    words = group_size // PACK
    return (
        group_size % PACK == 0
        and words & (words - 1) == 0
        and num_inner % (group_size * config.groups) == 0
    )


def _check(weight: Int4Weight, rows: int, cols: int, group_size: int, what: str) -> None:
    """Refuse a weight not in the `int4_ref` layout for [.., rows, cols] (ValueError)."""
    packed, scale, zero = weight
    lead = packed.shape[:-2]
    if packed.dtype != torch.int32 or tuple(packed.shape[-2:]) != (rows, cols // PACK):
        raise ValueError(f"{what} packed must be int32 [..., {rows}, {cols // PACK}]")
    shape = (*lead, rows, cols // group_size)
    if scale.dtype != torch.float32 or tuple(scale.shape) != shape:
        raise ValueError(f"{what} scale must be float32 {list(shape)}")
    if zero is not None and (zero.dtype != torch.uint8 or tuple(zero.shape) != shape):
        raise ValueError(f"{what} zero must be uint8 {list(shape)}")
    if (
        packed.stride(-1) != 1
        or scale.stride(-1) != 1
        or (zero is not None and zero.stride(-1) != 1)
    ):
        raise ValueError(f"{what} needs unit stride along K")


def _zero_args(weight: Int4Weight) -> tuple[Tensor, tuple[int, ...]]:
    """(zero or a stand-in never read, its strides)."""
    packed, _, zero = weight
    if zero is None:
        return packed, (0,) * packed.dim()
    return zero, zero.stride()


def fused_moe_int4_gemv(
    hidden: Tensor,
    w13: Int4Weight,
    w2: Int4Weight,
    group_size: int,
    topk_weights: Tensor,
    topk_ids: Tensor,
    nonfinite_experts: Tensor | None = None,
    up_config: Int4GemvConfig = MOE_UP_CONFIG,
    down_config: Int4GemvConfig = MOE_DOWN_CONFIG,
) -> Tensor:
    """Weighted sum of each token's top-k INT4 experts, one GEMV per pair (three launches).

    Args:
        hidden: [T, H] bf16/fp16/fp32.
        w13: (packed [E, 2I, H / 8] int32, scale [E, 2I, H / G] float32, zero or None); gate
            rows 0:I, up rows I:2I.
        w2: (packed [E, H, I / 8] int32, scale [E, H, I / G] float32, zero or None).
        group_size: G.
        topk_weights: [T, k] float32 (other float dtypes are converted).
        topk_ids: [T, k] int32/int64 in [0, E), or -1 for no expert.
        nonfinite_experts: optional [E] bool, set in place (`moe_triton.launch_topk_sum`).
        up_config, down_config: launch shapes of the two GEMVs.

    Returns:
        [T, H] in hidden's dtype.

    Raises:
        ValueError: weights not in the `int4_ref` layout, or one the GEMV does not compute.
    """
    num_tokens, hidden_size = hidden.shape
    inter_size = w2[0].shape[2] * PACK
    _check(w13, 2 * inter_size, hidden_size, group_size, "w13")
    _check(w2, hidden_size, inter_size, group_size, "w2")
    if not (
        int4_gemv_fits(group_size, hidden_size, up_config)
        and int4_gemv_fits(group_size, inter_size, down_config)
    ):
        raise ValueError(f"group size {group_size} does not fit the GEMVs for H / I")
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    ids = topk_ids.contiguous()
    num_pairs, top_k = ids.numel(), ids.shape[1]
    inter = hidden.new_empty(num_pairs, inter_size)
    (p13, s13, _), (z13, zs13) = w13, _zero_args(w13)
    moe_int4_gemv_up_kernel[(num_pairs, cdiv(inter_size, up_config.block_n))](
        hidden, p13, s13, z13, ids, inter, top_k, inter_size, hidden_size // PACK,
        hidden.stride(0), p13.stride(0), p13.stride(1), s13.stride(0), s13.stride(1),
        zs13[0], zs13[1], inter.stride(0),
        HAS_ZERO=w13[2] is not None, GROUP_WORDS=group_size // PACK, GROUPS=up_config.groups,
        BLOCK_N=up_config.block_n, num_warps=up_config.num_warps,
        num_stages=up_config.num_stages, **pdl_args(hidden),
    )  # fmt: skip
    pair_out = hidden.new_empty(num_pairs, hidden_size)
    (p2, s2, _), (z2, zs2) = w2, _zero_args(w2)
    moe_int4_gemv_down_kernel[(num_pairs, cdiv(hidden_size, down_config.block_n))](
        inter, p2, s2, z2, ids, pair_out, hidden_size, inter_size // PACK,
        inter.stride(0), p2.stride(0), p2.stride(1), s2.stride(0), s2.stride(1),
        zs2[0], zs2[1], pair_out.stride(0),
        HAS_ZERO=w2[2] is not None, GROUP_WORDS=group_size // PACK, GROUPS=down_config.groups,
        BLOCK_N=down_config.block_n, num_warps=down_config.num_warps,
        num_stages=down_config.num_stages, **pdl_args(hidden),
    )  # fmt: skip
    launch_topk_sum(
        pair_out, topk_weights.to(torch.float32).contiguous(), ids, hidden, out, nonfinite_experts
    )
    return out
