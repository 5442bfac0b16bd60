"""`EngineDriver`: the engine loop's helper for steps, experts and stats snapshots.

`EngineLoop` (`sits.engine.engine_loop`, in a thread or in a child process) steps its
`EngineCore` through this class: one step with the "stalled" rule, the periodic copy of the
MoE expert counters to the host (which also restores frozen experts when the monitor
auto-restores), the named expert operations, and the `EngineStats` snapshots with their
rate-limited per-tenant scan. It runs on the engine's own thread only.

Rules:
- A step is stalled when it produced nothing, nothing runs, nothing was preempted and (async
  scheduling) no step is in flight: the waiting work cannot start (e.g. deferred by
  `set_borrowing_tiers`) and the next step would decide the same, so the caller waits for a
  command instead of spinning.
- The expert counters are read every `EXPERT_STATS_PERIOD_STEPS` steps and whenever the engine
  goes idle (one device sync each).
- A snapshot's per-tenant scan (O(requests)) is redone when forced or at most every
  `LOAD_STATS_PERIOD_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.core.outputs import EngineCoreOutput
from sits.engine.engine_stats import ALL_TIERS, EngineStats, snapshot_stats, tier_values
from sits.runner.expert_health import ExpertMonitor, ExpertStats
from sits.sched.config import TenantTier

if TYPE_CHECKING:
    from sits.engine.core import EngineCore
    from sits.runner.model_info import ModelInfo

LOAD_STATS_PERIOD_S = 0.02
EXPERT_STATS_PERIOD_STEPS = 8


def force_after_commands(waited: bool, core: EngineCore) -> bool:
    """Whether the snapshot after a batch of commands redoes its per-tenant scan: not between
    steps (not `waited`, work left), where the scan keeps its period (it is O(queued), and
    commands arrive before nearly every step under load: 4 ms per step with 3,000 queued on
    our CPU); yes after an idle wait or when the commands left the engine idle (no step follows
    to refresh it)."""
    return waited or not core.has_unfinished_requests()


class EngineDriver:
    """One engine core with its expert monitor and stats (see the module docstring).

    Args:
        core: the engine core.
        info: the model's info (checkpoint directory for expert restores).
        config: engine configuration (spare expert slots turn auto-restore on).
        expert_freeze_after: consecutive anomalous checks that freeze an expert (0: never).
        restore_frozen_experts: reload frozen experts from the checkpoint on each read.

    Attributes:
        experts: the MoE expert monitor, or None for a dense model.
        expert_stats: the latest expert read, or None.
        stats: the latest snapshot.
        borrowing_tiers: tier values that may borrow (`EngineStats.borrowing_tiers`).
    """

    def __init__(
        self,
        core: EngineCore,
        info: ModelInfo,
        config: EngineConfig,
        expert_freeze_after: int,
        restore_frozen_experts: bool,
    ) -> None:
        self.core = core
        self.info = info
        runner = core.runner
        monitor = ExpertMonitor.of_model(
            runner.model,
            expert_freeze_after,
            model_dir=info.model_dir,
            auto_restore=restore_frozen_experts or config.num_spare_experts > 0,
            twins=[m for m in runner.models.values() if m is not runner.model],
        )
        self.experts = monitor if monitor.blocks else None
        self.expert_stats: ExpertStats | None = None
        self.borrowing_tiers = ALL_TIERS
        self.stats = EngineStats()
        self._expert_read_step = -1
        self._load_time_s = -1.0
        self.read_experts()
        self.snapshot(force=True)

    def step(
        self, while_gpu_runs: Callable[[], None] | None = None
    ) -> tuple[list[EngineCoreOutput], bool]:
        """One engine step, then the expert read when due.

        Args:
            while_gpu_runs: as `EngineCore.step`.

        Returns:
            (outputs, stalled): the step's outputs, and whether it was stalled.
        """
        core = self.core
        sched = core.scheduler
        num_preemptions = sched.num_preemptions
        outputs = core.step(while_gpu_runs)
        in_flight = core.pipeline is not None and core.pipeline.busy  # async scheduling
        stalled = (
            not outputs
            and sched.num_running == 0
            and sched.num_preemptions == num_preemptions
            and not in_flight
        )
        due = core.stats.num_steps - self._expert_read_step >= EXPERT_STATS_PERIOD_STEPS
        if due or stalled or not core.has_unfinished_requests():
            self.read_experts()
        return outputs, stalled

    def read_experts(self) -> ExpertStats | None:
        """Copy the expert counters to the host (one device sync); None for a dense model."""
        if self.experts is None:
            return None
        num_steps = self.core.stats.num_steps
        self._expert_read_step = num_steps
        self.expert_stats = self.experts.read(num_steps)  # restores frozen experts (auto)
        return self.expert_stats

    def expert_operation(self, name: str, layer_id: int, expert_id: int) -> ExpertStats | None:
        """Run "freeze", "unfreeze" or "restore" on one expert; returns a fresh read.

        Raises:
            InvalidParameterError: a dense model, or a layer/expert out of range (the
                monitor's errors); UnsupportedModelError: a restore the checkpoint cannot
                serve; ValueError: an unknown operation.
        """
        if self.experts is None:
            raise InvalidParameterError("layer", "the model has no MoE layers")
        if name == "freeze":
            self.experts.freeze(layer_id, expert_id)
        elif name == "unfreeze":
            self.experts.unfreeze(layer_id, expert_id)
        elif name == "restore":
            self.experts.restore(layer_id, expert_id, self.info.model_dir)
        else:
            raise ValueError(f"unknown expert operation {name!r}")
        return self.read_experts()

    def set_borrowing_tiers(self, tiers: frozenset[TenantTier]) -> None:
        """Pass the borrowing tiers to the scheduler and remember them for the snapshots."""
        self.core.scheduler.set_borrowing_tiers(tiers)
        self.borrowing_tiers = tier_values(tiers)

    def snapshot(self, force: bool = False) -> EngineStats:
        """A fresh snapshot, kept in `stats` (the per-tenant scan as the module says)."""
        now_s = time.monotonic()
        refresh_load = force or now_s - self._load_time_s >= LOAD_STATS_PERIOD_S
        if refresh_load:
            self._load_time_s = now_s
        self.stats = snapshot_stats(
            self.core,
            self.stats,
            refresh_load=refresh_load,
            borrowing_tiers=self.borrowing_tiers,
            experts=self.expert_stats,
            now_s=now_s,
        )
        return self.stats
