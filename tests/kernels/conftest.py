"""Kernel tests: Triton's CPU interpreter when no GPU is present, and paged batch builders.

Triton decides when a kernel module is imported (at `@triton.jit`) whether its kernels are
compiled or interpreted, so TRITON_INTERPRET=1 is set here: pytest imports this conftest before
the test modules of this directory (and the reference tests here never import triton).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from sits.kernels.attention_metadata import AttentionMetadata

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(slots=True)
class PagedBatch:
    """One step's inputs: new tokens' q/k/v, a cache holding the cached prefixes, the layout.

    Attributes:
        query: [num_tokens, num_heads, head_dim].
        key, value: [num_tokens, num_kv_heads, head_dim].
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; slots never written
            hold NaN, so any read of them shows up in the output.
        metadata: the step's layout; padding tokens (after the last sequence) have slot -1.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata


def make_paged_batch(
    chunks: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    num_padding_tokens: int = 0,
    num_shared_blocks: int = 0,
) -> PagedBatch:
    """Build a step over sequences whose blocks come shuffled out of one pool.

    Args:
        chunks: per sequence (cached tokens, new tokens); new tokens may be 0.
        num_padding_tokens: extra tokens after all sequences (slot -1, outside every sequence).
        num_shared_blocks: every sequence's first blocks are the same physical blocks (a
            prefix-cache hit); each sequence needs at least that many full cached blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(cached + new) // block_size) for cached, new in chunks) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [free.pop() for _ in range(num_shared_blocks)]
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    tables, cached_slots, new_slots, starts, seq_lens = [], [], [], [0], []
    for row, (cached, new) in enumerate(chunks):
        assert cached >= num_shared_blocks * block_size, "shared blocks must be cached"
        length = cached + new
        blocks = shared + [free.pop() for _ in range(-(-length // block_size) - len(shared))]
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(length)]
        tables.append(blocks)
        first_own = 0 if row == 0 else num_shared_blocks * block_size  # shared: written once
        cached_slots += slots[first_own:cached]
        new_slots += slots[cached:]
        starts.append(starts[-1] + new)
        seq_lens.append(length)
    cached_ids = torch.tensor(cached_slots, dtype=torch.long)  # [num_cached]
    for half in (0, 1):
        slots_view = cache[half].view(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, dim]
        slots_view[cached_ids] = torch.randn(
            len(cached_slots), num_kv_heads, head_dim, generator=gen
        )
    num_tokens = starts[-1] + num_padding_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    table = torch.zeros(len(chunks), max(len(t) for t in tables), dtype=torch.int32)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    slot_mapping = torch.tensor(new_slots + [-1] * num_padding_tokens, dtype=torch.int64)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        max_query_len=max(new for _, new in chunks),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return PagedBatch(
        query.to(device, dtype),
        key.to(device, dtype),
        value.to(device, dtype),
        cache.to(device, dtype),
        metadata,
    )


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """`make_paged_batch` as a fixture (see its docstring)."""
    return make_paged_batch
