"""Per-expert load and health of a sparse MoE layer, on the device: `ExpertState`.

Invariants:
- `ExpertState` lives on the expert weights' device and is updated inside the forward with
  tensor ops only (index_add_, where, logical ops; on CUDA the two Triton kernels that fuse
  them): no host synchronisation per step, and every tensor is updated in place, so a
  captured CUDA graph keeps working on it. The host reads it only through
  `runner.expert_health.ExpertMonitor.read()` (one copy per layer).
- A "check" of an expert is one forward in which it received at least one real (unpadded)
  token whose input row was finite; it is anomalous when one of those rows' outputs is
  non-finite. Rows already non-finite on entry (a request poisoned earlier) never count
  against an expert. "Input row finite" is tested on the token's router logits over the
  unfrozen experts, which are all non-finite when the hidden row holds a NaN or infinity.
- After `freeze_after` consecutive anomalous checks the expert is frozen on the device at once
  (the router masks its logit with -inf from the next forward on) while at least top_k
  experts stay unfrozen (candidates beyond that stay routed, lowest expert ids frozen first).
  Checks without tokens neither extend nor reset a streak.
- Freezing changes routing only: the expert's weights stay where they are (the runner's
  `expert_health` reads, steers and restores them). Every count, flag and id here is a
  logical expert id, whichever slot serves the expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_FREEZE_AFTER = 3


@dataclass(slots=True)
class ExpertState:
    """Device accumulators of one MoE layer (all [num_experts], on the weights' device).

    The methods are the PyTorch path of a forward (`mask_logits`, `count`, `mark_checked`, the
    experts' non-finite flags into `anomalous`, then `update_health`) and the references of
    the Triton kernels `kernels.moe_routing_triton.fused_route` and
    `kernels.moe_health_triton.fused_health_update`, which do the same in two launches.

    Attributes:
        num_tokens: int64, tokens routed to each expert since start (one per top-k choice).
        num_anomalous: int64, anomalous checks since start.
        streak: int64, consecutive anomalous checks (reset by a clean check).
        frozen: bool, experts the router masks.
        checked: bool, experts checked in the current forward (set by the routing, cleared by
            `update_health`): a persistent buffer, so a captured CUDA graph reuses it.
        anomalous: bool, experts whose output held a non-finite value in a row with a finite
            input in the current forward (set by the experts, cleared by `update_health`).
        freeze_after: [] int64, consecutive anomalous checks that freeze an expert; 0 disables
            it. On the device, so graphs captured before `set_freeze_after` follow it.
        top_k: experts per token (at most num_experts - top_k experts may be frozen).
    """

    num_tokens: Tensor
    num_anomalous: Tensor
    streak: Tensor
    frozen: Tensor
    checked: Tensor
    anomalous: Tensor
    freeze_after: Tensor
    top_k: int

    @classmethod
    def zeros(cls, num_experts: int, top_k: int, device: torch.device) -> ExpertState:
        """Fresh counters, nothing frozen, `freeze_after` = DEFAULT_FREEZE_AFTER."""
        zeros = torch.zeros(num_experts, dtype=torch.int64, device=device)
        flags = torch.zeros(num_experts, dtype=torch.bool, device=device)
        return cls(
            num_tokens=zeros,
            num_anomalous=zeros.clone(),
            streak=zeros.clone(),
            frozen=flags,
            checked=flags.clone(),
            anomalous=flags.clone(),
            freeze_after=torch.full((), DEFAULT_FREEZE_AFTER, dtype=torch.int64, device=device),
            top_k=top_k,
        )

    def set_freeze_after(self, freeze_after: int) -> None:
        """Change the freezing streak in place (0 disables freezing)."""
        with torch.inference_mode():  # the state may be inference tensors (made in a forward)
            self.freeze_after.fill_(freeze_after)

    def mask_logits(self, router_logits: Tensor) -> Tensor:
        """[T, E] logits with the frozen experts' columns set to -inf (same dtype)."""
        return router_logits.masked_fill(self.frozen, float("-inf"))

    def finite_rows(self, router_logits: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """[T] bool: real tokens (token_mask [T], None = all) whose unmasked router logits
        [T, E] are finite over the unfrozen experts.

        A NaN or infinite hidden row makes every logit of its row non-finite, so this is the
        finite-input test of the health check without reading the hidden row.
        """
        finite = (torch.isfinite(router_logits) | self.frozen).all(dim=-1)  # [T]
        return finite if token_mask is None else finite & token_mask

    def count(self, topk_ids: Tensor, token_mask: Tensor | None = None) -> None:
        """Add the step's routing: topk_ids [T, k] int64; token_mask [T] bool (None = all)
        leaves padding tokens out."""
        flat = topk_ids.flatten()  # [T * k]
        if token_mask is None:
            ones = torch.ones_like(flat)
        else:
            ones = token_mask[:, None].expand_as(topk_ids).flatten().long()  # [T * k]
        self.num_tokens.index_add_(0, flat, ones)

    def mark_checked(self, topk_ids: Tensor, finite_rows: Tensor) -> None:
        """Set `checked` for the experts of topk_ids [T, k] int64 that got a token of
        finite_rows [T] bool (`finite_rows`)."""
        counted = finite_rows[:, None].expand_as(topk_ids).flatten().long()  # [T * k]
        hits = torch.zeros_like(self.streak).index_add_(0, topk_ids.flatten(), counted)  # [E]
        self.checked |= hits > 0

    def update_health(self) -> None:
        """Fold the forward's `checked` and `anomalous` flags in, freeze experts whose streak
        reached `freeze_after` (lowest ids first, while at least top_k experts stay unfrozen),
        then clear both flags for the next forward."""
        anomalous = self.anomalous & self.checked  # [E]
        self.num_anomalous += anomalous.long()
        self.streak.copy_(
            torch.where(anomalous, self.streak + 1, torch.where(self.checked, 0, self.streak))
        )  # [E]
        candidates = (self.streak >= self.freeze_after) & ~self.frozen & (self.freeze_after > 0)
        room = self.frozen.numel() - self.top_k - self.frozen.sum()  # [] int64
        fits = torch.cumsum(candidates.long(), dim=0) <= room  # [E]
        self.frozen |= candidates & fits
        self.checked.zero_()
        self.anomalous.zero_()
