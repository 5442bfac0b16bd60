"""L8 admission: per-tenant rate limits, overload states and the circuit breaker.

Pure Python with an injected clock; imports no engine, runner, model or server code.
"""

from sits.admission.controller import (
    AdmissionController,
    Clock,
    FakeClock,
    SystemClock,
    TenantAdmissionStats,
)
from sits.admission.decision import (
    AdmissionDecision,
    AdmissionTicket,
    RateLimitSnapshot,
    RejectReason,
)
from sits.admission.headers import format_reset, ratelimit_headers, retry_after_headers
from sits.admission.overload import (
    OVERLOAD_HEADER,
    BreakerConfig,
    BreakerDecision,
    BreakerState,
    CircuitBreaker,
    OverloadAction,
    OverloadDecision,
    OverloadMonitor,
    OverloadPolicy,
    OverloadSignals,
    OverloadState,
    OverloadThresholds,
)
from sits.admission.token_bucket import TokenBucket

__all__ = [
    "OVERLOAD_HEADER",
    "AdmissionController",
    "AdmissionDecision",
    "AdmissionTicket",
    "BreakerConfig",
    "BreakerDecision",
    "BreakerState",
    "CircuitBreaker",
    "Clock",
    "FakeClock",
    "OverloadAction",
    "OverloadDecision",
    "OverloadMonitor",
    "OverloadPolicy",
    "OverloadSignals",
    "OverloadState",
    "OverloadThresholds",
    "RateLimitSnapshot",
    "RejectReason",
    "SystemClock",
    "TenantAdmissionStats",
    "TokenBucket",
    "format_reset",
    "ratelimit_headers",
    "retry_after_headers",
]
