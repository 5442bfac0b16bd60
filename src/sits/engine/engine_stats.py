"""`EngineStats`: the engine's load snapshot, and the borrowing tiers it carries.

The engine loop (`sits.engine.engine_loop`) takes a snapshot (`snapshot_stats`) on its own
thread between steps and sends it to the front end (`sits.engine.messages`), whose `stats()`
returns the newest. A snapshot is immutable and pickles (it crosses the process transport).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from sits.core.precision import PrecisionState
from sits.kvcache.host_pool import SwapStats
from sits.runner.expert_health import ExpertStats
from sits.sched.config import TenantTier
from sits.sched.tenants import TenantSchedStats

if TYPE_CHECKING:
    from sits.engine.core import EngineCore, WaitingLoad

ALL_TIERS = tuple(tier.value for tier in TenantTier)


def parse_tiers(tiers: Iterable[str | Enum]) -> frozenset[TenantTier]:
    """The tiers of `set_borrowing_tiers`: tier values or tier enums.

    Raises:
        ValueError: an unknown tier.
    """
    values = {tier.value if isinstance(tier, Enum) else str(tier) for tier in tiers}
    return frozenset(TenantTier(value) for value in values)


def tier_values(tiers: frozenset[TenantTier]) -> tuple[str, ...]:
    """`tiers` as values in the enum's order (`EngineStats.borrowing_tiers`)."""
    return tuple(t.value for t in TenantTier if t in tiers)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load, taken by the engine thread after each step.

    Attributes:
        num_running: requests holding KV blocks.
        num_waiting: requests queued (new or preempted).
        kv_cache_usage: fraction of KV blocks in use, 0..1.
        num_free_blocks, num_total_blocks: KV blocks free and in all.
        num_preemptions: preemptions since start.
        num_steps: engine steps since start.
        tenants: per configured tenant id, its scheduler numbers (running, waiting, blocks
            used / reserved / borrowed, ...); empty without configured tenants. Read-only.
        waiting: per tenant id with queued work, its oldest waiting arrival and prefill tokens
            still to compute (`EngineCore.waiting_load`). Read-only.
        oldest_waiting_arrival_s: time.monotonic() arrival of the oldest waiting request, or
            None when nothing waits (see `queue_delay_s`).
        num_queued_prefill_tokens: prefill tokens still to compute, all tenants together.
        num_prefill_tokens: prefill tokens computed since start.
        prefill_busy_s: seconds of the steps that computed them, since start (the ratio of the
            deltas of these two is a prefill rate in tokens per second).
        borrowing_tiers: tier values whose tenants may currently borrow beyond their
            reservation (`set_borrowing_tiers`; all three by default).
        num_prefix_cache_query_tokens: prompt tokens looked up in the prefix cache since start
            (the scheduler's `prefix_cache_stats.num_query_tokens`).
        num_prefix_cache_hit_tokens: of those, tokens served from the cache since start.
        swap: the host tier's swap and recompute counters since start (a copy).
        num_host_blocks_used, num_host_blocks_total: host KV blocks (0 without a host tier).
        experts: the MoE experts' load, health and frozen flags as last read (every few
            steps, see the module docstring); None for a dense model.
        busy_s: wall seconds of the steps that scheduled tokens, since start.
        tenant_busy_s: tenant id -> its share of `busy_s` (each step split by scheduled
            tokens; `StepStats.tenant_busy_s`). Read-only.
        precision: the weight sets and the last precision switch (`EngineCore.precision_state`);
            None only in the empty snapshot before the first.
        time_s: time.monotonic() when the snapshot was taken.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    tenants: Mapping[str, TenantSchedStats] = field(default_factory=dict)
    waiting: Mapping[str, WaitingLoad] = field(default_factory=dict)
    oldest_waiting_arrival_s: float | None = None
    num_queued_prefill_tokens: int = 0
    num_prefill_tokens: int = 0
    prefill_busy_s: float = 0.0
    borrowing_tiers: tuple[str, ...] = ALL_TIERS
    num_prefix_cache_query_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    swap: SwapStats = field(default_factory=SwapStats)
    num_host_blocks_used: int = 0
    num_host_blocks_total: int = 0
    experts: ExpertStats | None = None
    busy_s: float = 0.0
    tenant_busy_s: Mapping[str, float] = field(default_factory=dict)
    precision: PrecisionState | None = None
    time_s: float = 0.0

    def queue_delay_s(self, now_s: float) -> float:
        """Seconds the oldest waiting request has waited at `now_s` (time.monotonic()); 0 when
        nothing waits."""
        if self.oldest_waiting_arrival_s is None:
            return 0.0
        return max(now_s - self.oldest_waiting_arrival_s, 0.0)


def snapshot_stats(
    core: EngineCore,
    previous: EngineStats,
    *,
    refresh_load: bool,
    borrowing_tiers: tuple[str, ...],
    experts: ExpertStats | None,
    now_s: float,
) -> EngineStats:
    """A fresh `EngineStats` of `core` (call on the engine's thread, between steps).

    Args:
        previous: the last snapshot; its `waiting` map is kept unless `refresh_load` (that
            scan is O(requests)). The `tenants` map is read every time (O(tenants) counters),
            so a tenant's running and waiting counts agree with the totals of the same
            snapshot.
        borrowing_tiers, experts: copied into the snapshot as they are.
        now_s: time.monotonic() of the snapshot.
    """
    sched = core.scheduler
    waiting = core.waiting_load() if refresh_load else previous.waiting
    arrivals = [w.oldest_arrival_s for w in waiting.values() if w.oldest_arrival_s is not None]
    prefix_cache = sched.prefix_cache_stats
    return EngineStats(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        kv_cache_usage=sched.kv_usage,
        num_free_blocks=sched.num_free_blocks,
        num_total_blocks=sched.num_total_blocks,
        num_preemptions=sched.num_preemptions,
        num_steps=core.stats.num_steps,
        tenants=core.tenant_stats(),
        waiting=waiting,
        oldest_waiting_arrival_s=min(arrivals, default=None),
        num_queued_prefill_tokens=sum(w.num_prefill_tokens for w in waiting.values()),
        num_prefill_tokens=core.stats.num_prefill_tokens,
        prefill_busy_s=core.stats.prefill_busy_s,
        borrowing_tiers=borrowing_tiers,
        num_prefix_cache_query_tokens=prefix_cache.num_query_tokens,
        num_prefix_cache_hit_tokens=prefix_cache.num_hit_tokens,
        swap=dataclasses.replace(sched.swap_stats),
        num_host_blocks_used=sched.host.num_used_blocks,
        num_host_blocks_total=sched.config.num_host_blocks,
        experts=experts,
        busy_s=core.stats.busy_s,
        tenant_busy_s=dict(core.stats.tenant_busy_s),
        precision=core.precision_state(),
        time_s=now_s,
    )
