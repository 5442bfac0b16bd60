"""Models: HF architecture -> our module classes, HF config mapping, and the weight loader.

Entry points: `load_model(model_dir, dtype, device)` builds a `DecoderForCausalLM` whose
`forward(input_ids [T], positions [T], ctx) -> hidden [T, H]` and
`compute_logits(hidden [N, H]) -> [N, V] float32` serve the runner, and whose `arch`
(`ModelArch`: num_layers, num_kv_heads, head_dim, ...) sizes the KV cache;
`resolve_model_path(name_or_path)` finds or downloads a checkpoint directory.
Model files never import each other; they share `sits.layers`.
"""

from __future__ import annotations

from sits.layers.decoder import DecoderForCausalLM, ModelArch
from sits.models.loader import load_model, resolve_model_path
from sits.models.registry import get_model_class, supported_architectures

__all__ = [
    "DecoderForCausalLM",
    "ModelArch",
    "get_model_class",
    "load_model",
    "resolve_model_path",
    "supported_architectures",
]
