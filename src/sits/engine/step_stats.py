"""`StepStats`: the engine's step counters, tenant cost shares and prefill chunk log.

Load accounting for overload control (read by `AsyncLLM` for its stats): cumulative prefill
tokens computed and the wall time of the steps that computed them (`num_prefill_tokens`,
`prefill_busy_s`; their ratio is a prefill rate).

Cost accounting: each step's wall time (schedule + run + update) is added to `busy_s` and split
among the tenants of its scheduled requests in proportion to their scheduled tokens
(`split_step_time`; a prefill token and a decode token weigh the same), accumulated in
`tenant_busy_s`; so the tenants' shares always add up to `busy_s`. The prompt chunks (and
recomputes) of the last `MAX_PREFILL_CHUNK_LOG` scheduled prefills are kept in the bounded
`prefill_chunks` ring (request timelines on the dashboard; read it on the engine's thread).

Invariants: one `account_step` per step run, synchronous or asynchronous (`Stepper`);
the counters only grow; the clock readings are passed in (nothing here reads a clock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest, StepPlan
from sits.core.request import Request

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
    """Cumulative step counters (see the module docstring).

    Attributes:
        num_steps: steps run so far.
        num_prefill_tokens: prompt (or recomputed) tokens computed so far.
        prefill_busy_s: wall seconds of the steps that computed prefill tokens (the whole
            step counts, decodes batched with the prefill included).
        busy_s: wall seconds of every step that scheduled tokens.
        tenant_busy_s: tenant id -> its share of `busy_s`.
        tenant_scheduled_tokens: tenant id -> tokens scheduled for it so far (prompt chunks,
            recomputes and decodes).
        phase_s: wall seconds of the step's phases: "schedule" (the step policy and the
            scheduler), "runner" (inputs, model, sampling) and "update" (scheduler update and
            outputs); read by the engine loop's profile (`sits.engine.loop_profile`).
        num_decode_rows: one-token decodes scheduled so far.
        num_prefill_chunks: prompt (or recompute) chunks scheduled so far.
        num_wasted_prefill_tokens: computed prompt tokens of requests finished from outside
            before their first token (e.g. shed by a queue timeout).
        prefill_chunks: the latest prefill chunks, oldest first (bounded ring).
        record_request_chunks: when True (tracing), each request's prompt chunks (and
            recomputes) travel on its next output as `EngineCoreOutput.prefill_chunks`:
            (step end time.monotonic(), tokens) per chunk since its previous output.
    """

    num_steps: int = 0
    num_prefill_tokens: int = 0
    prefill_busy_s: float = 0.0
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
        if prefills:
            start_s, end_s = chunk_s
            self.num_prefill_tokens += sum(sr.num_tokens for sr in prefills)
            self.num_prefill_chunks += len(prefills)
            self.prefill_busy_s += busy_s
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
