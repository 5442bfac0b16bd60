"""`TritonPagedAttention` vs `TorchPagedAttention` on fresh random paged batches.

Runs the kernels through Triton's CPU interpreter (or compiled, on a GPU machine). Cache
slots never written hold NaN, so a kernel reading past a context or an unwritten slot fails.
Small launch blocks (16-32) make every path take several tiles and both key loops.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytest.importorskip("triton")

from sits.core.errors import InvalidParameterError  # noqa: E402
from sits.kernels.attention_ref import TorchPagedAttention  # noqa: E402
from sits.kernels.attention_triton import (  # noqa: E402
    TritonAttentionConfig,
    TritonPagedAttention,
    choose_num_splits,
    count_single_token_seqs,
)
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.fail(
        "sits' Triton kernels were compiled (not interpreted) on a machine without a GPU: a "
        "module imported them before tests/kernels/conftest.py set TRITON_INTERPRET=1",
        pytrace=False,
    )

SMALL = {"prefill_block_m": 32, "prefill_block_n": 16, "decode_block_n": 16}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3}


def check_against_reference(batch, config: TritonAttentionConfig) -> torch.Tensor:
    """Run both backends on copies of the batch's cache; assert equal caches and outputs."""
    head_dim = batch.query.shape[-1]
    scale = head_dim**-0.5
    ref_cache, tri_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = TorchPagedAttention().forward(
        batch.query, batch.key, batch.value, ref_cache, batch.metadata, scale
    )
    actual = TritonPagedAttention(config).forward(
        batch.query, batch.key, batch.value, tri_cache, batch.metadata, scale
    )
    assert actual.dtype == batch.query.dtype and actual.shape == batch.query.shape
    torch.testing.assert_close(tri_cache, ref_cache, rtol=0, atol=0, equal_nan=True)
    assert not expected.isnan().any(), "the reference read an unwritten slot: bad test input"
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    return actual


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (torch.float32, 4, 4, 64, 16),
        (torch.float32, 4, 2, 32, 4),
        (torch.float16, 8, 2, 16, 8),
        (torch.float16, 4, 1, 64, 16),
        (torch.float32, 6, 2, 48, 16),  # group 3 and head_dim 48: padded rows and columns
    ],
)
def test_prefill_varlen_matches_reference(
    paged_batch, dtype, num_heads, num_kv_heads, head_dim, block_size
) -> None:
    chunks = [(0, 37), (0, 5), (0, 64), (0, 2), (0, 19)]
    batch = paged_batch(
        chunks, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE, seed=head_dim
    )
    check_against_reference(batch, TritonAttentionConfig(**SMALL))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_shared_blocks", [0, 2])
def test_chunked_prefill_over_cached_prefix(paged_batch, dtype, num_shared_blocks) -> None:
    # (cached, new): chunks over prefixes, a 2-token chunk, a 1-token chunk (decode kernel).
    chunks = [(13, 7), (32, 16), (8, 40), (50, 2), (21, 1)]
    batch = paged_batch(
        chunks, 4, 2, 32, 4, dtype, DEVICE, seed=7, num_shared_blocks=num_shared_blocks
    )
    check_against_reference(batch, TritonAttentionConfig(**SMALL))


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size"),
    [(torch.float32, 16, 16), (torch.float16, 32, 8), (torch.float32, 64, 4)],
)
def test_decode_gqa_matches_reference(paged_batch, group, dtype, head_dim, block_size) -> None:
    chunks = [(0, 1), (16, 1), (39, 1), (63, 1), (5, 1)]
    batch = paged_batch(chunks, 2 * group, 2, head_dim, block_size, dtype, DEVICE, seed=group)
    config = TritonAttentionConfig(decode_block_n=16, decode_num_splits=1)
    check_against_reference(batch, config)


