"""sched layer: continuous-batching scheduler (pure decisions, CPU only).

`Scheduler` turns queued `Request`s into one `StepPlan` per step under `SchedulerConfig`'s
limits and applies each `StepResult`; it imports no torch, runner, models or layers.
"""

from __future__ import annotations

from sits.sched.config import SchedulerConfig
from sits.sched.scheduler import Scheduler, check_stop

__all__ = ["Scheduler", "SchedulerConfig", "check_stop"]
