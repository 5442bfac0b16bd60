"""Mixtral family (`MixtralForCausalLM`): Llama-like attention with a sparse MoE MLP in every
layer; experts have width `intermediate_size`, routing is softmax -> top-k -> renormalise.
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.layers.moe import MoeConfig
from sits.models.hf_config import architecture_of, attention_config_of, check_supported


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral 8x7B / 8x22B and compatible checkpoints."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers MixtralConfig (UnsupportedModelError for unsupported options)."""
        check_supported(hf_config)
        num_layers = hf_config.num_hidden_layers
        return DecoderConfig(
            architecture=architecture_of(hf_config) or "MixtralForCausalLM",
            vocab_size=hf_config.vocab_size,
            num_layers=num_layers,
            attention=attention_config_of(hf_config, qkv_bias=False, o_bias=False, qk_norm=False),
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
            moe=MoeConfig(
                num_experts=hf_config.num_local_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.intermediate_size,
                renormalize=True,
            ),
            moe_layer_ids=tuple(range(num_layers)),
        )
