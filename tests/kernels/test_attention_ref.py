"""The paged attention reference vs a dense causal attention computed in float64."""

from __future__ import annotations

import math

import pytest
import torch

from sits.kernels.attention_metadata import AttentionMetadata
from sits.kernels.attention_ref import TorchPagedAttention, write_kv

BLOCK_SIZE = 4
HEAD_DIM = 8


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook attention of a whole sequence, head by head, in float64.

    q: [L, H, D]; k, v: [L, K, D]; query head h reads kv head h // (H // K). Returns [L, H, D].
    """
    length, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    mask = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    out = torch.empty(length, num_heads, head_dim, dtype=torch.float64)
    for h in range(num_heads):
        scores = q[:, h].double() @ k[:, h // group].double().T / math.sqrt(head_dim) + mask
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group].double()
    return out


class PagedSteps:
    """Builds the metadata of steps over sequences whose blocks come from a shuffled pool."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = self.free.tolist()
        self.blocks: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def metadata(self, chunks: list[tuple[str, int]], shared: dict[str, str] | None = None):
        """chunks: (sequence, new token count). shared: sequence -> sequence it forks from."""
        starts, seq_lens, slots, spans = [0], [], [], []
        for name, count in chunks:
            start = self.done.get(name, 0)
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * BLOCK_SIZE < start + count:
                blocks.append(self.free.pop())
            slots += [
                blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(start, start + count)
            ]
            starts.append(starts[-1] + count)
            seq_lens.append(start + count)
            spans.append((start, start + count))
            self.done[name] = start + count
        table = torch.zeros(
            len(chunks), max(len(self.blocks[n]) for n, _ in chunks), dtype=torch.int32
        )
        for row, (name, _) in enumerate(chunks):
            table[row, : len(self.blocks[name])] = torch.tensor(self.blocks[name])
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            max_query_len=max(c for _, c in chunks),
            max_seq_len=max(seq_lens),
            block_size=BLOCK_SIZE,
        )
        return metadata, spans


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 1), (4, 4)])
def test_chunked_paged_attention_equals_dense(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads)
    lengths = {"a": 11, "b": 6, "c": 17}
    q = {n: torch.randn(L, num_heads, HEAD_DIM, generator=gen) for n, L in lengths.items()}
    k = {n: torch.randn(L, num_kv_heads, HEAD_DIM, generator=gen) for n, L in lengths.items()}
    v = {n: torch.randn(L, num_kv_heads, HEAD_DIM, generator=gen) for n, L in lengths.items()}
    expected = {n: dense_causal(q[n], k[n], v[n]) for n in lengths}
    kv_cache = torch.zeros(2, 32, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    steps = PagedSteps(num_blocks=32, seed=0)
    schedule = [  # mixed prefill chunks and decodes; every sequence ends fully computed
        [("a", 5), ("b", 6)],
        [("c", 7), ("a", 3)],
        [("a", 1), ("c", 9), ("b", 0)],
        [("c", 1), ("a", 1)],
        [("a", 1)],
    ]
    backend = TorchPagedAttention()
    for chunks in schedule:
        metadata, spans = steps.metadata(chunks)
        inputs = [
            torch.cat([t[name][s:e] for (name, _), (s, e) in zip(chunks, spans)]) for t in (q, k, v)
        ]
        out = backend.forward(*inputs, kv_cache, metadata, HEAD_DIM**-0.5)
        assert out.shape == (metadata.query_start_loc_cpu[-1], num_heads, HEAD_DIM)
        for i, ((name, _), (s, e)) in enumerate(zip(chunks, spans)):
            rows = out[metadata.query_start_loc_cpu[i] : metadata.query_start_loc_cpu[i + 1]]
            torch.testing.assert_close(rows.double(), expected[name][s:e], atol=1e-5, rtol=0)
    assert steps.done == lengths


def test_write_kv_skips_slot_minus_one() -> None:
    kv_cache = torch.zeros(2, 3, BLOCK_SIZE, 1, 2)
    key = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]])
    write_kv(kv_cache, key, -key, torch.tensor([5, -1, 8]))
    assert torch.equal(kv_cache[0, 1, 1, 0], torch.tensor([1.0, 1.0]))  # slot 5 = block 1, offset 1
    assert torch.equal(
        kv_cache[1, 2, 0, 0], torch.tensor([-3.0, -3.0])
    )  # slot 8 = block 2, offset 0
    assert int((kv_cache != 0).sum()) == 8  # nothing else written (2 tokens x K/V x 2 dims)


def test_sequence_reads_blocks_another_fills_in_the_same_step() -> None:
    """b forks a's 8-token prefix (shared blocks); both run in one step, a filling the blocks."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, 2, HEAD_DIM, generator=gen)
    k = torch.randn(12, 1, HEAD_DIM, generator=gen)
    v = torch.randn(12, 1, HEAD_DIM, generator=gen)
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, 1, HEAD_DIM)
    # a: positions 0..7 in blocks [2, 0]; b: positions 8..11 in block 3 after a's blocks.
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 8, 12], dtype=torch.int32),
        seq_lens=torch.tensor([8, 12], dtype=torch.int32),
        block_tables=torch.tensor([[2, 0, 0], [2, 0, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 12, 13, 14, 15]),
        query_start_loc_cpu=[0, 8, 12],
        seq_lens_cpu=[8, 12],
        max_query_len=8,
        max_seq_len=12,
        block_size=BLOCK_SIZE,
    )
    out = TorchPagedAttention().forward(q, k, v, kv_cache, metadata, HEAD_DIM**-0.5)
    expected = dense_causal(q, k, v)  # b's 4 tokens continue a's 8 tokens
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_half_precision_inputs_keep_their_dtype() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(6, 2, HEAD_DIM, generator=gen) for _ in range(3))
    kv_cache = torch.zeros(2, 2, BLOCK_SIZE, 2, HEAD_DIM, dtype=torch.bfloat16)
    steps = PagedSteps(num_blocks=2, seed=1)
    metadata, _ = steps.metadata([("a", 6)])
    out = TorchPagedAttention().forward(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), kv_cache, metadata, HEAD_DIM**-0.5
    )
    assert out.dtype == torch.bfloat16
    expected = dense_causal(q.bfloat16(), k.bfloat16(), v.bfloat16())
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)
