"""`HostKVCache` staged copies (the CUDA algorithm) equal the plain synchronous copies.

The staged path gathers swap-outs into a device buffer, serves swap-ins of host blocks written
in the same call from that buffer, and copies runs of consecutive host blocks at once; on the
CPU it runs synchronously, so its results are checked exactly here against the plain path on
random plans that follow the `StepPlan` contract. The gpu-marked test checks the stream
ordering on CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

from sits.runner.swap import HostKVCache, copy_runs

NUM_DEVICE_BLOCKS = 9
NUM_HOST_BLOCKS = 7


def _caches(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_DEVICE_BLOCKS, 4, 2, 3)  # [2, num_blocks, block_size, kv_heads, head_dim]
    return [torch.randn(shape, generator=g).to(device) for _ in range(3)]


def _random_plan(rng: random.Random) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Distinct host targets out, distinct device targets in; a swap-in may read a host block
    written by a swap-out of the same plan and may write a device block just swapped out."""
    out_devices = rng.sample(range(1, NUM_DEVICE_BLOCKS), rng.randrange(0, 5))
    out_hosts = rng.sample(range(NUM_HOST_BLOCKS), len(out_devices))
    in_hosts = rng.sample(range(NUM_HOST_BLOCKS), rng.randrange(0, 5))
    in_devices = rng.sample(range(1, NUM_DEVICE_BLOCKS), len(in_hosts))
    return list(zip(out_devices, out_hosts)), list(zip(in_hosts, in_devices))


def test_copy_runs() -> None:
    assert copy_runs([(0, 4), (1, 5), (2, 6), (3, 9), (5, 10)]) == [
        (0, 4, 3),
        (3, 9, 1),
        (5, 10, 1),
    ]
    assert copy_runs([(0, 3), (1, 2)]) == [(0, 3, 1), (1, 2, 1)]
    assert copy_runs([]) == []


BLOCK_BYTES = 3 * 2 * 4 * 2 * 3 * 4  # one host block: 3 layers of K and V, float32


@pytest.mark.parametrize("max_staged_blocks", [1024, 2])  # 2: chunked copies
@pytest.mark.parametrize("seed", range(4))
def test_staged_copies_equal_plain_copies(seed: int, max_staged_blocks: int) -> None:
    rng = random.Random(seed)
    plain_dev, staged_dev = _caches(seed), _caches(seed)
    plain = HostKVCache(plain_dev, NUM_HOST_BLOCKS, staged=False)
    staged = HostKVCache(
        staged_dev, NUM_HOST_BLOCKS, staged=True, max_staged_bytes=max_staged_blocks * BLOCK_BYTES
    )
    assert staged.staged and not plain.staged
    assert staged.max_staged_blocks == max_staged_blocks
    assert staged.blocks.shape == (NUM_HOST_BLOCKS, 3, 2, 4, 2, 3)
    assert staged.caches[1].shape == (2, NUM_HOST_BLOCKS, 4, 2, 3)
    num_same_call_reads = 0
    for _ in range(30):
        swap_out, swap_in = _random_plan(rng)
        num_same_call_reads += len({h for _, h in swap_out} & {h for h, _ in swap_in})
        plain.copy_blocks(plain_dev, swap_out, swap_in)
        staged.copy_blocks(staged_dev, swap_out, swap_in)
        assert all(torch.equal(a, b) for a, b in zip(plain_dev, staged_dev))
        assert torch.equal(plain.blocks, staged.blocks)
    assert num_same_call_reads > 0  # the redirect from the staging buffer was exercised


def test_swap_in_of_a_block_written_in_the_same_call_sees_the_new_data() -> None:
    device = _caches(0)
    original = [c.clone() for c in device]
    host = HostKVCache(device, NUM_HOST_BLOCKS, staged=True)
    host.copy_blocks(device, [(5, 3)], [])
    # Block 2 goes out to host 3 while host 3 (old block 5) comes into block 4 and block 2
    # itself is overwritten by host 3 too: both see the data written by this call.
    host.copy_blocks(device, [(2, 3), (6, 4)], [(3, 4), (4, 2)])
    for dev, orig, hst in zip(device, original, host.caches):
        assert torch.equal(hst[:, 3], orig[:, 2]) and torch.equal(hst[:, 4], orig[:, 6])
        assert torch.equal(dev[:, 4], orig[:, 2]) and torch.equal(dev[:, 2], orig[:, 6])
        assert torch.equal(dev[:, 5], orig[:, 5])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_side_stream_orders_copies_around_the_forward() -> None:
    rng = random.Random(5)
    cpu_dev, cuda_dev = _caches(1), _caches(1, "cuda")
    reference = HostKVCache(cpu_dev, NUM_HOST_BLOCKS, staged=False)
    host = HostKVCache(cuda_dev, NUM_HOST_BLOCKS)
    assert host.staged and host.blocks.is_pinned()
    host.blocks.zero_()  # pinned blocks start uninitialised; the reference's start at zero
    for _ in range(20):
        swap_out, swap_in = _random_plan(rng)
        reference.copy_blocks(cpu_dev, swap_out, swap_in)
        host.copy_blocks(cuda_dev, swap_out, swap_in)
        # The "forward" on the current stream overwrites every block just swapped out and
        # reads the swapped-in ones; neither may race the side stream's copies.
        for _, dev_id in swap_in:
            for ref, dev in zip(cpu_dev, cuda_dev):
                assert torch.equal(dev[:, dev_id].cpu(), ref[:, dev_id])
        for dev_id, _ in swap_out:
            if dev_id not in {d for _, d in swap_in}:
                for ref, dev in zip(cpu_dev, cuda_dev):
                    dev[:, dev_id].fill_(-1.0)
                    ref[:, dev_id].fill_(-1.0)
    host.synchronize()
    assert torch.equal(host.blocks, reference.blocks)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(cuda_dev, cpu_dev))
