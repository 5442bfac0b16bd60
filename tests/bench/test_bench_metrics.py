"""Metrics math on synthetic records: percentiles, TPOT, SLO flags, attainment and goodput."""

from __future__ import annotations

import pytest

from sits.bench.metrics import Distribution, percentile, slo_flags, summarize, summarize_by_tenant
from sits.bench.records import RequestRecord


def test_percentile_interpolates_linearly_between_closest_ranks() -> None:
    values = [300.0, 100.0, 200.0, 50.0]  # sorted: 50, 100, 200, 300
    assert percentile(values, 0) == 50.0
    assert percentile(values, 50) == 150.0  # rank 1.5
    assert percentile(values, 90) == pytest.approx(270.0, abs=1e-9)  # rank 2.7
    assert percentile(values, 99) == pytest.approx(297.0, abs=1e-9)  # rank 2.97
    assert percentile(values, 100) == 300.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_reports_milliseconds_and_empty_is_none() -> None:
    d = Distribution.of_seconds([0.5, 0.25, 0.125, 1.0])
    assert (d.mean, d.p50, d.count) == (468.75, 375.0, 4)
    empty = Distribution.of_seconds([])
    assert (empty.mean, empty.p50, empty.p90, empty.p99, empty.count) == (None,) * 4 + (0,)


def _ok(index: int, ttft_s: float, e2e_s: float, out: int, itl: list[float], **kw) -> RequestRecord:
    r = RequestRecord(index=index, tenant=kw.pop("tenant", "a"), arrival_s=0.0, input_len=16,
                      output_len=8, slo_ttft_ms=200.0, slo_tpot_ms=150.0, **kw)  # fmt: skip
    r.ok, r.status, r.ttft_s, r.e2e_s, r.output_tokens = True, 200, ttft_s, e2e_s, out
    r.itl_s = list(itl)
    r.num_chunks = len(itl) + 1
    return r


def _failed(index: int, status: int | None, tenant: str = "b") -> RequestRecord:
    r = RequestRecord(index=index, tenant=tenant, arrival_s=0.0, input_len=16, output_len=8,
                      slo_ttft_ms=200.0, slo_tpot_ms=150.0)  # fmt: skip
    r.status, r.error, r.e2e_s = status, "refused", 0.01
    return r


def _records() -> list[RequestRecord]:
    return [
        _ok(0, 0.1, 0.5, 5, [0.1] * 4, prompt_tokens=10),  # TPOT 0.1: meets both
        _ok(1, 0.3, 0.5, 3, [0.1] * 2, prompt_tokens=10),  # TTFT 300 > 200: meets TPOT only
        _ok(2, 0.2, 0.2, 1, [], prompt_tokens=10),  # TTFT == SLO; no TPOT: meets both
        _ok(3, 0.05, 1.05, 3, [0.5] * 2, tenant="b"),  # TPOT 0.5: meets TTFT only
        _failed(4, 429),
        _failed(5, 503),
        _failed(6, None),
    ]


def test_tpot_is_decode_time_over_output_tokens_after_the_first() -> None:
    records = _records()
    assert records[0].tpot_s == pytest.approx(0.1)  # (0.5 - 0.1) / 4
    assert records[1].tpot_s == pytest.approx(0.1)  # (0.5 - 0.3) / 2
    assert records[2].tpot_s is None  # one output token
    assert records[3].tpot_s == pytest.approx(0.5)
    assert records[4].tpot_s is None  # failed
    flags = [slo_flags(r) for r in records]
    assert [(f.ttft, f.tpot, f.both) for f in flags] == [
        (True, True, True), (False, True, False), (True, True, True), (True, False, False),
        (False, False, False), (False, False, False), (False, False, False),
    ]  # fmt: skip


