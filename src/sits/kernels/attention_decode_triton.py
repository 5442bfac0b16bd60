"""Triton paged attention for decode: one new query token per sequence, split-K over the context.

One program owns (sequence, kv head, split): it attends all GROUP = num_heads // num_kv_heads
query heads of the kv head at once (rows of one tl.dot, padded to BLOCK_M >= 16), so each
key/value tile is read from the cache once per kv head. With num_splits > 1 each split covers
an equal, BLOCK_N-aligned share of the sequence's context and writes unnormalised partials
(acc, running max, running sum); a second kernel combines them. With num_splits == 1 the
first kernel normalises and writes the output itself.

Invariants:
- Sequences whose new-token count is not exactly 1 are skipped (their output rows are left
  as they are), so a mixed batch can run this kernel beside the prefill kernel.
- Each sequence's split length is computed from its own context length in the kernel, so
  num_splits is a launch parameter only (fixed for a CUDA graph, any context length works);
  a split past the end of a short context is empty and weighs 0 in the combination.
- Softmax in float32 (log2 domain); output in the output tensor's dtype.
- A quantized cache (`QuantizedKVCache`, fp8 or int8) is dequantized on load (see
  `attention_tile_triton`); the fp8 V scale multiplies each split's accumulator before it is
  stored, so the combine kernel is the same for every cache kind.

Algorithm: FlashAttention-2 online softmax (Dao 2023) with the split-K ("flash-decoding",
Dao et al. 2023) combination out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.attention_tile_triton import LOG2_E, NEG_INIT, attend_tile, dot_query, paged_kv
from sits.kernels.kv_quant_ref import QuantizedKVCache
from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import next_power_of_2


@triton.jit
def decode_attention_kernel(
    query_ptr,
    cache_ptr,
    scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
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
    stride_part_seq,
    stride_part_head,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (seq, kv_head, split): attention of the sequence's query over its split."""
    pdl_enter(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    key_start = split * split_len
    key_end = tl.maximum(tl.minimum(seq_len, key_start + split_len), key_start)
    full_end = key_start + ((key_end - key_start) // BLOCK_N) * BLOCK_N

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M] query head within the group
    heads = kv_head * GROUP + rows  # [BLOCK_M]
    dims = tl.arange(0, BLOCK_DIM)  # [BLOCK_DIM]
    row_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]  # [BLOCK_M, BLOCK_DIM]
    q_ptrs = (
        query_ptr
        + q_start.to(tl.int64) * stride_q_token
        + heads[:, None] * stride_q_head
        + dims[None, :]
    )
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)  # [BLOCK_M, BLOCK_DIM]
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
    for start_n in range(key_start, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, start_n,
            key_end, rows, stride_cache_block, stride_cache_offset, stride_scale_block,
            stride_scale_offset, qk_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, BLOCK_DIM, False, False, DOT_PRECISION, KV_QUANT,
        )  # fmt: skip
    if full_end < key_end:
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, full_end,
            key_end, rows, stride_cache_block, stride_cache_offset, stride_scale_block,
            stride_scale_offset, qk_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, BLOCK_DIM, True, False, DOT_PRECISION, KV_QUANT,
        )  # fmt: skip
    if KV_QUANT == "fp8":
        acc = acc * tl.load(v_scale_ptr)

    if SPLIT:
        part = seq.to(tl.int64) * stride_part_seq + heads * stride_part_head + split  # [BLOCK_M]
        tl.store(part_max_ptr + part, m_i, mask=rows < GROUP)
        tl.store(part_sum_ptr + part, l_i, mask=rows < GROUP)
        acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :]
        tl.store(acc_ptrs, acc, mask=row_mask)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_DIM]
        o_ptrs = (
            out_ptr
            + q_start.to(tl.int64) * stride_o_token
            + heads[:, None] * stride_o_head
            + dims[None, :]
        )
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def decode_combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_loc_ptr,
    num_splits,
    stride_o_token,
    stride_o_head,
    stride_part_seq,
    stride_part_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (seq, head): combine the splits' partials into the normalised output row."""
    pdl_enter(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len != 1:
        return
    splits = tl.arange(0, BLOCK_SPLITS)  # [BLOCK_SPLITS]
    dims = tl.arange(0, BLOCK_DIM)  # [BLOCK_DIM]
    split_valid = splits < num_splits
    part = seq.to(tl.int64) * stride_part_seq + head * stride_part_head + splits
    m_s = tl.load(part_max_ptr + part, mask=split_valid, other=NEG_INIT)  # [BLOCK_SPLITS]
    l_s = tl.load(part_sum_ptr + part, mask=split_valid, other=0.0)
    weight = tl.exp2(m_s - tl.max(m_s, 0))  # [BLOCK_SPLITS]; 0 for empty splits
    total = tl.sum(weight * l_s, 0)
    acc_mask = split_valid[:, None] & (dims < HEAD_DIM)[None, :]
    acc_s = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=acc_mask, other=0.0
    )  # [BLOCK_SPLITS, BLOCK_DIM]
    out = tl.sum(acc_s * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [BLOCK_DIM]
    o_ptrs = out_ptr + q_start.to(tl.int64) * stride_o_token + head * stride_o_head + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def triton_decode_attention(
    output: Tensor,
    query: Tensor,
    kv_cache: Tensor | QuantizedKVCache,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    num_splits: int,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """Decode attention of every sequence with exactly one new token, written into `output`.

    Args:
        output: [num_tokens, num_heads, head_dim], query dtype; rows of sequences with one new
            token are overwritten, all others left as they are.
        query: [num_tokens, num_heads, head_dim], contiguous last dimension.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] in the query dtype, or a
            `QuantizedKVCache` (fp8/int8, dequantized on load); holding the step's K/V
            already; contiguous last dimension.
        block_tables: [num_seqs, max_num_blocks] int32.
        seq_lens: [num_seqs] int32, context length after this step.
        query_start_loc: [num_seqs + 1] int32.
        scale: softmax scale.
        num_splits: splits of each context (1 = single kernel, no combine pass).
        block_n: key positions per tile (power of two >= 16).
        num_warps, num_stages: launch parameters of the attention kernel.
    """
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    kv = paged_kv(kv_cache)
    data = kv.data  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_size, num_kv_heads = data.shape[2], data.shape[3]
    group = num_heads // num_kv_heads
    block_dim = next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )  # [num_seqs, num_heads, num_splits, head_dim]
        part_max = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device
        )  # [num_seqs, num_heads, num_splits]
        part_sum = torch.empty_like(part_max)
    else:  # unused by the kernel: any float32 tensor will do
        part_acc = part_max = part_sum = output.new_empty(1, dtype=torch.float32)
    decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, data, kv.scales, block_tables, seq_lens, query_start_loc, output,
        part_acc, part_max, part_sum, num_splits, scale * LOG2_E,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        *kv.strides,
        block_tables.stride(0), num_heads * num_splits, num_splits,
        GROUP=group,
        BLOCK_M=max(16, next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_DIM=block_dim,
        SPLIT=split,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_QUANT=kv.kind,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_args(output),
    )  # fmt: skip
    if split:
        decode_combine_kernel[(num_seqs, num_heads)](
            output, part_acc, part_max, part_sum, query_start_loc, num_splits,
            output.stride(0), output.stride(1), num_heads * num_splits, num_splits,
            HEAD_DIM=head_dim,
            BLOCK_DIM=block_dim,
            BLOCK_SPLITS=max(2, next_power_of_2(num_splits)),
            num_warps=4 if block_dim >= 128 else 2,
            **pdl_args(output),
        )  # fmt: skip
