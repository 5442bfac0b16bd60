"""`sits.bench.sender.LoopLagProbe` and `lag_summary` (the client's own event-loop lag), and the
client-process count of a run's config."""

from __future__ import annotations

import asyncio
import time

import pytest

from sits.bench.sender import LoopLagProbe, lag_summary


def test_a_blocked_loop_shows_as_lag_at_least_as_long_as_the_block() -> None:
    async def run() -> dict[str, float] | None:
        probe = LoopLagProbe(period_s=0.005)
        probe.start()
        await asyncio.sleep(0.03)  # a few samples of an idle loop
        time.sleep(0.08)  # the loop is blocked: the probe's next wake-up is >= 75 ms late
        await asyncio.sleep(0.03)
        await probe.stop()
        return lag_summary(probe.lags_ms)

    lag = asyncio.run(run())
    assert lag is not None and lag["max"] >= 75.0
    assert 0.0 <= lag["p50"] <= lag["p99"] <= lag["max"]


def test_a_probe_stopped_before_its_first_sample_has_no_figures() -> None:
    async def run() -> list[float]:
        probe = LoopLagProbe(period_s=10.0)
        probe.start()
        await probe.stop()
        return probe.lags_ms

    assert asyncio.run(run()) == [] and lag_summary([]) is None


def test_the_summary_takes_nearest_ranks() -> None:
    lags = [float(i) for i in range(200, 0, -1)]  # 1 .. 200 ms, unsorted
    assert lag_summary(lags) == {"p50": 101.0, "p99": 199.0, "max": 200.0}


def test_the_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="period_s must be > 0"):
        LoopLagProbe(period_s=0)


def test_client_procs_are_checked_with_the_run_config() -> None:
    from sits.bench.runner import ServeBenchConfig
    from sits.bench.workload import TenantLoad
    from sits.core.errors import InvalidParameterError

    tenant = (TenantLoad(name="default", api_key=None, request_rate=1.0, num_prompts=1),)
    assert ServeBenchConfig("http://h:1", tenant, client_procs=4).client_procs == 4
    with pytest.raises(InvalidParameterError, match="client_procs must be >= 1"):
        ServeBenchConfig("http://h:1", tenant, client_procs=0)
    with pytest.raises(InvalidParameterError, match="cannot be combined with max_concurrency"):
        ServeBenchConfig("http://h:1", tenant, client_procs=2, max_concurrency=8)


def test_the_command_line_names_the_flag_of_a_refused_value(capsys) -> None:
    from sits.cli.main import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--client-procs", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: argument --client-procs: client_procs must be >= 1" in err


def test_a_client_process_that_died_fails_the_run_with_its_name_and_code() -> None:
    import queue
    from types import SimpleNamespace

    from sits.bench.errors import BenchmarkError
    from sits.bench.sender import _take

    empty = queue.Queue()  # the dead process never put its result
    procs = [SimpleNamespace(name="sits-bench-client-0", exitcode=None),
             SimpleNamespace(name="sits-bench-client-1", exitcode=1)]  # fmt: skip
    with pytest.raises(BenchmarkError, match="client process sits-bench-client-1 exited with 1"):
        _take(empty, procs)
    results = queue.Queue()
    results.put(("shard", 0))
    assert _take(results, procs) == ("shard", 0)  # a result waiting is taken first
