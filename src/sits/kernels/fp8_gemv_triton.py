"""Triton kernels: FP8 weight-only GEMV for decode-sized steps, dense and fused MoE.

At one to a few tokens a projection reads every weight byte once and does two FLOPs per byte:
it is a matrix-vector product, bound by memory. The tiled `fp8_gemm_kernel` pads M to a 16-row
tensor-core tile and widens each weight tile for the tl.dot; measured on an H200 it reads the
Qwen3-30B-A3B projections at about 1 TB/s. These kernels instead give each program BLOCK_N
weight rows of one token (or one token-expert pair): the fp8 tile [BLOCK_N, BLOCK_K] is
widened to float32 and multiplied into a [BLOCK_N, BLOCK_K] float32 accumulator by the token's
activations, and summed along K once after the loop. No activation quantization, no tensor
cores, many programs in flight.

Kernels:
- `fp8_gemv_kernel`: program (row m, column tile): out[m, n] = sum_k x[m, k] * w[n, k] * s.
- `moe_fp8_gemv_up_kernel`: program (pair p, intermediate tile) of a token's top-k expert:
  gate and up rows of expert topk_ids[p] against the token's hidden row, SiLU(gate) * up in
  float32, rounded to hidden's dtype: inter [T * k, I].
- `moe_fp8_gemv_down_kernel`: program (pair p, hidden tile): inter[p] against w2's rows of
  the pair's expert, rounded to hidden's dtype: pair_out [T * k, H]; then
  `moe_triton.launch_topk_sum` weighs and sums each token's k rows (the shared non-finite
  flags included).

Scales: block scales [ceil(N / bn), ceil(K / bk)] (the Qwen3-*-FP8 `weight_scale_inv`): a tile
of BLOCK_N rows lies in one scale row (BLOCK_N divides bn, checked at launch), so each K step
multiplies the activations by that row's column scales before the product; per-row scales [N]
(per-channel, or per-tensor repeated) multiply each row's sum once after the loop.

Invariants:
- Weight-only: the result is `fp8_ref.fp8_linear_weight_only_reference` (dense) and
  `moe_ref.moe_forward_fp8` (MoE) up to float32 summation order and where the weight is
  rounded: every fp8 x bf16/fp16 product is exact in float32.
- Pairs with expert id -1 (a padding token) launch programs that return at once: no row is
  written, and the top-k sum never reads it.
- No host synchronisation and a launch sequence fixed by the shapes: capturable in a CUDA
  graph and replayable with new routing.

Algorithm: the split of a GEMV over output rows with a per-thread K accumulator is the
standard memory-bound matrix-vector layout (e.g. the GEMV kernels of NVIDIA's CUTLASS and of
FasterTransformer); the weight-only FP8 decode path is vLLM's "fp8 marlin" idea (weights in
fp8, activations in bf16) for the small-batch regime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.fp8_ref import FP8_DTYPE
from sits.kernels.moe_triton import launch_topk_sum
from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import cdiv, check_launch_fields

GEMV_MAX_ROWS = 1  # dense: up to this many tokens the GEMV beats the tiled W8A16 kernel
MOE_GEMV_MAX_TOKENS = 8  # fused MoE: up to this many tokens the per-pair GEMV is used
# H200 (bench/kernels/fp8_gemv_bench.py, 2026-12-02): on the qwen3 / llama projections the
# GEMV is 1.3-1.6x the tiled kernel at M = 1, 0.8-1.4x at M = 2 and 0.6-0.85x at M = 4 (each
# row re-reads the weight tile); the MoE GEMV is 1.4-1.5x the grouped W8A8 kernel at 1 token,
# 1.15x at 4 and 1.03x at 8.


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch shape of an FP8 GEMV.

    Attributes:
        block_n: weight rows per program (power of two >= 1; divides bn of block scales).
        block_k: K elements per loop step (power of two >= 16).
        num_warps, num_stages: Triton launch parameters.
    """

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_launch_fields(self, ("block_n", "block_k"), ("num_warps", "num_stages"))
        if self.block_k < 16:
            raise ValueError(f"block_k must be >= 16, got {self.block_k}")


DEFAULT_CONFIG = GemvConfig()
DENSE_CONFIG = GemvConfig(block_n=8, block_k=512, num_warps=8, num_stages=2)
MOE_CONFIGS = {  # scales -> (up, down): the sweep's best at one token on the H200
    "block": (GemvConfig(16, 256, 4, 2), GemvConfig(16, 256, 4, 2)),
    "channel": (GemvConfig(8, 256, 4, 3), GemvConfig(32, 256, 4, 2)),
}


