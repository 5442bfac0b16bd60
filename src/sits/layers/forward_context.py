"""The per-step inputs every attention layer reads: attention metadata and the paged KV cache.

It is passed explicitly to `model.forward` (no global forward context). Invariant: within a
layer, every token's K/V of the step is written to the cache before any attention of that layer
reads it, so sequences scheduled in one step may share blocks one of them fills this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from sits.kernels.attention_metadata import AttentionMetadata
    from sits.kernels.kv_quant_ref import QuantizedKVCache


class AttentionBackend(Protocol):
    """Computes paged attention for one layer (PyTorch reference on CPU, Triton on GPU)."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor | QuantizedKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """Write key/value into kv_cache at metadata.slot_mapping, then attend.

        Args:
            query: [num_tokens, num_heads, head_dim].
            key, value: [num_tokens, num_kv_heads, head_dim].
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V), or
                a `QuantizedKVCache` (fp8/int8 data of that shape plus float32 scales).
            metadata: the step's layout.
            scale: softmax scale (usually head_dim ** -0.5).

        Returns:
            [num_tokens, num_heads, head_dim] attention output, query dtype.
        """
        ...


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """Everything a model forward needs besides token ids and positions.

    Attributes:
        attn_metadata: the step's batch layout; None for a forward with no KV cache.
        kv_caches: one per decoder layer: a tensor [2, num_blocks, block_size, num_kv_heads,
            head_dim] in the model dtype (kv_cache_dtype "auto"), or a `QuantizedKVCache`
            (fp8/int8; see `sits.kernels.kv_quant_ref`).
        attn_backend: the attention implementation.
        token_mask: [num_tokens] bool, False on padding tokens (a decode batch padded to a
            CUDA-graph size); None = every token is real. MoE statistics skip padding.
    """

    attn_metadata: AttentionMetadata
    kv_caches: list[Tensor] | list[QuantizedKVCache]
    attn_backend: AttentionBackend
    token_mask: Tensor | None = None
