"""Builds the parts every engine front end needs: checkpoint facts, tokenizer, `EngineCore`.

With `load_format="dummy"` the engine reads a dummy directory (`sits.models.dummy`) made from
the checkpoint's config files, so the runner's loader makes seeded random weights on the
device; with `skip_tokenizer_init` no tokenizer is loaded (`EngineParts.tokenizer` is None).
Also maps the user-facing tenant config (`sits.tenancy`) to the scheduler's `TenantPolicy`s.
On a CPU device it sets torch's intra-op threads (`sits.config.cpu_threads_of`: 1 by default,
a process-wide setting) before the model loads.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from sits.config import CPU_THREADS_ENVS, EngineConfig, cpu_threads_of, env_values
from sits.engine.core import EngineCore
from sits.engine.tokenizer import Tokenizer
from sits.models.dummy import prepare_dummy_dir
from sits.models.loader import model_quant_config, resolve_model_path
from sits.runner.model_info import ModelInfo, read_model_info
from sits.sched.config import TenantPolicy, TenantTier
from sits.tenancy.config import TenantsConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What `build_engine` made.

    Attributes:
        core: scheduler + runner.
        tokenizer: the model's tokenizer; None with `skip_tokenizer_init`.
        info: checkpoint facts (max_model_len, eos ids, dtype, device).
    """

    core: EngineCore
    tokenizer: Tokenizer | None
    info: ModelInfo


def tenant_policies_of(tenants: TenantsConfig | None) -> tuple[TenantPolicy, ...]:
    """The scheduler policies of `tenants` (tier, reservation, weight, priority, SLOs).

    None gives () (plain FCFS): the server runs without `--tenants` that way, not with
    `TenantsConfig.default()`, whose single guaranteed tenant would only add bookkeeping.
    """
    if tenants is None:
        return ()
    return tuple(
        TenantPolicy(
            tenant_id=t.id,
            tier=TenantTier(t.tier.value),
            reserved_kv_fraction=t.reserved_kv_fraction,
            weight=t.weight,
            priority=t.priority,
            ttft_ms=t.ttft_ms,
            tpot_ms=t.tpot_ms,
        )
        for t in tenants
    )


def build_engine(
    config: EngineConfig, tenant_policies: tuple[TenantPolicy, ...] = ()
) -> EngineParts:
    """Resolve the model, load tokenizer and weights, and size the KV cache.

    Args:
        config: the engine configuration.
        tenant_policies: the scheduler's tenants (see `tenant_policies_of`); () for plain FCFS.

    Raises:
        ModelNotFoundError: the model path or id cannot be resolved.
        UnsupportedModelError: the architecture or one of its options is not supported.
        InvalidParameterError: the tenants' reservations do not fit the KV cache ("tenants").
    """
    model_dir = resolve_model_path(config.model, **config.hub_options)
    info = read_model_info(config, model_dir)
    tokenizer: Tokenizer | None = None
    if not config.skip_tokenizer_init:
        tokenizer_dir = (
            resolve_model_path(config.tokenizer, download_dir=config.download_dir)
            if config.tokenizer
            else model_dir
        )
        tokenizer = Tokenizer(tokenizer_dir)
    if config.load_format == "dummy":
        info = dataclasses.replace(info, model_dir=prepare_dummy_dir(model_dir, config.seed))
    if info.device.type == "cpu":
        _set_cpu_threads(config)
    core = EngineCore(config, info, tenant_policies)
    runner = core.runner
    quant = model_quant_config(runner.model)
    weights = str(info.dtype).removeprefix("torch.")
    if quant is not None:
        weights += f", weights {quant.describe()}"
    if config.precision_switch is not None:
        weights += f", precision switch {'/'.join(runner.models)}"
    logger.info(
        "loaded %s%s on %s (%s); KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB), "
        "max_model_len %d",
        model_dir,
        f" with dummy weights (seed {config.seed})" if config.load_format == "dummy" else "",
        info.device,
        weights,
        core.scheduler.num_total_blocks,  # what requests may use: less the null block
        config.block_size,
        core.scheduler.num_total_blocks * config.block_size,
        runner.kv_cache_bytes / 2**20,
        info.max_model_len,
    )
    return EngineParts(core, tokenizer, info)


def _set_cpu_threads(config: EngineConfig) -> None:
    """Set torch's intra-op threads as `cpu_threads_of` says (nothing when it says None).

    Raises:
        InvalidParameterError: a bad $SITS_CPU_THREADS.
    """
    threads = cpu_threads_of(config.cpu_threads, env_values(*CPU_THREADS_ENVS))
    if threads is not None and threads != torch.get_num_threads():
        logger.debug("torch threads on the CPU: %d -> %d", torch.get_num_threads(), threads)
        torch.set_num_threads(threads)
