"""TPOT pacing: the step-time model, the pacer's prefill budget, and the scheduler's limit."""

from __future__ import annotations

import dataclasses

import pytest

from sits.core.errors import InvalidParameterError
from sits.sched import Scheduler
from sits.sched.config import TenantPolicy, TenantTier
from sits.sched.step_policy import StepTimeModel, TpotPacer, ttft_rescue_tenants
from tests.sched.sched_testlib import fake_result, make_config, make_request, summary

# Mixed steps cost 20 ms + 10 us per prefill token; decode-only steps 10 ms.
INTERCEPT_S, SLOPE_S, DECODE_S = 0.02, 1e-5, 0.01


def _model() -> StepTimeModel:
    model = StepTimeModel(alpha=0.5)
    for num_tokens in (100, 1000, 4000, 2500):
        model.observe(num_tokens, INTERCEPT_S + SLOPE_S * num_tokens)
    model.observe(0, DECODE_S)
    return model


def test_step_time_model_fits_the_line_and_the_decode_average() -> None:
    model = StepTimeModel(alpha=0.5)
    assert not model.ready
    with pytest.raises(RuntimeError):
        model.predict(10)
    model.observe(0, 0.012)
    model.observe(0, 0.008)
    assert model.decode_s == pytest.approx(0.010)  # 0.5 * 0.008 + 0.5 * 0.012
    model.observe(1000, 0.05)
    assert model.mixed_line() == pytest.approx((0.0, 0.05 / 1000))  # one point: via the origin
    model = _model()
    assert model.mixed_line() == pytest.approx((INTERCEPT_S, SLOPE_S))
    assert model.predict(3000) == pytest.approx(0.05)
    assert model.predict(0) == pytest.approx(DECODE_S)
    with pytest.raises(InvalidParameterError):
        StepTimeModel(alpha=0.0)


def test_step_time_model_clips_stalls_once_it_has_samples() -> None:
    model = StepTimeModel(alpha=0.5, outlier_factor=4.0, min_samples=2)
    model.observe(0, 5.0)  # a cold first step (a kernel compiling): taken as it is
    model.observe(0, 0.01)
    assert model.decode_s == pytest.approx(2.505)
    for _ in range(12):
        model.observe(0, 0.01)
    before = 0.01 + 2.495 * 0.5**12  # the cold step's share halves with each step
    assert model.decode_s == pytest.approx(before)
    model.observe(0, 3.0)  # a stall after 14 samples: counts as 4 x the prediction
    assert model.decode_s == pytest.approx(0.5 * 4 * before + 0.5 * before)
    for num_tokens in (100, 1000):
        model.observe(num_tokens, INTERCEPT_S + SLOPE_S * num_tokens)
    model.observe(4000, 10.0)  # clipped to 4 x the line's 0.06 s
    assert model.num_mixed_samples == 3
    x, y = (100 + 1000) / 2, (0.021 + 0.03) / 2  # the moments before the stall...
    xs = 0.5 * 4000 + 0.5 * x
    ys = 0.5 * 0.24 + 0.5 * y
    assert model.predict(4000) > 0.06 and model._moments[1] == pytest.approx(ys)
    assert model._moments[0] == pytest.approx(xs)
    with pytest.raises(InvalidParameterError):
        StepTimeModel(outlier_factor=1.0)
    with pytest.raises(InvalidParameterError):
        StepTimeModel(min_samples=0)


def test_pacer_spaces_tokens_by_the_target_fraction_of_the_slo() -> None:
    gold = make_request("g", [1, 2, 3], tenant_id="gold")
    pacer = TpotPacer({"gold": 0.05}, 8192, model=_model())  # target_fraction 0.9: 45 ms
    gold.append_output_token(9)
    pacer.observe_step(100, 0.021, end_s=0.0, sampled_ids=["g"], finished_ids=[])
    pacer.model = _model()
    assert pacer.max_prefill_tokens(0.0, [gold]) == 2500  # (0.045 - 0.02) / 1e-5
    with pytest.raises(InvalidParameterError):
        TpotPacer({"gold": 0.05}, 8192, target_fraction=0.0)


