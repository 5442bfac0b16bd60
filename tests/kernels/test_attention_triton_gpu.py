"""`TritonPagedAttention` on an NVIDIA GPU in bfloat16 at real shapes, vs the PyTorch reference.

Shapes of Llama-3.1-8B attention (32 query heads, 8 kv heads, head_dim 128, block_size 16):
decode batches of 1-64 over 1k-8k contexts, 2k-token prefills, chunked prefill over cached
prefixes, a mixed batch, and a decode step captured in a CUDA graph and replayed over changed
contexts. Inputs are made on the GPU; blocks never written hold NaN.

Run on the GPU machine: `pytest tests/kernels -m gpu -q` (the CPU tests of this directory then
run compiled on the GPU too with `pytest tests/kernels -q`).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from sits.kernels.attention_ref import TorchPagedAttention, write_kv  # noqa: E402
from sits.kernels.attention_triton import TritonAttentionConfig, TritonPagedAttention  # noqa: E402
from sits.kernels.kv_write_triton import triton_write_kv  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
RTOL, ATOL = 1.6e-2, 4e-3  # bfloat16: about 2 ulp of the output plus P rounded to bf16


def gpu_batch(chunks: list[tuple[int, int]], seed: int, num_kv_heads: int = NUM_KV_HEADS) -> tuple:
    """(query, key, value, kv_cache, metadata) of a step; chunks = (cached, new) per sequence.

    Blocks come shuffled out of a pool with spare blocks; cached slots hold random K/V, every
    other slot NaN.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-(cached + new) // BLOCK_SIZE) for cached, new in chunks]
    num_blocks = sum(blocks_per_seq) + 8
    order = torch.randperm(num_blocks, generator=gen, device="cuda").cpu().tolist()
    shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    cache = torch.full(shape, float("nan"), dtype=DTYPE, device="cuda")
    table = torch.zeros(len(chunks), max(blocks_per_seq), dtype=torch.int32)
    starts, seq_lens, new_slots = [0], [], []
    for row, ((cached, new), count) in enumerate(zip(chunks, blocks_per_seq)):
        blocks = torch.tensor([order.pop() for _ in range(count)])
        table[row, :count] = blocks.int()
        positions = torch.arange(cached + new)
        slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        cached_slots = slots[:cached].cuda()
        for half in (0, 1):
            view = cache[half].view(-1, num_kv_heads, HEAD_DIM)  # [num_slots, kv_heads, dim]
            view[cached_slots] = torch.randn(
                cached, num_kv_heads, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE
            )
        new_slots.append(slots[cached:])
        starts.append(starts[-1] + new)
        seq_lens.append(cached + new)
    num_tokens = starts[-1]

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)

    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=table.cuda(),
        slot_mapping=torch.cat(new_slots).cuda(),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        max_query_len=max(new for _, new in chunks),
        max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE,
    )
    return rand(NUM_HEADS), rand(num_kv_heads), rand(num_kv_heads), cache, metadata


def check(
    chunks: list[tuple[int, int]],
    config: TritonAttentionConfig,
    seed: int,
    num_kv_heads: int = NUM_KV_HEADS,
) -> None:
    query, key, value, cache, metadata = gpu_batch(chunks, seed, num_kv_heads)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    expected = TorchPagedAttention().forward(query, key, value, ref_cache, metadata, SCALE)
    actual = TritonPagedAttention(config).forward(query, key, value, tri_cache, metadata, SCALE)
    assert torch.equal(tri_cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))
    assert not expected.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_real_shapes(batch_size: int, num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    contexts = torch.randint(1024, 8193, (batch_size,), generator=gen).tolist()
    chunks = [(context - 1, 1) for context in contexts]
    check(chunks, TritonAttentionConfig(decode_num_splits=num_splits), seed=batch_size)


@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 2048)],
        [(0, 2048), (0, 1000), (0, 517), (0, 3)],
        [(3000, 1024), (1500, 512), (16, 2048)],  # chunked prefill over cached prefixes
    ],
)
def test_prefill_real_shapes(chunks: list[tuple[int, int]]) -> None:
    check(chunks, TritonAttentionConfig.for_head_dim(HEAD_DIM), seed=len(chunks))


def test_mixed_batch_real_shapes() -> None:
    gen = torch.Generator().manual_seed(3)
    decodes = [(int(c), 1) for c in torch.randint(100, 4000, (60,), generator=gen)]
    check(decodes + [(2000, 512), (0, 700)], TritonAttentionConfig(), seed=3)


@pytest.mark.parametrize("num_splits", [None, 1])
def test_qwen3_moe_shape_group_8(num_splits: int | None) -> None:
    # Qwen3-30B-A3B attention: 32 query heads over 4 kv heads (GQA group 8).
    chunks = [(4095, 1), (1999, 1), (0, 2048), (1024, 1024), (7000, 1)]
    config = TritonAttentionConfig(decode_num_splits=num_splits)
    check(chunks, config, seed=8, num_kv_heads=4)


def test_write_kv_bf16_real_shapes() -> None:
    query, key, value, cache, metadata = gpu_batch([(100, 300), (5, 1), (0, 2048)], seed=4)
    expected, actual = cache.clone(), cache.clone()
    write_kv(expected, key, value, metadata.slot_mapping)
    triton_write_kv(actual, key, value, metadata.slot_mapping)
    assert torch.equal(actual.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_decode_cuda_graph_replay_over_changed_contexts() -> None:
    """Capture one decode forward; replay after the contexts grow (same tensors, fixed splits)."""
    batch_size = 16
    query, key, value, cache, metadata = gpu_batch([(3000, 1)] * batch_size, seed=5)
    backend = TritonPagedAttention(TritonAttentionConfig(decode_num_splits=8))
    graph_cache = cache.clone()
    backend.forward(query, key, value, graph_cache.clone(), metadata, SCALE)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = backend.forward(query, key, value, graph_cache, metadata, SCALE)

    # Next step: every sequence's new token at position 3000 - step, a shorter context each.
    gen = torch.Generator(device="cuda").manual_seed(6)
    for new_len in (2999, 1234, 17):
        lens = torch.full((batch_size,), new_len, dtype=torch.int32, device="cuda")
        positions = lens.long() - 1
        blocks = metadata.block_tables.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0].long()
        metadata.seq_lens.copy_(lens)
        metadata.slot_mapping.copy_(blocks * BLOCK_SIZE + positions % BLOCK_SIZE)
        for tensor in (query, key, value):
            tensor.copy_(torch.randn(tensor.shape, generator=gen, device="cuda", dtype=DTYPE))
        graph.replay()
        ref_metadata = AttentionMetadata(
            metadata.query_start_loc, lens, metadata.block_tables, metadata.slot_mapping,
            metadata.query_start_loc_cpu, [new_len] * batch_size, 1, new_len, BLOCK_SIZE,
        )  # fmt: skip
        ref_cache = graph_cache.clone()
        expected = TorchPagedAttention().forward(query, key, value, ref_cache, ref_metadata, SCALE)
        torch.testing.assert_close(output.float(), expected.float(), rtol=RTOL, atol=ATOL)
