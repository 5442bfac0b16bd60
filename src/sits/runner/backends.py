"""Which attention and MoE implementations a runner uses on its device.

On a CUDA device with Triton installed: `TritonPagedAttention` (and the fused Triton MoE when
`sits.kernels.moe_triton` provides it); elsewhere, and for a quantized KV cache the Triton
kernels do not read, the PyTorch references. The `*_triton` modules are imported only here and
only on that path, so the CPU path never imports triton.

Invariants: a backend is CUDA-graph safe when its forward launches a fixed sequence of kernels
for fixed shapes with no host synchronisation; `graph_safe` tells the runner whether a decode
step may be captured.
"""

from __future__ import annotations

import importlib.util

import torch

from sits.kernels.attention_ref import TorchPagedAttention
from sits.kernels.triton_utils import has_triton
from sits.layers.forward_context import AttentionBackend
from sits.layers.moe import MoeBackend


def triton_usable(device: torch.device) -> bool:
    """True on a CUDA device with Triton installed (compiled kernels, not the interpreter)."""
    return device.type == "cuda" and has_triton()


def select_attention_backend(
    device: torch.device, head_dim: int, kv_cache_dtype: str
) -> AttentionBackend:
    """The attention backend for `device` and a KV cache of `kv_cache_dtype`.

    Args:
        device: where the model runs.
        head_dim: size of one attention head (picks the Triton launch defaults).
        kv_cache_dtype: "auto", "fp8" or "int8".

    Returns:
        TritonPagedAttention on CUDA with Triton (for a quantized cache only when the Triton
        kernels read it: `TritonPagedAttention.supports_quantized_kv`), else TorchPagedAttention.
    """
    if triton_usable(device):
        from sits.kernels.attention_triton import TritonAttentionConfig, TritonPagedAttention

        reads_quantized = getattr(TritonPagedAttention, "supports_quantized_kv", False)
        if kv_cache_dtype == "auto" or reads_quantized:
            return TritonPagedAttention(TritonAttentionConfig.for_head_dim(head_dim))
    return TorchPagedAttention()


def select_moe_backend(device: torch.device) -> MoeBackend | None:
    """The fused Triton MoE on CUDA when available; None = the PyTorch reference."""
    if triton_usable(device) and importlib.util.find_spec("sits.kernels.moe_triton") is not None:
        from sits.kernels.moe_triton import TritonMoe

        return TritonMoe()
    return None


def graph_safe(model: torch.nn.Module, attn_backend: AttentionBackend) -> bool:
    """True when a decode forward of `model` with `attn_backend` can be captured in a CUDA
    graph: Triton attention, and every MoE block's backend marked `cuda_graph_safe`."""
    from sits.layers.moe import SparseMoeBlock

    if type(attn_backend).__name__ != "TritonPagedAttention":
        return False
    return all(
        getattr(module.moe_backend, "cuda_graph_safe", False)
        for module in model.modules()
        if isinstance(module, SparseMoeBlock)
    )


def moe_backend_name(model: torch.nn.Module) -> str:
    """The class name of the model's MoE backend for logs, "none (dense)" without MoE."""
    for module in model.modules():
        backend = getattr(module, "moe_backend", None)
        if backend is not None:
            return type(backend).__name__
    return "none (dense)"
