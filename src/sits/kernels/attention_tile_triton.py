"""Triton device functions shared by the paged attention kernels: one online-softmax step.

A step reads BLOCK_N consecutive key positions of one sequence and one kv head out of the
paged cache (each position's block id looked up in the sequence's block table), and folds
them into the running (acc, m, l) of up to BLOCK_M query rows.

The cache is either in the query dtype (KV_QUANT "none") or quantized (see
`sits.kernels.kv_quant_ref`): "fp8" (float8_e4m3fn bytes, one scale per kv head) or "int8"
(one scale per token and kv head). Quantized tiles are dequantized on load: the stored values
are converted exactly to the dot operand dtype (every e4m3 and int8 value is exact in
bf16/fp16/fp32) and the scales are applied in float32 where they factor out of the dot
products: q.(s_j k_j) = s_j (q.k_j) on the scores, sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j
on P (int8), and a per-head fp8 scale on the scores' scale and the finished accumulator (done
by the calling kernel). The dot operands are in the query dtype, except fp8 with bfloat16
queries: float16 (`dot_query`), since e4m3 -> f16 is one packed instruction per two values
on sm_90 while e4m3 -> bf16 adds a conversion per value, and float16 holds q (clamped to
+-65504), every e4m3 value and P in [0, 1] at least as precisely as bfloat16.

Invariants:
- Scores are in the log2 domain: `qk_scale` = softmax scale * log2(e), so exp2 gives softmax
  weights; m, l and acc are float32; P is cast to the value dtype for the P·V product (as in
  FlashAttention-2).
- The running max starts at a finite NEG_INIT, so a row that has seen only masked keys keeps
  l = 0 and acc = 0 (no NaN from -inf - -inf).
- Masked keys are never loaded (their loads are masked); positions are int32, cache offsets
  int64.
- KV_QUANT is a constexpr: the unquantized path compiles to the same code as without it.

Algorithm: online softmax (Milakov & Gimelshein 2018) in the tiled form of FlashAttention-2
(Dao 2023), over a paged cache (Kwon et al. 2023, PagedAttention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.kv_quant_ref import QuantizedKVCache

NEG_INIT = tl.constexpr(-1.0e38)  # running-max start: finite, below any real score
LOG2_E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2_E); host side
FP16_MAX = tl.constexpr(65504.0)  # largest finite float16


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Launch arguments of a layer's paged cache, plain or quantized.

    Attributes:
        data: [2, num_blocks, block_size, num_kv_heads, head_dim]; the query dtype, int8, or
            (fp8) a uint8 view of the float8_e4m3fn bytes.
        scales: float32 scales (`QuantizedKVCache.scales`); any tensor when unquantized.
        kind: "none", "fp8" or "int8" (the kernels' KV_QUANT).
        scale_strides: (K/V, block, offset) element strides of `scales` (0 where it has no
            such dimension); the kv-head stride is 1.
    """

    data: Tensor
    scales: Tensor
    kind: str
    scale_strides: tuple[int, int, int]

    @property
    def strides(self) -> tuple[int, ...]:
        """The kernels' cache stride arguments: data (K/V, block, offset, kv head), then
        `scale_strides`."""
        data = self.data
        return (data.stride(0), data.stride(1), data.stride(2), data.stride(3), *self.scale_strides)


def paged_kv(kv_cache: Tensor | QuantizedKVCache) -> PagedKV:
    """The kernels' view of a cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    tensor or `QuantizedKVCache` (fp8 scales [2, num_kv_heads], int8 [2, num_blocks,
    block_size, num_kv_heads], float32, contiguous last dimension)."""
    if not isinstance(kv_cache, QuantizedKVCache):
        return PagedKV(kv_cache, kv_cache, "none", (0, 0, 0))
    data, scales = kv_cache.data, kv_cache.scales
    assert scales.dtype == torch.float32 and scales.stride(-1) == 1, "scales: float32 rows"
    if kv_cache.kind == "fp8":
        assert scales.dim() == 2, "fp8 scales are [2, num_kv_heads]"
        return PagedKV(data.view(torch.uint8), scales, "fp8", (scales.stride(0), 0, 0))
    assert kv_cache.kind == "int8" and scales.dim() == 4, "int8 scales are [2, blocks, size, heads]"
    return PagedKV(data, scales, "int8", (scales.stride(0), scales.stride(1), scales.stride(2)))


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
def dot_query(q, KV_QUANT: tl.constexpr):
    """The query tile as the attention dot operand: float16 (clamped to its finite range) for
    an fp8 cache and bfloat16 queries, else q unchanged (see the module docstring)."""
    if KV_QUANT == "fp8":  # noqa: SIM102 (constexpr tests, nested as the compiler needs)
        if q.dtype == tl.bfloat16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -FP16_MAX), FP16_MAX).to(tl.float16)
    return q


