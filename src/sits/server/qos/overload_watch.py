"""The overload watcher: samples the engine's load on a timer and feeds the overload monitor.

Each tick (every `QosSettings.overload_poll_s`) reads `engine.stats()` and computes:
- queue_delay_s: how long the oldest counted waiting request has waited (time.monotonic());
- kv_usage: the used fraction of KV blocks, less the blocks tenants hold beyond their
  reservation (borrowed blocks are reclaimed on demand, so they are no pressure on anyone's
  promise; counting them would stop borrowing whenever borrowers fill idle memory);
- predicted_ttft_s: counted queued prefill tokens / the measured prefill rate, where the rate
  is an exponential moving average of (prefill tokens computed) / (seconds of the steps
  computing them) over the ticks in which representative prefill steps ran (steps of at
  least a quarter of the step budget: `sits.engine.stats`), starting from the warm-up's
  measured full-step rate; 0 while neither exists (no warm-up, only small prompts so far), so
  the state never turns red on an estimate that has not seen representative work;
- min_ttft_slo_s: the tightest TTFT SLO of the tenants (`TenantsConfig.min_ttft_ms`).
Counted work is that of guaranteed tenants (and of tenants not configured):
`ServerQos.counts_toward_load`. A burstable or best-effort tenant's backlog is bounded per
tenant at admission instead (`ServerQos.backlog_shed_reason`).
`ServerQos.observe` turns the signals into the state (green / yellow / red) and the engine's
borrowing tiers. An idle engine (nothing running, nothing waiting) is green at once, without
the hold time a calm signal otherwise needs. A tick that cannot read stats (dead engine)
changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from sits.admission import OverloadSignals, OverloadState
from sits.core.errors import InvalidParameterError
from sits.server.engine_client import EngineClient
from sits.server.qos.admit import ServerQos
from sits.tenancy import Tier

logger = logging.getLogger(__name__)


class PrefillRateEstimator:
    """EMA of the engine's prefill rate in tokens per second, from its cumulative counters.

    Args:
        alpha: weight of a new sample, in (0, 1].

    Raises:
        InvalidParameterError: alpha outside (0, 1].
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise InvalidParameterError("prefill_rate_alpha", f"must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.rate_tokens_per_s: float | None = None
        self._last: tuple[int, float] | None = None

    def update(
        self, num_prefill_tokens: int, prefill_busy_s: float, seed: float | None = None
    ) -> float | None:
        """Take the cumulative counters now; returns the rate (None until measured).

        A sample is (delta tokens) / (delta busy seconds) since the previous call, taken only
        when both grew; the first call only sets the baseline. `seed` (tokens per second,
        e.g. the warm-up's measurement) is the rate until a first sample, then the EMA's
        starting point.
        """
        if self.rate_tokens_per_s is None and seed:
            self.rate_tokens_per_s = seed
        last, self._last = self._last, (num_prefill_tokens, prefill_busy_s)
        if last is None:
            return self.rate_tokens_per_s
        num_tokens = num_prefill_tokens - last[0]
        busy_s = prefill_busy_s - last[1]
        if num_tokens > 0 and busy_s > 0:
            sample = num_tokens / busy_s
            old = self.rate_tokens_per_s
            self.rate_tokens_per_s = (
                sample if old is None else self.alpha * sample + (1 - self.alpha) * old
            )
        return self.rate_tokens_per_s


def overload_signals(
    stats: object,
    now_s: float,
    rate_tokens_per_s: float | None,
    min_ttft_ms: float | None,
    counted: Callable[[str], bool] | None = None,
) -> OverloadSignals:
    """The monitor's input from one engine stats snapshot (`AsyncLLM.EngineStats`).

    Args:
        stats: the snapshot; its per-tenant `waiting` loads are used when it has them (else
            its totals; fields missing on a test double count as 0), and its per-tenant
            borrowed blocks are taken off the KV usage.
        now_s: time.monotonic() now.
        rate_tokens_per_s: measured prefill rate, or None (no TTFT prediction yet).
        min_ttft_ms: the tightest tenant TTFT SLO, or None (TTFT signal off).
        counted: which tenant ids' queued work counts (None: all).
    """
    waiting = getattr(stats, "waiting", None)
    if waiting is None:
        oldest_s = getattr(stats, "oldest_waiting_arrival_s", None)
        queued = getattr(stats, "num_queued_prefill_tokens", 0)
    else:
        loads = [w for tid, w in waiting.items() if counted is None or counted(tid)]
        arrivals = [w.oldest_arrival_s for w in loads if w.oldest_arrival_s is not None]
        oldest_s = min(arrivals, default=None)
        queued = sum(w.num_prefill_tokens for w in loads)
    queue_delay_s = 0.0 if oldest_s is None else max(now_s - oldest_s, 0.0)
    predicted_s = queued / rate_tokens_per_s if rate_tokens_per_s else 0.0
    kv_usage = float(getattr(stats, "kv_cache_usage", 0.0))
    num_total_blocks = getattr(stats, "num_total_blocks", 0)
    tenants = getattr(stats, "tenants", None) or {}
    if num_total_blocks and tenants:
        borrowed = sum(t.blocks_borrowed for t in tenants.values())
        kv_usage = max(kv_usage - borrowed / num_total_blocks, 0.0)
    return OverloadSignals(
        queue_delay_s=queue_delay_s,
        kv_usage=kv_usage,
        predicted_ttft_s=predicted_s,
        min_ttft_slo_s=None if min_ttft_ms is None else min_ttft_ms / 1000.0,
    )


class OverloadWatcher:
    """Background task feeding `qos` from `engine` (see the module docstring).

    Attributes:
        last_signals: the latest measurement (None before the first tick).
        prefill: the prefill rate estimator.
    """

    def __init__(self, engine: EngineClient, qos: ServerQos) -> None:
        self.engine = engine
        self.qos = qos
        self.poll_s = qos.settings.overload_poll_s
        self.prefill = PrefillRateEstimator(qos.settings.prefill_rate_alpha)
        self.last_signals: OverloadSignals | None = None
        self._task: asyncio.Task[None] | None = None

    def tick(self, now_s: float | None = None) -> OverloadState | None:
        """Sample once; returns the state, or None when the engine has no stats."""
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - a dead engine: the lifecycle handles it
            return None
        rate = self.prefill.update(
            getattr(stats, "num_full_prefill_tokens", 0),
            getattr(stats, "full_prefill_busy_s", 0.0),
            getattr(stats, "prefill_rate_seed_tokens_per_s", None),
        )
        now_s = time.monotonic() if now_s is None else now_s
        signals = overload_signals(
            stats, now_s, rate, self.qos.tenants.min_ttft_ms, self.qos.counts_toward_load
        )
        self.last_signals = signals
        before = self.qos.overload_state
        idle = getattr(stats, "num_running", None) == 0 == getattr(stats, "num_waiting", None)
        state = self.qos.observe(signals, idle=idle)
        if state is not before:
            # Guaranteed tenants are never shed: with no other tier the state changes nothing.
            sheddable = any(t.tier is not Tier.GUARANTEED for t in self.qos.tenants.tenants)
            logger.log(
                logging.WARNING if sheddable else logging.INFO,
                "overload state %s -> %s (queue delay %.2f s, KV %.0f %%, predicted TTFT %.2f s)%s",
                before.value,
                state.value,
                signals.queue_delay_s,
                100 * signals.kv_usage,
                signals.predicted_ttft_s,
                "" if sheddable else ": every tenant is guaranteed, nothing is shed",
            )
        return state

    def snapshot(self) -> tuple[OverloadSignals | None, float | None]:
        """(last signals, prefill rate) for the metrics."""
        return self.last_signals, self.prefill.rate_tokens_per_s

    def start(self) -> None:
        """Start ticking (call from the running event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - keep watching; never kill the server
                logger.exception("overload check failed")

    async def stop(self) -> None:
        """Stop ticking."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
