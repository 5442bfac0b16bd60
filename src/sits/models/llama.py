"""Llama family (`LlamaForCausalLM`): pre-norm decoder, GQA, RoPE, SwiGLU MLP.

Config mapping: `attention_bias` adds biases to q/k/v and o; `mlp_bias` to the MLP.
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.models.hf_config import decoder_config_of


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3 and compatible checkpoints."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers LlamaConfig (UnsupportedModelError for unsupported options)."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return decoder_config_of(
            hf_config,
            "LlamaForCausalLM",
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            qk_norm=False,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )
