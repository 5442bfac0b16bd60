"""The serve benchmark's per-tenant table: its TTFT-outside-the-server column."""

from __future__ import annotations

from sits.bench.report import format_tenants, outside_server_p99_ms


def _summary() -> dict:
    lat = {"p50": 1.0, "p99": 2.0}
    return {"num_requests": 2, "completed": 2, "failed_429": 0, "failed_503": 0,
            "failed_other": 0, "ttft_attainment_pct": 100.0, "tpot_attainment_pct": 100.0,
            "slo_attainment_pct": 100.0, "goodput": 1.0, "output_throughput": 10.0,
            "ttft_ms": lat, "tpot_ms": lat}  # fmt: skip


def test_p99_of_ttft_minus_processing_time() -> None:
    requests = [{"ttft_ms": 100.0 + i, "processing_ms": 90.0} for i in range(100)]
    requests.append({"ttft_ms": None, "processing_ms": None})  # a failed request: left out
    assert outside_server_p99_ms(requests) == 109.0  # gaps 10..109; nearest rank 99 of 100
    assert outside_server_p99_ms([{"ttft_ms": 5.0, "processing_ms": None}]) is None


def test_each_tenant_row_has_its_own_requests_p99() -> None:
    doc = {
        "tenants": [
            {"name": "gold", "summary": _summary()},
            {"name": "bulk", "summary": _summary()},
        ],
        "totals": _summary(),
        "requests": [
            {"tenant": "gold", "ttft_ms": 120.0, "processing_ms": 100.0},
            {"tenant": "bulk", "ttft_ms": 1500.0, "processing_ms": 100.0},
        ],
    }
    lines = format_tenants(doc)
    assert lines[1].rstrip().endswith("out p99")
    rows = {line.split()[0]: line.split()[-1] for line in lines[2:]}
    assert rows == {"gold": "20.0", "bulk": "1400.0", "TOTAL": "1400.0"}
