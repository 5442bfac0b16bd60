"""Triton kernel: fold one forward's expert health check into a MoE layer's counters.

`fused_health_update` is the one-launch twin of `layers.moe_stats.ExpertState.update_health`
(which the CPU path runs as about ten PyTorch kernels): it reads the step's `checked` and
`anomalous` flags, updates the anomaly counters, streaks and frozen mask, and clears both
flags, so they can be persistent buffers that `fused_route` and the experts' non-finite check
set during the next forward (no per-step allocation or zeroing).

Invariants:
- An expert is anomalous this step only if it was also checked (it received a real token with
  a finite input row); a check extends the streak when anomalous and resets it otherwise; an
  expert without a check keeps its streak.
- Experts whose streak reaches `freeze_after` (> 0) are frozen, lowest expert ids first, while
  at least `top_k` experts stay unfrozen; frozen experts stay frozen (only an operator or a
  restore unfreezes them).
- `freeze_after` is read from device memory, so a CUDA graph captured before the operator
  changes it follows the new value. One program (num_experts <= 1024), no host
  synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import as_bytes, next_power_of_2

MAX_EXPERTS = 1024  # experts one program holds


@triton.jit
def fused_health_kernel(
    checked_ptr,
    anomalous_ptr,
    num_anomalous_ptr,
    streak_ptr,
    frozen_ptr,
    freeze_after_ptr,
    num_experts,
    top_k,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The single program updates every expert of the layer (see `fused_health_update`)."""
    pdl_enter(USE_PDL)
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    col_in = cols < num_experts
    checked = tl.load(checked_ptr + cols, mask=col_in, other=0) != 0
    anomalous = (tl.load(anomalous_ptr + cols, mask=col_in, other=0) != 0) & checked
    num_anomalous = tl.load(num_anomalous_ptr + cols, mask=col_in, other=0)
    tl.store(num_anomalous_ptr + cols, num_anomalous + anomalous.to(tl.int64), mask=col_in)
    streak = tl.load(streak_ptr + cols, mask=col_in, other=0)  # int64
    streak = tl.where(anomalous, streak + 1, tl.where(checked, 0, streak))
    tl.store(streak_ptr + cols, streak, mask=col_in)
    frozen = tl.load(frozen_ptr + cols, mask=col_in, other=0) != 0
    freeze_after = tl.load(freeze_after_ptr)
    candidates = col_in & ~frozen & (streak >= freeze_after) & (freeze_after > 0)
    room = num_experts - top_k - tl.sum(frozen.to(tl.int32), axis=0)
    fits = tl.cumsum(candidates.to(tl.int32), axis=0) <= room  # lowest ids first
    frozen = frozen | (candidates & fits)
    tl.store(frozen_ptr + cols, frozen.to(frozen_ptr.dtype.element_ty), mask=col_in)
    tl.store(checked_ptr + cols, tl.zeros([BLOCK_E], checked_ptr.dtype.element_ty), mask=col_in)
    zero = tl.zeros([BLOCK_E], anomalous_ptr.dtype.element_ty)
    tl.store(anomalous_ptr + cols, zero, mask=col_in)


def fused_health_update(
    checked: Tensor,
    anomalous: Tensor,
    num_anomalous: Tensor,
    streak: Tensor,
    frozen: Tensor,
    top_k: int,
    freeze_after: Tensor,
) -> None:
    """Fold the step's health flags into the counters and clear the flags, in one launch.

    All tensors are [num_experts] (num_experts <= 1024), contiguous, on one device, updated in
    place; equals `ExpertState.update_health`.

    Args:
        checked: bool or int32, experts that received a real token with a finite input row
            this step; cleared.
        anomalous: bool or int32, experts that turned a finite row into a non-finite one this
            step (counted only when also checked); cleared.
        num_anomalous: int64, += anomalous checks.
        streak: int64, consecutive anomalous checks.
        frozen: bool, experts the router masks; newly frozen experts are added.
        top_k: experts per token; at most num_experts - top_k experts end up frozen by this
            update (an operator may not have frozen more).
        freeze_after: [] or [1] int64 on the same device, streak that freezes an expert;
            <= 0 disables freezing.
    """
    (num_experts,) = checked.shape
    assert num_experts <= MAX_EXPERTS, f"{num_experts} experts > {MAX_EXPERTS}"
    for tensor in (checked, anomalous, num_anomalous, streak, frozen):
        assert tensor.shape == (num_experts,) and tensor.is_contiguous()
    assert num_anomalous.dtype == torch.int64 and streak.dtype == torch.int64
    assert freeze_after.numel() == 1 and freeze_after.dtype == torch.int64
    fused_health_kernel[(1,)](
        as_bytes(checked),
        as_bytes(anomalous),
        num_anomalous,
        streak,
        as_bytes(frozen),
        freeze_after,
        num_experts,
        top_k,
        BLOCK_E=next_power_of_2(num_experts),
        num_warps=max(1, min(4, num_experts // 64)),
        **pdl_args(streak),
    )
