"""Turns one user request into the engine requests of its n samples.

Sample i of request R runs as engine request "R" when n == 1, else "R-i". Each sample gets
n=1 and, when seeded, the seed `seed + i` (so n samples differ but repeat exactly for the same
seed). Samples 1..n-1 name sample 0 as their prefix leader so they reuse its cached prompt
blocks. EOS ids beyond the tokenizer's (from generation_config) become stop token ids unless
`ignore_eos`.
"""

from __future__ import annotations

import dataclasses
import time

from sits.core.limits import resolve_limits
from sits.core.request import Request
from sits.core.sampling_params import SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Engine request ids of a user request's samples."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def make_engine_requests(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    enable_prefix_caching: bool,
    arrival_time: float | None = None,
    tenant_id: str = "default",
    priority: int = 0,
    cache_salt: str | None = None,
    start_deadline_s: float | None = None,
) -> list[Request]:
    """Build the engine requests of one user request (one per sample); `start_deadline_s`
    (time.monotonic()) drops those not started by then (`Request.start_deadline_s`).

    Each carries one resolved `max_tokens`: `params.max_tokens` as given (the server resolved
    it), or, when None (the offline API's "fill the context"), what `resolve_limits` leaves
    after the prompt. The limits are checked once, when the scheduler queues the request.

    Raises:
        InvalidParameterError, PromptTooLongError: max_tokens is None and the prompt is empty
            or leaves no room in `max_model_len` (`resolve_limits`).
    """
    arrival = time.monotonic() if arrival_time is None else arrival_time
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = resolve_limits(len(prompt_token_ids), None, max_model_len).max_tokens
    eos = eos_token_ids[0] if eos_token_ids else None
    extra_stop_ids = [] if params.ignore_eos else [t for t in eos_token_ids[1:]]
    ids = child_request_ids(request_id, params.n)
    requests = []
    for i, child_id in enumerate(ids):
        child_params = dataclasses.replace(
            params,
            n=1,
            seed=None if params.seed is None else params.seed + i,
            stop_token_ids=params.stop_token_ids
            + [t for t in extra_stop_ids if t not in params.stop_token_ids],
            prompt_logprobs=params.prompt_logprobs if i == 0 else None,
        )
        leader = ids[0] if i > 0 and enable_prefix_caching else None
        requests.append(
            Request(
                request_id=child_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=child_params,
                eos_token_id=eos,
                arrival_time=arrival,
                max_tokens=max_tokens,
                cache_salt=cache_salt,
                tenant_id=tenant_id,
                priority=priority,
                prefix_leader_id=leader,
                start_deadline_s=start_deadline_s,
            )
        )
    return requests