def test_pacer_budget_follows_the_tightest_token_schedule() -> None:
    gold = make_request("g", [1, 2, 3], tenant_id="gold")
    other = make_request("o", [1, 2, 3], tenant_id="free")  # no TPOT SLO: never paces
    pacer = TpotPacer(
        {"gold": 0.05}, max_num_batched_tokens=8192, target_fraction=1.0, model=_model()
    )
    gold.append_output_token(9)
    other.append_output_token(9)
    pacer.observe_step(100, 0.021, end_s=0.0, sampled_ids=["g", "o"], finished_ids=[])
    pacer.model = _model()  # keep the exact line (observe_step fed it one more point)
    # Next gold token due at 0 + 1 * 50 ms; a full step (0.10192 s) does not fit.
    assert pacer.max_prefill_tokens(0.0, [gold, other]) == 3000  # (0.05 - 0.02) / 1e-5
    assert pacer.max_prefill_tokens(0.0125, [gold]) == 1750
    assert pacer.max_prefill_tokens(0.0125, [other]) is None
    assert pacer.max_prefill_tokens(0.0125, []) is None
    assert pacer.max_prefill_tokens(0.0299, [gold]) == 0  # 10 tokens < min_chunk_tokens 16
    assert pacer.max_prefill_tokens(0.04, [gold]) == 0  # slack 10 ms < the 20 ms intercept
    for token in range(4):
        gold.append_output_token(token)  # 5 tokens: next due at 0.25 s
    assert pacer.max_prefill_tokens(0.1, [gold]) is None  # 0.15 s of slack: a full step fits
    # Over a token late (due 0.25 < 1.0 - 0.05): rebased to be due now, then on schedule.
    assert pacer.max_prefill_tokens(1.0, [gold]) == 0
    gold.append_output_token(5)
    assert pacer.max_prefill_tokens(1.0, [gold]) == 3000
    pacer.forget(["g"])
    assert pacer.max_prefill_tokens(1.0, [gold]) is None  # no schedule for it any more


def test_pacer_budget_fills_the_largest_bucket_that_fits_less_the_decodes() -> None:
    def decoding(request_id: str, tenant_id: str):
        request = make_request(request_id, [1, 2, 3], tenant_id=tenant_id)
        request.append_output_token(9)
        request.num_computed_tokens = 3  # the prompt is in the cache: the next step decodes it
        return request

    gold, other = decoding("g", "gold"), decoding("o", "free")
    waiting = make_request("w", [1, 2, 3], tenant_id="gold")  # no KV yet: not a decode
    pacer = TpotPacer(
        {"gold": 0.05}, 8192, target_fraction=1.0, token_buckets=(1024, 2048, 2560, 4096)
    )
    pacer.observe_step(0, DECODE_S, end_s=0.0, sampled_ids=["g"], finished_ids=[])
    pacer.model = _model()
    padded = [pacer.padded_tokens(n) for n in (1, 1024, 1025, 4096, 5000)]
    assert padded == [1024, 1024, 2048, 4096, 5000]
    # 50 ms of slack fit (0.05 - 0.02) / 1e-5 = 3000 tokens: the 2560 bucket, less 2 decodes.
    assert pacer.max_prefill_tokens(0.0, [gold, other, waiting]) == 2558
    assert pacer.max_prefill_tokens(0.015, [gold, other]) == 1022  # 1500: the 1024 bucket
    assert pacer.max_prefill_tokens(0.025, [gold, other]) == 0  # 500 tokens: no bucket fits
    pacer.token_buckets = (256, 1024)
    assert pacer.max_prefill_tokens(0.0, [gold, other]) == 2998  # past the last bucket: unpadded
    pacer.token_buckets = ()
    assert pacer.max_prefill_tokens(0.015, [gold, other]) == 1498
    assert pacer.padded_tokens(1025) == 1025


def test_a_budget_below_the_minimum_prefill_is_a_decode_only_step() -> None:
    """min_prefill_tokens: a step takes prompt tokens only when that many fit; else none, and
    the time banked lets a later step take them."""
    gold = make_request("g", [1, 2, 3], tenant_id="gold")
    gold.append_output_token(9)
    gold.num_computed_tokens = 3
    pacer = TpotPacer({"gold": 0.05}, 8192, target_fraction=1.0, min_prefill_tokens=2000)
    pacer.observe_step(0, DECODE_S, end_s=0.0, sampled_ids=["g"], finished_ids=[])
    pacer.model = _model()
    assert pacer.max_prefill_tokens(0.015, [gold]) == 0  # 1,499 fit: below 2,000, none
    # That step decodes alone: by 15 ms its second token is in, due at 100 ms. At 50 ms the
    # 50 ms of slack fit 3,000 tokens, less the decode.
    gold.append_output_token(9)
    gold.num_computed_tokens = 4
    assert pacer.max_prefill_tokens(0.05, [gold]) == 2999
    assert pacer.max_prefill_tokens(0.065, [gold]) == 0  # 35 ms left: 1,499 fit, too few
    pacer.min_prefill_tokens = 0
    assert pacer.max_prefill_tokens(0.065, [gold]) == 1499  # off: the 1,499 go at once


def test_pacer_leaves_out_what_it_cannot_help_and_waits_for_a_model() -> None:
    gold = make_request("g", [1, 2, 3], tenant_id="gold")
    gold.append_output_token(9)
    tight = TpotPacer({"gold": DECODE_S / 0.9}, 8192, model=_model())  # 0.9 TPOT <= decode
    tight.observe_step(0, DECODE_S, end_s=0.0, sampled_ids=["g"], finished_ids=[])
    tight.model = _model()
    assert tight.max_prefill_tokens(0.0, [gold]) is None
    cold = TpotPacer({"gold": 0.05}, 8192)
    assert cold.enabled and not cold.model.ready
    cold.observe_step(0, DECODE_S, end_s=0.0, sampled_ids=["g"], finished_ids=[])
    assert cold.max_prefill_tokens(0.0, [gold]) is None  # no mixed step seen yet
    assert not TpotPacer({}, 8192).enabled


