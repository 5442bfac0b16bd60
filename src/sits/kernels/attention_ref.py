"""Plain PyTorch paged attention: the reference every attention kernel is checked against.

KV cache layout of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K,
1 = V); token slot s lives in block s // block_size at offset s % block_size. A layer's cache is
either that tensor in the model dtype ("auto") or a `QuantizedKVCache` (fp8/int8 data plus
float32 scales, see `sits.kernels.kv_quant_ref`): writes quantize, reads dequantize to float32.

Invariants:
- `TorchPagedAttention.forward` writes every K/V of the step before any attention reads the
  cache, so sequences of one step may share blocks that one of them fills this step.
- Scores, softmax and the weighted sum are computed in float32; the output has the query dtype.
- Only the `*_cpu` lists of the metadata drive Python control flow (no device syncs).

Algorithm: scaled dot-product attention (Vaswani et al. 2017, "Attention Is All You Need") with
grouped-query attention (Ainslie et al. 2023, "GQA"), keys/values gathered from a paged cache
(Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sits.kernels.kv_quant_ref import QuantizedKVCache, gather_kv_dequantized, write_kv_quantized

if TYPE_CHECKING:
    from sits.kernels.attention_metadata import AttentionMetadata


def write_kv(kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
    """Store the step's keys and values into the paged cache.

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], written in place.
        key, value: [num_tokens, num_kv_heads, head_dim]; cast to the cache dtype.
        slot_mapping: [num_tokens] int64, block_id * block_size + offset; -1 = skip the token.
    """
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
    value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
    keep = slot_mapping >= 0  # [num_tokens] bool
    slots = slot_mapping[keep]  # [num_kept]
    key_slots[slots] = key[keep].to(kv_cache.dtype)
    value_slots[slots] = value[keep].to(kv_cache.dtype)


def gather_kv(kv_cache: Tensor, block_table: Tensor, context_len: int) -> tuple[Tensor, Tensor]:
    """Read one sequence's first `context_len` keys and values out of the paged cache.

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        block_table: [max_num_blocks] int32, the sequence's block ids in order.
        context_len: tokens of the sequence in the cache (>= 1).

    Returns:
        (key, value), each [context_len, num_kv_heads, head_dim], cache dtype.
    """
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    num_blocks = -(-context_len // block_size)
    block_ids = block_table[:num_blocks].long()  # [num_blocks]
    key = kv_cache[0, block_ids].reshape(-1, num_kv_heads, head_dim)[:context_len]
    value = kv_cache[1, block_ids].reshape(-1, num_kv_heads, head_dim)[:context_len]
    return key, value


def causal_attention(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """Attention of one sequence's newest tokens over its whole context, in float32.

    The query tokens are the last `num_query` of the `context_len` tokens: query row j sits at
    position context_len - num_query + j and sees keys at positions <= its own.

    Args:
        query: [num_query, num_heads, head_dim].
        key, value: [context_len, num_kv_heads, head_dim], num_heads % num_kv_heads == 0; query
            head h reads kv head h // (num_heads // num_kv_heads).
        scale: softmax scale.

    Returns:
        [num_query, num_heads, head_dim] float32.
    """
    num_query, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    group_size = num_heads // num_kv_heads
    key = key.float().repeat_interleave(group_size, dim=1)  # [context_len, num_heads, head_dim]
    value = value.float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale  # [heads, query, context]
    query_pos = torch.arange(num_query, device=query.device) + (context_len - num_query)
    key_pos = torch.arange(context_len, device=query.device)
    future = key_pos[None, :] > query_pos[:, None]  # [num_query, context_len]
    scores = scores.masked_fill(future[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [num_heads, num_query, context_len]
    return torch.einsum("hqk,khd->qhd", probs, value)  # [num_query, num_heads, head_dim]


def paged_attention(
    query: Tensor, kv_cache: Tensor | QuantizedKVCache, metadata: AttentionMetadata, scale: float
) -> Tensor:
    """Causal attention of every sequence's new tokens over its cached and new tokens.

    The cache must already hold the step's K/V (see `write_kv`).

    Args:
        query: [num_tokens, num_heads, head_dim], the step's flat batch.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], or a quantized cache
            (dequantized to float32 before the dot products).
        metadata: the step's layout; sequence i's queries are
            query[query_start_loc_cpu[i]:query_start_loc_cpu[i + 1]] and its context is
            seq_lens_cpu[i] tokens long.
        scale: softmax scale.

    Returns:
        [num_tokens, num_heads, head_dim], query dtype. Rows of tokens outside every
        sequence's query range are zero.
    """
    output = torch.zeros_like(query)  # [num_tokens, num_heads, head_dim]
    starts = metadata.query_start_loc_cpu
    for seq_idx, context_len in enumerate(metadata.seq_lens_cpu):
        start, end = starts[seq_idx], starts[seq_idx + 1]
        if end == start:
            continue
        assert end - start <= context_len, "a sequence has more new tokens than context"
        block_table = metadata.block_tables[seq_idx]
        if isinstance(kv_cache, QuantizedKVCache):
            key, value = gather_kv_dequantized(kv_cache, block_table, context_len)
        else:
            key, value = gather_kv(kv_cache, block_table, context_len)
        output[start:end] = causal_attention(query[start:end], key, value, scale).to(query.dtype)
    return output


class TorchPagedAttention:
    """The CPU/reference `AttentionBackend`: `write_kv` then `paged_attention`."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor | QuantizedKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """Write key/value at metadata.slot_mapping (quantized for a quantized cache), then attend.

        Args:
            query: [num_tokens, num_heads, head_dim].
            key, value: [num_tokens, num_kv_heads, head_dim].
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] in the model dtype,
                or a `QuantizedKVCache`; written in place.
            metadata: the step's layout.
            scale: softmax scale.

        Returns:
            [num_tokens, num_heads, head_dim], query dtype.
        """
        if isinstance(kv_cache, QuantizedKVCache):
            write_kv_quantized(kv_cache, key, value, metadata.slot_mapping)
        else:
            write_kv(kv_cache, key, value, metadata.slot_mapping)
        return paged_attention(query, kv_cache, metadata, scale)
