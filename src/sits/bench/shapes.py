"""Named model shapes for benchmarks with random weights (`--random-weights SHAPE`).

Each shape is the Hugging Face config.json of a real checkpoint (architecture, widths, heads,
experts, vocabulary, RoPE), so the engine builds exactly that model; `write_shape_dir` writes it
(and a generation_config.json) into a directory under the sits cache dir, which the engine
loads with `load_format="dummy"` and `skip_tokenizer_init=True`: no weights, no tokenizer, no
download. The tiny shapes are for tests on the CPU.

Invariant: a shape directory's files are rewritten when their contents differ (atomically, by
rename), so a directory always matches the table below.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from sits.config import sits_cache_dir
from sits.core.errors import InvalidParameterError

# Values from the checkpoints' config.json on the Hugging Face Hub (Qwen/Qwen3-30B-A3B,
# meta-llama/Llama-3.1-8B, mistralai/Mixtral-8x7B-v0.1).
_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

_MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}

_TINY_COMMON: dict[str, Any] = {
    "bos_token_id": None,
    "eos_token_id": 0,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": 512,
}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "llama-3.1-8b": _LLAMA_31_8B,
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "tiny-qwen3-moe": {
        **_TINY_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "tiny-llama": {**_TINY_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
}


def shape_names() -> list[str]:
    """The known shape names, real shapes first."""
    return list(SHAPES)


def shape_config(name: str) -> dict[str, Any]:
    """A copy of the HF config dict of shape `name`.

    Raises:
        InvalidParameterError: unknown name (the message lists the known ones).
    """
    if name not in SHAPES:
        raise InvalidParameterError(
            "random_weights", f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}"
        )
    return json.loads(json.dumps(SHAPES[name]))


def write_shape_dir(name: str, cache_dir: str | None = None) -> str:
    """Write shape `name`'s config.json and generation_config.json; returns the directory.

    Args:
        name: a key of SHAPES.
        cache_dir: parent directory (default `sits_cache_dir()/shapes`).

    Raises:
        InvalidParameterError: unknown name.
    """
    config = shape_config(name)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    out_dir = os.path.join(cache_dir or os.path.join(sits_cache_dir(), "shapes"), name)
    os.makedirs(out_dir, exist_ok=True)
    _write_json_if_changed(os.path.join(out_dir, "config.json"), config)
    _write_json_if_changed(os.path.join(out_dir, "generation_config.json"), generation)
    return out_dir


def _write_json_if_changed(path: str, doc: dict[str, Any]) -> None:
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    fd, tmp_path = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp_path, path)
