"""Who sends what and when: client tenants and their seeded arrival schedules.

A run is a list of `ScheduledRequest`s in arrival order. Each tenant has its own arrival
process; the processes are merged by time (ties keep tenant order), so tenants interleave as
independent clients would.

Arrival process (as vLLM's serving benchmark): the first request of each process is sent at
t = 0, then gaps are drawn i.i.d.:
- burstiness 1 (Poisson): gap = -ln(1 - u) / rate with u = `random.Random(seed).random()`
  (inverse-CDF sampling of the exponential distribution; exactly reproducible for a seed,
  since `random()` is the Mersenne Twister, stable across Python versions);
- burstiness b != 1: gamma gaps with shape b and scale 1 / (rate * b) (mean 1 / rate; b < 1
  burstier, b > 1 more regular), from `random.Random.gammavariate`;
- rate = inf: every request at t = 0.
Tenant i of a run draws from `random.Random(seed + i)`, so adding a tenant at the end leaves
the others' schedules unchanged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from sits.core.errors import InvalidParameterError

DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One client tenant: its key, arrival process, request shape and SLOs.

    Attributes:
        name: label in the report (need not match the server's tenant id).
        api_key: sent as `Authorization: Bearer KEY`; None sends no header.
        request_rate: mean requests per second; `math.inf` sends all at once.
        num_prompts: requests to send; used when `duration_s` is None.
        duration_s: send requests for this many seconds instead of a fixed count.
        input_len: prompt length in tokens (> 0).
        output_len: `max_tokens` of each request (> 0).
        ttft_ms, tpot_ms: SLOs in milliseconds; None = none.
        burstiness: gamma shape of the gaps; 1 = Poisson.

    Raises:
        InvalidParameterError: a field out of range (`param` names it).
    """

    name: str = DEFAULT_TENANT
    api_key: str | None = None
    request_rate: float = math.inf
    num_prompts: int | None = 1000
    duration_s: float | None = None
    input_len: int = 1024
    output_len: int = 128
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidParameterError("name", "a tenant needs a non-empty name")
        if not (self.request_rate > 0 and not math.isnan(self.request_rate)):
            raise InvalidParameterError(
                "request_rate", f"request_rate must be > 0 or inf, got {self.request_rate}"
            )
        if self.duration_s is None:
            if self.num_prompts is None or self.num_prompts < 1:
                raise InvalidParameterError(
                    "num_prompts", f"num_prompts must be >= 1, got {self.num_prompts}"
                )
        elif not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise InvalidParameterError(
                "duration_s", f"duration_s must be > 0, got {self.duration_s}"
            )
        elif math.isinf(self.request_rate):
            raise InvalidParameterError(
                "duration_s", "duration_s needs a finite request_rate (inf sends all at t=0)"
            )
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidParameterError(name, f"{name} must be > 0, got {value}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise InvalidParameterError(
                "burstiness", f"burstiness must be > 0, got {self.burstiness}"
            )


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a run: when it is sent and for whom.

    Attributes:
        index: position in the merged schedule (0-based).
        tenant_index: position of its tenant in the run's tenant list.
        arrival_s: send time, seconds after the run's start.
    """

    index: int
    tenant_index: int
    arrival_s: float


def arrival_times(
    rate: float,
    seed: int,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    burstiness: float = 1.0,
) -> list[float]:
    """Send times (seconds from the start) of one arrival process; see the module docstring.

    Args:
        rate: mean requests per second (> 0, or inf).
        seed: seeds this process's `random.Random`.
        num_requests: how many times to draw (exclusive with `duration_s`).
        duration_s: draw until the next time would be >= `duration_s`.
        burstiness: gamma shape; 1 gives exponential (Poisson) gaps.

    Raises:
        InvalidParameterError: neither or both of `num_requests` and `duration_s`, or
            `duration_s` with an infinite rate.
    """
    if (num_requests is None) == (duration_s is None):
        raise InvalidParameterError("num_prompts", "give exactly one of num_prompts, duration_s")
    if math.isinf(rate):
        if num_requests is None:
            raise InvalidParameterError("duration_s", "duration_s needs a finite request_rate")
        return [0.0] * num_requests
    rng = random.Random(seed)
    times: list[float] = []
    now = 0.0
    while True:
        if num_requests is not None and len(times) == num_requests:
            return times
        if duration_s is not None and now >= duration_s:
            return times
        times.append(now)
        if burstiness == 1.0:
            gap = -math.log(1.0 - rng.random()) / rate
        else:
            gap = rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        now += gap


def build_schedule(tenants: Sequence[TenantLoad], seed: int) -> list[ScheduledRequest]:
    """Merge every tenant's arrival process into one schedule ordered by send time.

    Tenant i uses seed `seed + i`; equal times keep tenant order, then each tenant's order.
    """
    timed: list[tuple[float, int, int]] = []
    for tenant_index, tenant in enumerate(tenants):
        times = arrival_times(
            tenant.request_rate,
            seed + tenant_index,
            num_requests=tenant.num_prompts if tenant.duration_s is None else None,
            duration_s=tenant.duration_s,
            burstiness=tenant.burstiness,
        )
        timed.extend((t, tenant_index, k) for k, t in enumerate(times))
    timed.sort()
    return [
        ScheduledRequest(index=i, tenant_index=tenant_index, arrival_s=t)
        for i, (t, tenant_index, _) in enumerate(timed)
    ]
