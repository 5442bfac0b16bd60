"""Qwen3 family (`Qwen3ForCausalLM`): Llama-like decoder with a per-head RMSNorm on q and k
before RoPE; `attention_bias` adds biases to q/k/v and o.
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.models.hf_config import decoder_config_of


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 dense checkpoints."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers Qwen3Config (UnsupportedModelError for unsupported options)."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return decoder_config_of(
            hf_config,
            "Qwen3ForCausalLM",
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            qk_norm=True,
        )
