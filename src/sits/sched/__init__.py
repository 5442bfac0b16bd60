"""sched layer: continuous-batching, tenant-aware scheduler (pure decisions, CPU only).

`Scheduler` turns queued `Request`s into one `StepPlan` per step under `SchedulerConfig`'s
limits and applies each `StepResult`. With `SchedulerConfig.tenants` it honours each tenant's
`TenantPolicy` (reservations, tiers, priorities, weighted fair share, SLO deadlines); without,
it is plain FCFS. It imports no torch, runner, models, layers, tenancy, engine or server.
"""

from __future__ import annotations

from sits.sched.config import SchedulerConfig, TenantPolicy, TenantTier, reserved_amount
from sits.sched.scheduler import Scheduler
from sits.sched.state import check_stop
from sits.sched.tenants import TenantSchedStats

__all__ = [
    "Scheduler",
    "SchedulerConfig",
    "TenantPolicy",
    "TenantSchedStats",
    "TenantTier",
    "check_stop",
    "reserved_amount",
]
