"""Latency evidence and the P99 TTFT predictor behind the router's fallback to another pool.

- `LatencyWindow`: samples (seconds) of the last `window_s` seconds, at most `max_samples` of
  them (the oldest go first); nearest-rank percentiles and the mean over the samples still
  inside the window.
- `predict_ttft_p99_s`: a replica's recent P99 TTFT scaled by its queue (Little's law, below).
- `fallback_needed`: send a request to the fallback pool when every primary replica is
  predicted over the limit (the seeds' "route away when the predicted P99 exceeds 800 ms").
Time comes from the injected clock only; not thread-safe (the router uses it from one loop).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from sits.admission import Clock
from sits.core.errors import InvalidParameterError
from sits.core.fleet import ReplicaLoad


class LatencyWindow:
    """A sliding window of samples in seconds (latencies, or 0/1 outcomes for a rate).

    A sample stays while its age is < `window_s`; at most `max_samples` are kept.

    Args:
        clock: time source (`monotonic()` seconds).
        window_s: the window's length, seconds, > 0.
        max_samples: the most samples kept, >= 1.

    Raises:
        InvalidParameterError: `window_s` <= 0 or `max_samples` < 1.
    """

    __slots__ = ("_clock", "_samples", "max_samples", "window_s")

    def __init__(self, clock: Clock, window_s: float = 60.0, max_samples: int = 1000) -> None:
        if not window_s > 0:
            raise InvalidParameterError("window_s", f"must be > 0: {window_s}")
        if max_samples < 1:
            raise InvalidParameterError("max_samples", f"must be >= 1: {max_samples}")
        self._clock = clock
        self.window_s = float(window_s)
        self.max_samples = int(max_samples)
        self._samples: deque[tuple[float, float]] = deque(maxlen=self.max_samples)

    def add(self, value_s: float) -> None:
        """Add one sample, stamped with the clock's time now.

        Raises:
            InvalidParameterError: `value_s` is negative or not finite.
        """
        if not (math.isfinite(value_s) and value_s >= 0):
            raise InvalidParameterError("value_s", f"must be a finite number >= 0: {value_s}")
        self._samples.append((self._clock.monotonic(), float(value_s)))

    def count(self) -> int:
        """How many samples are inside the window now."""
        self._prune()
        return len(self._samples)

    def values(self) -> list[float]:
        """The samples inside the window now, oldest first."""
        self._prune()
        return [value for _, value in self._samples]

    def percentile(self, q: float) -> float | None:
        """The nearest-rank `q`-th percentile (q in percent, (0, 100]) of the window now: the
        smallest sample with at least q % of the samples at or below it; None when empty.

        Raises:
            InvalidParameterError: `q` outside (0, 100].
        """
        if not 0 < q <= 100:
            raise InvalidParameterError("q", f"must be in (0, 100]: {q}")
        ordered = sorted(self.values())
        if not ordered:
            return None
        rank = max(math.ceil(q * len(ordered) / 100 - 1e-9), 1)
        return ordered[rank - 1]

    def mean(self) -> float | None:
        """The mean of the window's samples now (an error rate for 0/1 samples); None when
        empty."""
        values = self.values()
        return sum(values) / len(values) if values else None

    def clear(self) -> None:
        """Forget every sample."""
        self._samples.clear()

    def _prune(self) -> None:
        horizon_s = self._clock.monotonic() - self.window_s
        while self._samples and self._samples[0][0] <= horizon_s:
            self._samples.popleft()


def predict_ttft_p99_s(
    observed: LatencyWindow, load: ReplicaLoad, inflight: int, min_samples: int = 5
) -> float | None:
    """Predict a replica's P99 time to first token, seconds, for a request sent now.

    The base is the replica's recent P99 TTFT: the router's own observations (`observed`) when
    it holds at least `min_samples`, else the heartbeat's `load.ttft_p99_s`, else whatever the
    router observed (fewer samples). It is scaled by the queue:

        predicted = p99 * (1 + num_waiting / max(1, num_running + inflight))

    Source: Little's law, L = lambda * W (Little 1961). At a fixed service rate lambda, the time
    a request spends queued grows in proportion to the queue ahead of it, so a replica with
    `num_waiting` requests queued behind a batch of `num_running + inflight` needs about
    `num_waiting / (num_running + inflight)` more batch turns before a new request's first
    token than the recent P99 already reflects. This is the predictor behind the seeds'
    "route away when the predicted P99 exceeds 800 ms".

    Args:
        observed: TTFTs the router measured on this replica, seconds.
        load: the replica's last heartbeat load (a static replica's is all zeros and None).
        inflight: requests the router has sent to it and not yet seen finish, >= 0.
        min_samples: observations needed to prefer them over the heartbeat's figure, >= 1.

    Returns:
        The prediction in seconds, or None when there is no latency evidence at all.

    Raises:
        InvalidParameterError: `inflight` < 0 or `min_samples` < 1.
    """
    if inflight < 0:
        raise InvalidParameterError("inflight", f"must be >= 0: {inflight}")
    if min_samples < 1:
        raise InvalidParameterError("min_samples", f"must be >= 1: {min_samples}")
    count = observed.count()
    if count >= min_samples or (load.ttft_p99_s is None and count > 0):
        base_s = observed.percentile(99)
    else:
        base_s = load.ttft_p99_s
    if base_s is None:
        return None
    return base_s * (1 + load.num_waiting / max(1, load.num_running + inflight))


def fallback_needed(predictions: Sequence[float | None], limit_s: float) -> bool:
    """Should the request go to the fallback pool?

    True when every primary candidate's prediction is known and > `limit_s`; an unknown (None)
    prediction counts as under the limit. With no primary candidate at all (empty
    `predictions`) it is True: nothing in the primary pool can serve within the limit.

    Args:
        predictions: `predict_ttft_p99_s` of each primary candidate, seconds or None.
        limit_s: the tenant's TTFT target (or `--fallback-p99-ms`), seconds, > 0.

    Raises:
        InvalidParameterError: `limit_s` <= 0.
    """
    if not limit_s > 0:
        raise InvalidParameterError("limit_s", f"must be > 0: {limit_s}")
    return all(p is not None and p > limit_s for p in predictions)
