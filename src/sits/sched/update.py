"""Applying a computed step to its requests over a `SchedulerState` (computed tokens,
prefix-cache blocks, sampled tokens, stop checks, outputs): `apply_step_result`, and with
async scheduling `apply_step_ahead`, which applies a launched step before its tokens are
known. The scheduling decisions are `sits.sched.planner`'s.

Async scheduling (`EngineConfig.async_scheduling`): the engine plans step N+1 while the device
still runs step N. `apply_step_ahead` (`Scheduler.update_ahead`) applies step N as far as it
can without N's tokens: each scheduled request's computed tokens advance, the blocks it fills
enter the prefix cache, and each sampled request gets `PLACEHOLDER_TOKEN_ID` as its newest
output token, so the next plan schedules it one decode further (its input id is filled in on
the device from step N's sampled tokens, see `ModelRunner.launch`). `apply_step_result`
(`Scheduler.update`) then replaces the placeholder with the real token, checks the stop
conditions and reports.

Invariants:
- At most one step is ahead: when `apply_step_ahead` runs, every earlier placeholder is
  resolved, so a placeholder is always a request's last token.
- A request that will surely end with step N (a length limit reached, or a prompt-only request
  whose prompt is done) is not planned again: its id is in `state.ahead_done`, which
  `planner.plan_step` skips. A request that ends on a stop token or EOS sampled in step N
  cannot be known ahead: it runs one more decode in step N+1, whose token is dropped.
- Blocks enter the prefix cache once their tokens are known and their KV is computed or queued
  (a later step that reads them runs after the step that writes them, on one device stream).
"""

from __future__ import annotations

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import PLACEHOLDER_TOKEN_ID, ScheduledRequest, StepPlan, StepResult
from sits.core.request import FinishReason, Request, RequestStatus
from sits.sched.checks import check_stop, engine_output, reaches_length_limit
from sits.sched.state import SchedulerState, drop_finished, finish_request


def apply_step_ahead(state: SchedulerState, plan: StepPlan) -> None:
    """Async scheduling: apply a launched step before its tokens are known, so that the next
    `plan_step` can plan the step after it; `apply_step_result(state, plan, result)` completes
    it. At most one step may be ahead (see the module docstring)."""
    assert state.ahead_plan is None, "a step is already ahead"
    done: set[str] = set()
    max_model_len = state.config.max_model_len
    for scheduled in plan.scheduled:
        request = state.requests.get(scheduled.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            continue
        request.num_computed_tokens += len(scheduled.token_ids)
        state.kv.cache_full_blocks(request, request.num_computed_tokens)
        if scheduled.sample:
            request.append_output_token(PLACEHOLDER_TOKEN_ID)
            if reaches_length_limit(request, max_model_len):
                done.add(request.request_id)
        elif request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
            done.add(request.request_id)
    state.ahead_plan, state.ahead_done = plan, done


def apply_step_result(
    state: SchedulerState, plan: StepPlan, result: StepResult
) -> list[EngineCoreOutput]:
    """Apply a computed step: advance computed tokens, cache blocks, append and stop.

    Requests finished between `plan_step` and this call (aborted) are skipped. Finished
    requests free their blocks at once. For the step `apply_step_ahead` applied, the computed
    tokens are advanced already and each sampled token replaces its placeholder; a request
    preempted since (waiting again) still gets its token and its stop check.

    Returns:
        One output per scheduled request that got a token, logprobs or prompt logprobs, or
        finished, in plan order.

    Raises:
        KeyError: the result lacks a sampled token for a request with `sample=True`.
    """
    ahead = plan is state.ahead_plan
    if ahead:
        state.ahead_plan, state.ahead_done = None, set()
    outputs = []
    requests = state.requests
    for scheduled in plan.scheduled:
        request = requests.get(scheduled.request_id)
        if request is None:
            continue
        # Not running: skipped, unless preempted by the plan made while this (ahead) step
        # ran: such a request still gets its token.
        if request.status is not RequestStatus.RUNNING and not (ahead and not request.is_finished):
            continue
        output = _update_request(state, request, scheduled, result, ahead)
        if output is not None:
            outputs.append(output)
    drop_finished(state)
    return outputs


def _update_request(
    state: SchedulerState,
    request: Request,
    scheduled: ScheduledRequest,
    result: StepResult,
    ahead: bool,
) -> EngineCoreOutput | None:
    """Apply one scheduled request's step (runs for every scheduled request); `ahead`:
    `apply_step_ahead` advanced its computed tokens and cached its blocks already."""
    request_id = request.request_id
    if not ahead:
        request.num_computed_tokens += len(scheduled.token_ids)
        assert request.num_computed_tokens <= len(request.all_token_ids), request
        state.kv.cache_full_blocks(request, request.num_computed_tokens)
    prompt_logprobs = result.prompt_logprobs.get(request_id) if result.prompt_logprobs else None
    if scheduled.sample:
        token_id = result.sampled_token_ids[request_id]
        if ahead:  # the newest output token is the step's placeholder
            assert request.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID, request
            request.output_token_ids[-1] = request.all_token_ids[-1] = token_id
        else:
            request.append_output_token(token_id)
        logprobs_by_id = result.logprobs
        logprobs = [logprobs_by_id[request_id]] if request_id in logprobs_by_id else None
        finish = check_stop(request, state.config.max_model_len)
        if finish is not None:
            finish_request(state, request, *finish)
        return engine_output(request, [token_id], logprobs, prompt_logprobs)
    if request.max_tokens == 0 and request.num_computed_tokens == len(request.all_token_ids):
        # A prompt-only request (e.g. prompt logprobs) ends once its prompt is computed.
        finish_request(state, request, FinishReason.LENGTH, None)
    elif prompt_logprobs is None:
        return None  # a prompt chunk with nothing to report
    return engine_output(request, [], None, prompt_logprobs)
