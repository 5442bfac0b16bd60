"""Qwen3-MoE family (`Qwen3MoeForCausalLM`): Qwen3 attention (q/k norm) with sparse MoE MLPs.

Config mapping: layer i is sparse iff i is not in `mlp_only_layers`, num_experts > 0 and
(i + 1) % `decoder_sparse_step` == 0; other layers use a dense MLP of `intermediate_size`.
Experts have width `moe_intermediate_size`; the top-k weights are renormalised only when
`norm_topk_prob` is set.
"""

from __future__ import annotations

from typing import Any

from sits.layers.decoder import DecoderConfig, DecoderForCausalLM
from sits.layers.moe import MoeConfig
from sits.models.hf_config import decoder_config_of


def _num_experts(hf_config: Any) -> int:
    value = getattr(hf_config, "num_experts", None)
    return int(value if value is not None else getattr(hf_config, "num_local_experts", 0))


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE checkpoints (e.g. Qwen3-30B-A3B)."""

    @staticmethod
    def config_from_hf(hf_config: Any) -> DecoderConfig:
        """Map a transformers Qwen3MoeConfig (UnsupportedModelError for unsupported options)."""
        num_experts = _num_experts(hf_config)
        sparse_step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
        moe_layer_ids = tuple(
            i
            for i in range(hf_config.num_hidden_layers)
            if i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0
        )
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return decoder_config_of(
            hf_config,
            "Qwen3MoeForCausalLM",
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            qk_norm=True,
            moe=MoeConfig(
                num_experts=num_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.moe_intermediate_size,
                renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
            ),
            moe_layer_ids=moe_layer_ids,
        )
