"""`Request`: the engine's mutable state of one sequence, and its status and finish reasons.

Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
`num_computed_tokens <= num_tokens`; a request whose computed tokens equal its total tokens is
ready to sample its next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum

from sits.core.sampling_params import SamplingParams


class FinishReason(StrEnum):
    """Why a request ended; the values are the OpenAI `finish_reason` strings."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the engine failed while serving it


# `stop_reason` of a request the engine dropped because it had not started by its
# `start_deadline_s` (finish_reason ABORT, no tokens): the server answers it with a 503.
START_DEADLINE_MISSED = "start_deadline_missed"


class RequestStatus(Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # queued, never scheduled or preempted (its KV blocks are freed)
    RUNNING = "running"  # holds KV blocks and is scheduled step by step
    FINISHED = "finished"  # done; its blocks are freed


@dataclass(slots=True)
class Request:
    """One engine request (one sample of a user request).

    Attributes:
        request_id: unique engine id.
        prompt_token_ids: the prompt.
        sampling_params: how to sample and when to stop.
        eos_token_id: the model's EOS id, or None.
        arrival_time: time.monotonic() seconds when it reached the engine.
        max_tokens: resolved limit on output tokens (sampling_params.max_tokens or what fits).
        cache_salt: namespace mixed into prefix-cache block hashes (tenant isolation).
        tenant_id: the tenant it belongs to.
        priority: lower runs first.
        prefix_leader_id: for samples 1..n-1 of an n>1 request, the id of sample 0: they wait
            until its prompt is computed, then reuse its cached prompt blocks.
        start_deadline_s: time.monotonic() seconds by which its computation must have
            started; a request still waiting untouched then is dropped (finish ABORT,
            stop_reason `START_DEADLINE_MISSED`) instead of being started. None: no deadline.
        output_token_ids: generated tokens.
        num_computed_tokens: tokens whose KV is in the cache.
        num_cached_tokens: prompt tokens found in the prefix cache when first scheduled.
        num_preemptions: how often it was preempted.
        status: waiting, running or finished.
        finish_reason, stop_reason: why it ended.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    max_tokens: int
    cache_salt: str | None = None
    tenant_id: str = "default"
    priority: int = 0
    prefix_leader_id: str | None = None
    start_deadline_s: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
