"""The engine's counters: step accounting, the load snapshot and the loop profile.

Step accounting (`StepStats`, on the engine's thread). Load accounting for overload control
(read by `AsyncLLM` for its stats): cumulative prefill tokens computed and the wall time of the
steps that computed them (`num_prefill_tokens`, `prefill_busy_s`), and the same over the
representative steps only (`num_full_prefill_tokens`, `full_prefill_busy_s`: steps with at
least `representative_prefill_tokens` prompt tokens, a quarter of the step budget), whose
ratio is the prefill rate the overload control predicts TTFT with. A step of a few prompt
tokens costs mostly fixed per-step time, so its tokens per second say nothing of how fast a
backlog drains (a 7-token request measured 69 tok/s on an engine that prefills thousands).
Cost accounting: each step's wall time (schedule + run + update) is added to `busy_s`
and split among the tenants of its scheduled requests in proportion to their scheduled tokens
(`split_step_time`; a prefill token and a decode token weigh the same), accumulated in
`tenant_busy_s`; so the tenants' shares always add up to `busy_s`. The prompt chunks (and
recomputes) of the last `MAX_PREFILL_CHUNK_LOG` scheduled prefills are kept in the bounded
`prefill_chunks` ring (request timelines on the dashboard; read it on the engine's thread).
Tokens per step (prompt chunk tokens and decodes together, vLLM's `iteration_tokens_total`)
are counted in the buckets of `ITERATION_TOKEN_BUCKETS` (`step_tokens_buckets`, one count per
bucket, the last for steps above the largest bound; `step_tokens_sum`).
Invariants: one `account_step` per step run, synchronous or asynchronous (`Stepper`); the
counters only grow; the clock readings are passed in (nothing in `StepStats` reads a clock).

The load snapshot (`EngineStats`, and the borrowing tiers it carries). The engine loop
(`sits.engine.engine_loop`) takes a snapshot (`snapshot_stats`) on its own thread between
steps and sends it to the front end (`sits.engine.messages`), whose `stats()` returns the
newest. A snapshot is immutable and pickles (it crosses the process transport).

The loop profile (`LoopProfile`): where the engine loop's time goes, logged at DEBUG every
`period_s`. The engine loop (`EngineLoop`, in a thread or a child process) times its own
phases with `add` (or `mark` then one `lap` per phase): "commands" (handling adds, finishes
and calls), "step" (`EngineDriver.step`: the core step and the expert read), "stats"
(snapshots) and "send" (handing outputs to the front end; the loop writes a step's outputs
during the next step's forward, inside its "runner" time, so "send" counts only writes made
outside a step). `maybe_log` reads the core's cumulative counters (`StepStats.phase_s`:
schedule, runner, update; steps, decode rows, prefill tokens and chunks, preemptions, wasted
prefill tokens), and the runner's when it keeps them (`ModelRunner.phase_s`: launch, shadow,
sync; rows run, padding included), and, once `period_s` has passed since the last line, logs
the averages per step over that window (preemptions and wasted tokens as window totals), e.g.

    engine loop, last 10.0 s (busy 10.0 s): 312 steps of 32.0 ms: step 28.1 (schedule 1.2,
    runner 24.0 [launch 1.5, shadow 1.8, sync 20.7], update 2.9), commands 1.1, stats 0.5,
    send 2.3; per step 180.0 decodes + 540.0 prefill tokens in 1.5 chunks, 768.0 rows run;
    3 preemptions; 0 prefill tokens of requests shed before their first token

(phase figures in ms per step; "busy" is the loop's time in its phases, so idle time in the
window does not inflate the per-step figures) so an operator, or a benchmark's log, sees
whether steps are bound by the model, by host work or by the server side (`sits serve
--log-level debug` shows it; at INFO a busy server would print a long line every 10 s that
nobody acts on). A line is written at the first step after `period_s` has passed (a window
may span an idle gap); windows without steps log nothing. Costs a few clock reads per step.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from sits.core.errors import InvalidParameterError
from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest, StepPlan
from sits.core.precision import PrecisionState
from sits.core.request import Request
from sits.kvcache.host_pool import SwapStats
from sits.obs.vllm_metrics import ITERATION_TOKEN_BUCKETS
from sits.runner.expert_health import ExpertStats
from sits.sched.config import TenantTier
from sits.sched.tenants import TenantSchedStats

if TYPE_CHECKING:
    from sits.engine.core import EngineCore, WaitingLoad

logger = logging.getLogger(__name__)

MAX_PREFILL_CHUNK_LOG = 4096


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One prompt chunk (or recompute after preemption) of a request, computed in one step.

    Attributes:
        request_id: engine request id.
        start_s, end_s: time.monotonic() seconds when the step's model run began and when the
            step ended (the chunk shares the step with the rest of the batch).
        start_position: position of the chunk's first token.
        num_tokens: tokens computed.
    """

    request_id: str
    start_s: float
    end_s: float
    start_position: int
    num_tokens: int


