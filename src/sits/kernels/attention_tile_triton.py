"""Triton device functions shared by the paged attention kernels: one online-softmax step.

A step reads BLOCK_N consecutive key positions of one sequence and one kv head out of the
paged cache (each position's block id looked up in the sequence's block table), and folds
them into the running (acc, m, l) of up to BLOCK_M query rows.

Invariants:
- Scores are in the log2 domain: `qk_scale` = softmax scale * log2(e), so exp2 gives softmax
  weights; m, l and acc are float32; P is cast to the value dtype for the P·V product (as in
  FlashAttention-2).
- The running max starts at a finite NEG_INIT, so a row that has seen only masked keys keeps
  l = 0 and acc = 0 (no NaN from -inf - -inf).
- Masked keys are never loaded (their loads are masked); positions are int32, cache offsets
  int64.

Algorithm: online softmax (Milakov & Gimelshein 2018) in the tiled form of FlashAttention-2
(Dao 2023), over a paged cache (Kwon et al. 2023, PagedAttention).
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_INIT = tl.constexpr(-1.0e38)  # running-max start: finite, below any real score
LOG2_E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2_E); host side


@triton.jit
def load_kv_tile(
    base_ptr,
    kv_offsets,
    dims,
    key_valid,
    MASK_KEYS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """Load [BLOCK_N, BLOCK_DIM] cache rows at base_ptr + kv_offsets (zeros where masked)."""
    ptrs = base_ptr + kv_offsets[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_DIM]
    if MASK_KEYS:
        if BLOCK_DIM != HEAD_DIM:
            tile = tl.load(ptrs, mask=key_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
        else:
            tile = tl.load(ptrs, mask=key_valid[:, None], other=0.0)
    else:
        if BLOCK_DIM != HEAD_DIM:
            tile = tl.load(ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    block_table_ptr,
    start_n,
    key_end,
    row_pos,
    stride_cache_block,
    stride_cache_offset,
    qk_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold key positions start_n .. start_n + BLOCK_N - 1 into the running softmax.

    Args:
        acc: [BLOCK_M, BLOCK_DIM] float32, unnormalised output.
        m_i, l_i: [BLOCK_M] float32, running max (log2 domain) and running sum.
        q: [BLOCK_M, BLOCK_DIM], query dtype.
        k_ptr, v_ptr: cache pointers already offset to the kv head (K and V halves).
        block_table_ptr: the sequence's row of the block table (int32 block ids).
        start_n: first key position of the tile.
        key_end: key positions >= key_end are not loaded (MASK_KEYS) and score -inf.
        row_pos: [BLOCK_M] int32 query positions; with MASK_CAUSAL keys after a row's
            position score -inf for that row.
        qk_scale: softmax scale * log2(e).

    Returns:
        (acc, m_i, l_i) updated.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    dims = tl.arange(0, BLOCK_DIM)  # [BLOCK_DIM]
    key_valid = offs_n < key_end  # [BLOCK_N]
    if MASK_KEYS:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=key_valid, other=0)
    else:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
    kv_offsets = (
        block_ids.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_offset
    )  # [BLOCK_N] int64
    k = load_kv_tile(k_ptr, kv_offsets, dims, key_valid, MASK_KEYS, HEAD_DIM, BLOCK_DIM)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASK_CAUSAL:
        qk = tl.where(offs_n[None, :] <= row_pos[:, None], qk, float("-inf"))
    elif MASK_KEYS:
        qk = tl.where(key_valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescale of the old terms
    p = tl.exp2(qk - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv_tile(v_ptr, kv_offsets, dims, key_valid, MASK_KEYS, HEAD_DIM, BLOCK_DIM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
