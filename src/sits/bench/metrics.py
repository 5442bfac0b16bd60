"""Metrics of a serving run from its request records: percentiles, SLO attainment, goodput.

Definitions (the ones vLLM's `benchmark_serving` uses, made explicit):
- percentiles interpolate linearly between the closest ranks (numpy's default "linear"):
  rank = p / 100 * (n - 1);
- TTFT, TPOT, E2E and ITL statistics cover successful requests only; ITL pools every gap;
- a request meets its TTFT SLO when it succeeded, produced a first token, and TTFT <= SLO; it
  meets its TPOT SLO when it succeeded and TPOT <= SLO (a request with one output token has no
  TPOT and meets it); a missing SLO is always met by a successful request;
- attainment (%) = requests meeting the SLO / requests sent, failures included (a shed or
  rate-limited request missed its promise); goodput = requests meeting both SLOs / duration;
- throughputs divide the successful requests' counts by the run's duration (every tenant runs
  during the whole run, so per-tenant figures use the same duration).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sits.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], pct: float) -> float:
    """The `pct`-th percentile of `values` with linear interpolation between closest ranks.

    Raises:
        ValueError: `values` is empty or `pct` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= pct <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {pct}")
    ordered = sorted(values)
    rank = pct / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds (all None without samples)."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    count: int

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Distribution:
        """Statistics of latencies given in seconds, reported in milliseconds."""
        if not values_s:
            return cls(None, None, None, None, 0)
        values_ms = [v * 1000.0 for v in values_s]
        p50, p90, p99 = (percentile(values_ms, p) for p in PERCENTILES)
        return cls(math.fsum(values_ms) / len(values_ms), p50, p90, p99, len(values_ms))


@dataclass(frozen=True, slots=True)
class SloFlags:
    """Which SLOs one request met."""

    ttft: bool
    tpot: bool

    @property
    def both(self) -> bool:
        """Met TTFT and TPOT."""
        return self.ttft and self.tpot


def slo_flags(record: RequestRecord) -> SloFlags:
    """Whether `record` met its own TTFT and TPOT SLOs (see the module docstring)."""
    if not record.ok:
        return SloFlags(False, False)
    ttft_ok = True
    if record.slo_ttft_ms is not None:
        ttft_ok = record.ttft_s is not None and record.ttft_s * 1000.0 <= record.slo_ttft_ms
    tpot_ok = True
    tpot = record.tpot_s
    if record.slo_tpot_ms is not None and tpot is not None:
        tpot_ok = tpot * 1000.0 <= record.slo_tpot_ms
    return SloFlags(ttft_ok, tpot_ok)


@dataclass(frozen=True, slots=True)
class Summary:
    """Aggregates of a set of requests over a run of `duration_s` seconds.

    Attributes:
        num_requests: requests sent; completed + failed.
        failed_429, failed_503: failures answered 429 (rate limited) and 503 (shed, overload);
            failed_other: every other failure (other statuses, broken streams, no response).
        request_throughput: completed requests per second.
        output_throughput: output tokens of completed requests per second.
        total_token_throughput: prompt + output tokens of completed requests per second.
        ttft_ms, tpot_ms, itl_ms, e2e_ms: latency statistics of completed requests.
        ttft_attainment_pct, tpot_attainment_pct, slo_attainment_pct: % of requests sent that
            met the TTFT SLO, the TPOT SLO, and both; None when no request had such an SLO.
        goodput: requests per second that met both SLOs; None when no request had an SLO.
    """

    num_requests: int
    completed: int
    failed: int
    failed_429: int
    failed_503: int
    failed_other: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    num_met_ttft: int
    num_met_tpot: int
    num_met_slo: int
    ttft_attainment_pct: float | None
    tpot_attainment_pct: float | None
    slo_attainment_pct: float | None
    goodput: float | None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (nested dicts for the distributions)."""
        return asdict(self)


def _pct(part: int, whole: int, wanted: bool) -> float | None:
    if not wanted:
        return None
    return 100.0 * part / whole if whole else 0.0


def summarize(records: Iterable[RequestRecord], duration_s: float) -> Summary:
    """Aggregate `records` (see the module docstring for every definition).

    Args:
        records: the requests to aggregate (a whole run or one tenant's part of it).
        duration_s: the run's wall time in seconds (> 0).

    Raises:
        ValueError: `duration_s` <= 0.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    records = list(records)
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    input_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done
    )
    output_tokens = sum(r.output_tokens for r in done)
    flags = [slo_flags(r) for r in records]
    has_ttft_slo = any(r.slo_ttft_ms is not None for r in records)
    has_tpot_slo = any(r.slo_tpot_ms is not None for r in records)
    num_met_slo = sum(f.both for f in flags)
    n = len(records)
    return Summary(
        num_requests=n,
        completed=len(done),
        failed=len(failed),
        failed_429=sum(r.status == 429 for r in failed),
        failed_503=sum(r.status == 503 for r in failed),
        failed_other=sum(r.status not in (429, 503) for r in failed),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft_ms=Distribution.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=Distribution.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=Distribution.of_seconds([gap for r in done for gap in r.itl_s]),
        e2e_ms=Distribution.of_seconds([r.e2e_s for r in done if r.e2e_s is not None]),
        num_met_ttft=sum(f.ttft for f in flags),
        num_met_tpot=sum(f.tpot for f in flags),
        num_met_slo=num_met_slo,
        ttft_attainment_pct=_pct(sum(f.ttft for f in flags), n, has_ttft_slo),
        tpot_attainment_pct=_pct(sum(f.tpot for f in flags), n, has_tpot_slo),
        slo_attainment_pct=_pct(num_met_slo, n, has_ttft_slo or has_tpot_slo),
        goodput=num_met_slo / duration_s if (has_ttft_slo or has_tpot_slo) else None,
    )


def summarize_by_tenant(
    records: Sequence[RequestRecord], duration_s: float, tenant_names: Sequence[str]
) -> dict[str, Summary]:
    """One `Summary` per tenant, in `tenant_names` order (a tenant without requests included)."""
    return {
        name: summarize([r for r in records if r.tenant == name], duration_s)
        for name in tenant_names
    }
