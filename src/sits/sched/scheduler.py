"""`Scheduler`: continuous batching under one token budget per step, with preemption.

One rule drives every step (as in vLLM v1): each request's computed tokens catch up with its
total tokens (prompt + outputs), a prefill chunk or a decode alike, within
`max_num_batched_tokens`. Running requests are served first in their running order, then
waiting requests first-come-first-served while the budget, `max_num_seqs` and free KV blocks
allow. When a running request cannot get blocks, the latest-arrived running request not yet
scheduled this step is preempted by recompute (its blocks freed, its outputs kept) and put at
the front of the waiting queue.

Invariants:
- Every decision is a pure function of the scheduler's state (no clocks, no randomness), so the
  same inputs give the same plans (identical across TP ranks, testable exactly on CPU).
- A request is in exactly one of: waiting queue, running list, or finished (dropped).
- Running requests hold KV blocks for all their computed tokens; waiting ones hold none.
- Blocks of a step's tokens enter the prefix cache in `update`, after they are computed.
- A step's scheduled tokens sum to at most `max_num_batched_tokens`; a request sampled in a
  step is one whose computed tokens reach all its tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.outputs import EngineCoreOutput, TokenLogprobs
from sits.core.plan import NewRequestData, ScheduledRequest, StepPlan, StepResult
from sits.core.request import FinishReason, Request, RequestStatus
from sits.kvcache.kv_manager import KVCacheManager, PrefixCacheStats, cdiv
from sits.sched.config import SchedulerConfig


@dataclass(slots=True)
class _StepState:
    """What one `schedule()` call has decided so far."""

    token_budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    new_requests: list[NewRequestData] = field(default_factory=list)
    num_preempted: int = 0


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Stop check after a token was appended to `request`.

    Order: a stop token id, then EOS (unless `ignore_eos`) -- both only once
    `num_output_tokens >= min_tokens` -- then the length limits (`max_tokens` outputs or
    `max_model_len` tokens in all).

    Returns:
        (FinishReason.STOP, the stop token id) for a stop token, (STOP, None) for EOS,
        (LENGTH, None) at a limit, or None to keep going.
    """
    params = request.sampling_params
    token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if not params.ignore_eos and token_id == request.eos_token_id:
            return FinishReason.STOP, None
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None


