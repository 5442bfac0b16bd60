"""`AsyncLLM`: the asyncio front end of the engine, used by the HTTP server.

The `EngineCore` step loop runs in its own thread; the asyncio side tokenizes, detokenizes and
delivers outputs to one queue per request, so HTTP work never runs on the step loop.
Commands reach the engine thread through a thread-safe inbox; outputs come back with
`loop.call_soon_threadsafe`. Invariants: every request that leaves `generate` unfinished
(client gone, task cancelled) is aborted and its KV blocks freed at the next loop iteration;
if the loop dies, every in-flight request gets `EngineDeadError` at once. The request side
(`generate`, `abort`, delivering outputs) is `RequestFrontEnd`, shared with `AsyncMPLLM`
(`sits.engine.async_mp`, the same API with the step loop in a child process).

`stats()` is a snapshot the engine thread refreshes after each step and each batch of inbox
commands; its queue and per-tenant part (an O(requests) scan) is refreshed at most every
`driver.LOAD_STATS_PERIOD_S` while requests run, and always when the engine goes idle.
`set_borrowing_tiers` reaches the scheduler through the inbox (overload control); while
only work it defers waits (nothing running), the loop waits on the inbox instead of stepping.

MoE experts (`sits.runner.expert_health`): the engine thread copies the device-side expert
counters to the host every `driver.EXPERT_STATS_PERIOD_STEPS` steps, when the engine goes idle
and on request (`expert_stats`), into `EngineStats.experts`; `freeze_expert` / `unfreeze_expert` run
on the engine thread between steps, so requests in flight continue. With spare expert slots
(`EngineConfig.num_spare_experts`) or `restore_frozen_experts`, that periodic read also
reloads each expert the health check froze from the checkpoint (into a spare slot when there
is one) and unfreezes it (`ExpertMonitor.read` with `auto_restore`).

Precision switch (`EngineConfig.precision_switch`): `set_precision` runs on the engine thread
between steps like the expert operations; `precision_state()` reads the latest state (also
in every `EngineStats` snapshot, which is how the engine process's parent knows it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError, SitsError
from sits.core.precision import PrecisionState
from sits.engine.builder import build_engine
from sits.engine.core import EngineCore, WaitingLoad
from sits.engine.delivery import BatchedDelivery
from sits.engine.driver import ALL_TIERS, EngineDriver, force_after_commands
from sits.engine.front_end import RequestFrontEnd, parse_tiers
from sits.engine.health import ENGINE_STEP_TIMEOUT_S
from sits.engine.loop_profile import LoopProfile
from sits.engine.output_processor import OutputProcessor
from sits.engine.step_stats import PrefillChunk
from sits.kvcache.host_pool import SwapStats
from sits.runner.expert_health import DEFAULT_FREEZE_AFTER, ExpertStats
from sits.sched.config import TenantPolicy
from sits.sched.tenants import TenantSchedStats

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2


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


class AsyncLLM(RequestFrontEnd):
    """Asynchronous engine front end.

    Args:
        config: engine configuration.
        health_timeout_s: the engine counts as unhealthy when its loop has not turned for
            this many seconds between steps (`hung_loop_error`).
        step_timeout_s: ... or when one step has run this many seconds (a hung step; a long
            one, such as a big prompt chunk on a CPU, stays healthy until then).
        tenant_policies: the scheduler's tenants (`sits.engine.builder.tenant_policies_of`);
            () for plain FCFS.
        expert_freeze_after: consecutive anomalous (non-finite output) checks that freeze an
            MoE expert; 0 disables automatic freezing.
        restore_frozen_experts: reload an expert frozen by the health check from the
            checkpoint and unfreeze it, when the engine thread next reads the expert stats
            (the disk read runs on the engine thread, between steps). Always on with spare
            expert slots (`config.num_spare_experts` > 0), which the reload then uses.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        health_timeout_s: float = 10.0,
        step_timeout_s: float = ENGINE_STEP_TIMEOUT_S,
        tenant_policies: tuple[TenantPolicy, ...] = (),
        expert_freeze_after: int = DEFAULT_FREEZE_AFTER,
        restore_frozen_experts: bool = False,
    ) -> None:
        parts = build_engine(config, tenant_policies)
        self.config = config
        self.engine_core = parts.core
        self.tokenizer = parts.tokenizer
        self.info = parts.info
        self.max_model_len = parts.info.max_model_len
        self.model_name = config.model_name
        self.health_timeout_s = health_timeout_s
        self.step_timeout_s = step_timeout_s
        self.errored = False
        self.dead_error: BaseException | None = None
        self._processor = OutputProcessor(self.tokenizer)
        self._delivery = BatchedDelivery()
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._heartbeat_s = time.monotonic()
        self._step_started_s: float | None = None
        self._driver = EngineDriver(
            parts.core, parts.info, config, expert_freeze_after, restore_frozen_experts
        )
        self._profile = LoopProfile(parts.core)
        self._thread = threading.Thread(target=self._engine_loop, name="sits-engine", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------
    # generate / abort: `RequestFrontEnd`.

    def is_healthy(self) -> bool:
        """True while the engine thread is alive and its loop keeps turning (a step within
        `step_timeout_s`); a hung loop's reason becomes `dead_error`."""
        if self.errored or self._stopping or not self._thread.is_alive():
            return False
        return self._loop_turning(self._heartbeat_s, self._step_started_s)

    def stats(self) -> EngineStats:
        """The latest load snapshot."""
        return self._driver.stats

    def set_borrowing_tiers(self, tiers: Iterable[str | Enum]) -> None:
        """Let only tenants of `tiers` start work beyond their reservation (overload control).

        Args:
            tiers: tier values ("guaranteed", "burstable", "best_effort") or tier enums; all
                three restore normal borrowing. Applied by the engine thread before its next
                step; running requests are not touched. No effect without configured tenants.

        Raises:
            ValueError: an unknown tier.
        """
        self._inbox.put(("borrowing", parse_tiers(tiers)))

    async def expert_stats(self) -> ExpertStats | None:
        """A fresh read of the MoE experts' counters (None for a dense model).

        Raises:
            EngineDeadError: the engine loop is dead or hung.
        """
        return await self._call_on_engine(self._driver.read_experts)

    async def freeze_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """Mask expert `expert_id` of decoder layer `layer_id` in its router from the next step.

        Returns:
            The experts' stats right after.

        Raises:
            InvalidParameterError: a dense model, no such MoE layer or expert, or too few
                experts would be left.
            EngineDeadError: the engine loop is dead or hung.
        """
        return await self._expert_operation("freeze", layer_id, expert_id)

    async def unfreeze_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """Route to the expert again (see `freeze_expert`; same errors)."""
        return await self._expert_operation("unfreeze", layer_id, expert_id)

    async def restore_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """Reload the expert's weights from the checkpoint and unfreeze it (see
        `freeze_expert`; also UnsupportedModelError when the checkpoint lacks them)."""
        return await self._expert_operation("restore", layer_id, expert_id)

    async def set_precision(self, name: str) -> PrecisionState:
        """Run weight set `name` from the next step on (applied by the engine thread between
        steps; requests in flight continue on their KV).

        Args:
            name: one of `precision_state().available` ("fp8" / "int4" or the model dtype's
                "bf16" / "fp16" / "fp32").

        Returns:
            The state right after the switch (its step and delay fill in once the first step
            in the new set has run).

        Raises:
            InvalidParameterError: no precision switch configured, or an unknown name.
            EngineDeadError: the engine loop is dead or hung.
        """
        called_s = time.monotonic()
        return await self._call_on_engine(lambda: self.engine_core.set_precision(name, called_s))

    def precision_state(self) -> PrecisionState:
        """The weight sets and the last switch, as the engine thread last left them."""
        return self.engine_core.precision_state()

    async def prefill_chunks(self) -> list[PrefillChunk]:
        """The latest prompt chunks the engine computed, oldest first (`StepStats.prefill_chunks`,
        a bounded ring; copied on the engine thread between steps).

        Raises:
            EngineDeadError: the engine loop is dead or hung.
        """
        return await self._call_on_engine(lambda: list(self.engine_core.stats.prefill_chunks))

    def record_timeline(self, enabled: bool = True) -> None:
        """Stamp each request's prompt chunks and detokenization time on its
        `RequestMetrics` (`prefill_chunks`, `detokenize_s`), for tracing; off by default.

        Chunks computed before the call are not reported.
        """
        self.engine_core.stats.record_request_chunks = enabled  # a flag the engine thread reads
        self._processor.time_detokenize = enabled

    async def shutdown(self) -> None:
        """Stop the engine thread; unfinished requests get EngineDeadError."""
        self._stopping = True
        self._inbox.put(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # ---- asyncio side -------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)

    async def _call_on_engine(self, fn: Callable[[], object]) -> object:
        """Run `fn()` on the engine thread between steps and return (or raise) its result."""
        self._check_alive()
        future: Future = Future()
        self._inbox.put(("call", fn, future))
        return await asyncio.wrap_future(future)

    async def _expert_operation(
        self, name: str, layer_id: int, expert_id: int
    ) -> ExpertStats | None:
        """`EngineDriver.expert_operation` on the engine thread between steps."""
        return await self._call_on_engine(
            lambda: self._driver.expert_operation(name, layer_id, expert_id)
        )

    # ---- engine thread ------------------------------------------------------------------

    def _engine_loop(self) -> None:
        core = self.engine_core
        driver = self._driver
        profile = self._profile
        stalled = False
        try:
            while not self._stopping:
                self._heartbeat_s = time.monotonic()
                self._drain_inbox(block=stalled or not core.has_unfinished_requests())
                if self._stopping or not core.has_unfinished_requests():
                    continue
                profile.mark()
                self._step_started_s = time.monotonic()
                outputs, stalled = driver.step()  # stalled: wait for a command, no spinning
                # A turn, recorded before the step mark clears: is_healthy never sees the
                # step's start gone with a turn older than the step.
                self._heartbeat_s = time.monotonic()
                self._step_started_s = None
                profile.lap("step")
                driver.snapshot(force=stalled or not core.has_unfinished_requests())
                profile.lap("stats")
                if outputs:
                    self._post(self._deliver, outputs)
                profile.lap("send")
                profile.maybe_log()
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine loop died")
            self.dead_error = exc
            self.errored = True
            self._post(self._fail_all, EngineDeadError(f"the engine loop died: {exc!r}"))

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        start_s = time.monotonic()
        while True:
            self._handle(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._driver.snapshot(force=force_after_commands(block, self.engine_core))
        self._profile.add("commands", time.monotonic() - start_s)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, children = command
            try:
                for child in children:
                    self.engine_core.add_request(child)
            except SitsError as exc:  # a request that can never run; never kill the loop
                self.engine_core.finish_requests([c.request_id for c in children])
                self._post(self._fail_request, request_id, exc)
        elif kind == "finish":
            _, ids, reason, stop_reason = command
            self.engine_core.finish_requests(ids, reason, stop_reason)
        elif kind == "borrowing":
            self._driver.set_borrowing_tiers(command[1])
        elif kind == "call":
            _, fn, future = command
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller, never kills the loop
                future.set_exception(exc)
        elif kind == "stop":
            self._stopping = True


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
        previous: the last snapshot; its `tenants` and `waiting` maps are kept unless
            `refresh_load` (that scan is O(requests)).
        borrowing_tiers, experts: copied into the snapshot as they are.
        now_s: time.monotonic() of the snapshot.
    """
    sched = core.scheduler
    tenants, waiting = previous.tenants, previous.waiting
    if refresh_load:
        tenants = core.tenant_stats()
        waiting = core.waiting_load()
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
        tenants=tenants,
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
