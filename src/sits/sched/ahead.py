"""Async scheduling's provisional update: what a launched step will have done, before its
sampled tokens are known on the host.

With async scheduling (`EngineConfig.async_scheduling`) the engine plans step N+1 while the
device still runs step N. `advance_ahead` applies step N to the requests as far as it can
without N's tokens: each scheduled request's computed tokens advance, and each sampled request
gets `PLACEHOLDER_TOKEN_ID` as its newest output token, so the next plan schedules it one
decode further (its input id is filled in on the device from step N's sampled tokens, see
`ModelRunner.launch`), and the blocks it fills enter the prefix cache. `Scheduler.update` later
replaces the placeholder with the real token (`resolve_placeholder`), checks the stop
conditions and reports.

Invariants:
- At most one step is ahead: when `advance_ahead` runs, every earlier placeholder is resolved,
  so a placeholder is always a request's last token.
- A request that will surely end with step N (its `max_tokens` or `max_model_len` reached, or
  a prompt-only request whose prompt is done) is not planned again: its id is in the returned
  set, which `Scheduler.schedule` skips. A request that ends on a stop token or EOS sampled in
  step N cannot be known ahead: it runs one more decode in step N+1, whose token is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from sits.core.plan import PLACEHOLDER_TOKEN_ID, StepPlan
from sits.core.request import Request, RequestStatus


def advance_ahead(
    requests: Mapping[str, Request],
    plan: StepPlan,
    max_model_len: int,
    cache_full_blocks: Callable[[Request, int], None],
) -> set[str]:
    """Apply a launched step to its running requests without its sampled tokens.

    Args:
        requests: the scheduler's unfinished requests by id.
        plan: the step on the device.
        max_model_len: the engine's context limit (tokens).
        cache_full_blocks: `KVCacheManager.cache_full_blocks`: the blocks the step fills enter
            the prefix cache now (their tokens are known; a later step that reads them runs
            after this one on the device), so the next plan can reuse them (e.g. the samples
            of an n > 1 request, admitted once their leader's prompt is computed).

    Returns:
        Ids of the requests that end with this step whatever it samples (length limits, or a
        prompt-only request's last prompt chunk): they must not be scheduled again.
    """
    done: set[str] = set()
    for scheduled in plan.scheduled:
        request = requests.get(scheduled.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            continue
        request.num_computed_tokens += len(scheduled.token_ids)
        cache_full_blocks(request, request.num_computed_tokens)
        if scheduled.sample:
            request.append_output_token(PLACEHOLDER_TOKEN_ID)
            if (
                request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= max_model_len
            ):
                done.add(request.request_id)
        elif request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
            done.add(request.request_id)
    return done


def resolve_placeholder(request: Request, token_id: int) -> None:
    """Replace the request's newest output token, a placeholder, with the sampled token."""
    assert request.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID, request
    request.output_token_ids[-1] = token_id
    request.all_token_ids[-1] = token_id
