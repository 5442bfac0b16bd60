"""Llama family (`LlamaForCausalLM`): pre-norm decoder, GQA, RoPE, SwiGLU MLP.

Config mapping: `attention_bias` adds biases to q/k/v and o; `mlp_bias` to the MLP.
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.models.hf_config import architecture_of, attention_config_of, check_supported


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3 and compatible checkpoints."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers LlamaConfig (UnsupportedModelError for unsupported options)."""
        check_supported(hf_config)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderConfig(
            architecture=architecture_of(hf_config) or "LlamaForCausalLM",
            vocab_size=hf_config.vocab_size,
            num_layers=hf_config.num_hidden_layers,
            attention=attention_config_of(
                hf_config, qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False
            ),
            intermediate_size=hf_config.intermediate_size,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
        )
