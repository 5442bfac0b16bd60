"""Builds the parts every engine front end needs: checkpoint facts, tokenizer, `EngineCore`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sits.config import EngineConfig
from sits.engine.core import EngineCore
from sits.engine.tokenizer import Tokenizer
from sits.models.loader import resolve_model_path
from sits.runner.model_info import ModelInfo, read_model_info

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What `build_engine` made.

    Attributes:
        core: scheduler + runner.
        tokenizer: the model's tokenizer.
        info: checkpoint facts (max_model_len, eos ids, dtype, device).
    """

    core: EngineCore
    tokenizer: Tokenizer
    info: ModelInfo


def build_engine(config: EngineConfig) -> EngineParts:
    """Resolve the model, load tokenizer and weights, and size the KV cache.

    Raises:
        ModelNotFoundError: the model path or id cannot be resolved.
        UnsupportedModelError: the architecture or one of its options is not supported.
    """
    model_dir = resolve_model_path(config.model)
    tokenizer_dir = resolve_model_path(config.tokenizer) if config.tokenizer else model_dir
    info = read_model_info(config, model_dir)
    tokenizer = Tokenizer(tokenizer_dir)
    core = EngineCore(config, info)
    runner = core.runner
    logger.info(
        "loaded %s on %s (%s); KV cache: %d blocks of %d tokens (%.1f MiB), max_model_len %d",
        model_dir,
        info.device,
        str(info.dtype).removeprefix("torch."),
        runner.num_blocks,
        config.block_size,
        runner.kv_cache_bytes / 2**20,
        info.max_model_len,
    )
    return EngineParts(core, tokenizer, info)
