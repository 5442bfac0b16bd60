"""The Triton KV write kernel vs `attention_ref.write_kv` (CPU interpreter, or the GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.attention_ref import write_kv  # noqa: E402
from sits.kernels.kv_write_triton import triton_write_kv  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.fail(
        "sits' Triton kernels were compiled (not interpreted) on a machine without a GPU: a "
        "module imported them before tests/kernels/conftest.py set TRITON_INTERPRET=1",
        pytrace=False,
    )


def fused_kv(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """key, value as strided views into one [num_tokens, 2 * kv_heads + 3, head_dim] tensor."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, 2 * num_kv_heads + 3, head_dim, generator=gen)
    fused = fused.to(DEVICE, dtype)
    return fused[:, 3 : 3 + num_kv_heads], fused[:, 3 + num_kv_heads :]


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "block_size", "num_kv_heads", "head_dim"),
    [
        (torch.float32, torch.float32, 16, 2, 32),
        (torch.float16, torch.float16, 8, 3, 16),
        (torch.float32, torch.float16, 4, 1, 24),
    ],
)
def test_write_kv_matches_reference(
    dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    num_blocks, num_tokens = 7, 20
    key, value = fused_kv(num_tokens, num_kv_heads, head_dim, dtype, seed=block_size)
    assert not key.is_contiguous()
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5, 19]] = -1  # padding tokens: not written
    slots = slots.to(DEVICE)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    expected = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    actual = expected.clone()
    write_kv(expected, key, value, slots)
    triton_write_kv(actual, key, value, slots)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    assert int(actual.isnan().any(-1).any(-1).sum()) == 2 * (num_blocks * block_size - 17)


def test_write_kv_all_slots_skipped_leaves_cache_unchanged() -> None:
    key, value = fused_kv(5, 2, 16, torch.float32, seed=3)
    cache = torch.randn(2, 3, 4, 2, 16).to(DEVICE)
    before = cache.clone()
    triton_write_kv(cache, key, value, torch.full((5,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


def test_write_kv_places_each_token_at_its_slot() -> None:
    key, value = fused_kv(3, 1, 16, torch.float32, seed=4)
    cache = torch.zeros(2, 2, 4, 1, 16, device=DEVICE)
    triton_write_kv(cache, key, value, torch.tensor([5, 0, 7], device=DEVICE))
    assert torch.equal(cache[0, 1, 1], key[0])
    assert torch.equal(cache[1, 0, 0], value[1])
    assert torch.equal(cache[0, 1, 3], key[2])
    assert int((cache != 0).any(-1).sum()) == 6
