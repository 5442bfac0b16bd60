"""Kernels: compute routines, each Triton kernel beside the plain PyTorch reference it must match.

References here run on any device and are what the CPU path uses:
- `attention_ref`: paged KV writes and causal paged attention (`TorchPagedAttention`).
- `moe_ref`: MoE routing (`select_experts`) and the expert loop (`moe_forward`, `TorchMoe`).
"""

from __future__ import annotations

from sits.kernels.attention_ref import TorchPagedAttention, paged_attention, write_kv
from sits.kernels.moe_ref import TorchMoe, moe_forward, select_experts

__all__ = [
    "TorchMoe",
    "TorchPagedAttention",
    "moe_forward",
    "paged_attention",
    "select_experts",
    "write_kv",
]