class Scheduler:
    """Continuous-batching scheduler over a paged KV cache with prefix caching.

    Args:
        config: step limits and KV cache geometry.

    Typical step: `plan = schedule()`; the runner computes it; `outputs = update(plan,
    result)`. Between steps, `add_request` and `finish_requests` (aborts, stop strings).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._arrival_seq: dict[str, int] = {}  # add order, the tie-break of arrival_time
        self._next_arrival_seq = 0
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._known_to_runner: set[str] = set()  # sent in StepPlan.new_requests, not finished
        self._finished_ids: list[str] = []  # finished since the last schedule(), runner knew
        self._num_preemptions = 0

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING) at the back of the waiting queue.

        Raises:
            InvalidParameterError: empty prompt ("prompt"), negative max_tokens, or a request
                id already in use ("request_id").
            PromptTooLongError: prompt + max_tokens exceeds max_model_len, or needs more KV
                blocks than the whole cache holds (it could never run).
        """
        self._validate(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self._requests[request.request_id] = request
        self._arrival_seq[request.request_id] = self._next_arrival_seq
        self._next_arrival_seq += 1
        self._waiting.append(request)

    def finish_requests(
        self,
        request_ids: str | list[str],
        reason: FinishReason,
        stop_reason: int | str | None = None,
    ) -> list[EngineCoreOutput]:
        """End requests from outside (abort, client disconnect, stop string); frees blocks.

        Unknown or already finished ids are ignored.

        Returns:
            One finished `EngineCoreOutput` (no new tokens) per request actually ended.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            self._finish(request, reason, stop_reason)
            outputs.append(self._output(request, [], None, None))
        self._drop_finished()
        return outputs

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished requests are dropped), or None."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def waiting_request_ids(self) -> list[str]:
        """Waiting request ids in queue order (front first)."""
        return [r.request_id for r in self._waiting]

    def running_request_ids(self) -> list[str]:
        """Running request ids in running (batch) order."""
        return [r.request_id for r in self._running]

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since the scheduler started (cumulative)."""
        return self._num_preemptions

    @property
    def kv_usage(self) -> float:
        """Fraction of usable KV blocks in use, in [0, 1]."""
        return self.kv.usage

    @property
    def num_free_blocks(self) -> int:
        """Usable KV blocks held by no request (cached free blocks included)."""
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """Usable KV blocks (num_blocks minus the reserved null block)."""
        return self.kv.num_usable_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache query and hit counters (in tokens)."""
        return self.kv.stats

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (no change) while any request holds blocks."""
        return self.kv.reset_prefix_cache()

    # ----------------------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        """Decide this step's work: running requests first, then waiting ones (FCFS).

        Returns:
            The plan: scheduled requests in batch order, requests new to the runner, and the
            ids of requests finished since the last call that the runner had been sent.
        """
        step = _StepState(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if step.num_preempted == 0:  # short of blocks: admitting more would only thrash
            self._schedule_waiting(step)
        finished_ids, self._finished_ids = self._finished_ids, []
        return StepPlan(
            scheduled=step.scheduled,
            new_requests=step.new_requests,
            finished_request_ids=finished_ids,
        )

    def _schedule_running(self, step: _StepState) -> None:
        for request in list(self._running):
            if step.token_budget == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new_tokens = min(
                request.num_tokens - request.num_computed_tokens, step.token_budget
            )
            assert num_new_tokens >= 1, request
            if self._allocate_or_preempt(request, num_new_tokens, step):
                self._add_to_step(request, num_new_tokens, step)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, step: _StepState) -> bool:
        """Get blocks for a running request, preempting victims until it fits.

        Returns:
            True when allocated; False when the request itself was preempted.
        """
        while not self.kv.allocate_slots(request, num_new_tokens):
            victim = self._pick_victim(step)
            self._preempt(victim)
            step.num_preempted += 1
            if victim is request:
                return False
        return True

    def _pick_victim(self, step: _StepState) -> Request:
        """The latest-arrived running request not scheduled in this step."""
        candidates = [r for r in self._running if r.request_id not in step.scheduled_ids]
        assert candidates, "the request asking for blocks is always a candidate"
        return max(candidates, key=lambda r: (r.arrival_time, self._arrival_seq[r.request_id]))

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free blocks, keep outputs, go to the front of the queue."""
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self._running.remove(request)
        self._waiting.appendleft(request)

    def _schedule_waiting(self, step: _StepState) -> None:
        deferred: list[Request] = []  # siblings waiting for their prefix leader
        while (
            self._waiting
            and step.token_budget > 0
            and len(self._running) < self.config.max_num_seqs
        ):
            request = self._waiting[0]
            if self._waits_for_leader(request):
                deferred.append(self._waiting.popleft())
                continue
            if not self._admit(request, step):
                break  # FCFS: no later request jumps ahead when blocks run out
            self._waiting.popleft()
        self._waiting.extendleft(reversed(deferred))

    def _waits_for_leader(self, request: Request) -> bool:
        """True while the request's prefix leader is alive and has not computed its prompt."""
        if request.prefix_leader_id is None:
            return False
        leader = self._requests.get(request.prefix_leader_id)
        if leader is None or leader.is_finished:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def _admit(self, request: Request, step: _StepState) -> bool:
        """Move a waiting request to running with its prefix hits; False if no blocks."""
        hit_block_ids, num_cached_tokens = self.kv.get_computed_blocks(request)
        num_new_tokens = min(request.num_tokens - num_cached_tokens, step.token_budget)
        if not self.kv.allocate_slots(request, num_new_tokens, hit_block_ids):
            return False
        request.num_computed_tokens = num_cached_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        self._add_to_step(request, num_new_tokens, step)
        return True

    def _add_to_step(self, request: Request, num_new_tokens: int, step: _StepState) -> None:
        start = request.num_computed_tokens
        end = start + num_new_tokens
        step.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.all_token_ids[start:end],
                start_position=start,
                block_ids=list(self.kv.get_block_ids(request.request_id)),
                sample=end == request.num_tokens and request.max_tokens > 0,
                output_token_ids=request.output_token_ids,
            )
        )
        step.scheduled_ids.add(request.request_id)
        step.token_budget -= num_new_tokens
        if request.request_id not in self._known_to_runner:
            self._known_to_runner.add(request.request_id)
            step.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                )
            )

    # ------------------------------------------------------------------------------- update
    def update(self, plan: StepPlan, result: StepResult) -> list[EngineCoreOutput]:
        """Apply a computed step: advance computed tokens, cache blocks, append and stop.

        Requests finished between `schedule` and `update` (aborted) are skipped. Finished
        requests free their blocks at once.

        Returns:
            One output per scheduled request that got a token, logprobs or prompt logprobs,
            or finished, in plan order.

        Raises:
            KeyError: the result lacks a sampled token for a request with `sample=True`.
        """
        outputs = []
        for scheduled in plan.scheduled:
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            output = self._update_request(request, scheduled, result)
            if output is not None:
                outputs.append(output)
        self._drop_finished()
        return outputs

    def _update_request(
        self, request: Request, scheduled: ScheduledRequest, result: StepResult
    ) -> EngineCoreOutput | None:
        request.num_computed_tokens += scheduled.num_tokens
        assert request.num_computed_tokens <= request.num_tokens, request
        self.kv.cache_full_blocks(request, request.num_computed_tokens)
        request_id = request.request_id
        new_token_ids: list[int] = []
        logprobs = None
        finish = None
        if scheduled.sample:
            token_id = result.sampled_token_ids[request_id]
            request.append_output_token(token_id)
            new_token_ids.append(token_id)
            if request_id in result.logprobs:
                logprobs = [result.logprobs[request_id]]
            finish = check_stop(request, self.config.max_model_len)
        elif request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
            finish = (FinishReason.LENGTH, None)  # prompt-only request (e.g. prompt logprobs)
        prompt_logprobs = result.prompt_logprobs.get(request_id)
        if finish is not None:
            self._finish(request, *finish)
        if not new_token_ids and logprobs is None and prompt_logprobs is None and finish is None:
            return None
        return self._output(request, new_token_ids, logprobs, prompt_logprobs)

    def _finish(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None
    ) -> None:
        """Mark finished and free its blocks; `_drop_finished` removes it from the queues."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv.free(request)
        del self._requests[request.request_id]
        del self._arrival_seq[request.request_id]
        if request.request_id in self._known_to_runner:
            self._known_to_runner.remove(request.request_id)
            self._finished_ids.append(request.request_id)

    def _drop_finished(self) -> None:
        self._running = [r for r in self._running if not r.is_finished]
        if any(r.is_finished for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.is_finished)

    def _output(
        self,
        request: Request,
        new_token_ids: list[int],
        logprobs: list[TokenLogprobs] | None,
        prompt_logprobs: list[TokenLogprobs | None] | None,
    ) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    # ---------------------------------------------------------------------------- validate
    def _validate(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise InvalidParameterError(
                "request_id", f"request id {request.request_id!r} is already in use"
            )
        num_prompt_tokens = request.num_prompt_tokens
        if num_prompt_tokens == 0:
            raise InvalidParameterError("prompt", "prompt must contain at least one token")
        if request.max_tokens < 0:
            raise InvalidParameterError(
                "max_tokens", f"max_tokens must be >= 0, got {request.max_tokens}"
            )
        num_total_tokens = num_prompt_tokens + request.max_tokens
        max_model_len = self.config.max_model_len
        if num_total_tokens > max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_total_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{request.max_tokens} for max_tokens). Please reduce the prompt or max_tokens."
            )
        num_blocks = cdiv(num_total_tokens, self.config.block_size)
        if num_blocks > self.kv.num_usable_blocks:
            raise PromptTooLongError(
                f"The request needs {num_total_tokens} tokens ({num_prompt_tokens} in the "
                f"prompt, {request.max_tokens} for max_tokens) = {num_blocks} KV blocks of "
                f"{self.config.block_size} tokens, but the KV cache holds only "
                f"{self.kv.num_usable_blocks} blocks. Please reduce the prompt or max_tokens."
            )
