"""Refusing a tensor-parallel size that the model's shapes do not fit, before any rank starts.

The engine finds out too, but only once its worker processes load their shards: each worker
then logs its traceback and `sits serve` / `sits generate` print a screen of them before their
one error line, after seconds of process starts. Building rank 0's shard on the meta device
(no memory, no weights read) raises the same error at once, with the numbers.
"""

from __future__ import annotations

from sits.config import EngineConfig


def check_tensor_parallel_fit(config: EngineConfig) -> None:
    """Build rank 0's shard of `config.model` on the meta device when
    `config.tensor_parallel_size` > 1; nothing with one rank.

    Raises:
        InvalidParameterError: the size does not divide the heads, KV heads, an intermediate
            size or the vocabulary (the message gives the numbers).
        UnsupportedModelError: the checkpoint is quantized (TP of quantized weights is not
            supported yet) or its architecture is not supported.
        ModelNotFoundError: the model cannot be resolved.
    """
    if config.tensor_parallel_size == 1:
        return
    from sits.models.loader import build_meta_model, resolve_model_path
    from sits.parallel.state import TensorParallel

    model_dir = resolve_model_path(config.model)
    tp = TensorParallel(rank=0, size=config.tensor_parallel_size)
    build_meta_model(model_dir, quantization=config.quantization, tp=tp)
