"""Sparse Mixture-of-Experts block: a linear router, top-k routing and fused expert weights.

Invariants:
- Routing follows the checkpoint's config exactly: softmax over all experts in float32, top-k,
  renormalise the k weights only when `MoeConfig.renormalize` (Mixtral: always; Qwen3-MoE:
  `norm_topk_prob`).
- Expert weights are stored fused: w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I].
- The compute goes through a `MoeBackend` seam; the default is the PyTorch reference
  (`kernels.moe_ref.TorchMoe`) and a fused GPU kernel can replace it without touching weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from sits.kernels.moe_ref import TorchMoe


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Shape and routing of a sparse MoE block.

    Attributes:
        num_experts: experts per layer (E).
        top_k: experts per token.
        intermediate_size: hidden width of one expert (I).
        renormalize: rescale the top-k weights to sum to 1.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool


class MoeBackend(Protocol):
    """Computes routing and experts (PyTorch reference on CPU, fused kernels on GPU)."""

    def select_experts(
        self, router_logits: Tensor, top_k: int, renormalize: bool
    ) -> tuple[Tensor, Tensor]:
        """[T, E] logits -> ([T, k] float32 weights, [T, k] int64 expert ids)."""
        ...

    def experts(
        self, hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
    ) -> Tensor:
        """[T, H] hidden, [E, 2I, H] w13, [E, H, I] w2 -> [T, H] weighted expert sum."""
        ...


class SparseMoeBlock(nn.Module):
    """Router + experts of one decoder layer.

    Attributes:
        gate: router, Linear(hidden_size, num_experts, bias=False).
        w13: [num_experts, 2 * intermediate_size, hidden_size] parameter.
        w2: [num_experts, hidden_size, intermediate_size] parameter.
        moe_backend: where routing and experts run.
    """

    def __init__(
        self, hidden_size: int, config: MoeConfig, moe_backend: MoeBackend | None = None
    ) -> None:
        super().__init__()
        self.config = config
        num_experts, inter = config.num_experts, config.intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        self.moe_backend: MoeBackend = moe_backend if moe_backend is not None else TorchMoe()

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden: [num_tokens, hidden_size] -> [num_tokens, hidden_size], hidden's dtype."""
        router_logits = self.gate(hidden)  # [num_tokens, num_experts]
        topk_weights, topk_ids = self.moe_backend.select_experts(
            router_logits, self.config.top_k, self.config.renormalize
        )  # [num_tokens, top_k] each
        return self.moe_backend.experts(hidden, self.w13, self.w2, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return f"{self.config}"
