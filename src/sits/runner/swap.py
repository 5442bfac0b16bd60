"""`HostKVCache`: the host tier's KV tensors and the device <-> host block copies of a step.

Layout: one host tensor [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in
the device cache's dtype, so a host block (all layers) is one contiguous range; `caches` are
per-layer views of it, [2, num_host_blocks, block_size, num_kv_heads, head_dim], the device
cache's per-block layout. On CUDA it is pinned, so copies are asynchronous DMA.
`HostKVTier` holds one `HostKVCache` per block-indexed component of the device caches: the
plain caches; or a quantized cache's data (fp8 bytes viewed as uint8) and, for int8, its
per-token scales [2, num_blocks, block_size, num_kv_heads]. fp8's per-head scales are fixed
once calibrated (before any block can be swapped) and stay on the device.

Semantics of `copy_blocks(device_caches, swap_out, swap_in)` (the `StepPlan` contract): every
swap-out reads its device block before any swap-in or the step's forward writes it, and every
swap-in sees the host data as left by the swap-outs of the same call; the step's forward, issued
after the call on the current stream, sees the swapped-in blocks.

CPU: synchronous copies, swap-outs then swap-ins.
CUDA ("staged" copies; `staged=True` runs the same algorithm on the CPU, for tests): copies run
on a side stream, ordered by events:
1. the side stream waits for the current stream (the previous forward wrote the KV read now);
2. swap-outs gather their device blocks into a device staging buffer (device-to-device);
3. swap-ins fill a device staging buffer from pinned host memory (DMA), or from (2)'s staging
   buffer for host blocks written by this call, and scatter it into their device blocks;
4. an event recorded here is waited for by the current stream, so the forward starts only
   after (2) and (3): swapped-in blocks are in place and reused device blocks were read;
5. the device -> host DMA of (2)'s staging buffer runs after the event, overlapping with the
   forward. Later calls use the same side stream, so a host block is never read or rewritten
   before an earlier DMA into it finished. `synchronize()` waits for everything (tests).
Staging buffers hold at most `max_staged_bytes` each: larger swap-outs are copied out chunk by
chunk before the swap-ins (which then read them from the host in stream order) and before the
event, so the forward waits for them too; larger swap-ins go chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from sits.kernels.kv_quant_ref import QuantizedKVCache

GIB_BYTES = 1 << 30
DEFAULT_MAX_STAGED_BYTES = 1 << 30


def num_host_blocks(swap_space: float, bytes_per_block: int) -> int:
    """Host blocks that fit in `swap_space` GiB (0 when the tier is off)."""
    return int(swap_space * GIB_BYTES) // bytes_per_block


def device_index(ids: list[int], device: torch.device) -> Tensor:
    """[len(ids)] int64 block ids on `device`. On CUDA through pinned memory with a
    non-blocking copy: a pageable copy would make the host wait for the stream it is issued
    on (the side stream, which waits for the previous forward). The caching host allocator
    keeps the pinned buffer alive until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(ids, device=device)
    return torch.tensor(ids, pin_memory=True).to(device, non_blocking=True)