def gemv_fits(config: GemvConfig, block: tuple[int, int] | None, *part_rows: int) -> bool:
    """True when `config`'s tiles lie in single scale rows of `block` (always for per-row
    scales): BLOCK_N divides bn and every part boundary in `part_rows`."""
    return block is None or not (
        block[0] % config.block_n or any(r % config.block_n for r in part_rows)
    )


def moe_configs(block: tuple[int, int] | None, inter_size: int) -> tuple[GemvConfig, ...] | None:
    """The shipped (up, down) MoE GEMV configs for these scales, or None when their tiles do
    not fit experts of intermediate size I (then the grouped kernel runs)."""
    up, down = MOE_CONFIGS["block" if block is not None else "channel"]
    return (up, down) if gemv_fits(up, block, inter_size) and gemv_fits(down, block) else None


@triton.jit
def _scaled_row(x_ptrs, s_ptrs, mask_k, BLOCK_SCALES: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step of a token's activations [BLOCK_K] in float32, times the weight's column
    scales of this tile's scale row when BLOCK_SCALES."""
    if EVEN_K:
        x = tl.load(x_ptrs).to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
    if BLOCK_SCALES:
        x = x * tl.load(s_ptrs, mask=mask_k, other=0.0)
    return x


@triton.jit
def _weight_tile(w_ptrs, mask_n, mask_k, EVEN_K: tl.constexpr):
    """The fp8 tile [BLOCK_N, BLOCK_K] widened to float32 (zeros outside the edges)."""
    if EVEN_K:
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    return w.to(tl.float32)


@triton.jit
def fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_om,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (m, n tile): out[m, n0:n0 + BLOCK_N] = x[m] @ (w * s)[n0:n0 + BLOCK_N].T."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    s_row = s_ptr + (n0 // SCALE_BLOCK_N) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = _scaled_row(
            x_ptr + row * stride_xm + offs_k,
            s_row + (offs_k // SCALE_BLOCK_K) * stride_sk,
            mask_k,
            BLOCK_SCALES,
            EVEN_K,
        )
        acc += _weight_tile(w_rows + offs_k[None, :], mask_n, mask_k, EVEN_K) * x[None, :]
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if not BLOCK_SCALES:
        out = out * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit(do_not_specialize=["top_k"])
def moe_fp8_gemv_up_kernel(
    hidden_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    inter_ptr,
    top_k,
    I,
    H,
    stride_ht,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ip,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (pair, n tile): inter[pair, n] = SiLU(x @ gate[n].T) * (x @ up[n].T)."""
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    token = pair // top_k
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    w_expert = w_ptr + expert * stride_we
    gate_rows = w_expert + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + I * stride_wn
    s_expert = s_ptr + expert * stride_se
    gate_s = s_expert + (n0 // SCALE_BLOCK_N) * stride_sn
    up_s = s_expert + ((I + n0) // SCALE_BLOCK_N) * stride_sn
    x_row = hidden_ptr + token * stride_ht
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < H
        scale_cols = (offs_k // SCALE_BLOCK_K) * stride_sk
        x_gate = _scaled_row(x_row + offs_k, gate_s + scale_cols, mask_k, BLOCK_SCALES, EVEN_K)
        x_up = _scaled_row(x_row + offs_k, up_s + scale_cols, mask_k, BLOCK_SCALES, EVEN_K)
        acc_gate += (
            _weight_tile(gate_rows + offs_k[None, :], mask_n, mask_k, EVEN_K) * x_gate[None, :]
        )
        acc_up += _weight_tile(up_rows + offs_k[None, :], mask_n, mask_k, EVEN_K) * x_up[None, :]
    gate = tl.sum(acc_gate, axis=1)  # [BLOCK_N]
    up = tl.sum(acc_up, axis=1)
    if not BLOCK_SCALES:
        gate = gate * tl.load(s_expert + offs_n * stride_sn, mask=mask_n, other=0.0)
        up = up * tl.load(s_expert + (I + offs_n) * stride_sn, mask=mask_n, other=0.0)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + pair * stride_ip + offs_n, act.to(inter_ptr.dtype.element_ty), mask=mask_n)


@triton.jit(do_not_specialize=["top_k"])
def moe_fp8_gemv_down_kernel(
    inter_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    out_ptr,
    H,
    I,
    stride_ip,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_op,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (pair, n tile): pair_out[pair, n] = inter[pair] @ w2[expert][n].T."""
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    s_expert = s_ptr + expert * stride_se
    s_row = s_expert + (n0 // SCALE_BLOCK_N) * stride_sn
    x_row = inter_ptr + pair * stride_ip
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < I
        x = _scaled_row(
            x_row + offs_k, s_row + (offs_k // SCALE_BLOCK_K) * stride_sk, mask_k,
            BLOCK_SCALES, EVEN_K,
        )  # fmt: skip
        acc += _weight_tile(w_rows + offs_k[None, :], mask_n, mask_k, EVEN_K) * x[None, :]
    out = tl.sum(acc, axis=1)
    if not BLOCK_SCALES:
        out = out * tl.load(s_expert + offs_n * stride_sn, mask=mask_n, other=0.0)
    tl.store(out_ptr + pair * stride_op + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


def _scale_layout(
    scale: Tensor, num_cols: int, num_inner: int, block: tuple[int, int] | None, name: str
) -> tuple[Tensor, int, int]:
    """(scale, row stride, column stride) of a weight's float32 scales over its last two dims.

    Raises:
        ValueError: a shape other than `block` implies ([..., ceil(N / bn), ceil(K / bk)]), or
            [..., N] / one element for per-row scales.
    """
    if block is not None:
        expected = (cdiv(num_cols, block[0]), cdiv(num_inner, block[1]))
        if tuple(scale.shape[-2:]) != expected:
            raise ValueError(f"{name} of shape {tuple(scale.shape)}, expected [..., {expected}]")
        return scale, scale.stride(-2), scale.stride(-1)
    if scale.numel() == 1:
        return scale.reshape(1), 0, 0
    if scale.shape[-1] != num_cols:
        raise ValueError(f"{name} of shape {tuple(scale.shape)}, expected [..., {num_cols}]")
    return scale, scale.stride(-1), 0


def _check_block_n(config: GemvConfig, block: tuple[int, int] | None, *rows: int) -> None:
    """A tile must lie in one scale row: BLOCK_N divides bn and every part's first row."""
    if not gemv_fits(config, block, *rows):
        raise ValueError(
            f"BLOCK_N {config.block_n} must divide the weight's scale block {block[0]} "
            f"and the part boundaries {list(rows)}"
        )


def triton_fp8_gemv(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    block: tuple[int, int] | None = None,
    config: GemvConfig = DEFAULT_CONFIG,
) -> Tensor:
    """y = x @ dequantize(weight).T (+ bias), weight-only, one program per (token, row tile).

    Args:
        x: [M, K] float32/float16/bfloat16 with unit stride along K (M small: decode).
        weight: [N, K] float8_e4m3fn, contiguous.
        weight_scale: float32, [ceil(N / bn), ceil(K / bk)] when `block`, else [N] or one
            element (per-tensor).
        bias: [N] or None.
        block: (bn, bk) of a block-scaled weight, None for per-row / per-tensor scales.
        config: launch shape; with `block`, BLOCK_N must divide bn.

    Returns:
        [M, N] in x's dtype.

    Raises:
        ValueError: shapes or dtypes the kernel does not compute.
    """
    num_rows, num_inner = x.shape
    num_cols = weight.shape[0]
    if weight.dtype != FP8_DTYPE or not weight.is_contiguous() or weight.shape[1] != num_inner:
        raise ValueError(
            f"expected a contiguous {FP8_DTYPE} weight [N, {num_inner}], got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    scale, stride_sn, stride_sk = _scale_layout(
        weight_scale.float(), num_cols, num_inner, block, "weight_scale"
    )
    _check_block_n(config, block)
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    fp8_gemv_kernel[(num_rows, cdiv(num_cols, config.block_n))](
        x, weight, scale, bias if bias is not None else out, out, num_cols, num_inner,
        x.stride(0), weight.stride(0), stride_sn, stride_sk, out.stride(0),
        SCALE_BLOCK_N=block[0] if block is not None else 1,
        SCALE_BLOCK_K=block[1] if block is not None else 1,
        BLOCK_SCALES=block is not None, HAS_BIAS=bias is not None,
        EVEN_K=num_inner % config.block_k == 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(x),
    )  # fmt: skip
    return out


def fused_moe_fp8_gemv(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    block: tuple[int, int] | None,
    topk_weights: Tensor,
    topk_ids: Tensor,
    nonfinite_experts: Tensor | None = None,
    up_config: GemvConfig = DEFAULT_CONFIG,
    down_config: GemvConfig = DEFAULT_CONFIG,
) -> Tensor:
    """Weighted sum of each token's top-k FP8 experts, weight-only, one GEMV per pair.

    Three launches: the gate/up GEMV with SiLU(gate) * up, the down GEMV, the top-k sum. For
    one to a few tokens, whose k pairs mostly hit distinct experts, so that grouping pairs by
    expert (`moe_fp8_triton.fused_moe_fp8`) saves no weight bytes.

    Args:
        hidden: [T, H] bf16/fp16/fp32.
        w13: [E, 2I, H] float8_e4m3fn, unit stride along H (gate rows 0:I, up rows I:2I).
        w13_scale: float32, [E, ceil(2I / bn), ceil(H / bk)] when `block`, else [E, 2I].
        w2: [E, H, I] float8_e4m3fn, unit stride along I.
        w2_scale: float32, [E, ceil(H / bn), ceil(I / bk)] when `block`, else [E, H].
        block: (bn, bk) of block scales, None for per-row scales.
        topk_weights: [T, k] float32 (other float dtypes are converted).
        topk_ids: [T, k] int32/int64 in [0, E), or -1 for no expert.
        nonfinite_experts: optional [E] bool, set in place (`moe_triton.launch_topk_sum`).
        up_config, down_config: launch shapes of the two GEMVs.

    Returns:
        [T, H] in hidden's dtype.

    Raises:
        ValueError: scales of another shape than `block` implies, or a BLOCK_N that does not
            divide bn and I.
    """
    num_tokens, hidden_size = hidden.shape
    inter_size = w2.shape[2]
    assert w13.shape[1:] == (2 * inter_size, hidden_size), "w13 must be [E, 2I, H]"
    assert w13.dtype == w2.dtype == FP8_DTYPE, "expert weights must be float8_e4m3fn"
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "experts need unit stride along K"
    s13, s13_n, s13_k = _scale_layout(
        w13_scale.float(), 2 * inter_size, hidden_size, block, "w13_scale"
    )
    s2, s2_n, s2_k = _scale_layout(w2_scale.float(), hidden_size, inter_size, block, "w2_scale")
    _check_block_n(up_config, block, inter_size)
    _check_block_n(down_config, block)
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    ids = topk_ids.contiguous()
    num_pairs, top_k = ids.numel(), ids.shape[1]
    inter = hidden.new_empty(num_pairs, inter_size)
    moe_fp8_gemv_up_kernel[(num_pairs, cdiv(inter_size, up_config.block_n))](
        hidden, w13, s13, ids, inter, top_k, inter_size, hidden_size,
        hidden.stride(0), w13.stride(0), w13.stride(1),
        s13.stride(0) if s13.dim() > 1 else 0, s13_n, s13_k, inter.stride(0),
        SCALE_BLOCK_N=block[0] if block is not None else 1,
        SCALE_BLOCK_K=block[1] if block is not None else 1,
        BLOCK_SCALES=block is not None, EVEN_K=hidden_size % up_config.block_k == 0,
        BLOCK_N=up_config.block_n, BLOCK_K=up_config.block_k,
        num_warps=up_config.num_warps, num_stages=up_config.num_stages, **pdl_args(hidden),
    )  # fmt: skip
    pair_out = hidden.new_empty(num_pairs, hidden_size)
    moe_fp8_gemv_down_kernel[(num_pairs, cdiv(hidden_size, down_config.block_n))](
        inter, w2, s2, ids, pair_out, hidden_size, inter_size,
        inter.stride(0), w2.stride(0), w2.stride(1),
        s2.stride(0) if s2.dim() > 1 else 0, s2_n, s2_k, pair_out.stride(0),
        SCALE_BLOCK_N=block[0] if block is not None else 1,
        SCALE_BLOCK_K=block[1] if block is not None else 1,
        BLOCK_SCALES=block is not None, EVEN_K=inter_size % down_config.block_k == 0,
        BLOCK_N=down_config.block_n, BLOCK_K=down_config.block_k,
        num_warps=down_config.num_warps, num_stages=down_config.num_stages, **pdl_args(hidden),
    )  # fmt: skip
    launch_topk_sum(
        pair_out, topk_weights.to(torch.float32).contiguous(), ids, hidden, out, nonfinite_experts
    )
    return out
