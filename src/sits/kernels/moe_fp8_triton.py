"""`fused_moe_fp8`: the fused MoE over FP8 experts, W8A8 on FP8 tensor cores (sm_89+).

Twin of `moe_ref.moe_forward_fp8` (weights dequantized, activations not quantized), computed
as `moe_forward_fp8_w8a8_reference` here (activations quantized the same way). One call runs
the launches of `moe_triton.fused_moe` plus two quantizations, none sized by a device value:
1. `fp8_gemm_triton.triton_quant_fp8_group`: hidden [T, H] -> fp8 with float32 scales per
   token and activation group: bk columns for block-scaled weights (block = (bn, bk)), all H
   columns (one scale per token) for per-row (per-channel) weights.
2. The alignment of `moe_triton` (`moe_align.align_pairs_to_experts`, or `pair_blocks` for a
   one-token step).
3. GEMM1, grouped over row blocks: fp8 rows of hidden gathered by pair times the expert's fp8
   gate and up rows (two float32 accumulators), scales applied as below, SiLU(gate) * up in
   the epilogue, rounded to hidden's dtype and stored for the pairs' rows only.
4. `moe_quant_inter_kernel`: the intermediate rows of row blocks in use -> fp8 per row and
   activation group (bk columns, or all I for per-row weights); padding rows of those blocks
   get zeros (scale 1), rows of unused blocks are never read.
5. GEMM2 on the fp8 intermediate and w2, each expert output row rounded to hidden's dtype and
   stored at its pair id; 6. `moe_triton.launch_topk_sum` (weights, -1 ids, non-finite flags).

Scales: block-scaled weights (w13_scale [E, 2I / bn, ceil(H / bk)], w2_scale [E, ceil(H / bn),
ceil(I / bk)], "weight_scale_inv", multiplied): each BLOCK_K step is one fp8 tl.dot, added as
acc += dot * a_scale[:, None] * w_scale[None, :] (BLOCK_K divides bk, so a step never crosses
an activation group or a weight scale block). Per-row weights (w13_scale [E, 2I], w2_scale
[E, H]): the dots accumulate unscaled and acc * a_scale[:, None] * w_scale[None, :] is applied
once after the K loop.

Invariants:
- The contract of `moe_triton.fused_moe`: no host sync, a fixed launch sequence for fixed
  shapes (CUDA-graph capturable and replayable with new routing), -1 ids get no row and add
  nothing, the same `nonfinite_experts` flags (the top-k sum kernel is shared).
- Products of fp8 values are exact in float32, so the kernels equal the reference up to float32
  summation order, and up to the rare activation whose rounding to fp8 that order flips.

Algorithm: grouped GEMM over expert-sorted, block-padded rows (MegaBlocks, Gale et al. 2022)
as in `moe_triton`; fine-grained FP8 scaling (1 x 128 activations, 128 x 128 weights) of
DeepSeek-V3 (DeepSeek-AI 2024, sec. 3.3), per-token / per-channel scaling for the other
layout, both as vLLM's fused_moe applies them to fp8_w8a8 experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from sits.core.errors import InvalidParameterError
from sits.kernels.fp8_gemm_triton import scale_to_fp8, triton_quant_fp8_group
from sits.kernels.fp8_ref import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8_block
from sits.kernels.moe_align import (
    ExpertAlignment,
    align_pairs_to_experts,
    max_padded_rows,
    pair_blocks,
)
from sits.kernels.moe_config import GemmConfig, MoeLaunchConfig
from sits.kernels.moe_triton import _block_rows, _tile_of, launch_topk_sum
from sits.kernels.triton_utils import cdiv, kernels_interpreted, next_power_of_2

QUANT_TILE_ELEMENTS = 4096  # elements of the intermediate per quantization program


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def moe_fp8_gemm1_kernel(
    q_ptr,
    q_scale_ptr,
    w13_ptr,
    w13_scale_ptr,
    inter_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    inter_size,
    hidden_size,
    max_blocks,
    stride_q_token,
    stride_qs_token,
    stride_w_expert,
    stride_w_row,
    stride_s_expert,
    stride_s_row,
    stride_s_col,
    stride_i_row,
    GROUP_K: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    ONE_PAIR_PER_BLOCK: tl.constexpr,
):
    """Program (row block, column block): inter = SiLU(x @ w1^T) * (x @ w3^T), fp8 operands."""
    pid_m, pid_n = _tile_of(tl.program_id(0), max_blocks, tl.cdiv(inter_size, BLOCK_N), GROUP_M)
    rows, pairs, expert = _block_rows(
        pid_m, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, BLOCK_M,
        ONE_PAIR_PER_BLOCK,
    )  # fmt: skip
    if expert < 0:
        return
    tokens = tl.where(pairs < num_pairs, pairs // top_k, 0).to(tl.int64)  # padding -> row 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of I
    cols_in = cols % inter_size  # clamped: loads stay in bounds, stores are masked
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = q_ptr + tokens[:, None] * stride_q_token + ks[None, :]  # [BLOCK_M, BLOCK_K] fp8
    g_ptrs = (
        w13_ptr + expert * stride_w_expert + cols_in[None, :] * stride_w_row + ks[:, None]
    )  # [BLOCK_K, BLOCK_N] fp8 gate rows, transposed
    u_ptrs = g_ptrs + inter_size * stride_w_row  # up rows
    a_scale_ptrs = q_scale_ptr + tokens * stride_qs_token  # [BLOCK_M]
    if BLOCK_SCALES:  # [BLOCK_N] scale rows of the gate and up columns
        gs_ptrs = w13_scale_ptr + expert * stride_s_expert
        us_ptrs = gs_ptrs + ((cols_in + inter_size) // SCALE_BLOCK_N) * stride_s_row
        gs_ptrs += (cols_in // SCALE_BLOCK_N) * stride_s_row
    else:
        gs_ptrs = w13_scale_ptr + expert * stride_s_expert + cols_in * stride_s_row
        us_ptrs = gs_ptrs + inter_size * stride_s_row
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, tl.cdiv(hidden_size, BLOCK_K)):
        k0 = k_step * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            gate = tl.load(g_ptrs)
            up = tl.load(u_ptrs)
        else:
            k_ok = ks < hidden_size - k0  # [BLOCK_K]
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            gate = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            up = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if BLOCK_SCALES:
            a_scale = tl.load(a_scale_ptrs + k0 // GROUP_K)[:, None]  # [BLOCK_M, 1]
            k_block = (k0 // SCALE_BLOCK_K) * stride_s_col
            g_scale = tl.load(gs_ptrs + k_block)[None, :]  # [1, BLOCK_N]
            u_scale = tl.load(us_ptrs + k_block)[None, :]
            acc_gate += tl.dot(a, gate) * (a_scale * g_scale)
            acc_up += tl.dot(a, up) * (a_scale * u_scale)
        else:
            acc_gate = tl.dot(a, gate, acc_gate)
            acc_up = tl.dot(a, up, acc_up)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if not BLOCK_SCALES:  # one scale per token and per weight row
        a_scale = tl.load(a_scale_ptrs)[:, None]  # [BLOCK_M, 1]
        acc_gate *= a_scale * tl.load(gs_ptrs)[None, :]
        acc_up *= a_scale * tl.load(us_ptrs)[None, :]
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # [BLOCK_M, BLOCK_N] float32
    i_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_i_row + cols[None, :]
    mask = (pairs < num_pairs)[:, None] & (cols < inter_size)[None, :]
    tl.store(i_ptrs, act.to(inter_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def moe_quant_inter_kernel(
    inter_ptr,
    q_ptr,
    scale_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    inter_size,
    stride_i_row,
    stride_q_row,
    stride_s_row,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ONE_PAIR_PER_BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    """Program (ROWS rows of one row block, group): q = fp8(inter / s), s = amax / FP8_MAX per
    row (1 for an all-zero or padding row); blocks without work exit at once."""
    chunk = tl.program_id(0)
    group = tl.program_id(1)
    block = chunk * ROWS // BLOCK_M  # ROWS divides BLOCK_M: a chunk lies in one block
    rows = chunk * ROWS + tl.arange(0, ROWS)  # [ROWS]
    expert = tl.load(block_expert_ptr + block)
    if not ONE_PAIR_PER_BLOCK:
        expert = tl.where(block * BLOCK_M < tl.load(num_padded_ptr), expert, -1)
    if expert < 0:
        return
    if ONE_PAIR_PER_BLOCK:  # `moe_align.pair_blocks`: the block's first row is its pair
        real = rows == block * BLOCK_M
    else:
        real = tl.load(sorted_ptr + rows) < num_pairs  # [ROWS] (rows of a block in use)
    local = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    cols = group * GROUP_SIZE + local
    col_ok = (local < GROUP_SIZE) & (cols < inter_size)
    rows64 = rows.to(tl.int64)
    x = tl.load(
        inter_ptr + rows64[:, None] * stride_i_row + cols[None, :],
        mask=real[:, None] & col_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # [ROWS, BLOCK_G]
    amax = tl.max(tl.abs(x), axis=1)  # [ROWS]
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)  # torch's rounding
    v = scale_to_fp8(x, scale[:, None], FP8_MAX, EXACT_ROUND)
    q_ptrs = q_ptr + rows64[:, None] * stride_q_row + cols[None, :]
    tl.store(q_ptrs, v.to(q_ptr.dtype.element_ty), mask=col_ok[None, :])
    tl.store(scale_ptr + rows64 * stride_s_row + group, scale)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def moe_fp8_gemm2_kernel(
    q_ptr,
    q_scale_ptr,
    w2_ptr,
    w2_scale_ptr,
    pair_out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    hidden_size,
    inter_size,
    max_blocks,
    stride_q_row,
    stride_qs_row,
    stride_w_expert,
    stride_w_row,
    stride_s_expert,
    stride_s_row,
    stride_s_col,
    stride_o_pair,
    GROUP_K: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    ONE_PAIR_PER_BLOCK: tl.constexpr,
):
    """Program (row block, column block): expert output = inter @ w2^T (fp8), stored per pair."""
    pid_m, pid_n = _tile_of(tl.program_id(0), max_blocks, tl.cdiv(hidden_size, BLOCK_N), GROUP_M)
    rows, pairs, expert = _block_rows(
        pid_m, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, BLOCK_M,
        ONE_PAIR_PER_BLOCK,
    )  # fmt: skip
    if expert < 0:
        return
    rows64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of H
    cols_in = cols % hidden_size
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = q_ptr + rows64[:, None] * stride_q_row + ks[None, :]  # [BLOCK_M, BLOCK_K] fp8
    b_ptrs = (
        w2_ptr + expert * stride_w_expert + cols_in[None, :] * stride_w_row + ks[:, None]
    )  # [BLOCK_K, BLOCK_N] fp8
    a_scale_ptrs = q_scale_ptr + rows64 * stride_qs_row  # [BLOCK_M]
    if BLOCK_SCALES:
        s_ptrs = w2_scale_ptr + expert * stride_s_expert + (cols_in // SCALE_BLOCK_N) * stride_s_row
    else:
        s_ptrs = w2_scale_ptr + expert * stride_s_expert + cols_in * stride_s_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, tl.cdiv(inter_size, BLOCK_K)):
        k0 = k_step * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks < inter_size - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if BLOCK_SCALES:
            a_scale = tl.load(a_scale_ptrs + k0 // GROUP_K)[:, None]  # [BLOCK_M, 1]
            b_scale = tl.load(s_ptrs + (k0 // SCALE_BLOCK_K) * stride_s_col)[None, :]
            acc += tl.dot(a, b) * (a_scale * b_scale)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        acc *= tl.load(a_scale_ptrs)[:, None] * tl.load(s_ptrs)[None, :]
    o_ptrs = pair_out_ptr + pairs.to(tl.int64)[:, None] * stride_o_pair + cols[None, :]
    mask = (pairs < num_pairs)[:, None] & (cols < hidden_size)[None, :]
    tl.store(o_ptrs, acc.to(pair_out_ptr.dtype.element_ty), mask=mask)


def _scale_strides(
    scale: Tensor, num_rows: int, num_cols: int, block: tuple[int, int] | None, name: str
) -> tuple[int, int, int]:
    """(expert, row, column) strides of an expert weight's scales after checking their shape
    (column stride 0 for per-row scales).

    Raises:
        InvalidParameterError: the shape is not that of the layout `block` names.
    """
    num_experts = scale.shape[0]
    if block is None:
        expected = (num_experts, num_rows)
    else:
        expected = (num_experts, cdiv(num_rows, block[0]), cdiv(num_cols, block[1]))
    if tuple(scale.shape) != expected:
        shape = tuple(scale.shape)
        raise InvalidParameterError(name, f"{name} of shape {shape}, expected {expected}")
    if block is None:
        return scale.stride(0), scale.stride(1), 0
    return scale.stride(0), scale.stride(1), scale.stride(2)


def _check_block_k(gemm: GemmConfig, block: tuple[int, int] | None) -> None:
    """Raises InvalidParameterError when BLOCK_K does not divide the K scale block."""
    if block is not None and block[1] % gemm.block_k:
        raise InvalidParameterError(
            "block_k", f"BLOCK_K {gemm.block_k} must divide the weight's K scale block {block[1]}"
        )


def launch_fp8_gemm1(
    q: Tensor,
    q_scale: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    block: tuple[int, int] | None,
    inter: Tensor,
    alignment: ExpertAlignment,
    top_k: int,
    gemm: GemmConfig,
) -> None:
    """GEMM1 into `inter` [max_padded_rows, I] (hidden's dtype; only the pairs' rows written).

    q [T, H] fp8 with q_scale [T, ceil(H / bk)] (block) or [T, 1] (per row) float32."""
    inter_size, hidden_size = w13.shape[1] // 2, w13.shape[2]
    stride_se, stride_sr, stride_sc = _scale_strides(
        w13_scale, 2 * inter_size, hidden_size, block, "w13_scale"
    )
    _check_block_k(gemm, block)
    max_blocks = alignment.max_num_blocks
    grid = (max_blocks * cdiv(inter_size, gemm.block_n),)
    moe_fp8_gemm1_kernel[grid](
        q, q_scale, w13, w13_scale, inter, alignment.sorted_pair_ids, alignment.block_expert_ids,
        alignment.num_padded_rows, alignment.num_pairs, top_k, inter_size, hidden_size,
        max_blocks, q.stride(0), q_scale.stride(0), w13.stride(0), w13.stride(1),
        stride_se, stride_sr, stride_sc, inter.stride(0),
        GROUP_K=block[1] if block is not None else hidden_size,
        SCALE_BLOCK_N=block[0] if block is not None else 1,
        SCALE_BLOCK_K=block[1] if block is not None else 1,
        BLOCK_SCALES=block is not None,
        BLOCK_M=alignment.block_m,
        BLOCK_N=gemm.block_n,
        BLOCK_K=gemm.block_k,
        GROUP_M=gemm.group_m,
        EVEN_K=hidden_size % gemm.block_k == 0,
        ONE_PAIR_PER_BLOCK=alignment.one_pair_per_block,
        num_warps=gemm.num_warps,
        num_stages=gemm.num_stages,
    )  # fmt: skip


def launch_quant_inter(
    inter: Tensor, alignment: ExpertAlignment, group_size: int
) -> tuple[Tensor, Tensor]:
    """Quantize the rows in use of `inter` [R, I]: (q [R, I] float8_e4m3fn, scale
    [R, ceil(I / group_size)] float32); rows of blocks without work are left unwritten."""
    num_rows, inter_size = inter.shape
    q = torch.empty(num_rows, inter_size, dtype=FP8_DTYPE, device=inter.device)
    num_groups = cdiv(inter_size, group_size)
    scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=inter.device)
    block_g = next_power_of_2(group_size)
    rows = min(alignment.block_m, max(1, QUANT_TILE_ELEMENTS // block_g))  # a power of two
    moe_quant_inter_kernel[(cdiv(num_rows, rows), num_groups)](
        inter, q, scale, alignment.sorted_pair_ids, alignment.block_expert_ids,
        alignment.num_padded_rows, alignment.num_pairs, inter_size,
        inter.stride(0), q.stride(0), scale.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_G=block_g,
        ROWS=rows,
        BLOCK_M=alignment.block_m,
        ONE_PAIR_PER_BLOCK=alignment.one_pair_per_block,
        FP8_MAX=FP8_MAX,
        EXACT_ROUND=kernels_interpreted(),
        num_warps=4,
    )  # fmt: skip
    return q, scale


def launch_fp8_gemm2(
    q: Tensor,
    q_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    block: tuple[int, int] | None,
    pair_out: Tensor,
    alignment: ExpertAlignment,
    gemm: GemmConfig,
) -> None:
    """GEMM2 of the fp8 intermediate (`launch_quant_inter`) into `pair_out` [num_pairs, H]."""
    hidden_size, inter_size = w2.shape[1], w2.shape[2]
    stride_se, stride_sr, stride_sc = _scale_strides(
        w2_scale, hidden_size, inter_size, block, "w2_scale"
    )
    _check_block_k(gemm, block)
    max_blocks = alignment.max_num_blocks
    grid = (max_blocks * cdiv(hidden_size, gemm.block_n),)
    moe_fp8_gemm2_kernel[grid](
        q, q_scale, w2, w2_scale, pair_out, alignment.sorted_pair_ids,
        alignment.block_expert_ids, alignment.num_padded_rows, alignment.num_pairs, hidden_size,
        inter_size, max_blocks, q.stride(0), q_scale.stride(0), w2.stride(0), w2.stride(1),
        stride_se, stride_sr, stride_sc, pair_out.stride(0),
        GROUP_K=block[1] if block is not None else inter_size,
        SCALE_BLOCK_N=block[0] if block is not None else 1,
        SCALE_BLOCK_K=block[1] if block is not None else 1,
        BLOCK_SCALES=block is not None,
        BLOCK_M=alignment.block_m,
        BLOCK_N=gemm.block_n,
        BLOCK_K=gemm.block_k,
        GROUP_M=gemm.group_m,
        EVEN_K=inter_size % gemm.block_k == 0,
        ONE_PAIR_PER_BLOCK=alignment.one_pair_per_block,
        num_warps=gemm.num_warps,
        num_stages=gemm.num_stages,
    )  # fmt: skip


def fused_moe_fp8(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    block: tuple[int, int] | None,
    topk_weights: Tensor,
    topk_ids: Tensor,
    config: MoeLaunchConfig,
    nonfinite_experts: Tensor | None = None,
) -> Tensor:
    """Weighted sum of each token's top-k FP8 experts, W8A8 (see the module docstring).

    Args:
        hidden: [T, H] bf16/fp16/fp32.
        w13: [E, 2I, H] float8_e4m3fn, unit stride along H (gate rows 0:I, up rows I:2I).
        w13_scale: float32, [E, ceil(2I / bn), ceil(H / bk)] when `block`, else [E, 2I].
        w2: [E, H, I] float8_e4m3fn, unit stride along I.
        w2_scale: float32, [E, ceil(H / bn), ceil(I / bk)] when `block`, else [E, H].
        block: (bn, bk) of block scales (activation groups are bk wide), None for per-row
            scales (activations quantized per token).
        topk_weights: [T, k] float32 (other float dtypes are converted).
        topk_ids: [T, k] int32/int64 in [0, E), or -1 for no expert (a padding token).
        config: launch shapes (`moe_config`, dtype fp8_w8a8); with `block`, both GEMMs'
            BLOCK_K must divide bk.
        nonfinite_experts: optional [E] bool, set in place on the device (`moe_triton`).

    Returns:
        [T, H] in hidden's dtype.

    Raises:
        InvalidParameterError: scales of another shape than `block` implies, or a BLOCK_K
            that does not divide bk.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    inter_size = w2.shape[2]
    assert w13.shape == (num_experts, 2 * inter_size, hidden_size), "w13 must be [E, 2I, H]"
    assert w2.shape == (num_experts, hidden_size, inter_size), "w2 must be [E, H, I]"
    assert w13.dtype == w2.dtype == FP8_DTYPE, "expert weights must be float8_e4m3fn"
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)  # [T, H]
    if num_tokens == 0:
        return out
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    w13_scale, w2_scale = w13_scale.float(), w2_scale.float()
    _scale_strides(w13_scale, 2 * inter_size, hidden_size, block, "w13_scale")  # refuse before
    _scale_strides(w2_scale, hidden_size, inter_size, block, "w2_scale")  # any launch
    _check_block_k(config.gemm1, block)
    _check_block_k(config.gemm2, block)
    q, q_scale = triton_quant_fp8_group(hidden, block[1] if block is not None else hidden_size)
    if num_tokens == 1:  # k distinct experts: a block per pair, no alignment launch
        alignment = pair_blocks(topk_ids, config.block_m)
    else:
        alignment = align_pairs_to_experts(topk_ids, num_experts, config.block_m)
    num_rows = max_padded_rows(alignment.num_pairs, num_experts, config.block_m)
    inter = hidden.new_empty(num_rows, inter_size)  # [max_padded_rows, I]
    launch_fp8_gemm1(q, q_scale, w13, w13_scale, block, inter, alignment, top_k, config.gemm1)
    q_inter, inter_scale = launch_quant_inter(
        inter, alignment, block[1] if block is not None else inter_size
    )
    pair_out = hidden.new_empty(alignment.num_pairs, hidden_size)  # [T * k, H]
    launch_fp8_gemm2(q_inter, inter_scale, w2, w2_scale, block, pair_out, alignment, config.gemm2)
    launch_topk_sum(pair_out, topk_weights, topk_ids, hidden, out, nonfinite_experts)
    return out


