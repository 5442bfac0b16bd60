"""Programmatic dependent launch (PDL) for sits' Triton kernels on Hopper and later GPUs.

A kernel launched with PDL (`launch_pdl=True`, CUDA's programmatic stream serialization)
may start while the kernel before it in the stream is still finishing: its programs are
placed on the SMs as soon as every program of the previous kernel has called
`griddepcontrol.launch_dependents` (or exited), and wait in `griddepcontrol.wait` until that
kernel has completed and its memory is visible. In a decode step of one token, where a layer
is a dozen kernels of a few microseconds each, this hides most of each launch's latency
behind the previous kernel's tail (the technique of TensorRT-LLM's and FlashInfer's
low-latency decode kernels; CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization"). CUDA graphs keep the dependency as a programmatic edge.

Invariants:
- A kernel launched with PDL calls `pdl_enter` first, in every program, before any load of
  another kernel's output, any store and any early return. So it completes only after the
  kernel before it has completed, and a kernel two launches later sees both kernels' writes
  (completion is transitive). A kernel that might return before `pdl_enter` must not be
  launched with PDL.
- `pdl_enter` also lets the next kernel launch (`launch_dependents`): at most two kernels are
  resident at once, and the next one only spins until this one ends.
- Kernels take `USE_PDL: tl.constexpr`; launches pass `**pdl_args(tensor)`, which sets
  `USE_PDL` and `launch_pdl` together (both False off Hopper, in the interpreter, or where
  this Triton lacks grid dependency control), so a kernel never waits on an edge it did not
  get or runs without the wait it needs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL is never turned on
    HAS_GDC = False


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to complete, then let the next one launch.
    A no-op unless USE_PDL (the launch's `launch_pdl`)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=16)
def _device_has_pdl(device_index: int) -> bool:
    from sits.kernels.triton_utils import kernels_interpreted

    if not HAS_GDC or kernels_interpreted():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_args(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel taking `USE_PDL` whose inputs live with `tensor`:
    `{"USE_PDL": on, "launch_pdl": on}`, on for CUDA devices of compute capability >= 9.0
    with compiled (not interpreted) kernels."""
    device = tensor.device
    on = device.type == "cuda" and _device_has_pdl(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    return {"USE_PDL": on, "launch_pdl": on}
