"""Tenants through the engine on the tiny model: a guaranteed tenant keeps its reservation while
a burstable tenant floods (bounded steps, against FCFS), load accounting, borrowing tiers."""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest

from sits.config import EngineConfig
from sits.core.sampling_params import RequestOutputKind, SamplingParams
from sits.engine.async_llm import AsyncLLM
from sits.engine.builder import build_engine, tenant_policies_of
from sits.engine.core import EngineCore, WaitingLoad
from sits.engine.output_processor import make_engine_requests
from sits.sched.config import TenantPolicy, TenantTier
from sits.sched.step_policy import TpotPacer
from sits.tenancy import TenantConfig, TenantsConfig, Tier, hash_api_key
from tests.waits import HANG_S, async_wait_until

BLOCK_BYTES = 8192  # tiny llama: 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x 4 B
NUM_BLOCKS = 33  # 32 usable blocks besides the null block
POLICIES = (
    TenantPolicy(tenant_id="gold", tier=TenantTier.GUARANTEED, reserved_kv_fraction=0.5),
    TenantPolicy(tenant_id="bulk", tier=TenantTier.BURSTABLE, reserved_kv_fraction=0.125),
    TenantPolicy(tenant_id="free", tier=TenantTier.BEST_EFFORT),
)


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_BYTES,
        max_num_seqs=8,
        max_num_batched_tokens=512,
    )


def _core(tiny_model_factory, policies=POLICIES) -> EngineCore:
    core = build_engine(_config(tiny_model_factory("llama")), policies).core
    assert core.runner.num_blocks == NUM_BLOCKS
    return core


