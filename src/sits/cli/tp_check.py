"""Refusing a tensor-parallel size that the model's shapes do not fit, before any rank starts.

`sits serve` / `sits generate` call this with the flags' config before they build an engine, so
the refusal is one `error:` line naming the flag (the engine makes the same check,
`runner.tp_executor.check_tensor_parallel_fit`, before it starts a worker).
"""

from __future__ import annotations

from sits.config import EngineConfig


def check_tensor_parallel_fit(config: EngineConfig) -> None:
    """Build rank 0's shard of `config.model` on the meta device when
    `config.tensor_parallel_size` > 1 (`runner.tp_executor.check_tensor_parallel_fit`);
    nothing with one rank.

    Raises:
        InvalidParameterError: the size does not divide the heads, KV heads, an intermediate
            size, the experts (expert parallel) or the vocabulary (with the numbers).
        UnsupportedModelError: the checkpoint is quantized or its architecture unsupported.
        ModelNotFoundError: the model cannot be resolved.
    """
    if config.tensor_parallel_size == 1:
        return
    from sits.models.loader import resolve_model_path
    from sits.runner.tp_executor import check_tensor_parallel_fit as check_shard

    check_shard(config, resolve_model_path(config.model, **config.hub_options))
