"""`EngineLoop`: the one engine step loop, whichever transport carries its messages.

The loop owns the `EngineCore` (through its `EngineDriver`, below) and talks to the front end
(`AsyncLLM`) only through two small objects it is given: a command source (`poll(timeout_s)`,
`recv()`) and an event sink (`send(event)`), with the messages of `sits.engine.messages`.
The in-thread transport (`sits.engine.thread_transport`) gives it a queue and a callback; the
process transport (`sits.engine.process_transport`) the two ends of a pair of pipes. Both run
this same loop with the same rules:

- While idle or stalled (`EngineDriver.step`) it blocks on the commands for up to
  `_IDLE_WAIT_S`, and sends a `Heartbeat` when the wait found none.
- Stats snapshots: after a batch of commands that ends an idle wait or leaves the engine idle
  (`force_after_commands`), before each call's result (so its caller sees its effect), and
  after a step when idle, when the step changed the number of running or waiting requests,
  and else every `_STATS_PERIOD_S`.
- A step's `StepOutputs` is written during the next step, once its forward is launched
  (`EngineCore.step`'s `while_gpu_runs`): the event's cost (the pickling and the pipe write,
  ~1.5-2 ms per step on the H200's host, in the process transport) then overlaps the device's
  work instead of lengthening every step, which under TPOT pacing is batch given up. It is
  written at once when no step follows (idle, stalled, stopping, dying).
- Commands queued by then are read in the same shadow: new requests (`AddRequest`) join the
  waiting queues at once (under load about four per step, ~1 ms of host work that each step
  paid before); any other command waits for the step's end, with everything after it
  (`while_gpu_runs`). So a `StatsUpdate` sent after commands can overtake an older step's
  event; the front end keeps the newest snapshot by `EngineStats.time_s`.
- Command handling between two steps lasts at most `MAX_DRAIN_S`; the rest waits one step.
- The loop publishes its times (the running step's start, its last turn) through a
  `LoopTimes`-like object for the front end's health check (below).
- A failure sends the pending step's outputs, then `EngineDied`, and ends the loop.

`EngineDriver` is the loop's helper for steps, experts and stats snapshots: one step with the
"stalled" rule, the periodic copy of the MoE expert counters to the host (which also restores
frozen experts when the monitor auto-restores), the named expert operations, and the
`EngineStats` snapshots with their rate-limited per-tenant scan. It runs on the engine's own
thread only. With more than one tensor-parallel rank the expert counters are rank 0's (every
rank's are equal), and the freezes, unfreezes and restores, the operator's and the automatic
ones, reach every rank before the next step (`ExpertMonitor.of_runner`). Its rules:
- A step is stalled when it produced nothing, nothing runs, nothing was preempted and (async
  scheduling) no step is in flight: the waiting work cannot start (e.g. deferred by
  `set_borrowing_tiers`) and the next step would decide the same, so the caller waits for a
  command instead of spinning.
- The expert counters are read every `EXPERT_STATS_PERIOD_STEPS` steps and whenever the engine
  goes idle (one device sync each).
- A snapshot's per-tenant scan (O(requests)) is redone when forced or at most every
  `LOAD_STATS_PERIOD_S`.

Health: when a silent engine loop counts as hung. A loop that has sent nothing for a while is
either inside one long step or hung. The two differ in how long they may last: one step (a big
prompt chunk on a CPU, a process starved of CPU) may run for minutes, while between steps the
loop turns every fraction of a second, idle or not. So the loop publishes when the running step
started and when it last turned (`LoopTimes` in a thread, `SharedLoopTimes` across processes),
the front end (`AsyncLLM`) reads them, and `hung_loop_error` applies a bound to each (the step's
bound defaults to `sits.engine.arg_utils.ENGINE_STEP_TIMEOUT_S`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError, InvalidParameterError, SitsError
from sits.core.outputs import EngineCoreOutput
from sits.engine.messages import (
    AddFailed,
    AddRequest,
    CallResult,
    Command,
    EngineCall,
    EngineDied,
    Event,
    FinishRequests,
    Heartbeat,
    RecordTimeline,
    SetBorrowingTiers,
    StatsUpdate,
    StepOutputs,
    Stop,
    pack_error,
)
from sits.engine.stats import ALL_TIERS, EngineStats, LoopProfile, snapshot_stats, tier_values
from sits.engine.step_watch import StepWatch
from sits.runner.expert_health import ExpertMonitor, ExpertStats
from sits.sched.config import TenantTier

if TYPE_CHECKING:
    from sits.engine.core import EngineCore
    from sits.runner.model_info import ModelInfo

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2  # longest wait for a command while idle, seconds
_STATS_PERIOD_S = 0.02  # snapshot period while stepping, seconds
MAX_DRAIN_S = 0.05  # longest run of command handling between two steps, seconds
LOAD_STATS_PERIOD_S = 0.02  # longest reuse of a snapshot's per-tenant scan, seconds
EXPERT_STATS_PERIOD_STEPS = 8  # steps between two reads of the expert counters


class CommandSource(Protocol):
    """Where the loop's commands come from (front end -> loop), in order."""

    def poll(self, timeout_s: float) -> bool:
        """Whether a command is ready, waiting up to `timeout_s` for one."""
        ...

    def recv(self) -> Command:
        """The next command (call after `poll` returned True)."""
        ...