@pytest.mark.parametrize("num_splits", [None, 1, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_split_k_long_context(paged_batch, num_splits, dtype) -> None:
    # 300 tokens: splits of different sizes, a ragged last tile; short contexts leave some
    # splits empty (7 splits of a 6-token context).
    chunks = [(299, 1), (5, 1), (128, 1), (40, 1)]
    batch = paged_batch(chunks, 8, 2, 32, 16, dtype, DEVICE, seed=11)
    config = TritonAttentionConfig(
        decode_block_n=16, decode_num_splits=num_splits, decode_min_split_tokens=64
    )
    assert choose_num_splits(4, 2, 300, config) == (num_splits or 5)
    check_against_reference(batch, config)


def test_mixed_batch_with_empty_sequence_and_padding(paged_batch) -> None:
    # A sequence with no new tokens, decodes, prefill chunks, and 3 padding tokens (slot -1).
    chunks = [(9, 0), (30, 1), (0, 23), (17, 6), (200, 1)]
    batch = paged_batch(chunks, 4, 2, 16, 8, torch.float32, DEVICE, seed=5, num_padding_tokens=3)
    config = TritonAttentionConfig(**SMALL, decode_num_splits=2)
    actual = check_against_reference(batch, config)
    assert torch.count_nonzero(actual[-3:]) == 0


@pytest.mark.parametrize("fixed_max_query_len", [23, 64])
def test_fixed_launches_for_graphs_ignore_the_cpu_fields(paged_batch, fixed_max_query_len) -> None:
    # Graph mode: both kernels over every sequence with a grid for `fixed_max_query_len` new
    # tokens; an empty sequence, decodes, chunks and 3 padding tokens (left zero).
    chunks = [(9, 0), (30, 1), (0, 23), (17, 6), (200, 1)]
    batch = paged_batch(chunks, 4, 2, 16, 8, torch.float32, DEVICE, seed=5, num_padding_tokens=3)
    config = TritonAttentionConfig(
        **SMALL, decode_num_splits=2, fixed_max_query_len=fixed_max_query_len
    )
    real = batch.metadata
    # CPU fields of a different step: a graph replays whatever the device tensors hold.
    batch.metadata = dataclasses.replace(
        real, query_start_loc_cpu=[0, 1], seq_lens_cpu=[1], max_query_len=1, max_seq_len=1
    )
    expected = TorchPagedAttention().forward(
        batch.query, batch.key, batch.value, batch.kv_cache.clone(), real, 16**-0.5
    )
    actual = TritonPagedAttention(config).forward(
        batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata, 16**-0.5
    )
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)
    assert torch.count_nonzero(actual[-3:]) == 0


def test_fixed_launches_need_a_split_count() -> None:
    with pytest.raises(InvalidParameterError) as err:
        TritonAttentionConfig(fixed_max_query_len=64)
    assert err.value.param == "fixed_max_query_len"
    with pytest.raises(InvalidParameterError):
        TritonAttentionConfig(fixed_max_query_len=0, decode_num_splits=1)


def test_default_launch_config_matches_reference(paged_batch) -> None:
    # The H200 defaults (128-row prefill tiles, 64-key tiles), at GQA group 4, head_dim 64.
    chunks = [(70, 60), (0, 3), (130, 1), (3, 1)]
    batch = paged_batch(chunks, 8, 2, 64, 16, torch.float16, DEVICE, seed=2)
    check_against_reference(batch, TritonAttentionConfig.for_head_dim(64))


def test_choose_num_splits_fills_the_gpu_without_short_splits() -> None:
    config = TritonAttentionConfig()  # 264 programs, splits of >= 256 tokens, <= 32 splits
    assert choose_num_splits(1, 8, 8192, config) == 32
    assert choose_num_splits(1, 8, 1000, config) == 4
    assert choose_num_splits(8, 8, 8192, config) == 5
    assert choose_num_splits(64, 8, 8192, config) == 1
    assert choose_num_splits(1, 8, 1, config) == 1
    assert choose_num_splits(1, 8, 8192, TritonAttentionConfig(decode_num_splits=6)) == 6


def test_count_single_token_seqs(paged_batch) -> None:
    batch = paged_batch([(3, 1), (0, 4), (2, 0), (5, 1)], 2, 1, 16, 4, torch.float32)
    assert count_single_token_seqs(batch.metadata) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("prefill_block_m", 48), ("decode_block_n", 8), ("decode_num_warps", 0)],
)
def test_config_rejects_bad_launch_parameters(field: str, value: int) -> None:
    with pytest.raises(InvalidParameterError) as info:
        TritonAttentionConfig(**{field: value})
    assert info.value.param == field


def test_forward_refuses_a_device_the_kernels_cannot_run_on(paged_batch) -> None:
    batch = paged_batch([(0, 2)], 2, 1, 16, 4, torch.float32)
    meta = torch.empty(2, 2, 16, device="meta")
    with pytest.raises(RuntimeError, match="cannot run on meta"):
        TritonPagedAttention().forward(
            meta, batch.key, batch.value, batch.kv_cache, batch.metadata, 0.25
        )


@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 7), (16, 20), (3, 1)],  # prefill, chunked prefill, a decode: every row covered
        [(299, 1), (5, 1), (40, 1)],  # pure decode, split
        [(9, 0), (30, 1), (0, 23)],  # an empty sequence
    ],
)
def test_every_output_row_is_written_when_rows_are_covered(paged_batch, monkeypatch, chunks):
    """Without padding the output is not zero-filled first: poison fresh allocations with NaN,
    so a row no kernel writes shows up."""
    import sits.kernels.attention_triton as module

    def nan_filled(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(module, "_uninitialized", nan_filled)
    batch = paged_batch(chunks, 4, 2, 16, 8, torch.float32, DEVICE, seed=21)
    config = TritonAttentionConfig(**SMALL, decode_num_splits=3)
    actual = check_against_reference(batch, config)
    assert not actual.isnan().any()


def test_flat_prefill_tiles_are_disjoint_and_within_the_grid() -> None:
    # The prefill kernel's flat grid: sequence s owns tiles from qsl[s] // block_q + s on; every
    # tile of every sequence must get its own program below num_tokens // block_q + num_seqs.
    rng = random.Random(0)
    for _ in range(200):
        block_q = rng.choice([1, 2, 16, 64])
        q_lens = [rng.choice([0, 1, 2, 15, 16, 17, 100, 333]) for _ in range(rng.randint(1, 40))]
        qsl = [0]
        for q_len in q_lens:
            qsl.append(qsl[-1] + q_len)
        num_programs = qsl[-1] // block_q + len(q_lens)
        owned = []
        for s, q_len in enumerate(q_lens):
            start = qsl[s] // block_q + s
            owned += [start + t for t in range(-(-q_len // block_q))]
        assert len(owned) == len(set(owned)) and all(0 <= t < num_programs for t in owned)
