"""The runner's weight sets for the runtime precision switch (`EngineConfig.precision_switch`).

The model-dtype model and its low-precision twin (`sits.models.precision_twin`) are both
resident; each has its own CUDA graphs (decode and mixed-step, over the same input buffers and
KV caches, captured into the same memory pools: only one set's graph replays at a time), and
the runner runs the set its `precision` names. The KV cache is one and untouched by a switch.

Memory: the twin's bytes are computed on the meta device and checked against the budget before
anything is allocated, with a minimal KV cache (one sequence of max_model_len tokens plus the
null block); the KV cache is sized after both sets are loaded, so it gets what is left.

Names: the model-dtype set is named by its dtype ("bf16", "fp16", "fp32"), the twin by its
scheme ("fp8", "int4").
"""

from __future__ import annotations

import logging

import torch

from sits.core.errors import PrecisionSwitchMemoryError
from sits.layers.decoder import DecoderForCausalLM
from sits.layers.moe import MoeBackend
from sits.models.precision_twin import (
    build_twin,
    check_unquantized,
    meta_twin,
    twin_weight_bytes,
    weight_bytes,
)

logger = logging.getLogger(__name__)

DTYPE_PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def precision_name(dtype: torch.dtype) -> str:
    """The name of the model-dtype weight set: "bf16", "fp16" or "fp32"."""
    return DTYPE_PRECISION_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def memory_budget_bytes(device: torch.device, gpu_memory_utilization: float | None) -> int | None:
    """Device bytes left for the twin and the KV cache now (the full model loaded): on CUDA
    `gpu_memory_utilization` of the total minus what is in use, as the KV sizing computes it
    (None: the free memory, for an explicit `kv_cache_memory_bytes`); None off CUDA (host
    memory is not budgeted)."""
    if device.type != "cuda":
        return None
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    if gpu_memory_utilization is None:
        return free_bytes
    return int(total_bytes * gpu_memory_utilization) - (total_bytes - free_bytes)


def check_twin_fits(
    scheme: str, *, full_bytes: int, twin_bytes: int, min_kv_bytes: int, budget_bytes: int | None
) -> None:
    """Refuse a twin that does not fit beside a minimal KV cache.

    Args:
        scheme: "fp8" or "int4" (for the message).
        full_bytes: the model-dtype weights' bytes (for the message).
        twin_bytes: the twin's own weights' bytes (`twin_weight_bytes`).
        min_kv_bytes: the smallest KV cache the engine may start with.
        budget_bytes: bytes left after the full model (`memory_budget_bytes`); None: no check.

    Raises:
        PrecisionSwitchMemoryError: twin_bytes + min_kv_bytes > budget_bytes.
    """
    if budget_bytes is not None and twin_bytes + min_kv_bytes > budget_bytes:
        raise PrecisionSwitchMemoryError(scheme, full_bytes, twin_bytes, min_kv_bytes, budget_bytes)


def load_twin(
    full: DecoderForCausalLM,
    model_dir: str,
    scheme: str,
    *,
    moe_backend: MoeBackend | None,
    min_kv_bytes: int,
    budget_bytes: int | None,
) -> DecoderForCausalLM:
    """Check the memory, then build the `scheme` twin of the loaded `full` model on its device.

    Raises:
        PrecisionSwitchMemoryError: see `check_twin_fits`.
        InvalidParameterError: the checkpoint is already quantized.
        UnsupportedModelError: the scheme cannot hold the model's shapes.
    """
    check_unquantized(full)
    param = next(full.parameters())
    twin = meta_twin(model_dir, scheme, param.dtype, moe_backend)
    twin_bytes, full_bytes = twin_weight_bytes(twin), weight_bytes(full)
    check_twin_fits(
        scheme,
        full_bytes=full_bytes,
        twin_bytes=twin_bytes,
        min_kv_bytes=min_kv_bytes,
        budget_bytes=budget_bytes,
    )
    twin = build_twin(full, twin, param.device)
    if param.device.type == "cuda":
        torch.cuda.empty_cache()  # the quantizers' temporaries: the KV sizing reads free memory
    logger.info(
        "precision switch: %s weights %.1f MiB beside the model-dtype %.1f MiB",
        scheme,
        twin_bytes / 2**20,
        full_bytes / 2**20,
    )
    return twin
