"""The timings of the server's most recent engine requests, kept in a bounded ring buffer.

`RequestRecorder` (`sits.obs.server_metrics`) adds one `RequestTimeline` when an engine request
ends (finished or aborted), from the timestamps the engine put on its outputs
(`RequestMetrics`, time.monotonic() seconds). The dashboard draws them as timelines (queue,
prefill chunks, decode); `latency_summary` gives their latency percentiles, shown by the
dashboard and sent to the fleet router in heartbeats (`sits.server.registration`).
Invariants: at most `max_requests` entries (the oldest go first); appended and read on the
event loop's thread only, so no lock is needed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_REQUESTS = 256


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    """One ended engine request (all its samples).

    Attributes:
        request_id: engine request id; its samples ran as `child_request_ids(request_id, n)`.
        tenant_id: its tenant.
        num_samples: n.
        arrival_s: when it reached the engine front end (time.monotonic()).
        first_scheduled_s: when the scheduler first gave it tokens (end of the queue); None if
            never scheduled.
        first_token_s: when its first token was produced (end of the prefill); None if none.
        last_token_s: when its latest token was produced; None if none.
        finished_s: when it ended (for an abort: when the server saw it end).
        num_prompt_tokens: prompt tokens.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_output_tokens: tokens generated, all samples together.
        tpot_s: mean time per output token after the first, over its samples with more than
            one token; None when none has.
        finish_reason: the first sample's finish reason ("stop", "length", "abort", ...).
    """

    request_id: str
    tenant_id: str
    num_samples: int
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    last_token_s: float | None
    finished_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    tpot_s: float | None
    finish_reason: str

    @property
    def queue_s(self) -> float | None:
        """Seconds from arrival to first scheduling (None if never scheduled)."""
        if self.first_scheduled_s is None:
            return None
        return max(self.first_scheduled_s - self.arrival_s, 0.0)

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first token (None without a token)."""
        if self.first_token_s is None:
            return None
        return max(self.first_token_s - self.arrival_s, 0.0)

    @property
    def e2e_s(self) -> float:
        """Seconds from arrival to the end."""
        return max(self.finished_s - self.arrival_s, 0.0)


class TimelineBuffer:
    """The last `max_requests` request timelines, oldest first.

    Args:
        max_requests: capacity (>= 1).
    """

    def __init__(self, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        assert max_requests >= 1
        self._items: deque[RequestTimeline] = deque(maxlen=max_requests)
        self.num_added = 0

    def add(self, timeline: RequestTimeline) -> None:
        """Append one ended request (dropping the oldest when full)."""
        self._items.append(timeline)
        self.num_added += 1

    def recent(self) -> list[RequestTimeline]:
        """The kept timelines, oldest first."""
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)


def percentiles(values: Iterable[float], qs: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles (the smallest value with at least q % of the values at or
    below it); {} for no values.

    Returns:
        {"p50": ..., "p90": ..., "p99": ...} for the default `qs`.
    """
    ordered = sorted(values)
    if not ordered:
        return {}
    out = {}
    for q in qs:
        rank = max(math.ceil(q / 100 * len(ordered)), 1)
        out[f"p{q:g}"] = ordered[rank - 1]
    return out


def latency_summary(timelines: Sequence[RequestTimeline]) -> dict[str, Any]:
    """p50/p90/p99 (`percentiles`) of TTFT, TPOT, E2E and queue time, seconds, over the
    requests of `timelines` that were not aborted.

    Returns:
        {"num_requests": N, "ttft_s": {...}, "tpot_s": {...}, "e2e_s": {...}, "queue_s": {...}},
        each inner dict {} when no request has that figure.
    """
    done = [t for t in timelines if t.finish_reason != "abort"]
    return {
        "num_requests": len(done),
        "ttft_s": percentiles(t.ttft_s for t in done if t.ttft_s is not None),
        "tpot_s": percentiles(t.tpot_s for t in done if t.tpot_s is not None),
        "e2e_s": percentiles(t.e2e_s for t in done),
        "queue_s": percentiles(t.queue_s for t in done if t.queue_s is not None),
    }
