"""Reading a Hugging Face config and mapping its common fields onto our `DecoderConfig` parts.

Invariants:
- Every option that would change results and that we do not implement raises
  UnsupportedModelError naming the option (activation, sliding window, rope kind), so a
  checkpoint either runs exactly or fails at load time. `quantization_config` is read by
  `layers.quant.config.quant_config_of` (from `loader.build_meta_model`), which refuses the
  schemes we lack.
- Both rope spellings are read: transformers 5 `rope_parameters` {rope_type, rope_theta, ...}
  and older `rope_theta` + `rope_scaling` {type|rope_type, factor, ...}.
"""

from __future__ import annotations

import os
from typing import Any

from sits.core.errors import ModelNotFoundError, UnsupportedModelError
from sits.layers.attention import AttentionConfig
from sits.layers.decoder import DecoderConfig
from sits.layers.rotary import RopeConfig


def load_hf_config(model_dir: str) -> Any:
    """Load `config.json` of a checkpoint directory with transformers' AutoConfig.

    Raises:
        ModelNotFoundError: the directory has no config.json.
        UnsupportedModelError: transformers does not know the config's model_type.
    """
    from transformers import AutoConfig  # heavy: imported on use

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ModelNotFoundError(f"no config.json in model directory {model_dir!r}")
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except (KeyError, ValueError) as err:
        raise UnsupportedModelError(f"cannot read the config of {model_dir!r}: {err}") from err


def head_dim_of(hf_config: Any) -> int:
    """`head_dim` when set, else hidden_size // num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim or hf_config.hidden_size // hf_config.num_attention_heads


def rope_parameters_of(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one flat dict with at least rope_type and rope_theta.

    Reads `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older).

    Raises:
        UnsupportedModelError: rope parameters nested per layer type.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise UnsupportedModelError(f"per-layer-type rope_parameters are not supported: {params}")
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if params["rope_type"] in ("llama3", "yarn") and "original_max_position_embeddings" not in (
        params
    ):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    return params


def rope_config_of(hf_config: Any) -> RopeConfig:
    """RopeConfig of the checkpoint (UnsupportedModelError for unknown kinds)."""
    return RopeConfig.from_dict(
        rope_parameters_of(hf_config), head_dim_of(hf_config), hf_config.max_position_embeddings
    )


def sliding_windows_of(hf_config: Any) -> list[int | None]:
    """Per layer, the sliding attention window the HF model applies (None = full attention)."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    return [window] * num_layers


def check_supported(hf_config: Any) -> None:
    """Raise UnsupportedModelError for options that would change results and we lack.

    Checks: hidden_act must be SiLU; no sliding window shorter than max_position_embeddings
    (a window that long never masks anything within the context). The quantization_config
    is checked by `quant_config_of` when the model is built.
    """
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")
    max_positions = hf_config.max_position_embeddings
    for layer_idx, window in enumerate(sliding_windows_of(hf_config)):
        if window is not None and window < max_positions:
            raise UnsupportedModelError(
                f"sliding_window={window} (layer {layer_idx}) is not supported: sliding-window "
                f"attention is not implemented; it would change results beyond {window} tokens"
            )


def attention_config_of(
    hf_config: Any, *, qkv_bias: bool, o_bias: bool, qk_norm: bool
) -> AttentionConfig:
    """AttentionConfig from the HF config's head layout and RoPE, with the family's options."""
    return AttentionConfig(
        hidden_size=hf_config.hidden_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        head_dim=head_dim_of(hf_config),
        rope=rope_config_of(hf_config),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        rms_norm_eps=hf_config.rms_norm_eps,
    )


def architecture_of(hf_config: Any) -> str:
    """`architectures[0]` of the config ("" when absent)."""
    architectures = getattr(hf_config, "architectures", None) or []
    return architectures[0] if architectures else ""


def decoder_config_of(
    hf_config: Any,
    default_architecture: str,
    *,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: bool,
    **family_fields: Any,
) -> DecoderConfig:
    """The DecoderConfig fields every family shares, plus the family's own (`family_fields`:
    e.g. `mlp_bias`, `moe`, `moe_layer_ids`). Checks `check_supported` first.

    Raises:
        UnsupportedModelError: an option that would change results is not implemented.
    """
    check_supported(hf_config)
    return DecoderConfig(
        architecture=architecture_of(hf_config) or default_architecture,
        vocab_size=hf_config.vocab_size,
        num_layers=hf_config.num_hidden_layers,
        attention=attention_config_of(hf_config, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm),
        intermediate_size=hf_config.intermediate_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=hf_config.max_position_embeddings,
        **family_fields,
    )
