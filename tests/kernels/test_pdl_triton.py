"""Programmatic dependent launch: when it is turned on, and that dependent chains stay exact.

On the CPU (the interpreter) `pdl_args` must turn PDL off, since the interpreter has no grid
dependency control. On a Hopper GPU it is on, and a chain of dependent kernels launched with
it (each RMSNorm reads the previous one's outputs, and every other one also a tensor written
two launches before) gives bit-identical results eagerly and replayed from a CUDA graph, where
the launches become programmatic edges.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.norm_triton import triton_rms_norm  # noqa: E402
from sits.kernels.pdl_triton import pdl_args  # noqa: E402

CUDA = torch.cuda.is_available()


def test_pdl_is_off_for_cpu_tensors() -> None:
    assert pdl_args(torch.zeros(1)) == {"USE_PDL": False, "launch_pdl": False}


def _chain(x: torch.Tensor, weight: torch.Tensor, num_links: int) -> list[torch.Tensor]:
    """num_links RMSNorms, each on the previous output plus the residual of two links back."""
    outs = [x, x]
    residual = x
    for link in range(num_links):
        normed, residual = triton_rms_norm(outs[-1], weight, 1e-6, residual)
        outs.append(normed if link % 2 else normed + outs[-2])  # reads a two-back output
    return outs[2:]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_pdl_chain_matches_in_a_cuda_graph() -> None:
    device = torch.device("cuda")
    on = torch.cuda.get_device_capability()[0] >= 9
    assert pdl_args(torch.zeros(1, device=device))["launch_pdl"] is on
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(4, 4096, device=device, dtype=torch.bfloat16, generator=gen)
    weight = torch.rand(4096, device=device, dtype=torch.bfloat16, generator=gen) + 0.5
    static_x = x.clone()
    eager = _chain(x, weight, 64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(static_x, weight, 64)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(static_x, weight, 64)
    static_x.copy_(torch.randn(4, 4096, device=device, dtype=torch.bfloat16, generator=gen))
    graph.replay()
    expected = _chain(static_x, weight, 64)
    torch.cuda.synchronize()
    for got, want in zip(captured, expected, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(eager[-1], expected[-1])  # the replay ran on the new input
