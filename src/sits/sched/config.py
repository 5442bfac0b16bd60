"""Scheduler configuration: step limits, KV geometry and the tenants' scheduling policies.

`SchedulerConfig` holds the immutable limits the scheduler enforces each step; `TenantPolicy`
is one tenant's tier, reservation, fair-share weight, priority and SLOs as the scheduler sees
them (the tenancy package owns the user-facing config; the engine maps it to these).

Invariants (checked at construction): every limit is >= 1; the cache has at least one usable
block besides the reserved null block 0; tenant ids are unique; a best-effort tenant reserves
nothing; the reservations (in blocks and in sequence slots, see `reserved_amount`) fit in the
cache and in `max_num_seqs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError

_FRACTION_EPS = 1e-9  # float slack when summing reserved fractions (0.1 + 0.2 + 0.7 == 1)


class TenantTier(Enum):
    """What capacity a tenant may count on (values match tenants.toml's `tier`).

    GUARANTEED: its reservation is always there: borrowers holding it are preempted.
    BURSTABLE: a reservation nobody else may newly take while it needs it, plus borrowing.
    BEST_EFFORT: idle capacity only (it reserves nothing).
    """

    GUARANTEED = "guaranteed"
    BURSTABLE = "burstable"
    BEST_EFFORT = "best_effort"


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantPolicy:
    """One tenant's scheduling policy.

    Attributes:
        tenant_id: matches `Request.tenant_id`.
        tier: guaranteed | burstable | best_effort.
        reserved_kv_fraction: share in [0, 1] of the usable KV blocks and of `max_num_seqs`
            kept for this tenant (see `reserved_amount` for the rounding).
        weight: > 0, fair-share weight against tenants of the same tier and priority.
        priority: lower runs first (compared before fair share).
        ttft_ms: time-to-first-token SLO in ms; a request's first-token deadline is
            arrival_time + ttft. None: no deadline.
        tpot_ms: time-per-output-token SLO in ms; the deadline of output token k (k >= 1)
            adds k * tpot. None: counted as 0.

    Raises:
        InvalidParameterError: an empty id, a fraction outside [0, 1], a best-effort tenant
            with a reservation, a weight <= 0 or an SLO <= 0 (`param` names the field).
    """

    tenant_id: str
    tier: TenantTier = TenantTier.BEST_EFFORT
    reserved_kv_fraction: float = 0.0
    weight: float = 1.0
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tenant_id, str) or not self.tenant_id:
            raise InvalidParameterError("tenant_id", "tenant_id must be a non-empty string")
        if not isinstance(self.tier, TenantTier):
            raise InvalidParameterError("tier", f"tier must be a TenantTier, got {self.tier!r}")
        fraction = self.reserved_kv_fraction
        if not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0):
            raise InvalidParameterError(
                "reserved_kv_fraction", f"reserved_kv_fraction must be in [0, 1], got {fraction}"
            )
        if self.tier is TenantTier.BEST_EFFORT and fraction > 0:
            raise InvalidParameterError(
                "reserved_kv_fraction",
                f"best_effort tenant {self.tenant_id!r} uses idle capacity only; "
                "its reserved_kv_fraction must be 0",
            )
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise InvalidParameterError("weight", f"weight must be > 0, got {self.weight}")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidParameterError(name, f"{name} must be > 0, got {value}")


def reserved_amount(fraction: float, total: int) -> int:
    """Units (blocks or sequence slots) a reserved fraction of `total` keeps.

    floor(fraction * total), but at least 1 when fraction > 0 (a reservation that rounds to
    nothing would silently break the tenant's guarantee).
    """
    if fraction <= 0:
        return 0
    return max(1, math.floor(fraction * total + _FRACTION_EPS))


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapCostModel:
    """Cost model of swap versus recompute preemption (a first-order estimate in seconds).

    recompute_s = num_computed_tokens * prefill_s_per_token (the victim's KV computed again
    as prefill when it resumes); swap_s = 2 * num_bytes / copy_bytes_per_s (out now, in at
    resume). A victim is swapped when swap_s < recompute_s and the host tier has room.

    Attributes:
        prefill_s_per_token: seconds one prefill token costs (> 0).
        copy_bytes_per_s: device <-> host copy bandwidth in bytes per second (> 0).

    Raises:
        InvalidParameterError: a constant <= 0 or not finite.
    """

    prefill_s_per_token: float
    copy_bytes_per_s: float

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "copy_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidParameterError(name, f"{name} must be > 0, got {value}")

    @classmethod
    def for_device(cls, device_type: str) -> SwapCostModel:
        """Defaults: "cuda": 20 us per prefill token (50k tokens/s, a mid-size model on one
        H100/H200-class GPU) and 25 GB/s pinned PCIe copies; otherwise (CPU): 1 ms per token
        and 5 GB/s memory copies."""
        if device_type == "cuda":
            return cls(prefill_s_per_token=20e-6, copy_bytes_per_s=25e9)
        return cls(prefill_s_per_token=1e-3, copy_bytes_per_s=5e9)

    def prefers_swap(self, num_computed_tokens: int, num_bytes: int) -> bool:
        """True when copying `num_bytes` out and back is cheaper than recomputing the tokens."""
        recompute_s = num_computed_tokens * self.prefill_s_per_token
        return 2 * num_bytes / self.copy_bytes_per_s < recompute_s


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Scheduler limits (vLLM engine-argument names) and tenant policies.

    Attributes:
        max_num_batched_tokens: token budget of one step, prefill chunks and decodes together.
        max_num_seqs: most requests running (holding KV blocks) at once.
        max_model_len: context limit in tokens (prompt + outputs).
        block_size: tokens per KV block.
        num_blocks: KV blocks in the cache, including the reserved null block 0.
        enable_prefix_caching: reuse cached KV blocks of identical prefixes.
        tenants: tenant policies. Empty (the default): one first-come-first-served queue for
            every request, whatever its tenant_id. Non-empty: tenant-aware scheduling, and a
            request of an unknown tenant is refused.
        vtc_prompt_weight: w_p, virtual-token-counter cost of one prompt token.
        vtc_output_weight: w_q, cost of one output token (Sheng et al., OSDI 2024 use
            w_p = 1, w_q = 2).
        num_host_blocks: blocks of the host KV tier (0: no tier, recompute-only preemption).
        kv_bytes_per_block: bytes one KV block takes across layers (the swap cost's copy size).
        swap_cost: when to swap rather than recompute (CPU defaults).

    Raises:
        InvalidParameterError: a limit is < 1, num_blocks < 2, a VTC weight <= 0, duplicate
            tenant ids, or reservations that do not fit ("tenants").
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int
    block_size: int = 16
    num_blocks: int
    enable_prefix_caching: bool = True
    tenants: tuple[TenantPolicy, ...] = ()
    vtc_prompt_weight: float = 1.0
    vtc_output_weight: float = 2.0
    num_host_blocks: int = 0
    kv_bytes_per_block: int = 0
    swap_cost: SwapCostModel = SwapCostModel.for_device("cpu")

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise InvalidParameterError(
                "num_blocks",
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks!r}; "
                "give the KV cache more memory",
            )
        for name in ("num_host_blocks", "kv_bytes_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidParameterError(name, f"{name} must be an integer >= 0, got {value!r}")
        for name in ("vtc_prompt_weight", "vtc_output_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidParameterError(name, f"{name} must be > 0, got {value}")
        object.__setattr__(self, "tenants", tuple(self.tenants))
        self._check_tenants()

    def _check_tenants(self) -> None:
        ids = [policy.tenant_id for policy in self.tenants]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise InvalidParameterError("tenants", f"duplicate tenant ids: {duplicates}")
        fractions = [policy.reserved_kv_fraction for policy in self.tenants]
        if sum(fractions) > 1.0 + _FRACTION_EPS:
            raise InvalidParameterError(
                "tenants", f"reserved_kv_fraction sums to {sum(fractions):g} > 1"
            )
        for name, total in (("KV blocks", self.num_usable_blocks), ("seqs", self.max_num_seqs)):
            reserved = sum(reserved_amount(f, total) for f in fractions)
            if reserved > total:
                raise InvalidParameterError(
                    "tenants",
                    f"the reservations need {reserved} {name} (each non-zero reservation "
                    f"keeps at least 1) but there are only {total}",
                )

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can use (all but the null block)."""
        return self.num_blocks - 1

    @classmethod
    def from_engine_config(
        cls,
        config: EngineConfig,
        *,
        num_blocks: int,
        max_model_len: int,
        tenants: tuple[TenantPolicy, ...] = (),
        num_host_blocks: int = 0,
        kv_bytes_per_block: int = 0,
        swap_cost: SwapCostModel | None = None,
    ) -> SchedulerConfig:
        """Scheduler limits from the engine config plus what the runner measured.

        Args:
            config: the engine configuration (budget, max_num_seqs, block size, caching).
            num_blocks: KV blocks the runner allocated.
            max_model_len: the resolved context length (config value or the model's).
            tenants: tenant policies (empty: plain FCFS).
            num_host_blocks, kv_bytes_per_block: the host tier the runner allocated.
            swap_cost: swap cost model (None: the CPU defaults).
        """
        return cls(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            tenants=tenants,
            num_host_blocks=num_host_blocks,
            kv_bytes_per_block=kv_bytes_per_block,
            swap_cost=swap_cost or SwapCostModel.for_device("cpu"),
        )
