"""Qwen2 family (`Qwen2ForCausalLM`): Llama-like decoder whose q/k/v projections have biases
(the output projection has none).
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.models.hf_config import decoder_config_of


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5 checkpoints."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers Qwen2Config (UnsupportedModelError for unsupported options)."""
        return decoder_config_of(
            hf_config, "Qwen2ForCausalLM", qkv_bias=True, o_bias=False, qk_norm=False
        )
