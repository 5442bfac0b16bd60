"""Fused MoE over INT4 weight-only (w4a16) experts: the Triton twin of
`moe_ref.moe_forward_int4`, built as `moe_triton.fused_moe` with the weights dequantized in
the GEMMs' K loops.

One call runs the launches of `moe_triton.fused_moe`, none sized by a value read from the
device:
1. The alignment (`moe_align.align_pairs_to_experts`; a one-token step skips it,
   `moe_align.pair_blocks`), imported as is.
2. GEMM1 (`moe_int4_gemm1_kernel`): rows of `hidden` gathered by pair times the block's expert
   gate and up rows. Each K step loads the packed words of the tile once and runs one tl.dot
   per nibble position, as the dense w4a16 GEMM does (`w4a16_gemm_triton.load_int4_words`,
   `int4_plane`: weights dequantized with their group scales and zero points in float32);
   SiLU(gate) * up in the epilogue, stored to the [max_padded_rows, I] intermediate.
3. GEMM2 (`moe_int4_gemm2_kernel`): intermediate rows times the dequantized w2 tiles, each
   expert output row rounded to the activation dtype and stored at its pair id.
4. The top-k sum and non-finite flags: `moe_triton.launch_topk_sum`, imported as is.

Invariants:
- Same contract as `moe_triton.fused_moe` (no host sync, so a call can be captured in a CUDA
  graph and replayed with new routing; ids -1 get no row and add nothing; `nonfinite_experts`
  set, never cleared, on the device) and as `moe_ref.moe_forward_int4`: dequantized weights
  are bit-identical to `int4_ref.dequantize_int4`'s, accumulation is float32, so results
  differ from the reference by the GEMMs' summation order only.
- Weights in the layout of `kernels.int4_ref`, per expert: w13 packed [E, 2I, H / 8] int32,
  scale [E, 2I, H / G] float32, zero [E, 2I, H / G] uint8 or None (8); w2 packed [E, H, I / 8],
  scale / zero [E, H, I / G]; G a multiple of 8 dividing H and I (as the layers check).

Algorithm: grouped GEMM over expert-sorted, block-padded rows (MegaBlocks, Gale et al. 2022)
with group-wise INT4 dequantization fused in the K loop (GPTQ / AWQ Triton GEMMs; vLLM's
fused_moe w4a16 path); SwiGLU expert MLP (Shazeer 2020).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.int4_ref import PACK
from sits.kernels.moe_align import (
    ExpertAlignment,
    align_pairs_to_experts,
    max_padded_rows,
    pair_blocks,
)
from sits.kernels.moe_config import GemmConfig, MoeLaunchConfig
from sits.kernels.moe_triton import _block_rows, _tile_of, launch_topk_sum
from sits.kernels.triton_utils import cdiv
from sits.kernels.w4a16_gemm_triton import MIN_BLOCK_K, int4_plane, load_int4_words

Int4Experts = tuple[Tensor, Tensor, Tensor | None]  # (packed, scale, zero or None)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def moe_int4_gemm1_kernel(
    hidden_ptr,
    packed_ptr,
    scale_ptr,
    zero_ptr,
    inter_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    inter_size,
    hidden_size,
    max_blocks,
    stride_h_token,
    stride_p_expert,
    stride_p_row,
    stride_s_expert,
    stride_s_row,
    stride_z_expert,
    stride_z_row,
    stride_i_row,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ONE_PAIR_PER_BLOCK: tl.constexpr,
):
    """Program (row block, column block): inter = SiLU(x @ w1^T) * (x @ w3^T) of one tile."""
    pid_m, pid_n = _tile_of(tl.program_id(0), max_blocks, tl.cdiv(inter_size, BLOCK_N), GROUP_M)
    rows, pairs, expert = _block_rows(
        pid_m, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, BLOCK_M,
        ONE_PAIR_PER_BLOCK,
    )  # fmt: skip
    if expert < 0:
        return
    tokens = tl.where(pairs < num_pairs, pairs // top_k, 0).to(tl.int64)  # padding -> row 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of I
    gate_rows = (cols % inter_size).to(tl.int64)  # clamped: loads in bounds, stores masked
    up_rows = gate_rows + inter_size
    packed_ptr += expert * stride_p_expert
    scale_ptr += expert * stride_s_expert
    zero_ptr += expert * stride_z_expert
    word_ids = tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8]
    num_words = hidden_size // 8
    a_rows = hidden_ptr + tokens[:, None] * stride_h_token  # [BLOCK_M, 1]
    dtype = hidden_ptr.dtype.element_ty
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for word0 in range(0, num_words, BLOCK_K // 8):
        words = word0 + word_ids  # [BLOCK_K / 8]
        gate_packed, gate_scale, gate_offset = load_int4_words(
            packed_ptr, scale_ptr, zero_ptr, gate_rows, word0, num_words, stride_p_row,
            stride_s_row, stride_z_row, GROUP_SIZE, HAS_ZERO, BLOCK_K,
        )  # fmt: skip
        up_packed, up_scale, up_offset = load_int4_words(
            packed_ptr, scale_ptr, zero_ptr, up_rows, word0, num_words, stride_p_row,
            stride_s_row, stride_z_row, GROUP_SIZE, HAS_ZERO, BLOCK_K,
        )  # fmt: skip
        a_ok = (words < num_words)[None, :]  # [1, BLOCK_K / 8]
        for j in tl.static_range(8):  # columns 8 * word + j: one dot per nibble
            a = tl.load(a_rows + (words * 8 + j)[None, :], mask=a_ok, other=0.0)
            gate = int4_plane(gate_packed, gate_scale, gate_offset, j, dtype)
            up = int4_plane(up_packed, up_scale, up_offset, j, dtype)
            acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # [BLOCK_M, BLOCK_N] float32
    i_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_i_row + cols[None, :]
    tl.store(i_ptrs, act.to(inter_ptr.dtype.element_ty), mask=(cols < inter_size)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def moe_int4_gemm2_kernel(
    inter_ptr,
    packed_ptr,
    scale_ptr,
    zero_ptr,
    pair_out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    hidden_size,
    inter_size,
    max_blocks,
    stride_i_row,
    stride_p_expert,
    stride_p_row,
    stride_s_expert,
    stride_s_row,
    stride_z_expert,
    stride_z_row,
    stride_o_pair,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ONE_PAIR_PER_BLOCK: tl.constexpr,
):
    """Program (row block, column block): expert output = inter @ w2^T, stored per pair."""
    pid_m, pid_n = _tile_of(tl.program_id(0), max_blocks, tl.cdiv(hidden_size, BLOCK_N), GROUP_M)
    rows, pairs, expert = _block_rows(
        pid_m, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, BLOCK_M,
        ONE_PAIR_PER_BLOCK,
    )  # fmt: skip
    if expert < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of H
    w_rows = (cols % hidden_size).to(tl.int64)
    packed_ptr += expert * stride_p_expert
    scale_ptr += expert * stride_s_expert
    zero_ptr += expert * stride_z_expert
    word_ids = tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8]
    num_words = inter_size // 8
    a_rows = inter_ptr + rows.to(tl.int64)[:, None] * stride_i_row  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for word0 in range(0, num_words, BLOCK_K // 8):
        words = word0 + word_ids  # [BLOCK_K / 8]
        packed, scale, offset = load_int4_words(
            packed_ptr, scale_ptr, zero_ptr, w_rows, word0, num_words, stride_p_row,
            stride_s_row, stride_z_row, GROUP_SIZE, HAS_ZERO, BLOCK_K,
        )  # fmt: skip
        a_ok = (words < num_words)[None, :]  # [1, BLOCK_K / 8]
        for j in tl.static_range(8):  # columns 8 * word + j: one dot per nibble
            a = tl.load(a_rows + (words * 8 + j)[None, :], mask=a_ok, other=0.0)
            w = int4_plane(packed, scale, offset, j, inter_ptr.dtype.element_ty)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    o_ptrs = pair_out_ptr + pairs.to(tl.int64)[:, None] * stride_o_pair + cols[None, :]
    mask = (pairs < num_pairs)[:, None] & (cols < hidden_size)[None, :]
    tl.store(o_ptrs, acc.to(pair_out_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _weight_args(experts: Int4Experts) -> tuple:
    """(packed, scale, zero-or-packed, their expert and row strides) for a launch."""
    packed, scale, zero = experts
    zero_arg = zero if zero is not None else packed  # not read without zero points
    return (
        packed, scale, zero_arg,
        packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
        zero_arg.stride(0) if zero is not None else 0,
        zero_arg.stride(1) if zero is not None else 0,
    )  # fmt: skip


def launch_int4_gemm1(
    hidden: Tensor,
    w13: Int4Experts,
    group_size: int,
    inter: Tensor,
    alignment: ExpertAlignment,
    top_k: int,
    gemm: GemmConfig,
) -> None:
    """GEMM1 into `inter` [max_padded_rows, I] (rows past the padded count left unwritten)."""
    packed, scale, zero, *strides = _weight_args(w13)
    inter_size, hidden_size = inter.shape[1], hidden.shape[1]
    max_blocks = alignment.max_num_blocks
    grid = (max_blocks * cdiv(inter_size, gemm.block_n),)
    moe_int4_gemm1_kernel[grid](
        hidden, packed, scale, zero, inter, alignment.sorted_pair_ids,
        alignment.block_expert_ids, alignment.num_padded_rows, alignment.num_pairs, top_k,
        inter_size, hidden_size, max_blocks, hidden.stride(0), *strides, inter.stride(0),
        GROUP_SIZE=group_size,
        HAS_ZERO=w13[2] is not None,
        BLOCK_M=alignment.block_m,
        BLOCK_N=gemm.block_n,
        BLOCK_K=gemm.block_k,
        GROUP_M=gemm.group_m,
        DOT_PRECISION=_dot_precision(hidden.dtype),
        ONE_PAIR_PER_BLOCK=alignment.one_pair_per_block,
        num_warps=gemm.num_warps,
        num_stages=gemm.num_stages,
    )  # fmt: skip


def launch_int4_gemm2(
    inter: Tensor,
    w2: Int4Experts,
    group_size: int,
    pair_out: Tensor,
    alignment: ExpertAlignment,
    gemm: GemmConfig,
) -> None:
    """GEMM2 into `pair_out` [num_pairs, H] (every pair's row written)."""
    packed, scale, zero, *strides = _weight_args(w2)
    hidden_size, inter_size = pair_out.shape[1], inter.shape[1]
    max_blocks = alignment.max_num_blocks
    grid = (max_blocks * cdiv(hidden_size, gemm.block_n),)
    moe_int4_gemm2_kernel[grid](
        inter, packed, scale, zero, pair_out, alignment.sorted_pair_ids,
        alignment.block_expert_ids, alignment.num_padded_rows, alignment.num_pairs,
        hidden_size, inter_size, max_blocks, inter.stride(0), *strides, pair_out.stride(0),
        GROUP_SIZE=group_size,
        HAS_ZERO=w2[2] is not None,
        BLOCK_M=alignment.block_m,
        BLOCK_N=gemm.block_n,
        BLOCK_K=gemm.block_k,
        GROUP_M=gemm.group_m,
        DOT_PRECISION=_dot_precision(inter.dtype),
        ONE_PAIR_PER_BLOCK=alignment.one_pair_per_block,
        num_warps=gemm.num_warps,
        num_stages=gemm.num_stages,
    )  # fmt: skip


def default_int4_config(num_tokens: int, top_k: int, num_experts: int) -> MoeLaunchConfig:
    """Untuned launch shapes by mean rows per expert (T * k / E), BLOCK_K 128 (each nibble's
    dot spans BLOCK_K / 8 = 16 columns). From an H200 sweep at the Qwen3-30B-A3B shape
    (bench/kernels/w4a16_bench.py --sweep): a one-token step streams its k experts over
    64-wide column tiles; up to 8 rows per expert 16-row blocks of 128-wide tiles (1.7x the
    64-wide ones at 10 and 64 tokens); past that 32-row blocks (1.6x the 64-row ones at 256).
    """
    rows_per_expert = num_tokens * top_k / max(1, num_experts)
    if rows_per_expert < 0.25:
        narrow = GemmConfig(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return MoeLaunchConfig(16, narrow, narrow)
    wide = GemmConfig(block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)
    return MoeLaunchConfig(16 if rows_per_expert <= 8 else 32, wide, wide)


def _check_experts(experts: Int4Experts, rows: int, cols: int, group_size: int, what: str) -> None:
    """Refuse expert weights not in the `kernels.int4_ref` layout (ValueError)."""
    packed, scale, zero = experts
    num_experts = packed.shape[0]
    groups = (num_experts, rows, cols // group_size)
    if tuple(packed.shape) != (num_experts, rows, cols // PACK) or packed.dtype != torch.int32:
        raise ValueError(f"{what} packed must be int32 {(num_experts, rows, cols // PACK)}")
    if tuple(scale.shape) != groups or scale.dtype != torch.float32:
        raise ValueError(f"{what} scale must be float32 {groups}, got {tuple(scale.shape)}")
    if zero is not None and (tuple(zero.shape) != groups or zero.dtype != torch.uint8):
        raise ValueError(f"{what} zero must be uint8 {groups}, got {tuple(zero.shape)}")
    for tensor in experts:
        if tensor is not None and tensor.stride(2) != 1:
            raise ValueError(f"{what} tensors need a unit stride along their last dimension")


def fused_moe_int4(
    hidden: Tensor,
    w13: Int4Experts,
    w2: Int4Experts,
    group_size: int,
    topk_weights: Tensor,
    topk_ids: Tensor,
    config: MoeLaunchConfig | None = None,
    nonfinite_experts: Tensor | None = None,
) -> Tensor:
    """Weighted sum of each token's top-k INT4 experts (`moe_ref.moe_forward_int4`).

    Args:
        hidden: [T, H] bf16/fp16/fp32, unit stride along H.
        w13: (packed [E, 2I, H / 8] int32, scale [E, 2I, H / G] float32, zero [E, 2I, H / G]
            uint8 or None); gate rows 0:I, up rows I:2I.
        w2: (packed [E, H, I / 8] int32, scale [E, H, I / G] float32, zero or None).
        group_size: G, a multiple of 8 dividing H and I.
        topk_weights: [T, k] float32 (other float dtypes are converted).
        topk_ids: [T, k] int32/int64 in [0, E), or -1 for no expert (a padding token).
        config: launch shapes (`moe_config`; BLOCK_K >= 128); None: `default_int4_config`.
        nonfinite_experts: optional [E] bool, set in place on the device (`moe_triton`).

    Returns:
        [T, H] in hidden's dtype.

    Raises:
        ValueError: weights not in the layout above, G not a multiple of 8 dividing H and I,
            or a BLOCK_K below 128.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, top_k = w13[0].shape[0], topk_ids.shape[1]
    inter_size = w2[0].shape[2] * PACK
    if group_size % PACK or hidden_size % group_size or inter_size % group_size:
        raise ValueError(f"group size {group_size} must be a multiple of 8 dividing H and I")
    _check_experts(w13, 2 * inter_size, hidden_size, group_size, "w13")
    _check_experts(w2, hidden_size, inter_size, group_size, "w2")
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)  # [T, H]
    if num_tokens == 0:
        return out
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if config is None:
        config = default_int4_config(num_tokens, top_k, num_experts)
    if min(config.gemm1.block_k, config.gemm2.block_k) < MIN_BLOCK_K:
        raise ValueError(f"BLOCK_K must be >= {MIN_BLOCK_K} for INT4 experts: {config}")
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if num_tokens == 1:  # k distinct experts: a block per pair, no alignment launch
        alignment = pair_blocks(topk_ids, config.block_m)
    else:
        alignment = align_pairs_to_experts(topk_ids, num_experts, config.block_m)
    num_rows = max_padded_rows(alignment.num_pairs, num_experts, config.block_m)
    inter = hidden.new_empty(num_rows, inter_size)  # [max_padded_rows, I]
    pair_out = hidden.new_empty(alignment.num_pairs, hidden_size)  # [T * k, H]
    launch_int4_gemm1(hidden, w13, group_size, inter, alignment, top_k, config.gemm1)
    launch_int4_gemm2(inter, w2, group_size, pair_out, alignment, config.gemm2)
    launch_topk_sum(pair_out, topk_weights, topk_ids, hidden, out, nonfinite_experts)
    return out