def _add(
    core: EngineCore,
    request_id: str,
    tenant_id: str,
    num_prompt: int,
    max_tokens: int,
    arrival_s: float | None = None,
) -> None:
    """Queue a greedy request of `tenant_id` with a prompt derived from its id."""
    seed = zlib.crc32(request_id.encode())
    prompt = [1 + (seed + 7 * i) % 500 for i in range(num_prompt)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    (request,) = make_engine_requests(
        request_id,
        prompt,
        params,
        eos_token_ids=(0,),
        max_model_len=256,
        enable_prefix_caching=True,
        arrival_time=arrival_s,
        tenant_id=tenant_id,
    )
    core.add_request(request)


def test_tenant_policies_map_the_tenants_file() -> None:
    tenants = TenantsConfig(
        (
            TenantConfig(
                id="g",
                tier=Tier.GUARANTEED,
                reserved_kv_fraction=0.5,
                weight=2.0,
                priority=1,
                ttft_ms=200,
                tpot_ms=20,
                api_key_sha256=(hash_api_key("k"),),
            ),
            TenantConfig(id="b", tier=Tier.BEST_EFFORT),
        ),
        anonymous_tenant_id="b",
    )
    g, b = tenant_policies_of(tenants)
    assert g == TenantPolicy(
        tenant_id="g",
        tier=TenantTier.GUARANTEED,
        reserved_kv_fraction=0.5,
        weight=2.0,
        priority=1,
        ttft_ms=200,
        tpot_ms=20,
    )
    assert b == TenantPolicy(tenant_id="b", tier=TenantTier.BEST_EFFORT)
    assert tenant_policies_of(None) == ()


def _flood_then_gold(core: EngineCore, num_steps: int) -> list[int]:
    """Bulk floods (a new request every step); a gold request arrives every 5 steps.
    Returns gold's waiting count after each step."""
    for i in range(12):
        _add(core, f"bulk-{i}", "bulk", 40, 60)
    for _ in range(4):
        core.step()
    gold_waiting = []
    for step in range(num_steps):
        _add(core, f"bulk-more-{step}", "bulk", 40, 60)
        if step % 5 == 0:
            _add(core, f"gold-{step}", "gold", 32, 8)
        core.step()
        waiting_ids = core.scheduler.waiting_request_ids()
        gold_waiting.append(sum(r.startswith("gold") for r in waiting_ids))
    return gold_waiting


def test_guaranteed_tenant_is_admitted_in_the_step_it_asks_while_bulk_floods(
    tiny_model_factory,
) -> None:
    core = _core(tiny_model_factory)
    # Before gold arrives, bulk borrows gold's idle reservation.
    for i in range(12):
        _add(core, f"warm-{i}", "bulk", 40, 60)
    for _ in range(4):
        core.step()
    bulk = core.tenant_stats()["bulk"]
    assert (bulk.num_running, bulk.num_waiting, bulk.blocks_used) == (8, 4, 24)
    assert (bulk.blocks_borrowed, bulk.num_preemptions) == (20, 0)  # all 8 slots are bulk's
    _add(core, "gold-a", "gold", 32, 8)
    _add(core, "gold-b", "gold", 32, 8)
    core.step()
    gold, bulk = core.tenant_stats()["gold"], core.tenant_stats()["bulk"]
    assert gold.num_running == 2 and gold.num_waiting == 0  # admitted in one step
    assert (bulk.num_running, bulk.num_preemptions) == (6, 2)  # two borrowed slots reclaimed
    steps = 1
    while core.scheduler.get_request("gold-a") or core.scheduler.get_request("gold-b"):
        core.step()
        steps += 1
    assert steps == 8  # prefill + first token, then 7 decodes: never delayed by bulk


def test_guaranteed_queueing_stays_bounded_under_a_flood_but_not_with_fcfs(
    tiny_model_factory,
) -> None:
    qos = _flood_then_gold(_core(tiny_model_factory), 20)
    assert qos == [0] * 20  # every gold request runs in the step it arrives
    fcfs = _flood_then_gold(_core(tiny_model_factory, policies=()), 20)
    assert max(fcfs) >= 3  # FCFS: gold queues behind the flood and piles up


def test_waiting_load_and_prefill_accounting(tiny_model_factory) -> None:
    core = _core(tiny_model_factory)
    _add(core, "b1", "bulk", 40, 4, arrival_s=10.0)
    _add(core, "b2", "bulk", 20, 4, arrival_s=11.0)
    _add(core, "g1", "gold", 32, 4, arrival_s=12.0)
    assert core.waiting_load() == {
        "bulk": WaitingLoad(oldest_arrival_s=10.0, num_prefill_tokens=60),
        "gold": WaitingLoad(oldest_arrival_s=12.0, num_prefill_tokens=32),
    }
    assert core.stats.representative_prefill_tokens == 512 // 4  # a quarter of the budget
    assert core.stats.prefill_rate_seed_tokens_per_s is None  # no warm-up on the CPU
    core.step()  # every prompt fits the 512-token budget
    assert core.waiting_load() == {}
    assert core.stats.num_prefill_tokens == 92 and core.stats.prefill_busy_s > 0
    assert core.stats.num_full_prefill_tokens == 0  # 92 < 128: not representative
    busy_s = core.stats.prefill_busy_s
    core.step()  # decodes only
    assert core.stats.num_prefill_tokens == 92 and core.stats.prefill_busy_s == busy_s
    stats = core.tenant_stats()
    assert (stats["gold"].blocks_reserved, stats["bulk"].blocks_reserved) == (16, 4)
    assert (stats["gold"].seqs_reserved, stats["bulk"].seqs_reserved) == (4, 1)


def test_borrowing_tiers_reach_the_engine_thread(tiny_model_factory) -> None:
    engine = AsyncLLM(_config(tiny_model_factory("llama")), tenant_policies=POLICIES)
    params = SamplingParams(max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run() -> None:
        engine.set_borrowing_tiers(["guaranteed"])
        await _until(lambda: engine.stats().borrowing_tiers == ("guaranteed",))
        gen = engine.generate("f1", list(range(5, 25)), params, tenant_id="free")
        task = asyncio.ensure_future(_drain(gen))
        await _until(lambda: engine.stats().tenants["free"].num_waiting == 1)
        stats = engine.stats()
        assert stats.waiting["free"].num_prefill_tokens == 20
        assert stats.oldest_waiting_arrival_s == stats.waiting["free"].oldest_arrival_s
        assert stats.queue_delay_s(stats.oldest_waiting_arrival_s + 2.0) == 2.0
        assert not task.done()  # best-effort may not borrow: it waits
        num_steps = engine.stats().num_steps
        await asyncio.sleep(0.3)
        assert engine.stats().num_steps - num_steps <= 5  # it waits for a command, no spinning
        engine.set_borrowing_tiers([Tier.GUARANTEED, Tier.BURSTABLE, Tier.BEST_EFFORT])
        assert await asyncio.wait_for(task, HANG_S) == 3
        assert engine.stats().borrowing_tiers == ("guaranteed", "burstable", "best_effort")
        with pytest.raises(ValueError):
            engine.set_borrowing_tiers(["gold"])
        await engine.shutdown()

    asyncio.run(run())


async def _drain(gen) -> int:
    num_tokens = 0
    async for out in gen:
        num_tokens += sum(len(c.token_ids) for c in out.outputs)
    return num_tokens


async def _until(predicate) -> None:
    assert await async_wait_until(predicate), "condition not reached"


def test_a_first_token_at_risk_lifts_tpot_pacing_for_its_prompt(
    tiny_model_factory, monkeypatch
) -> None:
    policies = (
        TenantPolicy(tenant_id="gold", tier=TenantTier.GUARANTEED, reserved_kv_fraction=0.5,
                     ttft_ms=1000, tpot_ms=50),
        TenantPolicy(tenant_id="bulk", tier=TenantTier.BURSTABLE, priority=1, ttft_ms=1000,
                     tpot_ms=200),
    )  # fmt: skip
    core = _core(tiny_model_factory, policies)
    # Pacing allows no prompt token at all.
    monkeypatch.setattr(TpotPacer, "max_prefill_tokens", lambda self, now_s, running: 0)
    now = time.monotonic()
    _add(core, "fresh", "gold", 20, 2, arrival_s=now)  # 1 s of TTFT left: waits
    _add(core, "late-bulk", "bulk", 20, 2, arrival_s=now - 0.9)  # at risk, but less important
    for _ in range(3):
        assert core.step() == []
    _add(core, "late-gold", "gold", 30, 2, arrival_s=now - 0.6)  # 0.4 s left < half its TTFT
    outputs = core.step()  # the rescue budget is late-gold's 30 prompt tokens
    assert [(o.request_id, len(o.new_token_ids)) for o in outputs] == [("late-gold", 1)]
    assert core.scheduler.get_request("fresh").num_computed_tokens == 0


def test_the_pacing_fraction_reaches_the_pacer(tiny_model_factory) -> None:
    gold = TenantPolicy(tenant_id="gold", tier=TenantTier.GUARANTEED, tpot_ms=50.0)
    config = _config(tiny_model_factory("llama")).with_changes(tpot_pacing_fraction=0.95)
    core = build_engine(config, (gold,)).core
    pacer = core.policy.pacer
    assert (pacer.target_fraction, pacer.tpot_s_by_tenant) == (0.95, {"gold": 0.05})
