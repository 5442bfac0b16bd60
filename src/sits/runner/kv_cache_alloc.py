"""Sizes and allocates the paged KV cache tensors of a model.

One tensor per decoder layer, [2, num_blocks, block_size, num_kv_heads, head_dim] in the model
dtype (index 0 holds keys, 1 values).
"""

from __future__ import annotations

import torch

from sits.core.errors import InvalidParameterError

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB upper bound on the CPU


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_kv_blocks(
    *,
    bytes_per_block: int,
    device: torch.device,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
) -> int:
    """How many KV blocks to allocate.

    With `kv_cache_memory_bytes` set, that many bytes. Otherwise on CUDA the part of
    `gpu_memory_utilization` * total GPU memory not yet used (call after loading weights); on
    the CPU enough blocks for `max_num_seqs` full-length sequences, at most 1 GiB.

    Raises:
        InvalidParameterError: the memory holds fewer blocks than one full-length sequence needs.
    """
    if kv_cache_memory_bytes is not None:
        budget_bytes = kv_cache_memory_bytes
    elif device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        budget_bytes = int(total_bytes * gpu_memory_utilization) - (total_bytes - free_bytes)
    else:
        blocks_per_seq = -(-max_model_len // block_size)
        wanted = bytes_per_block * blocks_per_seq * max_num_seqs
        budget_bytes = min(wanted, DEFAULT_CPU_KV_CACHE_BYTES)
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 2:
        raise InvalidParameterError(
            "kv_cache_memory_bytes",
            f"KV cache memory ({budget_bytes} bytes) holds {num_blocks} blocks of "
            f"{bytes_per_block} bytes; at least 2 are needed",
        )
    return int(num_blocks)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Zero-filled KV cache tensors, one per layer: [2, num_blocks, block_size, kv_heads, dim]."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
