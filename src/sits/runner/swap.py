"""`HostKVCache`: the host tier's KV tensors and the device <-> host block copies of a step.

Layout: one host tensor per layer, [2, num_host_blocks, block_size, num_kv_heads, head_dim] in
the device cache's dtype (the same per-block layout), pinned when the device is CUDA so copies
can be asynchronous. Only plain-tensor caches (kv_cache_dtype "auto") are supported;
`EngineConfig` refuses a host tier with a quantized cache.

Invariants:
- `copy_blocks` runs every swap-out before every swap-in, and the runner calls it before the
  step's forward: a device block freed by a swap-out this step may be the target of a swap-in
  or of the forward's KV writes in the same step.
- Swap-outs are synchronous (the host tensor holds the data when `copy_blocks` returns);
  swap-ins are issued with non_blocking=True on CUDA and ordered before the forward by the
  current stream. A separate copy stream overlapping compute is a later optimisation.
"""

from __future__ import annotations

import torch
from torch import Tensor

GIB_BYTES = 1 << 30


def num_host_blocks(cpu_offload_gb: float, bytes_per_block: int) -> int:
    """Host blocks that fit in `cpu_offload_gb` GiB (0 when the tier is off)."""
    return int(cpu_offload_gb * GIB_BYTES) // bytes_per_block


class HostKVCache:
    """Host copies of KV blocks, one tensor per layer.

    Args:
        device_caches: the device KV caches (plain tensors), each
            [2, num_blocks, block_size, num_kv_heads, head_dim].
        num_blocks: host blocks to allocate (>= 1).
    """

    def __init__(self, device_caches: list[Tensor], num_blocks: int) -> None:
        assert num_blocks >= 1 and device_caches, num_blocks
        assert all(isinstance(c, Tensor) for c in device_caches), "plain-tensor caches only"
        self.device = device_caches[0].device
        pin = self.device.type == "cuda"
        self.num_blocks = num_blocks
        self.caches = [
            torch.zeros(
                (c.shape[0], num_blocks, *c.shape[2:]), dtype=c.dtype, device="cpu"
            ).pin_memory()
            if pin
            else torch.zeros((c.shape[0], num_blocks, *c.shape[2:]), dtype=c.dtype)
            for c in device_caches
        ]  # each [2, num_host_blocks, block_size, num_kv_heads, head_dim]

    def copy_blocks(
        self,
        device_caches: list[Tensor],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
    ) -> None:
        """Copy (device, host) pairs out, then (host, device) pairs in, for every layer."""
        if swap_out:
            dev_ids = torch.tensor([d for d, _ in swap_out], device=self.device)
            host_ids = torch.tensor([h for _, h in swap_out])
            for dev, host in zip(device_caches, self.caches):
                blocks = dev.index_select(1, dev_ids)  # [2, n, block_size, kv_heads, dim]
                host.index_copy_(1, host_ids, blocks.to("cpu"))
        if swap_in:
            non_blocking = self.device.type == "cuda"
            host_ids = torch.tensor([h for h, _ in swap_in])
            dev_ids = torch.tensor([d for _, d in swap_in], device=self.device)
            for dev, host in zip(device_caches, self.caches):
                blocks = host.index_select(1, host_ids)  # [2, n, block_size, kv_heads, dim]
                if non_blocking:
                    blocks = blocks.pin_memory()
                dev.index_copy_(1, dev_ids, blocks.to(self.device, non_blocking=non_blocking))
