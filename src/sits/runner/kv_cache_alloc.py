"""Sizes and allocates the paged KV cache tensors of a model.

One cache per decoder layer, [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 holds
keys, 1 values): with kv_cache_dtype "auto" a tensor in the model dtype; with "fp8"/"int8" a
`QuantizedKVCache` (1-byte data plus float32 scales, see `sits.kernels.kv_quant_ref`).

Capacity accounting: bytes per block count the data and the scales that grow with the blocks
(int8: 4 bytes per slot, head, K/V and layer); fp8's per-(layer, K/V, head) scales are a fixed
amount taken from the budget before dividing it into blocks.
"""

from __future__ import annotations

import torch

from sits.core.errors import InvalidParameterError
from sits.kernels.kv_quant_ref import (
    QuantizedKVCache,
    allocate_quantized_kv_cache,
    fixed_scale_bytes,
    scale_bytes_per_block,
)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB upper bound on the CPU


def kv_bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes one KV block takes across all layers (keys and values, data and int8 scales).

    `dtype` (the model dtype) sizes the "auto" cache; "fp8"/"int8" store 1 byte per element.
    """
    if kv_cache_dtype == "auto":
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size
    data_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim
    return data_bytes + num_layers * scale_bytes_per_block(kv_cache_dtype, block_size, num_kv_heads)


def kv_fixed_bytes(num_layers: int, num_kv_heads: int, kv_cache_dtype: str = "auto") -> int:
    """KV cache bytes that do not grow with the blocks: fp8's per-(layer, K/V, head) scales."""
    if kv_cache_dtype == "auto":
        return 0
    return num_layers * fixed_scale_bytes(kv_cache_dtype, num_kv_heads)


def num_kv_blocks(
    *,
    bytes_per_block: int,
    device: torch.device,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    fixed_bytes: int = 0,
) -> int:
    """How many KV blocks to allocate.

    With `kv_cache_memory_bytes` set, that many bytes. Otherwise on CUDA the part of
    `gpu_memory_utilization` * total GPU memory not yet used (call after loading weights); on
    the CPU enough blocks for `max_num_seqs` full-length sequences, at most 1 GiB.
    `fixed_bytes` (see `kv_fixed_bytes`) is taken from the budget first.

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
        wanted = bytes_per_block * blocks_per_seq * max_num_seqs + fixed_bytes
        budget_bytes = min(wanted, DEFAULT_CPU_KV_CACHE_BYTES)
    num_blocks = max(budget_bytes - fixed_bytes, 0) // bytes_per_block
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
    kv_cache_dtype: str = "auto",
) -> list[torch.Tensor] | list[QuantizedKVCache]:
    """Zero-filled KV caches, one per layer, each [2, num_blocks, block_size, kv_heads, dim].

    "auto": tensors in `dtype`; "fp8"/"int8": `QuantizedKVCache`s (fp8 scales uncalibrated).
    """
    if kv_cache_dtype != "auto":
        return [
            allocate_quantized_kv_cache(
                kv_cache_dtype, num_blocks, block_size, num_kv_heads, head_dim, device
            )
            for _ in range(num_layers)
        ]
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_dtype_name(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The KV storage for logs: "float32", "fp8 (float8_e4m3fn, per-head scales)", ..."""
    if kv_cache_dtype == "fp8":
        return "fp8 (float8_e4m3fn, per-head scales)"
    if kv_cache_dtype == "int8":
        return "int8 (per-token-per-head scales)"
    return str(dtype).removeprefix("torch.")
