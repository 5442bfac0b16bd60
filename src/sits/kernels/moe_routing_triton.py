"""Triton kernel: one MoE layer's routing and expert bookkeeping in a single launch.

`fused_route` does, for a block of tokens per program, what the PyTorch path of
`layers.moe.SparseMoeBlock` does in about ten kernels: mask the frozen experts' router logits
with -inf (`ExpertState.mask_logits`), softmax over all experts in float32, top-k and optional
renormalisation (`moe_ref.select_experts`), add the routed tokens of real (unpadded) tokens to
the per-expert counters (`ExpertState.count`) and mark the experts that received a real token
with a finite logits row (`ExpertState.mark_checked`).
`gate_route` (decode steps of one or two tokens) also computes the router logits itself: a
GEMV over the gate rows split across programs, whose last program to finish routes the step,
so one launch replaces the gate's GEMM and the routing.

Invariants:
- Order of the k experts: descending probability; equal probabilities (equal masked logits)
  go lowest expert id first. torch.topk leaves the order of equal values unspecified (its CPU
  selection returns ties in no fixed order), so the two agree exactly whenever the k + 1
  largest masked logits of a row are distinct, which is how they are compared in the tests
  (bfloat16 logits tie often: there the kernel's order is still deterministic).
  The kernel ranks by the masked logit itself (softmax is monotone), so two logits whose
  probabilities round to the same float32 keep their logit order: one valid torch answer.
- A row whose softmax is NaN in torch (a NaN or +inf logit among the unfrozen experts, or all
  of them -inf) gets NaN weights, as in torch, and is routed to its lowest-id unfrozen experts
  (torch picks arbitrary NaN entries, frozen ones included): frozen experts never receive a
  token as long as at least top_k experts are unfrozen (`ExpertState` guarantees it).
- Padding tokens (`token_mask` False) are routed to no expert: id -1 and weight 0 in every
  choice, so the experts compute nothing for them (`moe_triton.fused_moe` and
  `moe_ref.moe_forward` skip id -1; their output rows are zeros). Without this, a decode
  batch padded to a captured graph size sent its padding rows, which share one input, to k
  more experts per layer, whose weights the step then read for nothing.
- Finite-input test: an expert is checked when it receives a real token whose logits row is
  finite over the unfrozen experts. A hidden row holding a NaN or an infinity makes every
  logit of its row non-finite (x_i * w_i is NaN or infinite for w_i != 0 or x_i = NaN, and
  NaN for inf * 0), so this equals `isfinite(hidden).all(-1)` for finite router weights
  whose logits do not overflow, without reading the hidden row; a frozen expert's (possibly
  corrupt) gate row is ignored.
- Counters are added with relaxed atomics, one per (program, expert that got tokens), so
  programs may run in any order; no host synchronisation, no allocation sized by device
  values: a call can be captured in a CUDA graph.
- `gate_route`'s logits are rounded to hidden's dtype before routing, as the gate's
  `nn.Linear` output is, so both paths route alike up to the summation order of the logits.

Algorithm: softmax top-k routing of sparsely-gated MoE (Shazeer et al. 2017) with the Mixtral
renormalisation (Jiang et al. 2024). Top-k is k rounds of an argmax over an order-preserving
int32 image of the float32 logits (positive floats keep their bits, negative floats flip their
magnitude bits), ties to the lowest index. The last-program-routes pattern of `gate_route`
is the "threadfence reduction" of NVIDIA's CUDA samples (a release/acquire counter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import as_bytes, cdiv, next_power_of_2

MAX_EXPERTS = 256  # widest router row one program holds
MAX_TOP_K = 16
GATE_ROUTE_MAX_TOKENS = 16  # `gate_route` (router GEMV + routing) takes up to this many tokens
# H200 (bench/kernels/gate_route_bench.py, 2026-12-02), against the gate's cuBLAS GEMM and
# `fused_route`: Qwen3-30B-A3B 1.51x at 1 token, 1.09x at 2, 0.56x at 4; Mixtral 2.10x, 1.45x,
# 0.95x (each token re-walks the gate rows in the same program). The MoE layer uses it up to:
GATE_ROUTE_FASTER_TOKENS = 2
GATE_ROUTE_PROGRAMS = 128  # the sweep's best at one token: one gate row per program (E=128)
GATE_ROUTE_BLOCK_H = 512  # hidden columns per loop step
GATE_ROUTE_WARPS = 1
# int32 keys below every logit's key (-inf maps to -2139095041), as constexprs for the kernel:
KEY_TAKEN = tl.constexpr(-2147483647)  # padding columns and experts already chosen
KEY_FROZEN = tl.constexpr(-2147483646)  # frozen experts: after every other expert


@triton.jit
def _float_key(x):
    """float32 x -> int32 with the same order (-0.0 just below +0.0); NaN never reaches it."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_float(key):
    """Inverse of `_float_key` (the map is an involution on the bits)."""
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _route_rows(
    x,
    rows,
    row_in,
    frozen_ptr,
    mask_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens_ptr,
    checked_ptr,
    num_experts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Route the rows `rows` ([BLOCK_T] int32, `row_in` the real ones) of logits x
    [BLOCK_T, BLOCK_E] float32 (columns past num_experts ignored): store their top-k weights
    and ids, add their counts, mark the checked experts (see `fused_route`)."""
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    col_in = cols < num_experts
    frozen = tl.load(frozen_ptr + cols, mask=col_in, other=0) != 0  # [BLOCK_E]
    x = tl.where(col_in[None, :], x, float("-inf"))
    # Finite-input test over the unfrozen experts (NaN fails `< inf`).
    open_col = col_in & ~frozen  # [BLOCK_E]
    bad = open_col[None, :] & ~(tl.abs(x) < float("inf"))  # [BLOCK_T, BLOCK_E]
    row_finite = tl.max(bad.to(tl.int32), axis=1) == 0  # [BLOCK_T]
    # float32 softmax denominator of the masked row; NaN exactly where torch's softmax is.
    x = tl.where(frozen[None, :], float("-inf"), x)
    row_max = tl.max(x, axis=1)  # [BLOCK_T]
    exps = tl.where(col_in[None, :], tl.exp(x - row_max[:, None]), 0.0)
    denom = tl.sum(exps, axis=1)  # [BLOCK_T]
    row_nan = denom != denom  # [BLOCK_T]
    key = tl.where(row_nan[:, None], 0, _float_key(x))  # [BLOCK_T, BLOCK_E] int32
    key = tl.where(frozen[None, :], KEY_FROZEN, key)
    key = tl.where(col_in[None, :], key, KEY_TAKEN)
    k_cols = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    weights = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.int32)
    routed = tl.zeros([x.shape[0], BLOCK_E], dtype=tl.int32)  # 1 where the token chose it
    for choice in tl.static_range(TOP_K):
        best, best_id = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
        weight = tl.exp(_key_float(best) - row_max) / denom  # [BLOCK_T]; NaN on NaN rows
        weights = tl.where(k_cols == choice, weight[:, None], weights)
        ids = tl.where(k_cols == choice, best_id[:, None], ids)
        chosen = cols[None, :] == best_id[:, None]  # [BLOCK_T, BLOCK_E]
        routed = tl.where(chosen, 1, routed)
        key = tl.where(chosen, KEY_TAKEN, key)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    real = row_in
    if HAS_MASK:
        real = real & (tl.load(mask_ptr + rows, mask=row_in, other=0) != 0)
        weights = tl.where(real[:, None], weights, 0.0)  # padding: no expert, weight 0
        ids = tl.where(real[:, None], ids, -1)
    out_offsets = rows.to(tl.int64)[:, None] * TOP_K + k_cols  # [BLOCK_T, BLOCK_K]
    out_mask = row_in[:, None] & (k_cols < TOP_K)
    tl.store(weights_ptr + out_offsets, weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, ids.to(tl.int64), mask=out_mask)
    counts = tl.sum(tl.where(real[:, None], routed, 0), axis=0)  # [BLOCK_E]
    tl.atomic_add(
        num_tokens_ptr + cols, counts.to(tl.int64), mask=col_in & (counts > 0), sem="relaxed"
    )
    checks = tl.max(tl.where((real & row_finite)[:, None], routed, 0), axis=0)  # [BLOCK_E]
    one = tl.full([BLOCK_E], 1, checked_ptr.dtype.element_ty)
    tl.store(checked_ptr + cols, one, mask=col_in & (checks > 0))


@triton.jit(do_not_specialize=["num_tokens"])
def fused_route_kernel(
    logits_ptr,
    frozen_ptr,
    mask_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens_ptr,
    checked_ptr,
    num_tokens,
    num_experts,
    stride_logits_token,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p routes tokens [p * BLOCK_T, (p + 1) * BLOCK_T) (see `fused_route`)."""
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    row_in = rows < num_tokens
    tile_in = row_in[:, None] & (cols < num_experts)[None, :]  # [BLOCK_T, BLOCK_E]
    offsets = rows.to(tl.int64)[:, None] * stride_logits_token + cols[None, :]
    x = tl.load(logits_ptr + offsets, mask=tile_in, other=0.0).to(tl.float32)
    _route_rows(
        x, rows, row_in, frozen_ptr, mask_ptr, weights_ptr, ids_ptr, num_tokens_ptr,
        checked_ptr, num_experts, TOP_K, RENORMALIZE, HAS_MASK, BLOCK_E, BLOCK_K,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens"])
def gate_route_kernel(
    hidden_ptr,
    gate_ptr,
    logits_ptr,
    arrivals_ptr,
    frozen_ptr,
    mask_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens_ptr,
    checked_ptr,
    num_tokens,
    num_experts,
    hidden_size,
    stride_hidden_token,
    stride_gate_expert,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p: the router logits of experts [p * BLOCK_G, (p + 1) * BLOCK_G) for every
    token, rounded to hidden's dtype (what the gate's nn.Linear returns); the last program
    to finish routes all tokens (see `gate_route`)."""
    pdl_enter(USE_PDL)
    experts = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    expert_in = experts < num_experts
    gate_rows = gate_ptr + experts.to(tl.int64)[:, None] * stride_gate_expert  # [BLOCK_G, 1]
    for token in range(num_tokens):
        x_row = hidden_ptr + token * stride_hidden_token
        acc = tl.zeros([BLOCK_G, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, hidden_size, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_in = offs_h < hidden_size
            x = tl.load(x_row + offs_h, mask=h_in, other=0.0).to(tl.float32)
            w = tl.load(gate_rows + offs_h[None, :], mask=expert_in[:, None] & h_in[None, :])
            acc += w.to(tl.float32) * x[None, :]
        logit = tl.sum(acc, axis=1).to(hidden_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + token * BLOCK_E + experts, logit, mask=expert_in)
    # The last program to arrive routes (the threadfence reduction of the CUDA samples):
    # every program's logits are stored before its release add; the last one's acquire add
    # sees them all, and it reads them past L1 (.cg), which may hold an earlier call's.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.store(arrivals_ptr, 0)  # ready for the next launch (stream order)
        rows = tl.arange(0, BLOCK_T)  # [BLOCK_T]
        row_in = rows < num_tokens
        cols = tl.arange(0, BLOCK_E)
        tile = logits_ptr + rows[:, None] * BLOCK_E + cols[None, :]
        tile_in = row_in[:, None] & (cols < num_experts)[None, :]
        x = tl.load(tile, mask=tile_in, other=0.0, cache_modifier=".cg")
        _route_rows(
            x, rows, row_in, frozen_ptr, mask_ptr, weights_ptr, ids_ptr, num_tokens_ptr,
            checked_ptr, num_experts, TOP_K, RENORMALIZE, HAS_MASK, BLOCK_E, BLOCK_K,
        )  # fmt: skip


def _check_route_args(
    num_experts: int, top_k: int, frozen: Tensor, num_tokens_acc: Tensor, checked: Tensor
) -> None:
    """The kernels' limits and the counters' shapes (asserts: callers pass them right)."""
    assert 1 <= top_k <= min(MAX_TOP_K, num_experts), f"top_k {top_k} out of range"
    assert num_experts <= MAX_EXPERTS, f"{num_experts} experts > {MAX_EXPERTS}"
    assert frozen.shape == (num_experts,) and frozen.is_contiguous()
    assert num_tokens_acc.shape == (num_experts,) and num_tokens_acc.dtype == torch.int64
    assert checked.shape == (num_experts,) and checked.is_contiguous()


def default_block_tokens(num_tokens: int) -> int:
    """Tokens per program: one for decode-sized batches (most programs in flight, no wasted
    rows), eight beyond 512 tokens (fewer atomics on the counters)."""
    return 1 if num_tokens <= 512 else 8


def fused_route(
    router_logits: Tensor,
    frozen: Tensor,
    top_k: int,
    renormalize: bool,
    num_tokens_acc: Tensor,
    checked: Tensor,
    token_mask: Tensor | None = None,
    block_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Route a step's tokens and update the expert counters, in one launch.

    Equals `ExpertState.mask_logits` -> `moe_ref.select_experts` -> `ExpertState.count` ->
    `ExpertState.mark_checked` on real tokens (see the module docstring for the order of
    equal values, for non-finite rows and for padding tokens).

    Args:
        router_logits: [num_tokens, num_experts] float32, float16 or bfloat16 (read as
            float32), last dimension contiguous; num_experts <= 256.
        frozen: [num_experts] bool, experts masked out of the routing.
        top_k: experts per token, 1 <= top_k <= min(16, num_experts).
        renormalize: divide the k weights by their sum.
        num_tokens_acc: [num_experts] int64, += routed (token, expert) pairs of real tokens.
        checked: [num_experts] bool or int32, set to 1 (never cleared) for every expert that
            received a real token whose logits row is finite over the unfrozen experts.
        token_mask: [num_tokens] bool, False on padding tokens (routed to no expert: ids -1
            and weights 0; not counted, not checked); None = every token is real.
        block_tokens: tokens per program (a power of two); None = `default_block_tokens`.

    Returns:
        (topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64), the
        experts in descending weight order; -1 and 0 on padding tokens.
    """
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1 or num_experts == 1, "logits rows must be contiguous"
    _check_route_args(num_experts, top_k, frozen, num_tokens_acc, checked)
    device = router_logits.device
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return topk_weights, topk_ids
    if token_mask is not None:
        assert token_mask.shape == (num_tokens,) and token_mask.dtype == torch.bool
    block_t = block_tokens if block_tokens is not None else default_block_tokens(num_tokens)
    block_e = next_power_of_2(num_experts)
    mask = as_bytes(token_mask) if token_mask is not None else frozen  # unread when None
    fused_route_kernel[(cdiv(num_tokens, block_t),)](
        router_logits, as_bytes(frozen), mask, topk_weights, topk_ids, num_tokens_acc,
        as_bytes(checked), num_tokens, num_experts, router_logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        HAS_MASK=token_mask is not None,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k),
        num_warps=max(1, min(4, block_t * block_e // 256)),
        **pdl_args(topk_ids),
    )  # fmt: skip
    return topk_weights, topk_ids


def gate_route(
    hidden: Tensor,
    gate_weight: Tensor,
    arrivals: Tensor,
    frozen: Tensor,
    top_k: int,
    renormalize: bool,
    num_tokens_acc: Tensor,
    checked: Tensor,
    token_mask: Tensor | None = None,
    programs: int = GATE_ROUTE_PROGRAMS,
    block_h: int = GATE_ROUTE_BLOCK_H,
    num_warps: int = GATE_ROUTE_WARPS,
) -> tuple[Tensor, Tensor]:
    """The router GEMV and `fused_route` in one launch, for decode-sized steps.

    Equals `fused_route(hidden @ gate_weight.T, ...)` with the logits rounded to hidden's
    dtype, as the gate's `nn.Linear` returns them (float32 sums in another order than
    cuBLAS's: a logit may differ by one unit in the last place). Programs of BLOCK_G experts
    compute every token's logits into a float32 scratch; the last program to finish (counted
    in `arrivals`) routes all tokens. At one token this replaces a cuBLAS GEMM that reads the
    512 KB Qwen3-30B-A3B gate at ~0.1 TB/s and the routing launch after it.

    Args:
        hidden: [T, H] float32/float16/bfloat16, unit stride along H; T <= GATE_ROUTE_MAX_TOKENS.
        gate_weight: [E, H], hidden's dtype, unit stride along H; E <= 256.
        arrivals: [1] int32 zero on the device, kept for the next call (returned to zero):
            one per layer is safe, calls on one stream run in order.
        frozen, top_k, renormalize, num_tokens_acc, checked, token_mask: as `fused_route`.
        programs: programs the experts are split over (fewer when E is smaller); block_h:
            hidden columns per loop step; num_warps: per program (launch parameters).

    Returns:
        (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64), as `fused_route`.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts = gate_weight.shape[0]
    assert 1 <= num_tokens <= GATE_ROUTE_MAX_TOKENS, f"{num_tokens} tokens for gate_route"
    assert gate_weight.shape == (num_experts, hidden_size) and gate_weight.stride(1) == 1
    assert hidden.stride(1) == 1 and gate_weight.dtype == hidden.dtype
    assert arrivals.shape == (1,) and arrivals.dtype == torch.int32
    _check_route_args(num_experts, top_k, frozen, num_tokens_acc, checked)
    device = hidden.device
    block_e = next_power_of_2(num_experts)
    block_t = next_power_of_2(num_tokens)
    logits = torch.empty(block_t, block_e, dtype=torch.float32, device=device)  # scratch
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if token_mask is not None:
        assert token_mask.shape == (num_tokens,) and token_mask.dtype == torch.bool
    block_g = max(1, num_experts // programs)
    block_g = 1 << (block_g.bit_length() - 1)  # a power of two
    mask = as_bytes(token_mask) if token_mask is not None else frozen  # unread when None
    gate_route_kernel[(cdiv(num_experts, block_g),)](
        hidden, gate_weight, logits, arrivals, as_bytes(frozen), mask, topk_weights, topk_ids,
        num_tokens_acc, as_bytes(checked), num_tokens, num_experts, hidden_size,
        hidden.stride(0), gate_weight.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        HAS_MASK=token_mask is not None,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k),
        BLOCK_G=block_g,
        BLOCK_H=min(block_h, next_power_of_2(hidden_size)),
        num_warps=num_warps,
        **pdl_args(topk_ids),
    )  # fmt: skip
    return topk_weights, topk_ids