def test_scheduler_limits_prefill_tokens_but_not_decodes() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=64))
    scheduler.add_request(make_request("A", list(range(8)), max_tokens=8))
    plan = scheduler.schedule()
    scheduler.update(plan, fake_result(plan))  # A decodes from now on
    scheduler.add_request(make_request("B", list(range(20, 40)), max_tokens=4))
    scheduler.add_request(make_request("C", list(range(50, 55)), max_tokens=2))

    plan = scheduler.schedule(max_prefill_tokens=0)  # decode-only step
    assert summary(plan) == [("A", 8, 1, True)]
    scheduler.update(plan, fake_result(plan))
    plan = scheduler.schedule(max_prefill_tokens=12)  # B gets a 12-token chunk, C nothing
    assert summary(plan) == [("A", 9, 1, True), ("B", 0, 12, False)]
    scheduler.update(plan, fake_result(plan))
    plan = scheduler.schedule(max_prefill_tokens=10)  # B's last 8 tokens, then C's first 2
    assert summary(plan) == [("A", 10, 1, True), ("B", 12, 8, True), ("C", 0, 2, False)]
    scheduler.update(plan, fake_result(plan))
    plan = scheduler.schedule(max_prefill_tokens=0)  # C paused mid-prompt; B decodes
    assert summary(plan) == [("A", 11, 1, True), ("B", 20, 1, True)]
    scheduler.update(plan, fake_result(plan))
    plan = scheduler.schedule()  # no limit: C's remaining 3 tokens
    assert summary(plan) == [("A", 12, 1, True), ("B", 21, 1, True), ("C", 2, 3, True)]


GOLD = TenantPolicy(tenant_id="gold", tier=TenantTier.GUARANTEED, reserved_kv_fraction=0.5,
                    priority=0, ttft_ms=1000, tpot_ms=50)  # fmt: skip
BURST = TenantPolicy(tenant_id="burst", tier=TenantTier.BURSTABLE, priority=1, ttft_ms=5000,
                     tpot_ms=200)  # fmt: skip


def test_rescue_tenants_are_those_at_least_as_important_as_the_paced() -> None:
    assert ttft_rescue_tenants([GOLD, BURST]) == {"gold"}
    same = dataclasses.replace(BURST, priority=0)
    assert ttft_rescue_tenants([GOLD, same]) == {"gold", "burst"}
    no_tpot = dataclasses.replace(GOLD, tpot_ms=None)
    assert ttft_rescue_tenants([no_tpot, dataclasses.replace(BURST, tpot_ms=None)]) == set()
    ttft_only = TenantPolicy(tenant_id="chat", priority=0, ttft_ms=300)
    assert ttft_rescue_tenants([GOLD, BURST, ttft_only]) == {"gold", "chat"}


def test_prompt_tokens_at_risk_count_waiting_and_part_prefilled_first_tokens() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=16, tenants=(GOLD, BURST)))
    # gold: TTFT 1 s, at risk once it has waited 0.5 s (TTFT_RESCUE_SLACK 0.5).
    scheduler.add_request(make_request("g0", list(range(24)), arrival_time=0.0, tenant_id="gold"))
    scheduler.add_request(
        make_request("g1", list(range(100, 110)), arrival_time=0.4, tenant_id="gold")
    )
    scheduler.add_request(
        make_request("b0", list(range(200, 230)), arrival_time=0.0, tenant_id="burst")
    )
    plan = scheduler.schedule()  # g0 gets 16 of its 24 prompt tokens (the budget)
    assert summary(plan) == [("g0", 0, 16, False)]
    scheduler.update(plan, fake_result(plan))
    risk = scheduler.prompt_tokens_at_risk
    assert risk(0.49, 0.5, {"gold"}) == 0
    assert risk(0.5, 0.5, {"gold"}) == 8  # g0's 8 prompt tokens left (running, no token yet)
    assert risk(0.9, 0.5, {"gold"}) == 8 + 10  # and the whole of g1 (waiting)
    assert risk(0.9, 0.5, {"gold", "burst"}) == 18  # burst (TTFT 5 s) is not at risk yet
    assert risk(2.5, 0.5, {"gold", "burst"}) == 18 + 30
    assert risk(2.5, 0.5, {"nobody"}) == 0
    plan = scheduler.schedule()  # g0's last 8 tokens and its first token; g1's first 8
    assert summary(plan) == [("g0", 16, 8, True), ("g1", 0, 8, False)]
    scheduler.update(plan, fake_result(plan))
    assert risk(0.9, 0.5, {"gold"}) == 2  # g0 has its first token; g1 has 2 tokens left
