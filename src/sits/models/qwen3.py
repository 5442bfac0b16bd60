"""Qwen3 family (`Qwen3ForCausalLM`): Llama-like decoder with a per-head RMSNorm on q and k
before RoPE; `attention_bias` adds biases to q/k/v and o.
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.models.hf_config import architecture_of, attention_config_of, check_supported


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 dense checkpoints."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers Qwen3Config (UnsupportedModelError for unsupported options)."""
        check_supported(hf_config)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderConfig(
            architecture=architecture_of(hf_config) or "Qwen3ForCausalLM",
            vocab_size=hf_config.vocab_size,
            num_layers=hf_config.num_hidden_layers,
            attention=attention_config_of(
                hf_config, qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True
            ),
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
        )
