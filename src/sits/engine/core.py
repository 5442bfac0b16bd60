"""`EngineCore`: the step loop's body: schedule, run the model, update, report.

It is synchronous and single-threaded: `LLM` calls `step()` directly and `AsyncLLM` calls it
from its own engine thread. Messages in and out are plain dataclasses (`Request` in,
`EngineCoreOutput` out), so the core can later move into its own process.

Load accounting for overload control (read by `AsyncLLM` for its stats): cumulative prefill
tokens computed and the wall time of the steps that computed them (`num_prefill_tokens`,
`prefill_busy_s`; their ratio is a prefill rate), and `waiting_load()` (per tenant: oldest
waiting arrival and prefill work still queued).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest
from sits.core.request import FinishReason, Request
from sits.runner.model_info import ModelInfo
from sits.runner.model_runner import ModelRunner
from sits.sched.config import SchedulerConfig, SwapCostModel, TenantPolicy
from sits.sched.scheduler import Scheduler
from sits.sched.tenants import TenantSchedStats


@dataclass(frozen=True, slots=True)
class WaitingLoad:
    """One tenant's queued work.

    Attributes:
        oldest_arrival_s: time.monotonic() arrival of its oldest waiting request; None when
            none waits (it may still have running requests with prompt left to compute).
        num_prefill_tokens: tokens still to prefill: every token of each waiting request (new
            or preempted: all are computed again; prefix-cache hits not deducted) plus the
            prompt tokens its running requests have not computed yet (chunked prefill).
    """

    oldest_arrival_s: float | None = None
    num_prefill_tokens: int = 0


class EngineCore:
    """Scheduler + model runner.

    Args:
        config: engine configuration.
        info: the resolved checkpoint facts (see `read_model_info`).
        tenant_policies: the tenants' scheduling policies; empty (the default) schedules every
            request first-come-first-served whatever its tenant_id.

    Attributes:
        runner: the model runner (device state).
        scheduler: the scheduler (KV block and batch decisions).
        num_steps: steps run so far.
        num_prefill_tokens: prompt (or recomputed) tokens computed so far, cumulative.
        prefill_busy_s: wall seconds of the steps that computed prefill tokens, cumulative
            (the whole step counts, decodes batched with the prefill included).
    """

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        tenant_policies: tuple[TenantPolicy, ...] = (),
    ) -> None:
        self.config = config
        self.info = info
        self.runner = ModelRunner(config, info)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=info.max_model_len,
                block_size=config.block_size,
                num_blocks=self.runner.num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
                tenants=tuple(tenant_policies),
                num_host_blocks=self.runner.num_host_blocks,
                kv_bytes_per_block=self.runner.kv_bytes_per_block,
                swap_cost=SwapCostModel.for_device(self.runner.device.type),
            )
        )
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.prefill_busy_s = 0.0
        self._first_scheduled_s: dict[str, float] = {}
        self._unreported_first_scheduled: set[str] = set()

    def check_request(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise at once if a request can never be served.

        Raises:
            InvalidParameterError: the prompt is empty or holds a token id outside the
                vocabulary.
            PromptTooLongError: prompt + max_tokens exceeds max_model_len or the whole KV cache.
        """
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens == 0:
            raise InvalidParameterError("prompt", "prompt must contain at least one token")
        vocab_size = self.runner.model.arch.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
            raise InvalidParameterError(
                "prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})"
            )
        limit = self.info.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens."
            )
        cache_tokens = self.runner.num_blocks * self.config.block_size
        if num_prompt_tokens + max_tokens > cache_tokens:
            raise PromptTooLongError(
                f"The request needs {num_prompt_tokens + max_tokens} tokens of KV cache "
                f"({num_prompt_tokens} prompt + {max_tokens} max_tokens) but the whole cache "
                f"holds {cache_tokens} tokens."
            )

    def add_request(self, request: Request) -> None:
        """Queue a request (raises like `check_request` when it can never fit)."""
        self.check_request(request.prompt_token_ids, request.max_tokens)
        self.scheduler.add_request(request)

    def finish_requests(
        self,
        request_ids: list[str],
        reason: FinishReason = FinishReason.ABORT,
        stop_reason: int | str | None = None,
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside (abort, stop string); frees their blocks at once."""
        for request_id in request_ids:
            self._first_scheduled_s.pop(request_id, None)
            self._unreported_first_scheduled.discard(request_id)
        return self.scheduler.finish_requests(request_ids, reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def tenant_stats(self) -> dict[str, TenantSchedStats]:
        """Per configured tenant: running, waiting, blocks used/reserved/borrowed (empty without
        tenants)."""
        return self.scheduler.tenant_stats()

    def waiting_load(self) -> dict[str, WaitingLoad]:
        """The queued work of each tenant id that has some (see `WaitingLoad`). O(requests)."""
        sched = self.scheduler
        loads: dict[str, WaitingLoad] = {}
        for request_id in sched.waiting_request_ids():
            request = sched.get_request(request_id)
            if request is None:
                continue
            load = loads.get(request.tenant_id) or WaitingLoad()
            oldest_s = load.oldest_arrival_s
            if oldest_s is None or request.arrival_time < oldest_s:
                oldest_s = request.arrival_time
            loads[request.tenant_id] = WaitingLoad(
                oldest_s, load.num_prefill_tokens + request.num_tokens
            )
        for request_id in sched.running_request_ids():
            request = sched.get_request(request_id)
            if request is None:
                continue
            left = request.num_prompt_tokens - request.num_computed_tokens
            if left > 0:
                load = loads.get(request.tenant_id) or WaitingLoad()
                loads[request.tenant_id] = WaitingLoad(
                    load.oldest_arrival_s, load.num_prefill_tokens + left
                )
        return loads

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step.

        Returns:
            One output per request that produced tokens, logprobs or finished this step.
        """
        plan = self.scheduler.schedule()
        now = time.monotonic()
        for sr in plan.scheduled:
            if sr.request_id not in self._first_scheduled_s:
                self._first_scheduled_s[sr.request_id] = now
                self._unreported_first_scheduled.add(sr.request_id)
        # Counted before `update`, which appends to the (shared) output_token_ids lists.
        num_prefill = sum(sr.num_tokens for sr in plan.scheduled if _is_prefill(sr))
        result = self.runner.run(plan)
        outputs = self.scheduler.update(plan, result)
        self.num_steps += 1
        if num_prefill:
            self.num_prefill_tokens += num_prefill
            self.prefill_busy_s += time.monotonic() - now
        for out in outputs:
            if out.request_id in self._unreported_first_scheduled:
                self._unreported_first_scheduled.discard(out.request_id)
                out.first_scheduled_time = self._first_scheduled_s[out.request_id]
            if out.finished:
                self._first_scheduled_s.pop(out.request_id, None)
        return outputs


def _is_prefill(sr: ScheduledRequest) -> bool:
    """True for a prompt chunk or a recompute (not a one-token decode of a running request)."""
    return sr.num_tokens > 1 or not sr.output_token_ids