class EventSink(Protocol):
    """Where the loop's events go (loop -> front end)."""

    def send(self, event: Event) -> None:
        """Hand `event` on (may raise OSError / EOFError when the front end is gone)."""
        ...


class LoopTimesSink(Protocol):
    """Where the loop publishes its times (`LoopTimes`, `SharedLoopTimes`)."""

    def mark(self, step_started_s: float, typical_step_s: float = 0.0) -> None: ...


class EngineLoop:
    """The step loop over one driver (see the module docstring). Runs on one thread only.

    Args:
        driver: the engine's driver (its `core` is the engine core).
        commands: the command source.
        events: the event sink.
        loop_times: where the loop publishes its times.

    Attributes:
        stopping: a `Stop` was handled (the loop ends after this turn).
        pending: the last step's `StepOutputs`, written during the next step.
        deferred: commands read during a step, handled after it, in order.
        took_adds: the running step's forward took new requests.
    """

    def __init__(
        self,
        driver: EngineDriver,
        commands: CommandSource,
        events: EventSink,
        loop_times: LoopTimesSink,
    ) -> None:
        self.driver = driver
        self.core = driver.core
        self.commands = commands
        self.events = events
        self.loop_times = loop_times
        self.stopping = False
        self.pending: StepOutputs | None = None
        self.deferred: list[Command] = []
        self.took_adds = False
        self.stats_time_s = time.monotonic()
        self.profile = LoopProfile(driver.core)
        warmup = getattr(self.core.runner, "warmup", None)
        rate = warmup.prefill_tokens_per_s if warmup is not None else None
        self.step_watch = StepWatch(max(warmup.token_counts) / rate if rate else None)

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot."""
        return self.driver.stats

    def run(self) -> bool:
        """The step loop until `Stop` or the front end goes away.

        Returns:
            True when the loop died (an `EngineDied` was sent), False when it stopped.
        """
        core = self.core
        sched = core.scheduler
        profile = self.profile
        stalled = False
        try:
            while not self.stopping:
                self.loop_times.mark(0.0)
                idle = stalled or not core.has_unfinished_requests()
                if idle:
                    self.flush()  # no step follows soon: the last one's outputs go now
                self.drain(block=idle)
                if self.stopping or not core.has_unfinished_requests():
                    continue
                profile.mark()
                step_start_s = time.monotonic()
                typical_s = self.step_watch.typical_s()
                self.loop_times.mark(step_start_s, typical_s)
                # The last step's outputs are written, and new requests taken, while the
                # device runs this one.
                self.took_adds = False
                outputs, stalled = self.driver.step(self.while_gpu_runs)
                self.step_watch.record(time.monotonic() - step_start_s)
                self.loop_times.mark(0.0, self.step_watch.typical_s())
                profile.lap("step")
                stalled = stalled and not self.took_adds  # stalled: wait for a command
                idle = stalled or not core.has_unfinished_requests()
                due = (
                    idle
                    or time.monotonic() - self.stats_time_s >= _STATS_PERIOD_S
                    or (sched.num_running, sched.num_waiting)
                    != (self.stats.num_running, self.stats.num_waiting)
                )
                stats = self.snapshot(force=idle) if due else None
                profile.lap("stats")
                self.flush()  # a step with no device phase did not write the one before
                if outputs or stats is not None:
                    self.pending = StepOutputs(outputs, stats)
                profile.lap("send")
                profile.maybe_log()
            self.flush()
        except (EOFError, BrokenPipeError):
            logger.info("engine loop: the front end is gone; exiting")
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine loop died")
            self._send_quietly(self.pending)
            self._send_quietly(EngineDied(pack_error(exc)))
            return True
        return False

    def flush(self) -> None:
        """Write the pending `StepOutputs`, if any (see `run`)."""
        event, self.pending = self.pending, None
        if event is not None:
            self.events.send(event)

    def while_gpu_runs(self) -> None:
        """Host work in the shadow of a step's forward: write the last step's outputs, then
        read the queued commands for at most `MAX_DRAIN_S`. New requests (`AddRequest`) only
        join the waiting queues, which the running step does not read, so they are handled
        at once; the first other command (an abort frees blocks the step is writing, an
        expert operation changes weights it reads) and everything after it wait in
        `deferred` for the drain after the step, keeping the commands' order."""
        self.flush()
        commands = self.commands
        deadline_s = time.monotonic() + MAX_DRAIN_S
        while not self.deferred and commands.poll(0) and time.monotonic() < deadline_s:
            command = commands.recv()
            if not isinstance(command, AddRequest):
                self.deferred.append(command)
                return
            self.handle(command)
            self.took_adds = True

    def drain(self, block: bool) -> None:
        """Handle the deferred and queued commands (waiting up to `_IDLE_WAIT_S` for one when
        `block` and none was deferred) for at most `MAX_DRAIN_S`; a `Heartbeat` when the wait
        found none. The bound keeps a flood of commands from holding the steps (and the
        heartbeat they carry) back: the rest waits for the next drain, one step later.

        After an idle wait, or when the commands left nothing to run, a fresh snapshot
        follows (`force_after_commands`). Between busy steps none does: the step that follows
        at once sends one at its end (the counts changed, or `_STATS_PERIOD_S` passed), and a
        snapshot here (~0.3 ms on the H200's host) came out of every paced step."""
        commands = self.commands
        if not self.deferred and not commands.poll(_IDLE_WAIT_S if block else 0):
            if block:
                self.events.send(Heartbeat())
            return
        start_s = time.monotonic()
        deadline_s = start_s + MAX_DRAIN_S
        while self.deferred and not self.stopping:
            self.handle(self.deferred.pop(0))
        while not self.stopping and commands.poll(0) and time.monotonic() < deadline_s:
            self.handle(commands.recv())
        if force_after_commands(block, self.core):
            self.events.send(StatsUpdate(self.snapshot(force=True)))
        self.profile.add("commands", time.monotonic() - start_s)

    def handle(self, command: Command) -> None:
        """Apply one command to the engine (between steps, or an add during a forward)."""
        core = self.core
        match command:
            case AddRequest(request_id, children):
                try:
                    for child in children:
                        core.add_request(child)
                except SitsError as exc:  # a request that can never be served; not a failure
                    core.finish_requests([c.request_id for c in children])
                    self.events.send(AddFailed(request_id, pack_error(exc)))
            case FinishRequests(request_ids, reason, stop_reason):
                core.finish_requests(list(request_ids), reason, stop_reason)
            case SetBorrowingTiers(tiers):
                self.driver.set_borrowing_tiers(tiers)
            case RecordTimeline(enabled):
                core.stats.record_request_chunks = enabled
            case EngineCall(call_id, name, args):
                try:
                    result = CallResult(call_id, True, self.call(name, args))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    result = CallResult(call_id, False, pack_error(exc))
                # Stats first: once the caller has its result, stats() shows the call's effect.
                self.events.send(StatsUpdate(self.snapshot(force=False)))
                self.events.send(result)
            case Stop():
                self.stopping = True
            case _:
                raise TypeError(f"not an engine command: {command!r}")

    def call(self, name: str, args: tuple) -> Any:
        """The loop method `name` of an `EngineCall` (one of `messages.CALL_NAMES`).

        Raises:
            What the method raises (InvalidParameterError, UnsupportedModelError, ...).
        """
        if name == "prefill_chunks":
            return list(self.core.stats.prefill_chunks)
        if name == "set_precision":
            return self.core.set_precision(*args)  # (name, the front end's time.monotonic())
        if name == "expert_stats":
            return self.driver.read_experts()
        return self.driver.expert_operation(name.removesuffix("_expert"), *args)

    def snapshot(self, force: bool) -> EngineStats:
        """A fresh stats snapshot (`EngineDriver.snapshot`), noting when it was taken."""
        self.stats_time_s = time.monotonic()
        return self.driver.snapshot(force)

    def _send_quietly(self, event: Event | None) -> None:
        if event is None:
            return
        with contextlib.suppress(OSError, ValueError, EOFError):  # the front end is gone
            self.events.send(event)


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
        monitor = ExpertMonitor.of_runner(
            core.runner,
            expert_freeze_after,
            model_dir=info.model_dir,
            auto_restore=restore_frozen_experts or config.num_spare_experts > 0,
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
            and not core.grammar_gate  # a held request's compile ends without a command
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


def hung_loop_error(
    now_s: float,
    turned_s: float,
    step_started_s: float | None,
    health_timeout_s: float,
    step_timeout_s: float,
) -> EngineDeadError | None:
    """Why an engine loop counts as hung, or None while it is live.

    Inside a step the loop is live until the step has run `step_timeout_s`: one long step (a
    big prompt chunk on a CPU, a starved process) is not a hung loop. Between steps it must
    turn within `health_timeout_s` (an idle loop turns every fraction of a second).

    Args:
        now_s, turned_s, step_started_s: time.monotonic() now, when the loop last turned (or
            last reported), and when the running step started (None between steps).
        health_timeout_s, step_timeout_s: the two bounds, seconds.
    """
    if step_started_s is not None:
        if now_s - step_started_s < step_timeout_s:
            return None
        digits = 1 if step_timeout_s >= 1 else 4  # a sub-second timeout: show its scale
        return EngineDeadError(
            f"an engine step has run for {now_s - step_started_s:.{digits}f} s, over the step "
            f"timeout of {step_timeout_s:g} s (--engine-step-timeout)"
        )
    if now_s - turned_s < health_timeout_s:
        return None
    return EngineDeadError(
        f"the engine loop has not turned for {now_s - turned_s:.1f} s between steps "
        f"(health timeout {health_timeout_s:g} s)"
    )


class LoopTimes:
    """The engine loop's times as plain attributes (loop and reader share one process).

    Attributes:
        step_started_s: time.monotonic() start of the running step; 0.0 between steps.
        turned_s: time.monotonic() of the loop's last turn.
        typical_step_s: the loop's slow step (`step_watch.StepWatch.typical_s`), seconds.
    """

    def __init__(self) -> None:
        self.step_started_s = 0.0
        self.turned_s = time.monotonic()
        self.typical_step_s = 0.0

    def mark(self, step_started_s: float, typical_step_s: float = 0.0) -> None:
        """A turn of the loop now, inside a step started at `step_started_s` (0.0: none)."""
        self.typical_step_s = typical_step_s
        self.turned_s = time.monotonic()  # before the step mark: never a cleared step with
        self.step_started_s = step_started_s  # a turn older than the step

    def read(self) -> tuple[float, float, float]:
        """(step_started_s or 0.0, turned_s, typical_step_s)."""
        return self.step_started_s, self.turned_s, self.typical_step_s


class SharedLoopTimes:
    """`LoopTimes` over a shared `multiprocessing.Array("d", 3)` (the engine process writes,
    the server process reads): (step start or 0.0, last turn), time.monotonic() seconds, one
    system-wide clock on Linux, and the typical step in seconds."""

    def __init__(self, array: Any) -> None:
        self.array = array

    def mark(self, step_started_s: float, typical_step_s: float = 0.0) -> None:
        """As `LoopTimes.mark`."""
        with self.array.get_lock():
            self.array[:] = (step_started_s, time.monotonic(), typical_step_s)

    def read(self) -> tuple[float, float, float]:
        """As `LoopTimes.read` (zeros before the loop's first turn)."""
        with self.array.get_lock():
            step_started_s, turned_s, typical_step_s = self.array[:]
        return step_started_s, turned_s, typical_step_s