def test_summary_counts_throughput_latencies_attainment_and_goodput() -> None:
    s = summarize(_records(), duration_s=2.0)
    assert (s.num_requests, s.completed, s.failed) == (7, 4, 3)
    assert (s.failed_429, s.failed_503, s.failed_other) == (1, 1, 1)
    # Input: usage prompt tokens (10 x 3) plus the asked length where usage gave none (16).
    assert (s.total_input_tokens, s.total_output_tokens) == (46, 12)
    assert (s.request_throughput, s.output_throughput, s.total_token_throughput) == (2.0, 6.0, 29.0)
    ttft = s.ttft_ms  # 50, 100, 200, 300
    assert (ttft.mean, ttft.p50, ttft.count) == (pytest.approx(162.5), pytest.approx(150.0), 4)
    assert (ttft.p90, ttft.p99) == (pytest.approx(270.0), pytest.approx(297.0))
    tpot = s.tpot_ms  # 100, 100, 500
    assert (tpot.mean, tpot.p50) == (pytest.approx(700 / 3), pytest.approx(100.0))
    assert (tpot.p90, tpot.p99, tpot.count) == (pytest.approx(420.0), pytest.approx(492.0), 3)
    itl = s.itl_ms  # six gaps of 100, two of 500
    assert (itl.mean, itl.p50, itl.p90, itl.p99, itl.count) == (
        pytest.approx(200.0),
        pytest.approx(100.0),
        pytest.approx(500.0),
        pytest.approx(500.0),
        8,
    )
    e2e = s.e2e_ms  # 200, 500, 500, 1050
    assert (e2e.mean, e2e.p50) == (pytest.approx(562.5), pytest.approx(500.0))
    assert (e2e.p90, e2e.p99) == (pytest.approx(885.0), pytest.approx(1033.5))
    assert (s.num_met_ttft, s.num_met_tpot, s.num_met_slo) == (3, 3, 2)
    assert s.ttft_attainment_pct == pytest.approx(300 / 7)
    assert s.tpot_attainment_pct == pytest.approx(300 / 7)
    assert s.slo_attainment_pct == pytest.approx(200 / 7)
    assert s.goodput == 1.0  # two requests met both SLOs in 2 s


def test_per_tenant_summaries_split_the_records_and_share_the_duration() -> None:
    by_tenant = summarize_by_tenant(_records(), 2.0, ["a", "b", "idle"])
    a, b, idle = by_tenant["a"], by_tenant["b"], by_tenant["idle"]
    assert (a.num_requests, a.completed, a.num_met_slo, a.goodput) == (3, 3, 2, 1.0)
    assert a.slo_attainment_pct == pytest.approx(200 / 3)
    assert (b.num_requests, b.completed, b.failed_429, b.failed_503, b.failed_other) == (
        4,
        1,
        1,
        1,
        1,
    )
    assert (b.ttft_attainment_pct, b.tpot_attainment_pct, b.slo_attainment_pct) == (25.0, 0.0, 0.0)
    assert (idle.num_requests, idle.slo_attainment_pct, idle.goodput) == (0, None, None)


def test_without_slos_attainment_and_goodput_are_none() -> None:
    records = _records()
    for r in records:
        r.slo_ttft_ms = r.slo_tpot_ms = None
    s = summarize(records, 1.0)
    assert (s.ttft_attainment_pct, s.tpot_attainment_pct, s.slo_attainment_pct) == (None,) * 3
    assert s.goodput is None and s.num_met_slo == 4  # every success meets absent SLOs
    only_ttft = _records()
    for r in only_ttft:
        r.slo_tpot_ms = None
    s = summarize(only_ttft, 1.0)
    assert (s.ttft_attainment_pct, s.tpot_attainment_pct) == (pytest.approx(300 / 7), None)
    assert (s.num_met_slo, s.goodput) == (3, 3.0)
    with pytest.raises(ValueError):
        summarize(records, 0.0)


def test_record_json_is_in_milliseconds() -> None:
    doc = _records()[0].to_json()
    assert (doc["ttft_ms"], doc["tpot_ms"], doc["e2e_ms"], doc["itl_ms"]) == (
        100.0, 100.0, 500.0, [100.0] * 4
    )  # fmt: skip
    assert (doc["ok"], doc["status"], doc["output_tokens"], doc["num_chunks"]) == (True, 200, 5, 5)
