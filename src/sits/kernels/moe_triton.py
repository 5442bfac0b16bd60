"""`TritonMoe`: the GPU `MoeBackend`, fused Triton twin of `moe_ref.TorchMoe`.

One call runs three to six launches, none sized by a value read from the device:
1. `moe_align.align_pairs_to_experts` (one launch for small steps, three for large ones):
   (token, expert) pairs grouped by expert, padded per expert to BLOCK_M rows, with each row
   block's expert id and the padded row count. A one-token step skips it: its k pairs have k
   distinct experts, so each pair is a block of its own (`moe_align.pair_blocks`).
2. GEMM1, grouped over row blocks: rows of `hidden` gathered by pair (token = pair // top_k)
   times the block's expert w13 gate and up rows (two accumulators), SiLU(gate) * up in the
   epilogue, stored to an intermediate [max_padded_rows, I] in sorted-row order.
3. GEMM2, grouped the same way: intermediate rows times w2[expert], each expert output row
   rounded to the activation dtype and stored at its pair id ([T * top_k, H]).
4. The top-k sum: out[t] = sum_j weight[t, j] * expert_out[t * k + j] in float32, cast to the
   activation dtype; it also raises the non-finite flags (below). Pairs with expert id -1 (a
   padding token's) get no GEMM row and add nothing: an all -1 token's output row is zeros.

Invariants:
- Same contract as `moe_ref.moe_forward`: accumulation in float32 (GEMMs and the weighted
  sum), each expert's output rounded to hidden's dtype before it is weighted, so the result
  equals the reference up to the GEMMs' summation order.
- GEMM grids cover `cdiv(max_padded_rows, BLOCK_M)` row blocks (a bound fixed by T, k, E);
  programs past the device-side padded row count exit at once, so a call can be captured in
  a CUDA graph and replayed with new routing. Padding rows are computed from a clamped (valid)
  token row and never stored to the output.
- `nonfinite_experts[e]` is set (never cleared) on the device when an output row of expert e
  holds a non-finite value and that token's hidden row is finite: the sum kernel tests every
  expert output row it reads and, only then, the token's hidden row.
- Routing weights are finite and in [0, 1] (softmax), so weighting never creates or hides a
  non-finite value.

Algorithm: grouped GEMM over expert-sorted, block-padded rows as in MegaBlocks (Gale et al.
2022, block-sparse MoE); the SwiGLU expert MLP of Shazeer 2020 ("GLU Variants Improve
Transformer"); tile order grouped by GROUP_M row blocks for L2 reuse (Triton matmul tutorial).
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.moe_align import (
    ExpertAlignment,
    align_pairs_to_experts,
    max_padded_rows,
    pair_blocks,
)
from sits.kernels.moe_config import GemmConfig, MoeConfigStore, MoeLaunchConfig
from sits.kernels.moe_ref import select_experts
from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import cdiv, next_power_of_2

SUM_BLOCK_H = 512  # hidden columns per program of the top-k sum


@triton.jit
def _tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a program, GROUP_M row blocks swept together."""
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _block_rows(
    pid_m,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    BLOCK_M: tl.constexpr,
    ONE_PAIR_PER_BLOCK: tl.constexpr,
):
    """(rows [BLOCK_M] of the intermediate, pair ids [BLOCK_M] with num_pairs on padding,
    expert) of row block pid_m; expert -1: the block has no work."""
    local = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rows = pid_m * BLOCK_M + local  # [BLOCK_M] sorted rows
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if ONE_PAIR_PER_BLOCK:  # `moe_align.pair_blocks`: block b is pair b alone
        pairs = tl.where(local == 0, pid_m, num_pairs)
    else:
        pairs = tl.load(sorted_ptr + rows)  # [BLOCK_M]
        expert = tl.where(pid_m * BLOCK_M < tl.load(num_padded_ptr), expert, -1)
    return rows, pairs, expert


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def moe_gemm1_kernel(
    hidden_ptr,
    w13_ptr,
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
    stride_w_expert,
    stride_w_row,
    stride_i_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
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
    cols_in = cols % inter_size  # clamped: loads stay in bounds, stores are masked
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = hidden_ptr + tokens[:, None] * stride_h_token + ks[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = (
        w13_ptr + expert * stride_w_expert + cols_in[None, :] * stride_w_row + ks[:, None]
    )  # [BLOCK_K, BLOCK_N] gate rows, transposed
    u_ptrs = g_ptrs + inter_size * stride_w_row  # up rows
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            gate = tl.load(g_ptrs)
            up = tl.load(u_ptrs)
        else:
            k_ok = ks < hidden_size - k0  # [BLOCK_K]
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            gate = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            up = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # [BLOCK_M, BLOCK_N] float32
    i_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_i_row + cols[None, :]
    tl.store(i_ptrs, act.to(inter_ptr.dtype.element_ty), mask=(cols < inter_size)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def moe_gemm2_kernel(
    inter_ptr,
    w2_ptr,
    pair_out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    hidden_size,
    inter_size,
    max_blocks,
    stride_i_row,
    stride_w_expert,
    stride_w_row,
    stride_o_pair,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
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
    cols_in = cols % hidden_size
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_i_row + ks[None, :]
    b_ptrs = (
        w2_ptr + expert * stride_w_expert + cols_in[None, :] * stride_w_row + ks[:, None]
    )  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks < inter_size - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    o_ptrs = pair_out_ptr + pairs.to(tl.int64)[:, None] * stride_o_pair + cols[None, :]
    mask = (pairs < num_pairs)[:, None] & (cols < hidden_size)[None, :]
    tl.store(o_ptrs, acc.to(pair_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_sum_kernel(
    pair_out_ptr,
    weights_ptr,
    topk_ids_ptr,
    hidden_ptr,
    out_ptr,
    flags_ptr,
    top_k,
    hidden_size,
    stride_o_pair,
    stride_h_token,
    stride_out_token,
    CHECK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (token, column block): weighted top-k sum in float32; non-finite flags. The k
    expert rows are read as one [BLOCK_K, BLOCK_H] tile: one round trip to memory, not k."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    col_ok = cols < hidden_size
    choices = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    pairs = token * top_k + choices  # [BLOCK_K]
    choice_ok = choices < top_k
    experts = tl.load(topk_ids_ptr + pairs, mask=choice_ok, other=-1)  # -1: no expert
    weights = tl.load(weights_ptr + pairs, mask=choice_ok, other=0.0)  # [BLOCK_K]
    routed = experts >= 0  # a padding token's pairs have no row: never read
    o_ptrs = pair_out_ptr + pairs[:, None] * stride_o_pair + cols[None, :]
    tile_ok = routed[:, None] & col_ok[None, :]  # [BLOCK_K, BLOCK_H]
    expert_out = tl.load(o_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    acc = tl.sum(weights[:, None] * expert_out, axis=0)  # [BLOCK_H]
    if CHECK:
        bad = tl.sum((~(tl.abs(expert_out) < float("inf"))).to(tl.int32), axis=1)  # [BLOCK_K]
        if tl.max(bad, axis=0) > 0:
            num_bad_inputs = 0
            for h0 in range(0, hidden_size, BLOCK_H):
                h_cols = h0 + tl.arange(0, BLOCK_H)
                x = tl.load(
                    hidden_ptr + token * stride_h_token + h_cols,
                    mask=h_cols < hidden_size,
                    other=0.0,
                ).to(tl.float32)
                num_bad_inputs += tl.sum((~(tl.abs(x) < float("inf"))).to(tl.int32), axis=0)
            if num_bad_inputs == 0:
                one = tl.full([BLOCK_K], 1, flags_ptr.dtype.element_ty)
                tl.store(flags_ptr + experts, one, mask=bad > 0)
    tl.store(
        out_ptr + token * stride_out_token + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok
    )


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_gemm1(
    hidden: Tensor,
    w13: Tensor,
    inter: Tensor,
    alignment: ExpertAlignment,
    top_k: int,
    gemm: GemmConfig,
) -> None:
    """GEMM1 into `inter` [max_padded_rows, I] (rows past the padded count left unwritten)."""
    inter_size, hidden_size = w13.shape[1] // 2, w13.shape[2]
    max_blocks = alignment.max_num_blocks
    grid = (max_blocks * cdiv(inter_size, gemm.block_n),)
    moe_gemm1_kernel[grid](
        hidden, w13, inter, alignment.sorted_pair_ids, alignment.block_expert_ids,
        alignment.num_padded_rows, alignment.num_pairs, top_k, inter_size, hidden_size,
        max_blocks, hidden.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        BLOCK_M=alignment.block_m,
        BLOCK_N=gemm.block_n,
        BLOCK_K=gemm.block_k,
        GROUP_M=gemm.group_m,
        EVEN_K=hidden_size % gemm.block_k == 0,
        DOT_PRECISION=_dot_precision(hidden.dtype),
        ONE_PAIR_PER_BLOCK=alignment.one_pair_per_block,
        num_warps=gemm.num_warps,
        num_stages=gemm.num_stages,
    )  # fmt: skip


def launch_gemm2(
    inter: Tensor, w2: Tensor, pair_out: Tensor, alignment: ExpertAlignment, gemm: GemmConfig
) -> None:
    """GEMM2 into `pair_out` [num_pairs, H] (every pair's row written)."""
    hidden_size, inter_size = w2.shape[1], w2.shape[2]
    max_blocks = alignment.max_num_blocks
    grid = (max_blocks * cdiv(hidden_size, gemm.block_n),)
    moe_gemm2_kernel[grid](
        inter, w2, pair_out, alignment.sorted_pair_ids, alignment.block_expert_ids,
        alignment.num_padded_rows, alignment.num_pairs, hidden_size, inter_size, max_blocks,
        inter.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=alignment.block_m,
        BLOCK_N=gemm.block_n,
        BLOCK_K=gemm.block_k,
        GROUP_M=gemm.group_m,
        EVEN_K=inter_size % gemm.block_k == 0,
        DOT_PRECISION=_dot_precision(inter.dtype),
        ONE_PAIR_PER_BLOCK=alignment.one_pair_per_block,
        num_warps=gemm.num_warps,
        num_stages=gemm.num_stages,
    )  # fmt: skip


def launch_topk_sum(
    pair_out: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    hidden: Tensor,
    out: Tensor,
    nonfinite_experts: Tensor | None,
) -> None:
    """out [T, H] = weighted sum of each token's top_k rows of pair_out; flags (see module)."""
    num_tokens, top_k = topk_ids.shape
    hidden_size = out.shape[1]
    block_h = min(SUM_BLOCK_H, next_power_of_2(hidden_size))
    check = nonfinite_experts is not None
    flags = nonfinite_experts.view(torch.uint8) if check else out  # unused when not checking
    moe_sum_kernel[(num_tokens, cdiv(hidden_size, block_h))](
        pair_out, topk_weights, topk_ids, hidden, out, flags, top_k, hidden_size,
        pair_out.stride(0), hidden.stride(0), out.stride(0),
        CHECK=check,
        BLOCK_H=block_h,
        BLOCK_K=max(2, next_power_of_2(top_k)),
        num_warps=4,
        **pdl_args(out),
    )  # fmt: skip


def fused_moe(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    config: MoeLaunchConfig,
    nonfinite_experts: Tensor | None = None,
) -> Tensor:
    """Weighted sum of each token's top-k experts (the `moe_ref.moe_forward` function).

    Args:
        hidden: [T, H] bf16/fp16/fp32, unit stride along H.
        w13: [E, 2I, H], hidden's dtype, unit stride along H (gate rows 0:I, up rows I:2I).
        w2: [E, H, I], hidden's dtype, unit stride along I.
        topk_weights: [T, k] float32 (other float dtypes are converted).
        topk_ids: [T, k] int32/int64 in [0, E), or -1 for no expert (a padding token).
        config: launch shapes (`moe_config`).
        nonfinite_experts: optional [E] bool, set in place on the device (module docstring).

    Returns:
        [T, H] in hidden's dtype.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    inter_size = w2.shape[2]
    assert w13.shape == (num_experts, 2 * inter_size, hidden_size), "w13 must be [E, 2I, H]"
    assert w2.shape == (num_experts, hidden_size, inter_size), "w2 must be [E, H, I]"
    assert hidden.dtype == w13.dtype == w2.dtype, "hidden and expert weights differ in dtype"
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)  # [T, H]
    if num_tokens == 0:
        return out
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if num_tokens == 1:  # k distinct experts: a block per pair, no alignment launch
        alignment = pair_blocks(topk_ids, config.block_m)
    else:
        alignment = align_pairs_to_experts(topk_ids, num_experts, config.block_m)
    num_rows = max_padded_rows(alignment.num_pairs, num_experts, config.block_m)
    inter = hidden.new_empty(num_rows, inter_size)  # [max_padded_rows, I]
    pair_out = hidden.new_empty(alignment.num_pairs, hidden_size)  # [T * k, H]
    launch_gemm1(hidden, w13, inter, alignment, top_k, config.gemm1)
    launch_gemm2(inter, w2, pair_out, alignment, config.gemm2)
    launch_topk_sum(pair_out, topk_weights, topk_ids, hidden, out, nonfinite_experts)
    return out


class TritonMoe:
    """The fused-kernel MoE backend (`layers.moe.MoeBackend`).

    Args:
        config: fixed launch shapes for every call; None picks per call from the tuned files
            (`moe_config.MoeConfigStore`) or the default heuristic.
        config_dir: where tuned JSON files are looked up (default: `kernels/configs`).

    Attributes:
        cuda_graph_safe: True: a call launches a fixed kernel sequence for fixed shapes with
            no host sync, so the runner may capture it in a decode CUDA graph.
        tuned_num_experts: the expert count the tuned configs are looked up by when the
            weights hold spare slots too (None: the weights' first dimension).
    """

    cuda_graph_safe = True

    def __init__(
        self, config: MoeLaunchConfig | None = None, config_dir: str | Path | None = None
    ) -> None:
        self.config = config
        # The model's expert count for the tuned-config lookup when w13/w2 also hold spare
        # slots (set by `SparseMoeBlock.add_spare_slots`); None = w2.shape[0].
        self.tuned_num_experts: int | None = None
        self.config_store = MoeConfigStore(config_dir)

    def select_experts(
        self, router_logits: Tensor, top_k: int, renormalize: bool
    ) -> tuple[Tensor, Tensor]:
        """See `moe_ref.select_experts`: ([T, k] float32 weights, [T, k] int64 ids)."""
        return select_experts(router_logits, top_k, renormalize)

    def launch_config(
        self, hidden: Tensor, w2: Tensor, top_k: int, dtype: torch.dtype | None = None
    ) -> MoeLaunchConfig:
        """The config a call with these inputs uses (host-side shapes only); dtype: the GEMM
        operands' (default hidden's; float8_e4m3fn picks the fp8_w8a8 configs)."""
        if self.config is not None:
            return self.config
        num_slots, _, inter_size = w2.shape
        num_experts = self.tuned_num_experts or num_slots
        return self.config_store.select(
            hidden.shape[0], top_k, num_experts, inter_size, dtype or hidden.dtype, hidden.device
        )

    def experts(
        self,
        hidden: Tensor,
        w13: Tensor,
        w2: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        nonfinite_experts: Tensor | None = None,
    ) -> Tensor:
        """See `fused_moe`: [T, H] in hidden's dtype; no host sync."""
        config = self.launch_config(hidden, w2, topk_ids.shape[1])
        return fused_moe(hidden, w13, w2, topk_weights, topk_ids, config, nonfinite_experts)

    def experts_fp8(
        self,
        hidden: Tensor,
        w13: Tensor,
        w13_scale: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
        block: tuple[int, int] | None,
        topk_weights: Tensor,
        topk_ids: Tensor,
        nonfinite_experts: Tensor | None = None,
    ) -> Tensor:
        """FP8 experts (`moe_ref.moe_forward_fp8`'s arguments): [T, H] in hidden's dtype, no
        host sync. Up to `fp8_gemv_triton.MOE_GEMV_MAX_TOKENS` tokens the weight-only
        per-pair GEMV (`fused_moe_fp8_gemv`); past them, with FP8 tensor cores (sm_89+),
        `moe_fp8_triton.fused_moe_fp8` (W8A8);
        on older GPUs the weights are dequantized whole to hidden's dtype for `fused_moe`
        (slow, but still graph safe)."""
        # Imported here: moe_fp8_triton imports this module's kernels.
        from sits.kernels import fp8_gemv_triton as gemv
        from sits.kernels.fp8_gemm_triton import fp8_gemm_supported
        from sits.kernels.fp8_ref import FP8_DTYPE, dequantize_fp8
        from sits.kernels.moe_fp8_triton import fused_moe_fp8

        top_k = topk_ids.shape[1]
        if not fp8_gemm_supported(hidden.device):
            w13 = dequantize_fp8(w13, w13_scale, block, hidden.dtype)  # [E, 2I, H]
            w2 = dequantize_fp8(w2, w2_scale, block, hidden.dtype)  # [E, H, I]
            return self.experts(hidden, w13, w2, topk_weights, topk_ids, nonfinite_experts)
        gemv_configs = gemv.moe_configs(block, w2.shape[2])
        if hidden.shape[0] <= gemv.MOE_GEMV_MAX_TOKENS and gemv_configs is not None:
            return gemv.fused_moe_fp8_gemv(
                hidden, w13, w13_scale, w2, w2_scale, block, topk_weights, topk_ids,
                nonfinite_experts, *gemv_configs,
            )  # fmt: skip
        config = self.launch_config(hidden, w2, top_k, FP8_DTYPE)
        return fused_moe_fp8(
            hidden, w13, w13_scale, w2, w2_scale, block, topk_weights, topk_ids, config,
            nonfinite_experts,
        )  # fmt: skip

    def experts_int4(
        self,
        hidden: Tensor,
        w13: tuple[Tensor, Tensor, Tensor | None],
        w2: tuple[Tensor, Tensor, Tensor | None],
        group_size: int,
        topk_weights: Tensor,
        topk_ids: Tensor,
        nonfinite_experts: Tensor | None = None,
    ) -> Tensor:
        """INT4 w4a16 experts (`moe_ref.moe_forward_int4`'s arguments: (packed, scale, zero or
        None) per weight): [T, H] in hidden's dtype, no host sync: up to
        `int4_gemv_triton.MOE_INT4_GEMV_MAX_TOKENS` tokens the per-pair GEMV, past them
        `moe_int4_triton.fused_moe_int4` with its own default launch shapes."""
        # Imported here: moe_int4_triton imports this module's kernels.
        from sits.kernels import int4_gemv_triton as gemv
        from sits.kernels.moe_int4_triton import fused_moe_int4

        up, down = gemv.MOE_UP_CONFIG, gemv.MOE_DOWN_CONFIG
        inter_size = w2[0].shape[2] * 8
        if (
            hidden.shape[0] <= gemv.MOE_INT4_GEMV_MAX_TOKENS
            and gemv.int4_gemv_fits(group_size, hidden.shape[1], up)
            and gemv.int4_gemv_fits(group_size, inter_size, down)
        ):  # decode: one GEMV per token-expert pair
            return gemv.fused_moe_int4_gemv(
                hidden, w13, w2, group_size, topk_weights, topk_ids, nonfinite_experts, up, down
            )
        return fused_moe_int4(
            hidden, w13, w2, group_size, topk_weights, topk_ids, None, nonfinite_experts
        )