def split_step_time(tokens_by_tenant: Mapping[str, int], step_s: float) -> dict[str, float]:
    """Each tenant's share of one step's wall time, in proportion to its scheduled tokens.

    Args:
        tokens_by_tenant: tenant id -> tokens scheduled for it in the step (> 0 in all).
        step_s: the step's wall time in seconds.

    Returns:
        tenant id -> seconds; the values add up to `step_s` (up to float rounding).
    """
    total = sum(tokens_by_tenant.values())
    if total <= 0:
        return {}
    return {tenant_id: step_s * n / total for tenant_id, n in tokens_by_tenant.items()}


def prefills_of(plan: StepPlan) -> list[ScheduledRequest]:
    """A plan's prompt chunks and recomputes: not a one-token decode of a request with
    outputs. Call before `Scheduler.update`, which appends to the (shared) output lists."""
    return [sr for sr in plan.scheduled if len(sr.token_ids) > 1 or not sr.output_token_ids]


@dataclass(slots=True)
class StepStats:
    """Cumulative step counters (see the module docstring's step accounting).

    Attributes:
        num_steps: steps run so far.
        num_prefill_tokens: prompt (or recomputed) tokens computed so far.
        prefill_busy_s: wall seconds of the steps that computed prefill tokens (the whole
            step counts, decodes batched with the prefill included).
        representative_prefill_tokens: prompt tokens a step needs to count in the two
            counters below (>= 1).
        num_full_prefill_tokens, full_prefill_busy_s: `num_prefill_tokens` and
            `prefill_busy_s` of the steps with at least representative_prefill_tokens.
        prefill_rate_seed_tokens_per_s: the warm-up's measured full-step prefill rate
            (`runner.warmup.WarmupReport`), or None when no warm-up ran.
        busy_s: wall seconds of every step that scheduled tokens.
        tenant_busy_s: tenant id -> its share of `busy_s`.
        tenant_scheduled_tokens: tenant id -> tokens scheduled for it so far (prompt chunks,
            recomputes and decodes).
        phase_s: wall seconds of the step's phases: "schedule" (the step policy and the
            scheduler), "runner" (inputs, model, sampling) and "update" (scheduler update and
            outputs); read by the engine loop's profile (`LoopProfile`).
        num_decode_rows: one-token decodes scheduled so far.
        num_prefill_chunks: prompt (or recompute) chunks scheduled so far.
        num_wasted_prefill_tokens: computed prompt tokens of requests finished from outside
            before their first token (e.g. shed by a queue timeout).
        prefill_chunks: the latest prefill chunks, oldest first (bounded ring).
        record_request_chunks: when True (tracing), each request's prompt chunks (and
            recomputes) travel on its next output as `EngineCoreOutput.prefill_chunks`:
            (step end time.monotonic(), tokens) per chunk since its previous output.
        step_tokens_buckets: steps by their scheduled tokens: index i counts the steps of
            at most ITERATION_TOKEN_BUCKETS[i] tokens (and more than the bound before), the
            last index the steps above every bound.
        step_tokens_sum: tokens scheduled over all steps.
    """

    num_steps: int = 0
    num_prefill_tokens: int = 0
    prefill_busy_s: float = 0.0
    representative_prefill_tokens: int = 1
    num_full_prefill_tokens: int = 0
    full_prefill_busy_s: float = 0.0
    prefill_rate_seed_tokens_per_s: float | None = None
    busy_s: float = 0.0
    tenant_busy_s: dict[str, float] = field(default_factory=dict)
    tenant_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    phase_s: dict[str, float] = field(
        default_factory=lambda: {"schedule": 0.0, "runner": 0.0, "update": 0.0}
    )
    num_decode_rows: int = 0
    num_prefill_chunks: int = 0
    num_wasted_prefill_tokens: int = 0
    prefill_chunks: deque[PrefillChunk] = field(
        default_factory=lambda: deque(maxlen=MAX_PREFILL_CHUNK_LOG)
    )
    record_request_chunks: bool = False
    step_tokens_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    )
    step_tokens_sum: int = 0
    _first_scheduled_s: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _unreported_first_scheduled: set[str] = field(default_factory=set, init=False, repr=False)
    _unreported_chunks: dict[str, list[tuple[float, int]]] = field(
        default_factory=dict, init=False, repr=False
    )

    def note_scheduled(self, plan: StepPlan, start_s: float, scheduled_s: float) -> None:
        """A plan was made: its "schedule" phase, and each request's first scheduled time
        (reported on its next output). start_s, scheduled_s: clock seconds when planning
        began and when the plan was made."""
        self.phase_s["schedule"] += scheduled_s - start_s
        # This loop (and `account_step`'s) runs every step (256 decodes: ~0.1 ms of host time
        # on our CPU), so it reads fields, not properties.
        first_scheduled_s = self._first_scheduled_s
        for sr in plan.scheduled:
            if sr.request_id not in first_scheduled_s:
                first_scheduled_s[sr.request_id] = scheduled_s
                self._unreported_first_scheduled.add(sr.request_id)

    def forget(self, request_id: str, request: Request | None) -> None:
        """A request finished from outside (abort, stop string, start deadline); `request`
        (None if unknown) counts its computed prompt tokens as wasted before a first token."""
        if request is not None and request.num_output_tokens == 0:
            prompt_done = min(request.num_computed_tokens, request.num_prompt_tokens)
            self.num_wasted_prefill_tokens += prompt_done
        self._first_scheduled_s.pop(request_id, None)
        self._unreported_first_scheduled.discard(request_id)
        self._unreported_chunks.pop(request_id, None)

    def account_step(
        self,
        plan: StepPlan,
        prefills: list[ScheduledRequest],
        tokens_by_tenant: dict[str, int],
        step_s: float,
        busy_s: float,
        chunk_s: tuple[float, float],
        runner_s: float,
        update_s: float,
    ) -> None:
        """Count one step run (see `Stepper.account_step` for its times).

        Args:
            plan: the step's plan; prefills: its prompt chunks (`prefills_of`).
            tokens_by_tenant: tokens scheduled per tenant.
            step_s: its wall seconds, charged to its tenants.
            busy_s: its seconds counted in `prefill_busy_s` when it had prefills.
            chunk_s: (start, end) clock seconds of its prompt chunks.
            runner_s, update_s: seconds of its "runner" and "update" phases.
        """
        phase_s = self.phase_s
        phase_s["runner"] += runner_s
        phase_s["update"] += update_s
        self.num_decode_rows += len(plan.scheduled) - len(prefills)
        self.num_steps += 1
        num_step_tokens = sum(tokens_by_tenant.values())
        self.step_tokens_buckets[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_step_tokens)] += 1
        self.step_tokens_sum += num_step_tokens
        if prefills:
            start_s, end_s = chunk_s
            num_tokens = sum(sr.num_tokens for sr in prefills)
            self.num_prefill_tokens += num_tokens
            self.num_prefill_chunks += len(prefills)
            self.prefill_busy_s += busy_s
            if num_tokens >= self.representative_prefill_tokens:
                self.num_full_prefill_tokens += num_tokens
                self.full_prefill_busy_s += busy_s
            self.prefill_chunks.extend(
                PrefillChunk(sr.request_id, start_s, end_s, sr.start_position, sr.num_tokens)
                for sr in prefills
            )
            if self.record_request_chunks:
                for sr in prefills:
                    chunks = self._unreported_chunks.setdefault(sr.request_id, [])
                    chunks.append((end_s, sr.num_tokens))
        self._charge(tokens_by_tenant, step_s)

    def annotate(self, outputs: list[EngineCoreOutput]) -> None:
        """Put each request's first scheduled time (once) and its unreported prefill chunks
        on its output; forget the first scheduled time of the finished."""
        first_scheduled_s = self._first_scheduled_s
        unreported_first = self._unreported_first_scheduled
        unreported_chunks = self._unreported_chunks
        for out in outputs:
            request_id = out.request_id
            if request_id in unreported_first:
                unreported_first.discard(request_id)
                out.first_scheduled_time = first_scheduled_s[request_id]
            if unreported_chunks:
                out.prefill_chunks = unreported_chunks.pop(request_id, None)
            if out.finish_reason is not None:  # finished
                first_scheduled_s.pop(request_id, None)

    def _charge(self, tokens_by_tenant: dict[str, int], step_s: float) -> None:
        """Add one step's wall time to `busy_s` and the tenants' shares (see the module doc)."""
        if not tokens_by_tenant:
            return
        self.busy_s += step_s
        for tenant_id, share_s in split_step_time(tokens_by_tenant, step_s).items():
            self.tenant_busy_s[tenant_id] = self.tenant_busy_s.get(tenant_id, 0.0) + share_s
        for tenant_id, num_tokens in tokens_by_tenant.items():
            count = self.tenant_scheduled_tokens.get(tenant_id, 0)
            self.tenant_scheduled_tokens[tenant_id] = count + num_tokens


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
        num_full_prefill_tokens, full_prefill_busy_s: the same over representative steps
            only (`StepStats`); the overload control's prefill rate.
        prefill_rate_seed_tokens_per_s: the warm-up's full-step prefill rate, or None.
        borrowing_tiers: tier values whose tenants may currently borrow beyond their
            reservation (`set_borrowing_tiers`; all three by default).
        num_prefix_cache_query_tokens: prompt tokens looked up in the prefix cache since start
            (the scheduler's `prefix_cache_stats.num_query_tokens`).
        num_prefix_cache_hit_tokens: of those, tokens served from the cache since start.
        swap: the host tier's swap and recompute counters since start (a copy).
        num_host_blocks_used, num_host_blocks_total: host KV blocks (0 without a host tier).
        experts: the MoE experts' load, health and frozen flags as last read (every few
            steps, `sits.engine.engine_loop.EXPERT_STATS_PERIOD_STEPS`); None for a dense model.
        busy_s: wall seconds of the steps that scheduled tokens, since start.
        tenant_busy_s: tenant id -> its share of `busy_s` (each step split by scheduled
            tokens; `StepStats.tenant_busy_s`). Read-only.
        precision: the weight sets and the last precision switch (`EngineCore.precision_state`);
            None only in the empty snapshot before the first.
        step_tokens_buckets, step_tokens_sum: steps by tokens scheduled (`StepStats`: one
            count per ITERATION_TOKEN_BUCKETS bound, then the steps above the largest); ()
            in the empty snapshot.
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
    num_full_prefill_tokens: int = 0
    full_prefill_busy_s: float = 0.0
    prefill_rate_seed_tokens_per_s: float | None = None
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
    step_tokens_buckets: tuple[int, ...] = ()
    step_tokens_sum: int = 0
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
        num_full_prefill_tokens=core.stats.num_full_prefill_tokens,
        full_prefill_busy_s=core.stats.full_prefill_busy_s,
        prefill_rate_seed_tokens_per_s=core.stats.prefill_rate_seed_tokens_per_s,
        borrowing_tiers=borrowing_tiers,
        num_prefix_cache_query_tokens=prefix_cache.num_query_tokens,
        num_prefix_cache_hit_tokens=prefix_cache.num_hit_tokens,
        swap=dataclasses.replace(sched.swap_stats),
        num_host_blocks_used=sched.num_host_blocks_used,
        num_host_blocks_total=sched.config.num_host_blocks,
        experts=experts,
        busy_s=core.stats.busy_s,
        tenant_busy_s=dict(core.stats.tenant_busy_s),
        precision=core.precision_state(),
        step_tokens_buckets=tuple(core.stats.step_tokens_buckets),
        step_tokens_sum=core.stats.step_tokens_sum,
        time_s=now_s,
    )


