"""Helpers of the scheduler tests: request factory and a fake runner that "samples" tokens."""

from __future__ import annotations

from collections.abc import Callable

from sits.core.outputs import EngineCoreOutput, TokenLogprobs
from sits.core.plan import StepPlan, StepResult
from sits.core.request import Request
from sits.core.sampling_params import SamplingParams
from sits.sched import Scheduler, SchedulerConfig

TOKEN = 7  # what the fake runner samples unless told otherwise


def make_config(**changes: object) -> SchedulerConfig:
    """A small config: block_size 4, 64 blocks, budget 64, max_model_len 128."""
    values: dict[str, object] = dict(
        max_num_batched_tokens=64,
        max_num_seqs=16,
        max_model_len=128,
        block_size=4,
        num_blocks=64,
        enable_prefix_caching=True,
    )
    values.update(changes)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 4,
    *,
    arrival_time: float = 0.0,
    eos_token_id: int | None = None,
    prefix_leader_id: str | None = None,
    cache_salt: str | None = None,
    tenant_id: str = "default",
    priority: int = 0,
    **params: object,
) -> Request:
    """A request whose SamplingParams get `max_tokens` and any extra `params`."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        max_tokens=max_tokens,
        cache_salt=cache_salt,
        tenant_id=tenant_id,
        priority=priority,
        prefix_leader_id=prefix_leader_id,
    )


def fake_result(plan: StepPlan, token_of: Callable[[str], int] | None = None) -> StepResult:
    """Sample `token_of(request_id)` (default TOKEN) for every request with sample=True."""
    result = StepResult()
    for scheduled in plan.scheduled:
        if scheduled.sample:
            token = TOKEN if token_of is None else token_of(scheduled.request_id)
            result.sampled_token_ids[scheduled.request_id] = token
    return result


def run_step(
    scheduler: Scheduler, token_of: Callable[[str], int] | None = None
) -> tuple[StepPlan, list[EngineCoreOutput]]:
    """One engine step with the fake runner."""
    plan = scheduler.schedule()
    return plan, scheduler.update(plan, fake_result(plan, token_of))


def summary(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    """(request_id, start_position, num_tokens, sample) per scheduled request."""
    return [(s.request_id, s.start_position, s.num_tokens, s.sample) for s in plan.scheduled]


def run_to_completion(
    scheduler: Scheduler, max_steps: int = 1000, token_of: Callable[[str], int] | None = None
) -> dict[str, EngineCoreOutput]:
    """Step until nothing is left; returns each request's finishing output."""
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        plan, outputs = run_step(scheduler, token_of)
        assert plan.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        finished.update({o.request_id: o for o in outputs if o.finished})
    raise AssertionError("requests did not finish")


def logprobs_of(token_id: int) -> TokenLogprobs:
    """A fixed TokenLogprobs entry for `token_id`."""
    return TokenLogprobs(token_ids=[token_id], logprobs=[-0.5], ranks=[1])


def weighted_service(
    scheduler: Scheduler, plan: StepPlan, w_prompt: float = 1.0, w_output: float = 2.0
) -> dict[str, float]:
    """Service a plan gives each tenant: w_prompt per prompt token computed + w_output per
    sampled token (Sheng et al., OSDI 2024). Call before `update` (it reads the requests).

    Only valid without preemption or prefix hits (then every prompt chunk is computed once).
    """
    service: dict[str, float] = {}
    for scheduled in plan.scheduled:
        request = scheduler.get_request(scheduled.request_id)
        end = scheduled.start_position + scheduled.num_tokens
        num_prompt = max(min(end, request.num_prompt_tokens) - scheduled.start_position, 0)
        cost = w_prompt * num_prompt + w_output * scheduled.sample
        service[request.tenant_id] = service.get(request.tenant_id, 0.0) + cost
    return service
