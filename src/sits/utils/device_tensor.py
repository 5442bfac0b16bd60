"""Host lists to device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, which CUDA orders after
all the work already queued on the stream: the host waits for the device. With async
scheduling (`sits.engine.async_step`) the host prepares a step while the step before it runs,
so such a copy would stall it for a whole step. `to_device` stages the values in pinned memory
(torch's caching host allocator, which keeps the block until the copy has run) and copies
them with non_blocking=True, which returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
              device: torch.device) -> Tensor:  # fmt: skip
    """[len(values)] tensor of `dtype` on `device`; on CUDA the copy is queued, not waited for."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
