"""Which model class serves which checkpoint: HF `architectures[0]` (or `model_type`) -> class.

Invariant: every class here is a `DecoderForCausalLM` with a static
`config_from_hf(hf_config) -> DecoderConfig`; anything else raises UnsupportedModelError naming
the supported architectures.
"""

from __future__ import annotations

from typing import Any

from sits.core.errors import UnsupportedModelError
from sits.layers.decoder import DecoderForCausalLM
from sits.models.llama import LlamaForCausalLM
from sits.models.mixtral import MixtralForCausalLM
from sits.models.qwen2 import Qwen2ForCausalLM
from sits.models.qwen3 import Qwen3ForCausalLM
from sits.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def supported_architectures() -> list[str]:
    """Sorted names of the architectures sits can serve."""
    return sorted(MODEL_CLASSES)


def get_model_class(hf_config: Any) -> type[DecoderForCausalLM]:
    """The class for a config's `architectures[0]` (falls back to its `model_type`).

    Raises:
        UnsupportedModelError: the architecture is not served; the message lists the supported.
    """
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        name = architectures[0]
    else:
        model_type = getattr(hf_config, "model_type", "")
        name = _ARCHITECTURE_OF_MODEL_TYPE.get(model_type, f"<none; model_type={model_type!r}>")
    model_class = MODEL_CLASSES.get(name)
    if model_class is None:
        raise UnsupportedModelError(
            f"architecture {name} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    return model_class
