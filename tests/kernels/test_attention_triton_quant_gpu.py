"""Triton attention over a quantized KV cache on an NVIDIA GPU, bf16, at real shapes, vs the
PyTorch reference (`kv_quant_ref`, `attention_ref.paged_attention`).

Shapes of Qwen3-30B-A3B attention (32 query heads, 4 kv heads, head_dim 128, block_size 16):
the quantized KV write at prefill and decode sizes (identical bytes and scales, fp8 calibration
included), decode batches over 1k-8k contexts with and without split-K, prefill and chunked
prefill over cached prefixes in a mixed batch, a quantized decode step captured in a CUDA
graph and replayed, and the bf16 cache path through the same kernels.

The byte oracle is the reference write run on the CPU: torch on CUDA divides a tensor by a
Python scalar as a * (1 / b), so there the reference's int8 scales (amax / 127) differ from the
correctly rounded quotient by one ulp for about 5% of the values (seen on the H200), while the
CPU reference and the Triton kernel divide exactly (IEEE). Attention is checked against the
reference attention over the cache the Triton write produced.

Run on the GPU machine: `pytest tests/kernels/test_attention_triton_quant_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.attention_ref import TorchPagedAttention, paged_attention  # noqa: E402
from sits.kernels.attention_triton import TritonAttentionConfig, TritonPagedAttention  # noqa: E402
from sits.kernels.kv_quant_ref import (  # noqa: E402
    QuantizedKVCache,
    allocate_quantized_kv_cache,
    write_kv_quantized,
)
from sits.kernels.kv_write_triton import triton_write_kv_quantized  # noqa: E402
from tests.kernels.test_attention_triton_quant import (  # noqa: E402
    assert_same_cache,
    clone_cache,
    quantized_cache_of,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
RTOL, ATOL = 1.6e-2, 4e-3  # bfloat16: about 2 ulp of the output plus P rounded to bf16
KINDS = ["fp8", "int8"]


def cpu_copy(cache: QuantizedKVCache) -> QuantizedKVCache:
    return QuantizedKVCache(cache.kind, cache.data.cpu(), cache.scales.cpu())


def cpu_reference_write(
    cache: QuantizedKVCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> QuantizedKVCache:
    """A CPU copy of the cache after the reference write of key/value at slots."""
    expected = cpu_copy(cache)
    write_kv_quantized(expected, key.cpu(), value.cpu(), slots.cpu())
    return expected


def batch_of(paged_batch, chunks: list[tuple[int, int]], seed: int):
    """A bf16 step on the GPU at the Qwen3-30B-A3B attention shape (cached slots random)."""
    return paged_batch(
        chunks, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE, "cuda", seed=seed
    )


def check(batch, kind: str, config: TritonAttentionConfig) -> None:
    """Triton forward on the quantized cache: the reference's bytes, the reference's attention."""
    cache = quantized_cache_of(batch.kv_cache, kind)
    metadata = batch.metadata
    expected_cache = cpu_reference_write(cache, batch.key, batch.value, metadata.slot_mapping)
    actual = TritonPagedAttention(config).forward(
        batch.query, batch.key, batch.value, cache, metadata, SCALE
    )
    assert_same_cache(cpu_copy(cache), expected_cache)
    expected = paged_attention(batch.query, cache, metadata, SCALE)
    assert not expected.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", KINDS)
def test_write_quantized_real_shapes(kind: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    num_blocks = 600
    actual = allocate_quantized_kv_cache(
        kind, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "cuda"
    )
    for num_tokens in (4096, 256):  # a prefill (calibrates fp8), then a decode-sized batch
        shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
        key = torch.randn(shape, generator=gen, device="cuda").to(DTYPE)
        value = (3 * torch.randn(shape, generator=gen, device="cuda")).to(DTYPE)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device="cuda")[:num_tokens]
        slots[::7] = -1
        expected = cpu_reference_write(actual, key, value, slots)
        triton_write_kv_quantized(actual, key, value, slots)
        assert_same_cache(cpu_copy(actual), expected)
    assert int(actual.data.view(torch.uint8).count_nonzero()) > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_real_shapes(paged_batch, kind: str, num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(16)
    contexts = torch.randint(1024, 8193, (16,), generator=gen).tolist()
    batch = batch_of(paged_batch, [(context - 1, 1) for context in contexts], seed=16)
    check(batch, kind, TritonAttentionConfig(decode_num_splits=num_splits))


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunked_and_decode_mixed_real_shapes(paged_batch, kind: str) -> None:
    # A fresh 2k prefill, chunks over cached prefixes, and decodes over long contexts.
    chunks = [(0, 2048), (3000, 1024), (16, 512), (4095, 1), (7000, 1), (1999, 1)]
    batch = batch_of(paged_batch, chunks, seed=4)
    check(batch, kind, TritonAttentionConfig.for_head_dim(HEAD_DIM))


def test_bf16_cache_through_the_same_kernels(paged_batch) -> None:
    chunks = [(0, 1024), (2000, 512), (4095, 1), (7000, 1)]
    batch = batch_of(paged_batch, chunks, seed=5)
    ref_cache, tri_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    args = (batch.query, batch.key, batch.value)
    expected = TorchPagedAttention().forward(*args, ref_cache, batch.metadata, SCALE)
    config = TritonAttentionConfig.for_head_dim(HEAD_DIM)
    actual = TritonPagedAttention(config).forward(*args, tri_cache, batch.metadata, SCALE)
    assert torch.equal(tri_cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))
    torch.testing.assert_close(actual.float(), expected.float(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_decode_cuda_graph_replay(paged_batch, kind: str) -> None:
    """Capture one quantized decode forward (write + attention); replay over changed contexts."""
    batch_size = 16
    batch = batch_of(paged_batch, [(3000, 1)] * batch_size, seed=6)
    metadata = batch.metadata
    cache = quantized_cache_of(batch.kv_cache, kind)  # fp8: calibrated by the cached prefix
    backend = TritonPagedAttention(TritonAttentionConfig(decode_num_splits=8))
    args = (batch.query, batch.key, batch.value)
    backend.forward(*args, clone_cache(cache), metadata, SCALE)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = backend.forward(*args, cache, metadata, SCALE)

    gen = torch.Generator(device="cuda").manual_seed(7)
    for new_len in (3001, 2999, 1234, 17):
        lens = torch.full((batch_size,), new_len, dtype=torch.int32, device="cuda")
        positions = lens.long() - 1
        blocks = metadata.block_tables.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0].long()
        metadata.seq_lens.copy_(lens)
        metadata.slot_mapping.copy_(blocks * BLOCK_SIZE + positions % BLOCK_SIZE)
        for tensor in args:
            tensor.copy_(torch.randn(tensor.shape, generator=gen, device="cuda", dtype=DTYPE))
        expected_cache = cpu_reference_write(cache, batch.key, batch.value, metadata.slot_mapping)
        graph.replay()
        ref_metadata = type(metadata)(
            metadata.query_start_loc, lens, metadata.block_tables, metadata.slot_mapping,
            metadata.query_start_loc_cpu, [new_len] * batch_size, 1, new_len, BLOCK_SIZE,
        )  # fmt: skip
        assert_same_cache(cpu_copy(cache), expected_cache)
        expected = paged_attention(batch.query, cache, ref_metadata, SCALE)
        torch.testing.assert_close(output.float(), expected.float(), rtol=RTOL, atol=ATOL)
