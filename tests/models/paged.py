"""Test helper: drive a model step by step through a real paged KV cache.

`PagedRunner` hands each sequence KV blocks from a shuffled free list (so block tables are not
contiguous), builds the flat `AttentionMetadata` of a step from (sequence, new tokens) pairs,
and returns every new token's logits.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from sits.kernels.attention_metadata import AttentionMetadata
from sits.kernels.attention_ref import TorchPagedAttention
from sits.layers.forward_context import ForwardContext


class PagedRunner:
    """A minimal model runner over one model and one paged KV cache."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
            for _ in range(model.num_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_ids: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def _grow(self, seq_id: str, num_tokens: int) -> None:
        blocks = self.block_ids.setdefault(seq_id, [])
        while len(blocks) * self.block_size < num_tokens:
            blocks.append(self.free_blocks.pop())

    def metadata(self, chunks: list[tuple[str, list[int]]]) -> tuple[AttentionMetadata, Tensor]:
        """Metadata of one step and the positions of its tokens."""
        starts, seq_lens, positions, slots = [0], [], [], []
        for seq_id, token_ids in chunks:
            start = self.num_cached.get(seq_id, 0)
            end = start + len(token_ids)
            self._grow(seq_id, end)
            blocks = self.block_ids[seq_id]
            for pos in range(start, end):
                positions.append(pos)
                slots.append(
                    blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            starts.append(starts[-1] + len(token_ids))
            seq_lens.append(end)
        width = max(len(self.block_ids[s]) for s, _ in chunks)
        table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, (seq_id, _) in enumerate(chunks):
            table[row, : len(self.block_ids[seq_id])] = torch.tensor(self.block_ids[seq_id])
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        return metadata, torch.tensor(positions, dtype=torch.int64)

    @torch.inference_mode()
    def step(self, chunks: list[tuple[str, list[int]]]) -> list[Tensor]:
        """Compute one step; returns each chunk's logits [len(tokens), vocab] float32."""
        metadata, positions = self.metadata(chunks)
        input_ids = torch.tensor([t for _, tokens in chunks for t in tokens], dtype=torch.int64)
        ctx = ForwardContext(metadata, self.kv_caches, TorchPagedAttention())
        logits = self.model.compute_logits(self.model(input_ids, positions, ctx))
        for seq_id, token_ids in chunks:
            self.num_cached[seq_id] = self.num_cached.get(seq_id, 0) + len(token_ids)
        return list(logits.split([len(t) for _, t in chunks]))
