"""Triton kernel: store a step's keys and values into the paged KV cache by slot mapping.

Twin of `attention_ref.write_kv`, which it must match exactly (a copy with a dtype cast).

KV cache layout of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K,
1 = V), head_dim contiguous; token slot s lives in block s // block_size at offset
s % block_size.

Invariants:
- One program per token writes all its kv heads of K and V; a slot of -1 writes nothing.
- Cache offsets are computed in int64 (a layer's cache may exceed 2**31 elements).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.triton_utils import next_power_of_2


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """Program t copies key[t] and value[t] ([num_kv_heads, head_dim]) to slot_mapping[t]."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    dims = tl.arange(0, BLOCK_DIM)[None, :]  # [1, BLOCK_DIM]
    mask = (heads < num_kv_heads) & (dims < head_dim)  # [BLOCK_HEADS, BLOCK_DIM]
    dst = (
        cache_ptr
        + block_id * stride_cache_block
        + block_offset * stride_cache_offset
        + heads * stride_cache_head
        + dims
    )
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask
    )
    tl.store(dst + stride_cache_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def triton_write_kv(
    kv_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor, num_warps: int = 4
) -> None:
    """Store the step's keys and values into the paged cache (Triton twin of `write_kv`).

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], written in place; its
            last dimension must be contiguous.
        key, value: [num_tokens, num_kv_heads, head_dim], any strides with a contiguous last
            dimension (e.g. views into a fused QKV output); cast to the cache dtype.
        slot_mapping: [num_tokens] int64 (or int32), block_id * block_size + offset; -1 = skip.
        num_warps: warps per program.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "cache must be [2, blocks, ...]"
    assert tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim), "cache/key shape mismatch"
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert kv_cache.stride(4) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_HEADS=next_power_of_2(num_kv_heads),
        BLOCK_DIM=next_power_of_2(head_dim),
        num_warps=num_warps,
    )
