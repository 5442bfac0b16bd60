"""Qwen2 family (`Qwen2ForCausalLM`): Llama-like decoder whose q/k/v projections have biases
(the output projection has none).
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.models.hf_config import architecture_of, attention_config_of, check_supported


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5 checkpoints."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers Qwen2Config (UnsupportedModelError for unsupported options)."""
        check_supported(hf_config)
        return DecoderConfig(
            architecture=architecture_of(hf_config) or "Qwen2ForCausalLM",
            vocab_size=hf_config.vocab_size,
            num_layers=hf_config.num_hidden_layers,
            attention=attention_config_of(hf_config, qkv_bias=True, o_bias=False, qk_norm=False),
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
        )
