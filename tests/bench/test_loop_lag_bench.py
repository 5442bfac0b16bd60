"""sits.bench.loop_lag: reading the server's event-loop lag histogram from /metrics."""

from __future__ import annotations

import pytest

from sits.bench import loop_lag as bench


def _metrics(total_s: float, count: int, le_01: int) -> str:
    return "\n".join(
        [
            "# TYPE sits:event_loop_lag_seconds histogram",
            f'sits:event_loop_lag_seconds_bucket{{le="0.05",model_name="m"}} {le_01 - 1}.0',
            f'sits:event_loop_lag_seconds_bucket{{le="0.1",model_name="m"}} {le_01}.0',
            f'sits:event_loop_lag_seconds_bucket{{le="+Inf",model_name="m"}} {count}.0',
            f'sits:event_loop_lag_seconds_count{{model_name="m"}} {count}.0',
            f'sits:event_loop_lag_seconds_sum{{model_name="m"}} {total_s}',
            'sits:num_requests_running{model_name="m"} 3.0',
        ]
    )


def test_lag_between_two_scrapes() -> None:
    before = bench.lag_counts(_metrics(0.5, 100, 99))
    assert before == {"sum": 0.5, "count": 100.0, "le_0.1": 99.0}
    after = bench.lag_counts(_metrics(2.5, 140, 129))  # 40 samples, 10 over 100 ms, 2 s
    summary = bench.lag_summary(before, after)
    assert summary["samples"] == 40
    assert summary["mean_ms"] == pytest.approx(50.0)
    assert summary["over_100ms_pct"] == pytest.approx(25.0)
    assert bench.lag_summary(before, before) == {
        "mean_ms": 0.0,
        "over_100ms_pct": 0.0,
        "samples": 0.0,
    }
