"""`HostKVCache.copy_blocks`: exact device <-> host block copies, swap-outs before swap-ins."""

from __future__ import annotations

import argparse

import pytest
import torch

from sits.config import EngineConfig
from sits.engine.arg_utils import add_engine_args, engine_kwargs
from sits.runner.swap import GIB_BYTES, HostKVCache, num_host_blocks


def _caches(num_layers: int = 2, num_blocks: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (2, num_blocks, 4, 2, 3)  # [2, num_blocks, block_size, kv_heads, head_dim]
    return [torch.randn(shape, generator=g) for _ in range(num_layers)]


def test_swap_out_then_in_moves_exact_blocks() -> None:
    device = _caches()
    original = [c.clone() for c in device]
    host = HostKVCache(device, num_blocks=3)
    assert host.caches[0].shape == (2, 3, 4, 2, 3) and host.caches[0].dtype == torch.float32
    host.copy_blocks(device, swap_out=[(2, 1), (4, 0)], swap_in=[])
    for dev, hst in zip(original, host.caches):
        assert torch.equal(hst[:, 1], dev[:, 2]) and torch.equal(hst[:, 0], dev[:, 4])
        assert torch.equal(hst[:, 2], torch.zeros_like(hst[:, 2]))
    # In one step: block 2 goes out to host 2 while host 1 (old block 2) comes into block 3,
    # and host 2 comes back into block 2 only after its swap-out (out before in).
    host.copy_blocks(device, swap_out=[(1, 2)], swap_in=[(1, 3), (2, 2)])
    for dev, orig in zip(device, original):
        assert torch.equal(dev[:, 3], orig[:, 2]) and torch.equal(dev[:, 2], orig[:, 1])
        assert torch.equal(dev[:, 0], orig[:, 0]) and torch.equal(dev[:, 4], orig[:, 4])


def test_host_block_count_and_flag() -> None:
    assert num_host_blocks(0, 1024) == 0
    assert num_host_blocks(1.0, 1 << 20) == 1024
    assert num_host_blocks(3 * 1000 / GIB_BYTES, 1000) in (2, 3)  # float rounding of GiB
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    kwargs = engine_kwargs(parser.parse_args(["--model", "m", "--cpu-offload-gb", "2.5"]))
    assert EngineConfig(**kwargs).swap_space == 2.5
    assert engine_kwargs(parser.parse_args(["--model", "m"]))["swap_space"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_swap_on_cuda_uses_pinned_host_blocks() -> None:
    device = [c.cuda() for c in _caches()]
    original = [c.clone() for c in device]
    host = HostKVCache(device, num_blocks=3)
    assert all(h.is_pinned() and h.device.type == "cpu" for h in host.caches)
    host.copy_blocks(device, swap_out=[(2, 1), (4, 0)], swap_in=[])
    host.copy_blocks(device, swap_out=[(1, 2)], swap_in=[(1, 3), (0, 1), (2, 2)])
    torch.cuda.synchronize()
    for dev, orig in zip(device, original):
        assert torch.equal(dev[:, 3], orig[:, 2]) and torch.equal(dev[:, 1], orig[:, 4])
        assert torch.equal(dev[:, 2], orig[:, 1]) and torch.equal(dev[:, 0], orig[:, 0])
