"""Mixtral family (`MixtralForCausalLM`): Llama-like attention with a sparse MoE MLP in every
layer; experts have width `intermediate_size`, routing is softmax -> top-k -> renormalise.
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.layers.moe import MoeConfig
from sits.models.hf_config import decoder_config_of


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral 8x7B / 8x22B and compatible checkpoints."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers MixtralConfig (UnsupportedModelError for unsupported options)."""
        return decoder_config_of(
            hf_config,
            "MixtralForCausalLM",
            qkv_bias=False,
            o_bias=False,
            qk_norm=False,
            moe=MoeConfig(
                num_experts=hf_config.num_local_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.intermediate_size,
                renormalize=True,  # softmax over all experts, top-k, renormalised
            ),
            moe_layer_ids=tuple(range(hf_config.num_hidden_layers)),
        )
