"""Arrival schedules: seeded, reproducible, exact; tenants merged by time."""

from __future__ import annotations

import math
import random

import pytest

from sits.bench.workload import TenantLoad, arrival_times, build_schedule
from sits.core.errors import InvalidParameterError

# -ln(1 - u) / 2 for the first draws u of random.Random(0) (0.8444218515250481, 0.7579544029...).
SEED0_RATE2_GAPS = (0.9303035555326117, 0.7093145764858809, 0.2728565727707964)


def test_poisson_arrivals_are_exact_for_a_seed() -> None:
    times = arrival_times(2.0, seed=0, num_requests=4)
    assert times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == pytest.approx(SEED0_RATE2_GAPS, abs=1e-12)
    assert arrival_times(2.0, seed=0, num_requests=4) == times  # reproducible
    assert arrival_times(2.0, seed=1, num_requests=4) != times
    # The same gaps at twice the rate are exactly half as long.
    doubled = arrival_times(4.0, seed=0, num_requests=4)
    assert [t * 2 for t in doubled] == pytest.approx(times, abs=1e-12)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(math.inf, seed=3, num_requests=5) == [0.0] * 5
    with pytest.raises(InvalidParameterError):
        arrival_times(math.inf, seed=3, duration_s=1.0)


def test_duration_draws_until_the_window_closes() -> None:
    times = arrival_times(2.0, seed=0, duration_s=1.9)
    # 0, 0.930, 1.640 (< 1.9); the next, 1.913, is past the window.
    assert times == pytest.approx([0.0, 0.9303035555326117, 1.6396181320184926], abs=1e-12)
    with pytest.raises(InvalidParameterError):
        arrival_times(2.0, seed=0)
    with pytest.raises(InvalidParameterError):
        arrival_times(2.0, seed=0, num_requests=3, duration_s=1.0)


def test_bursty_gaps_are_gamma_draws_of_the_seeded_generator() -> None:
    times = arrival_times(5.0, seed=7, num_requests=4, burstiness=0.5)
    rng = random.Random(7)
    expected = [0.0]
    for _ in range(3):
        expected.append(expected[-1] + rng.gammavariate(0.5, 1.0 / (5.0 * 0.5)))
    assert times == expected


def test_schedule_merges_tenants_by_time_with_their_own_seeds() -> None:
    gold = TenantLoad(name="gold", request_rate=2.0, num_prompts=3)
    bulk = TenantLoad(name="bulk", request_rate=math.inf, num_prompts=2)
    schedule = build_schedule([gold, bulk], seed=0)
    gold_times = arrival_times(2.0, seed=0, num_requests=3)
    # At t=0: gold's first (tenant order breaks the tie), then bulk's two; then gold's rest.
    assert [(r.index, r.tenant_index) for r in schedule] == [(0, 0), (1, 1), (2, 1), (3, 0), (4, 0)]
    assert [r.arrival_s for r in schedule] == [0.0, 0.0, 0.0, gold_times[1], gold_times[2]]
    # Tenant i draws from seed + i: appending a tenant leaves the others' times unchanged.
    alone = build_schedule([gold], seed=0)
    assert [r.arrival_s for r in alone] == gold_times


def test_tenant_load_checks_its_fields() -> None:
    with pytest.raises(InvalidParameterError) as err:
        TenantLoad(request_rate=0.0)
    assert err.value.param == "request_rate"
    with pytest.raises(InvalidParameterError) as err:
        TenantLoad(num_prompts=0)
    assert err.value.param == "num_prompts"
    with pytest.raises(InvalidParameterError) as err:
        TenantLoad(input_len=0)
    assert err.value.param == "input_len"
    with pytest.raises(InvalidParameterError) as err:
        TenantLoad(ttft_ms=-1.0)
    assert err.value.param == "ttft_ms"
    with pytest.raises(InvalidParameterError) as err:
        TenantLoad(request_rate=math.inf, num_prompts=None, duration_s=5.0)
    assert err.value.param == "duration_s"
    assert TenantLoad(request_rate=1.0, num_prompts=None, duration_s=5.0).duration_s == 5.0
