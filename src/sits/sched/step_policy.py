"""`StepPolicy`: what the engine decides before each step from the clock, as a `StepDecision`.

Three per-step policies live here, each a pure function of the scheduler's state and `now_s`
(the engine passes its clock's reading; nothing here reads a clock):
- start deadlines: a request past its `Request.start_deadline_s` that never started (nothing
  computed, nothing generated; for a follower of an n>1 request, its leader neither) is
  dropped (`due_unstarted`); one that started runs on, dropping it would throw work away;
- TPOT pacing with TTFT rescue: the step's prefill budget (`TpotPacer.max_prefill_tokens`),
  lifted to at least the prompt tokens of first tokens at risk (at most `TTFT_RESCUE_SLACK` of
  their TTFT SLO left) of the tenants `ttft_rescue_tenants` names (below);
- reclaim: with tenants, the guaranteed tenants whose reservation may be reclaimed from
  borrowers by preemption now (`Scheduler.reclaim_due_tenants` with `RECLAIM_PATIENCE`).

Order within a step (the engine's `Stepper.plan`): drop the `due_unstarted` requests first, then
`decide`, so the dropped requests count neither as first tokens at risk nor as a tenant's
oldest waiting request. After the step, `observe_step` feeds the pacer's step-time model.

TPOT pacing (`TpotPacer`): how many prefill tokens the next step may take without breaking a
TPOT SLO.

A step that batches a long prefill chunk with the running decodes delays every decode's next
token by the whole step. Tenants with a TPOT SLO (`TenantPolicy.tpot_ms`) need the mean time
between their output tokens to stay within it, so each decoding request r carries a token
schedule: its n-th token after the first is due at `t_first(r) + n * f * tpot(r)` (f =
`target_fraction`, 0.9: a margin for what the client waits for beyond the engine). Before each
step, `TpotPacer.max_prefill_tokens` finds the tightest slack (due time of the next token -
now) among running, decoding requests and returns the largest prefill budget whose predicted
step time fits in it; decode-only steps (fast, often a CUDA graph) then bank time for the next
long chunk. A request whose TPOT is below the decode-only step time cannot be helped by
pacing and is left out, so pacing never starves prefill for a schedule it cannot meet; a
request behind its schedule recovers (tpot - decode step time) per decode-only step, and one
more than a token behind (e.g. back from a preemption) is rebased to be due now, so no
request's old lateness holds prefill back for long.
This is SLO-aware chunk sizing in the spirit of Sarathi-Serve (Agrawal et al., "Taming
Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve", OSDI 2024), driven by each
request's own token schedule instead of one fixed chunk.

Pacing must not starve the prompts it shares the GPU with: a TTFT miss is a whole request
missed, while one long step moves a TPOT mean only a little. So `StepPolicy` lifts the limit
to at least the prompt tokens of requests whose first token is at risk (no token yet and at
most `TTFT_RESCUE_SLACK` of their TTFT SLO left), for tenants at least as important as the
paced ones (`ttft_rescue_tenants`): without it, an eager mixed step dearer than every
decode's slack left the paced tenant's own new prompts queued for seconds (H200,
bench/RESULTS.md).

Step times come from `StepTimeModel`: an exponential moving average of decode-only steps and
an online least-squares line (exponentially weighted means of x, y, x^2 and x*y) of mixed
steps' seconds against the tokens they ran (decodes + prompt tokens, padded to the step's CUDA
graph bucket); once a kind has a few samples, a step far slower than predicted (a one-off stall)
is clipped. Until both kinds were observed, pacing is off.

A mixed step replays the CUDA graph of the smallest token bucket that holds it
(`TpotPacer.token_buckets`) and costs about what a full bucket costs, so the budget is the
largest bucket that fits the slack, less the decodes the step carries: a budget cut between two
buckets ran the padding for nothing (H200: 218 decodes + 837 prompt tokens ran as 1,280 tokens
while a full FCFS batch of 256 fitted the same bucket; bench/RESULTS.md, 2026-11-30).

Invariants: `TpotPacer.max_prefill_tokens` returns None (no limit) or an int in [0,
max_num_batched_tokens]; it reads no clock (the caller passes the time).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sits.core.errors import InvalidParameterError
from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest
from sits.core.request import Request, RequestStatus
from sits.sched.config import TenantPolicy
from sits.sched.scheduler import Scheduler

# A guaranteed tenant preempts borrowers for its reservation once its oldest waiting request
# has used this fraction of its TTFT SLO; before that, requests finishing free the capacity at
# no recompute cost (with 200+ running, a few finish every step). On the H200 QoS runs the
# guaranteed tenant's TTFT p99 stayed at ~425 ms of 1 s with it (bench/RESULTS.md).
RECLAIM_PATIENCE = 0.25
TTFT_RESCUE_SLACK = 0.5  # a first token with half its TTFT SLO left lifts pacing for its prompt


@dataclass(frozen=True, slots=True)
class StepDecision:
    """The arguments of one `Scheduler.schedule` call.

    Attributes:
        max_prefill_tokens: prompt (or recompute) tokens the step may take; None: no limit.
        reclaim_tenants: guaranteed tenants whose reclaim by preemption is due; None without
            tenants.
    """

    max_prefill_tokens: int | None = None
    reclaim_tenants: frozenset[str] | None = None


class StepPolicy:
    """Start deadlines, TPOT pacing with TTFT rescue, and reclaim (see the module docstring).

    Args:
        tenant_policies: the tenants' policies; empty: FCFS (no pacing, no reclaim).
        pacer: the TPOT pacer (on when a tenant has a TPOT SLO).
        max_num_batched_tokens: the step's token budget (caps the TTFT rescue).

    Attributes:
        pacer: the TPOT pacer; a benchmark may swap it for one of its own.
    """

    def __init__(
        self,
        tenant_policies: Sequence[TenantPolicy],
        pacer: TpotPacer,
        max_num_batched_tokens: int,
    ) -> None:
        self.pacer = pacer
        self.max_num_batched_tokens = max_num_batched_tokens
        self._rescue_tenants = ttft_rescue_tenants(tenant_policies)
        self._has_tenants = bool(tenant_policies)
        self._start_deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)

    def add_request(self, request: Request) -> None:
        """Note a queued request's start deadline, if it has one."""
        if request.start_deadline_s is not None:
            heapq.heappush(self._start_deadlines, (request.start_deadline_s, request.request_id))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the pacing schedules of requests finished from outside (unknown ids ignored;
        their deadlines are skipped when due)."""
        self.pacer.forget(request_ids)

    def due_unstarted(self, now_s: float, scheduler: Scheduler) -> list[str]:
        """The requests to drop now: past their start deadline and never started (nor, for
        a follower of an n>1 request, its leader). The engine finishes them ABORT with
        stop_reason `START_DEADLINE_MISSED`; their outputs lead the step's outputs.

        Args:
            now_s: the engine clock's seconds (time.monotonic()).
            scheduler: the scheduler that holds the requests (read only).
        """
        heap = self._start_deadlines
        due = []
        while heap and heap[0][0] <= now_s:
            _, request_id = heapq.heappop(heap)
            request = scheduler.get_request(request_id)
            if request is None or not _untouched(request):
                continue
            leader = scheduler.get_request(request.prefix_leader_id or "")
            if leader is None or _untouched(leader):
                due.append(request_id)
        return due

    def decide(self, now_s: float, scheduler: Scheduler) -> StepDecision:
        """The step's prefill budget (pacing, lifted by the TTFT rescue) and due reclaims.

        Args:
            now_s: the engine clock's seconds (time.monotonic()).
            scheduler: the scheduler about to plan the step (read; the pacer may rebase the
                token schedule of a running request over a token late).
        """
        max_prefill_tokens = None
        pacer = self.pacer
        if pacer.enabled:
            max_prefill_tokens = pacer.max_prefill_tokens(now_s, scheduler.running_requests())
            if max_prefill_tokens is not None and self._rescue_tenants:
                at_risk = scheduler.prompt_tokens_at_risk(
                    now_s, TTFT_RESCUE_SLACK, self._rescue_tenants
                )
                rescue = min(at_risk, self.max_num_batched_tokens)
                max_prefill_tokens = max(max_prefill_tokens, rescue)
        reclaim = None
        if self._has_tenants:
            reclaim = scheduler.reclaim_due_tenants(now_s, RECLAIM_PATIENCE)
        return StepDecision(max_prefill_tokens, reclaim)

    def observe_step(
        self,
        num_decodes: int,
        prefills: Sequence[ScheduledRequest],
        step_s: float,
        end_s: float,
        outputs: Sequence[EngineCoreOutput],
    ) -> None:
        """Feed the pacer one step that scheduled tokens (a no-op without pacing).

        Args:
            num_decodes: its one-token decodes; prefills: its prompt chunks and recomputes.
            step_s: its wall seconds; end_s: clock seconds when its accounting ended.
            outputs: its outputs (who got a token, who finished).
        """
        pacer = self.pacer
        if not pacer.enabled:
            return
        num_tokens = num_decodes + sum(sr.num_tokens for sr in prefills)
        pacer.observe_step(
            pacer.padded_tokens(num_tokens) if prefills else 0,
            step_s,
            end_s,
            (out.request_id for out in outputs if out.new_token_ids),
            (out.request_id for out in outputs if out.finished),
        )


def _untouched(request: Request) -> bool:
    """Waiting with nothing computed and nothing generated (never started)."""
    return (
        request.status is RequestStatus.WAITING
        and request.num_computed_tokens == 0
        and request.num_output_tokens == 0
    )


# -------------------------------------------------------------------------------- TPOT pacing
def ttft_rescue_tenants(policies: Iterable[TenantPolicy]) -> frozenset[str]:
    """Tenants whose first tokens at risk override TPOT pacing (see the module docstring):
    those with a TTFT SLO whose priority is at least as high (value as low) as the highest of
    the tenants with a TPOT SLO. Empty when no tenant has a TPOT SLO (no pacing)."""
    policies = tuple(policies)
    paced = [p.priority for p in policies if p.tpot_ms]
    if not paced:
        return frozenset()
    top = min(paced)
    return frozenset(p.tenant_id for p in policies if p.ttft_ms and p.priority <= top)


class StepTimeModel:
    """Predicts a step's wall seconds from the tokens it runs (see the module docstring).

    Args:
        alpha: weight of a new observation in the moving averages, in (0, 1].
        outlier_factor: once `min_samples` steps of a kind were seen, a step this many times
            slower than predicted counts as this many times the prediction; > 1.
        min_samples: steps of a kind seen before its outliers are clipped (>= 1).

    Attributes:
        num_decode_samples, num_mixed_samples: steps of each kind observed.

    Raises:
        InvalidParameterError: alpha outside (0, 1], outlier_factor <= 1, min_samples < 1.
    """

    def __init__(
        self, alpha: float = 0.1, outlier_factor: float = 4.0, min_samples: int = 8
    ) -> None:
        if not 0 < alpha <= 1:
            raise InvalidParameterError("alpha", f"must be in (0, 1], got {alpha}")
        if not outlier_factor > 1:
            raise InvalidParameterError("outlier_factor", f"must be > 1, got {outlier_factor}")
        if min_samples < 1:
            raise InvalidParameterError("min_samples", f"must be >= 1, got {min_samples}")
        self.alpha = alpha
        self.outlier_factor = outlier_factor
        self.min_samples = min_samples
        self.num_decode_samples = 0
        self.num_mixed_samples = 0
        self.decode_s: float | None = None  # EMA of decode-only steps, seconds
        self._moments: list[float] | None = None  # EMAs of x, y, x*x, x*y of mixed steps

    def observe(self, num_tokens: int, step_s: float) -> None:
        """Take one step: the tokens a step with prompt tokens ran (padded; 0 for a decode-only
        step) and its wall seconds.

        Once `min_samples` steps of its kind were seen, a step over `outlier_factor` x the
        prediction counts as that bound: a one-off stall (a kernel compiled for a new shape,
        a garbage collection) moves the averages only as much as a slow step could.
        """
        a = self.alpha
        is_decode = num_tokens == 0
        seen = self.num_decode_samples if is_decode else self.num_mixed_samples
        if seen >= self.min_samples:  # then the kind has a prediction
            predicted = self._predicted(num_tokens)
            if predicted is not None and predicted > 0:
                step_s = min(step_s, self.outlier_factor * predicted)
        if is_decode:
            self.num_decode_samples += 1
            self.decode_s = (
                step_s if self.decode_s is None else a * step_s + (1 - a) * self.decode_s
            )
            return
        self.num_mixed_samples += 1
        x = float(num_tokens)
        sample = (x, step_s, x * x, x * step_s)
        if self._moments is None:
            self._moments = list(sample)
        else:
            self._moments = [a * s + (1 - a) * m for s, m in zip(sample, self._moments)]

    def _predicted(self, num_tokens: int) -> float | None:
        if num_tokens == 0:
            return self.decode_s
        if self._moments is None:
            return None
        intercept, slope = self.mixed_line()
        return intercept + slope * num_tokens

    @property
    def ready(self) -> bool:
        """True once both decode-only and mixed steps were observed."""
        return self.decode_s is not None and self._moments is not None

    def mixed_line(self) -> tuple[float, float]:
        """(intercept seconds, seconds per token) of mixed steps.

        Without spread in the observed token counts the line goes through the origin and the
        mean; the slope is never negative and the intercept never below 0.

        Raises:
            RuntimeError: no mixed step observed yet.
        """
        if self._moments is None:
            raise RuntimeError("no mixed step observed yet")
        mean_x, mean_y, mean_xx, mean_xy = self._moments
        var_x = mean_xx - mean_x * mean_x
        if var_x > 1e-6 * mean_xx:
            slope = max((mean_xy - mean_x * mean_y) / var_x, 0.0)
            intercept = mean_y - slope * mean_x
            if intercept >= 0:
                return intercept, slope
        return 0.0, mean_y / mean_x

    def predict(self, num_tokens: int) -> float:
        """Predicted seconds of a step with prompt tokens that runs this many tokens (0: a
        decode-only step).

        Raises:
            RuntimeError: the model is not `ready`.
        """
        predicted = self._predicted(num_tokens) if self.ready else None
        if predicted is None:
            raise RuntimeError("step time model not ready")
        return predicted


@dataclass(slots=True)
class TpotPacer:
    """Tracks first-token times and sizes each step's prefill budget (module docstring).

    Args:
        tpot_s_by_tenant: tenant id -> TPOT SLO in seconds (tenants without one left out).
        max_num_batched_tokens: the step's token budget (the largest answer).
        min_chunk_tokens: a budget below this is rounded down to 0 (a tiny chunk would pay
            a mixed step's fixed cost for almost nothing).
        target_fraction: the schedule spaces tokens by this fraction of each TPOT SLO, in
            (0, 1]: the engine's token times exclude what the client also waits for
            (detokenizing, the HTTP send, the network, garbage-collection pauses), so pacing
            to the SLO itself would put half the requests over it. 0.9: on the H200
            (bench/RESULTS.md, 2026-11-30) a 40 ms schedule gave client-measured TPOTs of
            at most 40.06 ms over 1,733 requests, so 10 % is ample margin, while every
            point of it costs decode batch size, hence throughput.
        min_prefill_tokens: a budget below this is 0 too: the step runs its decodes alone,
            which banks time on the paced requests' schedules, so a later step can take at
            least this many prompt tokens. 0: off. Where a step's cost is concave in its
            tokens, alternating decode-only and large steps costs less than filling the same
            middle-sized step each time: on the CPU simulation with the H200's measured step
            costs (`bench/qos_sim.py --cost-curve`, virtual clock), 1,536 took QoS from 5,496
            to 5,773 output tok/s (gold's TTFT and TPOT SLOs still all met); with a linear
            cost it lost 2 %. On the H200 (bench/RESULTS.md, 2026-11-30, runs 17-19) 1,536
            gave QoS / FCFS 0.992 against 0.923 while a MoE config made 1,152-token steps
            dear, and 0.965 / 0.960 against 0.948 / 0.957 once it did not: off by default
            until more runs than these two pairs show the gain.
        model: the step-time model, fed by the engine after each step.
        token_buckets: token counts a step with prompt tokens is padded to (the runner's
            mixed-step CUDA graphs), ascending; empty: such steps run unpadded.
    """

    tpot_s_by_tenant: Mapping[str, float]
    max_num_batched_tokens: int
    min_chunk_tokens: int = 16
    target_fraction: float = 0.9
    min_prefill_tokens: int = 0
    model: StepTimeModel | None = None
    token_buckets: tuple[int, ...] = ()
    _first_token_s: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.target_fraction <= 1:
            raise InvalidParameterError(
                "target_fraction", f"must be in (0, 1], got {self.target_fraction}"
            )
        if self.model is None:
            self.model = StepTimeModel()

    def padded_tokens(self, num_tokens: int) -> int:
        """The tokens a step with prompt tokens runs: the smallest bucket >= num_tokens, or
        num_tokens itself past the largest bucket or without buckets."""
        buckets = self.token_buckets
        i = bisect_left(buckets, num_tokens)
        return buckets[i] if i < len(buckets) else num_tokens

    @property
    def enabled(self) -> bool:
        """True when some tenant has a TPOT SLO."""
        return bool(self.tpot_s_by_tenant)

    def observe_step(
        self,
        num_tokens: int,
        step_s: float,
        end_s: float,
        sampled_ids: Iterable[str],
        finished_ids: Iterable[str],
    ) -> None:
        """After a step: feed the model and note first tokens and finished requests.

        Args:
            num_tokens: 0 for a decode-only step, else the tokens it ran (decodes + prompt
                or recomputed tokens, padded: `padded_tokens`).
            step_s: the step's wall seconds (model run and scheduling).
            end_s: time.monotonic() when its tokens were produced.
            sampled_ids: ids of the requests that got a token in the step.
            finished_ids: requests that ended in the step (forgotten).
        """
        assert self.model is not None
        self.model.observe(num_tokens, step_s)
        for request_id in sampled_ids:
            self._first_token_s.setdefault(request_id, end_s)
        self.forget(finished_ids)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the schedules of requests that ended (unknown ids are ignored)."""
        for request_id in request_ids:
            self._first_token_s.pop(request_id, None)

    def max_prefill_tokens(self, now_s: float, running: Iterable[Request]) -> int | None:
        """Prefill tokens the next step may take, or None for no limit.

        The step may run the largest token bucket whose predicted time fits the tightest
        slack; its prompt tokens are that less the decodes of the running requests.

        Args:
            now_s: time.monotonic() now.
            running: the running requests (a schedule over a token late is rebased).
        """
        model = self.model
        if not self.enabled or model is None or not model.ready:
            return None
        decode_s = model.predict(0)
        slack_s = math.inf
        num_decodes = 0
        for request in running:
            num_decodes += request.num_tokens - request.num_computed_tokens == 1
            slo_s = self.tpot_s_by_tenant.get(request.tenant_id)
            first_s = self._first_token_s.get(request.request_id)
            if slo_s is None or first_s is None:
                continue
            tpot_s = slo_s * self.target_fraction
            if tpot_s <= decode_s:
                continue
            due_s = first_s + request.num_output_tokens * tpot_s
            if due_s < now_s - tpot_s:  # over a token late (e.g. was preempted): rebase
                self._first_token_s[request.request_id] = now_s - request.num_output_tokens * tpot_s
                due_s = now_s
            slack_s = min(slack_s, due_s - now_s)
        if slack_s == math.inf or model.predict(self.max_num_batched_tokens) <= slack_s:
            return None
        intercept, slope = model.mixed_line()
        if slope <= 0 or slack_s <= intercept:
            return 0
        num_tokens = int((slack_s - intercept) / slope)
        if self.token_buckets and num_tokens < self.token_buckets[-1]:
            i = bisect_right(self.token_buckets, num_tokens)
            num_tokens = self.token_buckets[i - 1] if i else 0
        budget = min(num_tokens - num_decodes, self.max_num_batched_tokens)
        return budget if budget >= max(self.min_chunk_tokens, self.min_prefill_tokens) else 0