def _quantize_dequantize(x: Tensor, group_size: int) -> Tensor:
    """x [M, K] through fp8 per row and group_size-wide group, back to float32."""
    q, scale = quantize_fp8_block(x, (1, group_size))
    return dequantize_fp8(q, scale, (1, group_size), torch.float32)


def moe_forward_fp8_w8a8_reference(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    block: tuple[int, int] | None,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    """What `fused_moe_fp8` computes, in plain PyTorch (reads expert ids back to the host).

    Activations are quantized as the kernels do (hidden per token and bk group, or per
    token; the intermediate SiLU(gate) * up, rounded to hidden's dtype, likewise), both
    operands dequantized to float32 and multiplied in float32; each expert output is rounded
    to hidden's dtype, then weighted and summed in float32. Args as `fused_moe_fp8`.

    Returns:
        [T, H] in hidden's dtype.
    """
    hidden_size, inter_size = w2.shape[1], w2.shape[2]
    x = _quantize_dequantize(hidden, block[1] if block is not None else hidden_size)  # [T, H]
    output = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        token_idx, choice_idx = torch.nonzero(topk_ids == expert, as_tuple=True)  # [n] each
        w13_e = dequantize_fp8(w13[expert], w13_scale[expert], block, torch.float32)
        w2_e = dequantize_fp8(w2[expert], w2_scale[expert], block, torch.float32)
        gate, up = (x[token_idx] @ w13_e.T).chunk(2, dim=-1)  # [n, I] each
        inter = (F.silu(gate) * up).to(hidden.dtype)
        inter = _quantize_dequantize(inter, block[1] if block is not None else inter_size)
        expert_out = (inter @ w2_e.T).to(hidden.dtype)  # [n, H]
        weights = topk_weights[token_idx, choice_idx].float()[:, None]  # [n, 1]
        output.index_add_(0, token_idx, expert_out.float() * weights)
    return output.to(hidden.dtype)