LOOP_PHASES = ("commands", "step", "stats", "send")
CORE_PHASES = ("schedule", "runner", "update")
RUNNER_PHASES = ("launch", "shadow", "sync")
DEFAULT_PERIOD_S = 10.0


class LoopProfile:
    """Accumulates loop phase seconds and logs a window summary (module docstring).

    Args:
        core: the `EngineCore` whose counters are read.
        period_s: seconds between log lines, > 0.
        clock: time source (time.monotonic by default).

    Raises:
        InvalidParameterError: period_s <= 0.
    """

    def __init__(
        self,
        core: object,
        period_s: float = DEFAULT_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not period_s > 0:
            raise InvalidParameterError("period_s", f"must be > 0, got {period_s}")
        self.core = core
        self.period_s = period_s
        self._clock = clock
        self._loop_s = dict.fromkeys(LOOP_PHASES, 0.0)
        self._since_s = clock()
        self._mark_s = self._since_s
        self._base = self._core_counters()

    def add(self, phase: str, seconds: float) -> None:
        """Add `seconds` to one of `LOOP_PHASES`."""
        self._loop_s[phase] += seconds

    def mark(self) -> None:
        """Start timing a run of phases (`lap`)."""
        self._mark_s = self._clock()

    def lap(self, phase: str) -> None:
        """Add the time since the last `mark` or `lap` to `phase`, and mark now."""
        now_s = self._clock()
        self._loop_s[phase] += now_s - self._mark_s
        self._mark_s = now_s

    def _core_counters(self) -> dict[str, float]:
        core = self.core
        stats = core.stats  # type: ignore[attr-defined]
        counters = {name: stats.phase_s[name] for name in CORE_PHASES}
        for name in ("num_steps", "num_decode_rows", "num_prefill_tokens", "num_prefill_chunks"):
            counters[name] = getattr(stats, name)
        runner = getattr(core, "runner", None)
        if hasattr(runner, "phase_s"):  # a fake runner (tests, simulations) may keep none
            counters.update(runner.phase_s)  # type: ignore[union-attr]
            counters["rows_run"] = runner.num_rows_run  # type: ignore[union-attr]
        counters["wasted"] = stats.num_wasted_prefill_tokens
        counters["preemptions"] = core.scheduler.num_preemptions  # type: ignore[attr-defined]
        return counters

    def maybe_log(self) -> str | None:
        """Log at DEBUG (and return) the window's line when `period_s` has passed and steps
        ran."""
        now_s = self._clock()
        window_s = now_s - self._since_s
        if window_s < self.period_s:
            return None
        counters = self._core_counters()
        delta = {name: counters[name] - self._base[name] for name in counters}
        loop_s, self._loop_s = self._loop_s, dict.fromkeys(LOOP_PHASES, 0.0)
        self._since_s, self._base = now_s, counters
        steps = int(delta["num_steps"])
        if steps == 0:
            return None
        ms = {name: 1e3 * seconds / steps for name, seconds in {**loop_s, **delta}.items()}
        busy_s = sum(loop_s.values())
        preemptions = int(delta["preemptions"])
        runner, rows = "", ""
        if "rows_run" in delta:
            runner = " [" + ", ".join(f"{n} {ms[n]:.1f}" for n in RUNNER_PHASES) + "]"
            rows = f", {delta['rows_run'] / steps:.1f} rows run"
        line = (
            f"engine loop, last {window_s:.1f} s (busy {busy_s:.1f} s): {_plural(steps, 'step')} "
            f"of {1e3 * busy_s / steps:.1f} ms: step {ms['step']:.1f} (schedule "
            f"{ms['schedule']:.1f}, runner {ms['runner']:.1f}{runner}, update "
            f"{ms['update']:.1f}), commands {ms['commands']:.1f}, stats {ms['stats']:.1f}, "
            f"send {ms['send']:.1f}; per step {delta['num_decode_rows'] / steps:.1f} decodes + "
            f"{delta['num_prefill_tokens'] / steps:.1f} prefill tokens in "
            f"{delta['num_prefill_chunks'] / steps:.1f} chunks{rows}; "
            f"{_plural(preemptions, 'preemption')}; {int(delta['wasted'])} prefill tokens "
            "of requests shed before their first token"
        )
        logger.debug("%s", line)
        return line


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