@triton.jit
def to_query_dtype(tile, q, KV_QUANT: tl.constexpr):
    """Stored cache values -> q's dtype (after `dot_query`): fp8 bytes are reinterpreted as
    float8_e4m3fn first; every stored value converts exactly. Plain tiles are returned as is."""
    if KV_QUANT == "fp8":
        tile = tile.to(tl.float8e4nv, bitcast=True).to(q.dtype)
    elif KV_QUANT == "int8":
        tile = tile.to(q.dtype)
    return tile


@triton.jit
def load_token_scales(
    scale_ptr,
    block_ids,
    offs_n,
    key_valid,
    stride_block,
    stride_offset,
    BLOCK_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,
):
    """[BLOCK_N] float32 int8 scales of key positions offs_n (0 where masked)."""
    offsets = block_ids.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_offset
    if MASK_KEYS:
        scales = tl.load(scale_ptr + offsets, mask=key_valid, other=0.0)
    else:
        scales = tl.load(scale_ptr + offsets)
    return scales


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    start_n,
    key_end,
    row_pos,
    stride_cache_block,
    stride_cache_offset,
    stride_scale_block,
    stride_scale_offset,
    qk_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Fold key positions start_n .. start_n + BLOCK_N - 1 into the running softmax.

    Args:
        acc: [BLOCK_M, BLOCK_DIM] float32, unnormalised output (fp8: before the V scale).
        m_i, l_i: [BLOCK_M] float32, running max (log2 domain) and running sum.
        q: [BLOCK_M, BLOCK_DIM], the dot operand (`dot_query`).
        k_ptr, v_ptr: cache pointers already offset to the kv head (K and V halves).
        k_scale_ptr, v_scale_ptr: int8 only: scale pointers offset to the kv head (K and V).
        block_table_ptr: the sequence's row of the block table (int32 block ids).
        start_n: first key position of the tile.
        key_end: key positions >= key_end are not loaded (MASK_KEYS) and score -inf.
        row_pos: [BLOCK_M] int32 query positions; with MASK_CAUSAL keys after a row's
            position score -inf for that row.
        stride_scale_block, stride_scale_offset: int8 scale strides (elements).
        qk_scale: softmax scale * log2(e) (fp8: times the head's K scale).
        KV_QUANT: "none", "fp8" or "int8".

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
    k = to_query_dtype(k, q, KV_QUANT)  # [BLOCK_N, BLOCK_DIM]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    if KV_QUANT == "int8":
        k_scales = load_token_scales(
            k_scale_ptr, block_ids, offs_n, key_valid, stride_scale_block, stride_scale_offset,
            BLOCK_SIZE, MASK_KEYS,
        )  # fmt: skip
        qk = qk * (k_scales * qk_scale)[None, :]
    else:
        qk = qk * qk_scale
    if MASK_CAUSAL:
        qk = tl.where(offs_n[None, :] <= row_pos[:, None], qk, float("-inf"))
    elif MASK_KEYS:
        qk = tl.where(key_valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescale of the old terms
    p = tl.exp2(qk - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv_tile(v_ptr, kv_offsets, dims, key_valid, MASK_KEYS, HEAD_DIM, BLOCK_DIM)
    v = to_query_dtype(v, q, KV_QUANT)  # [BLOCK_N, BLOCK_DIM]
    if KV_QUANT == "int8":
        v_scales = load_token_scales(
            v_scale_ptr, block_ids, offs_n, key_valid, stride_scale_block, stride_scale_offset,
            BLOCK_SIZE, MASK_KEYS,
        )  # fmt: skip
        pv = tl.dot((p * v_scales[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i
