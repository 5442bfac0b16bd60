"""`ModelInfo`: the facts the engine needs about a checkpoint before it loads the weights.

Read from `config.json` and `generation_config.json` of a Hugging Face checkpoint directory,
combined with the engine configuration: device, dtype, context length and EOS ids.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, ModelNotFoundError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Resolved model facts.

    Attributes:
        model_dir: local checkpoint directory.
        device: where the model runs.
        dtype: weight and KV cache dtype.
        max_model_len: context length limit in tokens (prompt + output).
        eos_token_ids: ids that end generation (config's and generation config's EOS ids).
        hf_config: the raw config.json dictionary.
    """

    model_dir: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    hf_config: dict


def read_model_info(config: EngineConfig, model_dir: str) -> ModelInfo:
    """Read a checkpoint's config and resolve device, dtype and context length.

    Raises:
        ModelNotFoundError: the directory has no config.json.
        InvalidParameterError: max_model_len exceeds the model's position limit, or CUDA was
            asked for but is not available.
    """
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{model_dir!r} has no config.json: not a checkpoint directory")
    with open(path, encoding="utf-8") as f:
        hf_config = json.load(f)
    device = _resolve_device(config.device)
    dtype = _resolve_dtype(config.dtype, hf_config, device)
    max_model_len = _resolve_max_model_len(config.max_model_len, hf_config)
    eos = _eos_ids(hf_config, model_dir)
    return ModelInfo(model_dir, device, dtype, max_model_len, eos, hf_config)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError(
            "device", "device 'cuda' was asked for but CUDA is not available"
        )
    return torch.device(name)


def _resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    text_config = hf_config.get("text_config") or {}
    saved = hf_config.get("torch_dtype") or hf_config.get("dtype") or text_config.get("dtype")
    dtype = _DTYPES.get(str(saved), torch.float32)
    if device.type == "cpu":
        # Half-precision matmuls on the CPU are slow and less exact; serve them in float32.
        return torch.float32
    return dtype if dtype != torch.float32 else torch.bfloat16


def _resolve_max_model_len(asked: int | None, hf_config: dict) -> int:
    model_len = int(hf_config.get("max_position_embeddings") or 2048)
    if asked is None:
        return model_len
    if asked > model_len:
        raise InvalidParameterError(
            "max_model_len",
            f"max_model_len {asked} exceeds the model's max_position_embeddings {model_len}",
        )
    return asked


def _eos_ids(hf_config: dict, model_dir: str) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [hf_config.get("eos_token_id")]
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            sources.append(json.load(f).get("eos_token_id"))
    for value in sources:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)
