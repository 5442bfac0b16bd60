"""Triton paged attention for prefill: variable-length new tokens over a cached prefix, causal.

One program owns (query tile of a sequence, kv head). Its BLOCK_M rows are BLOCK_Q consecutive
new tokens times the GROUP_P2 query heads of the kv head (token-major, head-minor; padded
heads are masked), so one key/value tile read from the cache serves every query head of the
group. A query at position p sees keys 0..p of its own sequence; the sequence's new tokens
are its last q_len positions (chunked prefill over a cached prefix of seq_len - q_len).

The key loop has two parts: key tiles wholly at or before the tile's first query position
need no mask; the rest (at most about (BLOCK_Q + BLOCK_N) / BLOCK_N tiles) get the causal
mask.

The grid is flat over the step's query tiles, not (max tiles x sequences): sequence s owns the
tile indices [start(s), start(s) + cdiv(q_len(s), BLOCK_Q)) with start(s) = qsl[s] // BLOCK_Q + s
(qsl = query_start_loc). These ranges are disjoint and all lie below num_tokens // BLOCK_Q +
num_seqs, so that many programs per kv head cover every tile, and a program finds its
sequence by binary search over qsl. A step of one long prompt beside hundreds of decodes (or a
mixed-step CUDA graph captured for max_num_seqs sequences) then launches about
num_tokens / BLOCK_Q + num_seqs programs per kv head instead of max_tiles x num_seqs. Tiles
are launched last-first, so the longest programs of a sequence start first.

Invariants:
- Sequences with no new tokens, and with SKIP_SINGLE sequences with exactly one (left to the
  decode kernel), are skipped: their output rows are left as they are.
- Softmax in float32 (log2 domain); output in the output tensor's dtype.
- A quantized cache (`QuantizedKVCache`, fp8 or int8) is dequantized on load (see
  `attention_tile_triton`).

Algorithm: FlashAttention-2 (Dao 2023) with a paged cache (Kwon et al. 2023) and grouped-query
heads packed into the rows of one tile (Ainslie et al. 2023, GQA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.attention_tile_triton import LOG2_E, NEG_INIT, attend_tile, dot_query, paged_kv
from sits.kernels.kv_quant_ref import QuantizedKVCache
from sits.kernels.triton_utils import next_power_of_2


@triton.jit(do_not_specialize=["num_seqs", "search_steps"])  # one compile for any batch
def prefill_attention_kernel(
    query_ptr,
    cache_ptr,
    scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scale_kv,
    stride_scale_block,
    stride_scale_offset,
    stride_table_seq,
    num_seqs,
    search_steps,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Program (flat tile, kv_head): causal attention of BLOCK_Q new tokens x GROUP heads."""
    flat = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    # The last sequence s with start(s) = qsl[s] // BLOCK_Q + s <= flat (module docstring).
    lo = 0
    hi = num_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= flat, mid, lo)
        hi = tl.where(start <= flat, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile = flat - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    if SKIP_SINGLE:  # noqa: SIM102 (constexpr test first: compiled out when False)
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + tile * BLOCK_Q  # position of the tile's first new token
    key_end = seq_len - q_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q)  # last position + 1
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # keys seen by every row of the tile

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    tokens = tile * BLOCK_Q + rows // GROUP_P2  # [BLOCK_M] new-token index in the sequence
    head_in_group = rows % GROUP_P2  # [BLOCK_M]
    row_valid = (tokens < q_len) & (head_in_group < GROUP)  # [BLOCK_M]
    row_pos = seq_len - q_len + tokens  # [BLOCK_M] query positions
    heads = kv_head * GROUP + head_in_group  # [BLOCK_M]
    dims = tl.arange(0, BLOCK_DIM)  # [BLOCK_DIM]
    row_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]  # [BLOCK_M, BLOCK_DIM]
    token_ids = (q_start + tokens).to(tl.int64)  # [BLOCK_M] rows of the flat batch
    q_ptrs = query_ptr + token_ids[:, None] * stride_q_token + heads[:, None] * stride_q_head
    q = tl.load(q_ptrs + dims[None, :], mask=row_mask, other=0.0)  # [BLOCK_M, BLOCK_DIM]
    q = dot_query(q, KV_QUANT)

    acc = tl.zeros([BLOCK_M, BLOCK_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_ptr = cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    v_ptr = k_ptr + stride_cache_kv
    k_scale_ptr = scales_ptr + kv_head  # the head's fp8 scale, or its int8 scale column
    v_scale_ptr = k_scale_ptr + stride_scale_kv
    if KV_QUANT == "fp8":
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, start_n,
            key_end, row_pos, stride_cache_block, stride_cache_offset, stride_scale_block,
            stride_scale_offset, qk_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, BLOCK_DIM, False, False, DOT_PRECISION, KV_QUANT,
        )  # fmt: skip
    for start_n in range(full_end, key_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, start_n,
            key_end, row_pos, stride_cache_block, stride_cache_offset, stride_scale_block,
            stride_scale_offset, qk_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, BLOCK_DIM, True, True, DOT_PRECISION, KV_QUANT,
        )  # fmt: skip
    if KV_QUANT == "fp8":
        acc = acc * tl.load(v_scale_ptr)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_DIM]
    o_ptrs = out_ptr + token_ids[:, None] * stride_o_token + heads[:, None] * stride_o_head
    tl.store(o_ptrs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


def prefill_block_q(block_m: int, group: int) -> int:
    """New tokens per prefill tile: block_m rows shared by next_power_of_2(group) heads each."""
    return max(1, block_m // next_power_of_2(group))


def triton_prefill_attention(
    output: Tensor,
    query: Tensor,
    kv_cache: Tensor | QuantizedKVCache,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    max_query_len: int,
    skip_single: bool,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
) -> None:
    """Causal attention of every sequence's new tokens over its context, written into `output`.

    Args:
        output: [num_tokens, num_heads, head_dim], query dtype; rows of the sequences handled
            are overwritten, all others left as they are.
        query: [num_tokens, num_heads, head_dim], contiguous last dimension.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] in the query dtype, or a
            `QuantizedKVCache` (fp8/int8, dequantized on load); holding the step's K/V
            already; contiguous last dimension.
        block_tables: [num_seqs, max_num_blocks] int32.
        seq_lens: [num_seqs] int32, context length after this step.
        query_start_loc: [num_seqs + 1] int32.
        scale: softmax scale.
        max_query_len: largest new-token count (nothing to do when 0; no device sync).
        skip_single: leave sequences with exactly one new token to the decode kernel.
        block_m: rows (new tokens x padded group heads) per tile, power of two >= 16.
        block_n: key positions per tile, power of two >= 16.
        num_warps, num_stages: launch parameters.
    """
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    kv = paged_kv(kv_cache)
    data = kv.data  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_size, num_kv_heads = data.shape[2], data.shape[3]
    group = num_heads // num_kv_heads
    block_q = prefill_block_q(block_m, group)
    if max_query_len == 0 or num_seqs == 0:
        return
    num_programs = query.shape[0] // block_q + num_seqs  # covers every tile (module docstring)
    prefill_attention_kernel[(num_programs, num_kv_heads)](
        query, data, kv.scales, block_tables, seq_lens, query_start_loc, output,
        scale * LOG2_E, query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        *kv.strides,
        block_tables.stride(0),
        num_seqs,
        max(1, (num_seqs - 1).bit_length()),  # binary-search steps over query_start_loc
        GROUP=group,
        GROUP_P2=next_power_of_2(group),
        BLOCK_Q=block_q,
        BLOCK_M=block_q * next_power_of_2(group),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_DIM=next_power_of_2(head_dim),
        SKIP_SINGLE=skip_single,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_QUANT=kv.kind,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