def copy_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Maximal runs of (row, host id) pairs where both go up by one, as (first row, first host
    id, length): one DMA per run.

    Example: [(0, 4), (1, 5), (2, 6), (3, 9), (5, 10)] -> [(0, 4, 3), (3, 9, 1), (5, 10, 1)].
    """
    runs: list[tuple[int, int, int]] = []
    for row, host_id in pairs:
        if runs and runs[-1][0] + runs[-1][2] == row and runs[-1][1] + runs[-1][2] == host_id:
            first_row, first_id, length = runs[-1]
            runs[-1] = (first_row, first_id, length + 1)
        else:
            runs.append((row, host_id, 1))
    return runs


class HostKVCache:
    """Host copies of KV blocks for all layers.

    Args:
        device_caches: the device KV caches (plain tensors, one shape and dtype), each
            [2, num_blocks, block_size, num_kv_heads, head_dim].
        num_blocks: host blocks to allocate (>= 1).
        staged: copy through device staging buffers (the CUDA algorithm); None: on CUDA only.
            On the CPU there is no stream, so it is synchronous either way.
        max_staged_bytes: the largest staging buffer (at least one block).

    Attributes:
        blocks: [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
        caches: per layer, a [2, num_host_blocks, block_size, num_kv_heads, head_dim] view.
    """

    def __init__(
        self,
        device_caches: list[Tensor],
        num_blocks: int,
        staged: bool | None = None,
        max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES,
    ) -> None:
        assert num_blocks >= 1 and device_caches, num_blocks
        assert all(isinstance(c, Tensor) for c in device_caches), "plain-tensor caches only"
        first = device_caches[0]
        assert all(c.shape == first.shape and c.dtype == first.dtype for c in device_caches)
        self.device = first.device
        self.num_blocks = num_blocks
        shape = (num_blocks, len(device_caches), *first.shape[:1], *first.shape[2:])
        if self.device.type == "cuda":
            # Never read before written: no need to spend seconds zeroing gigabytes.
            self.blocks = torch.empty(shape, dtype=first.dtype, pin_memory=True)
            self._stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device)
        else:
            self.blocks = torch.zeros(shape, dtype=first.dtype)
            self._stream = None
        self.caches = [self.blocks[:, layer].transpose(0, 1) for layer in range(len(device_caches))]
        self.staged = self._stream is not None if staged is None else staged
        block_bytes = self.blocks[0].numel() * self.blocks.element_size()
        self.max_staged_blocks = max(max_staged_bytes // block_bytes, 1)

    def copy_blocks(
        self,
        device_caches: list[Tensor],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
    ) -> None:
        """Copy (device, host) pairs out, then (host, device) pairs in, for every layer.

        On CUDA the current stream waits for the copies the forward depends on; the
        device -> host transfers finish in the background (see the module docstring).
        """
        if not swap_out and not swap_in:
            return
        if self._stream is not None:
            self._copy_cuda(device_caches, swap_out, swap_in, self._stream)
        elif self.staged:
            self._copy_staged(device_caches, swap_out, swap_in, on_ready=None)
        else:
            self._copy_sync(device_caches, swap_out, swap_in)

    def synchronize(self) -> None:
        """Wait until every copy issued so far has finished (no-op on the CPU)."""
        if self._stream is not None:
            self._stream.synchronize()

    def _copy_sync(
        self,
        device_caches: list[Tensor],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
    ) -> None:
        if swap_out:
            dev_ids = torch.tensor([d for d, _ in swap_out], device=self.device)
            host_ids = torch.tensor([h for _, h in swap_out])
            for dev, host in zip(device_caches, self.caches):
                blocks = dev.index_select(1, dev_ids)  # [2, n, block_size, kv_heads, dim]
                host.index_copy_(1, host_ids, blocks.to("cpu"))
        if swap_in:
            host_ids = torch.tensor([h for h, _ in swap_in])
            dev_ids = torch.tensor([d for _, d in swap_in], device=self.device)
            for dev, host in zip(device_caches, self.caches):
                blocks = host.index_select(1, host_ids)  # [2, n, block_size, kv_heads, dim]
                dev.index_copy_(1, dev_ids, blocks.to(self.device))

    def _copy_cuda(
        self,
        device_caches: list[Tensor],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        side: torch.cuda.Stream,
    ) -> None:
        main = torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        ready = torch.cuda.Event()
        with torch.cuda.stream(side):
            self._copy_staged(device_caches, swap_out, swap_in, on_ready=lambda: ready.record(side))
        main.wait_event(ready)

    def _copy_staged(
        self,
        device_caches: list[Tensor],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        on_ready: Callable[[], None] | None,
    ) -> None:
        """Steps 2, 3 and 5 of the module docstring, on the current stream; `on_ready` is
        called between 3 and 5 (CUDA: records the event the forward waits for)."""
        out_pairs = sorted(swap_out, key=lambda pair: pair[1])
        max_rows = self.max_staged_blocks
        staged_out: Tensor | None = None
        out_rows: dict[int, int] = {}  # host id -> row of staged_out
        if len(out_pairs) <= max_rows:  # the DMA out waits until after `on_ready`
            staged_out = self._gather(device_caches, [d for d, _ in out_pairs])
            out_rows = {host_id: row for row, (_, host_id) in enumerate(out_pairs)}
        else:  # chunk by chunk now; swap-ins then read the host in stream order
            for start in range(0, len(out_pairs), max_rows):
                part = out_pairs[start : start + max_rows]
                self._store(self._gather(device_caches, [d for d, _ in part]), part)
        in_pairs = sorted(swap_in, key=lambda pair: pair[0])
        for start in range(0, len(in_pairs), max_rows):
            part = in_pairs[start : start + max_rows]
            self._load(device_caches, part, staged_out, out_rows)
        if on_ready is not None:
            on_ready()
        if staged_out is not None:
            self._store(staged_out, out_pairs)

    def _store(self, staged: Tensor, pairs: list[tuple[int, int]]) -> None:
        """DMA staged rows to their host blocks; `pairs` sorted by host id, row i = pairs[i]."""
        non_blocking = self.device.type == "cuda"
        for row, host_id, length in copy_runs([(r, h) for r, (_, h) in enumerate(pairs)]):
            dst = self.blocks[host_id : host_id + length]
            dst.copy_(staged[row : row + length], non_blocking=non_blocking)

    def _gather(self, device_caches: list[Tensor], dev_ids: list[int]) -> Tensor:
        """Device blocks in host layout: [n, num_layers, 2, block_size, kv_heads, dim]."""
        staged = torch.empty(
            (len(dev_ids), *self.blocks.shape[1:]), dtype=self.blocks.dtype, device=self.device
        )
        if dev_ids:
            index = device_index(dev_ids, self.device)
            for layer, dev in enumerate(device_caches):
                # [2, n, block_size, kv_heads, dim] -> [n, 2, block_size, kv_heads, dim]
                staged[:, layer].copy_(dev.index_select(1, index).transpose(0, 1))
        return staged

    def _load(
        self,
        device_caches: list[Tensor],
        pairs: list[tuple[int, int]],
        staged_out: Tensor | None,
        out_rows: dict[int, int],
    ) -> None:
        """Swap-ins (sorted by host id): host, or this call's staged swap-outs, -> device."""
        staged = torch.empty(
            (len(pairs), *self.blocks.shape[1:]), dtype=self.blocks.dtype, device=self.device
        )  # [n, num_layers, 2, block_size, kv_heads, dim]
        from_host = []  # (row, host id) of blocks the host holds already
        for row, (host_id, _) in enumerate(pairs):
            if staged_out is not None and host_id in out_rows:  # written by this call
                staged[row].copy_(staged_out[out_rows[host_id]])
            else:
                from_host.append((row, host_id))
        non_blocking = self.device.type == "cuda"
        for row, host_id, length in copy_runs(from_host):
            src = self.blocks[host_id : host_id + length]
            staged[row : row + length].copy_(src, non_blocking=non_blocking)
        index = device_index([d for _, d in pairs], self.device)
        for layer, dev in enumerate(device_caches):
            dev.index_copy_(1, index, staged[:, layer].transpose(0, 1))


def cache_components(device_caches: Sequence[Tensor | QuantizedKVCache]) -> list[list[Tensor]]:
    """The block-indexed tensors of the device caches, one list (over layers) per component.

    Plain caches: [caches]. Quantized: [data] (fp8 viewed as uint8, so copies move the exact
    bytes with the ops every device has), plus [scales] for int8 (one scale per stored token
    and head, block-indexed like the data). Every tensor is [2, num_blocks, ...].
    """
    first = device_caches[0]
    if isinstance(first, Tensor):
        return [list(device_caches)]
    data = [c.data.view(torch.uint8) if c.kind == "fp8" else c.data for c in device_caches]
    if first.kind == "int8":
        return [data, [c.scales for c in device_caches]]
    return [data]


class HostKVTier:
    """The host tier of any KV cache kind: a `HostKVCache` per component (`cache_components`).

    Args:
        device_caches: the device KV caches (plain tensors or `QuantizedKVCache`s).
        num_blocks: host blocks to allocate (>= 1).
        staged, max_staged_bytes: as `HostKVCache`.

    Attributes:
        parts: one HostKVCache per component.
    """

    def __init__(
        self,
        device_caches: Sequence[Tensor | QuantizedKVCache],
        num_blocks: int,
        staged: bool | None = None,
        max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES,
    ) -> None:
        self.parts = [
            HostKVCache(component, num_blocks, staged, max_staged_bytes)
            for component in cache_components(device_caches)
        ]

    def copy_blocks(
        self,
        device_caches: Sequence[Tensor | QuantizedKVCache],
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
    ) -> None:
        """`HostKVCache.copy_blocks` for every component (each orders itself against the
        current stream, so the forward waits for all of them)."""
        for part, component in zip(self.parts, cache_components(device_caches)):
            part.copy_blocks(component, swap_out, swap_in)

    def synchronize(self) -> None:
        """Wait until every copy issued so far has finished (no-op on the CPU)."""
        for part in self.parts:
            part.synchronize()
