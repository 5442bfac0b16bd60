"""Async scheduling matches the synchronous engine token for token: requests added between
steps, chunked prefill, min_tokens, n > 1, prompt-only and logprob mixtures, and an empty plan
made while a step is ahead (it once dropped its swap copies and finished ids); then the
scheduler's and runner's state after all finished."""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable

import pytest

from sits.config import EngineConfig
from sits.core.request import FinishReason
from sits.core.sampling_params import SamplingParams
from sits.engine.builder import build_engine
from sits.engine.core import EngineCore
from sits.engine.output_processor import make_engine_requests

BLOCK_BYTES = 8192  # tiny llama: 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x 4 B
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _core(model_dir, async_scheduling: bool, policies=(), **overrides) -> EngineCore:
    kwargs = dict(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        async_scheduling=async_scheduling,
    )
    kwargs.update(overrides)
    return build_engine(EngineConfig(**kwargs), policies).core


def _prompt(request_id: str, length: int) -> list[int]:
    seed = zlib.crc32(request_id.encode())
    return [1 + (seed + 7 * i) % 500 for i in range(length)]


def _add(core, request_id, length, params=GREEDY, prompt=None, **kwargs) -> list[str]:
    reqs = make_engine_requests(
        request_id,
        prompt if prompt is not None else _prompt(request_id, length),
        params,
        eos_token_ids=(),
        max_model_len=256,
        enable_prefix_caching=core.config.enable_prefix_caching,
        **kwargs,
    )
    for r in reqs:
        core.add_request(r)
    return [r.request_id for r in reqs]


Script = dict[int, Callable[[EngineCore], object]]


def _drive(core: EngineCore, script: Script, max_steps: int = 400):
    """Run the core to completion, calling script[i](core) before step i; (tokens by request,
    finish reasons, prompt logprob counts)."""
    tokens: dict[str, list[int]] = defaultdict(list)
    finished: dict[str, tuple] = {}
    prompt_lps: dict[str, int] = defaultdict(int)
    last = max(script) if script else -1
    step = 0

    def record(outs):
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.new_prompt_logprobs:
                prompt_lps[out.request_id] += len(out.new_prompt_logprobs)
            if out.new_logprobs:
                prompt_lps["lp:" + out.request_id] += len(out.new_logprobs)
            if out.finished:
                assert out.request_id not in finished, out.request_id
                finished[out.request_id] = (out.finish_reason, out.stop_reason)

    while step <= last or core.has_unfinished_requests():
        assert step < max_steps, "the engine does not drain"
        if step in script:
            outs = script[step](core)
            if isinstance(outs, list) and outs and hasattr(outs[0], "request_id"):
                record(outs)
        record(core.step())
        step += 1
    return dict(tokens), finished, dict(prompt_lps)


def _check_drained(core: EngineCore, initial_free: int) -> None:
    sched = core.scheduler
    assert sched.num_running == 0
    assert not sched.has_unfinished_requests()
    assert not core.has_unfinished_requests()
    assert sched.kv.num_free_blocks == initial_free


def _compare(model_dir, script_of: Callable[[], Script], policies=(), **overrides):
    results = {}
    for mode in (False, True):
        core = _core(model_dir, mode, policies, **overrides)
        initial = core.scheduler.kv.num_free_blocks
        results[mode] = _drive(core, script_of())
        _check_drained(core, initial)
        results[mode] = results[mode] + (core,)
    return results[False], results[True]


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


# ------------------------------------------------------------------------------ scenarios
def test_requests_added_between_steps_and_restart(llama) -> None:
    def script():
        return {
            0: lambda c: _add(c, "a", 20),
            2: lambda c: _add(c, "b", 33),
            3: lambda c: _add(c, "c", 5),
            30: lambda c: _add(c, "d", 17),  # after draining to empty
        }

    (st, sf, _, _), (at, af, _, _) = _compare(llama, script)
    assert at == st and af == sf and len(af) == 4


def test_chunked_prefill_and_max_model_len(llama) -> None:
    long = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)

    def script():
        return {
            0: lambda c: (_add(c, "a", 100), _add(c, "b", 230, long), _add(c, "c", 70)),
        }

    (st, sf, _, _), (at, af, _, _) = _compare(llama, script, max_num_batched_tokens=48)
    assert at == st and af == sf
    assert len(at["b"]) == 26 and af["b"][0] is FinishReason.LENGTH


def test_min_tokens_and_stop_tokens(llama) -> None:
    def script():
        return {0: lambda c: [_add(c, f"r{i}", 9 + i) for i in range(4)]}

    ref, _ = _compare(llama, script)
    stops = {rid: toks[2] for rid, toks in ref[0].items()}

    def script2():
        actions = {}

        def add_all(c):
            for i in range(4):
                rid = f"r{i}"
                p = SamplingParams(
                    temperature=0, max_tokens=10, min_tokens=4 if i % 2 else 0,
                    stop_token_ids=[stops[rid]], ignore_eos=True,
                )  # fmt: skip
                _add(c, rid, 9 + i, p)

        actions[0] = add_all
        return actions

    (st, sf, _, _), (at, af, _, _) = _compare(llama, script2)
    assert at == st and af == sf


def test_n_greater_than_one_with_seed(llama) -> None:
    p = SamplingParams(temperature=0.8, n=3, seed=5, max_tokens=6)

    def script():
        return {0: lambda c: (_add(c, "a", 40, p), _add(c, "b", 10))}

    (st, sf, _, _), (at, af, _, _) = _compare(llama, script)
    assert at == st and af == sf and len(af) == 4


def test_prompt_only_and_logprob_mixture(llama) -> None:
    def script():
        def add(c):
            _add(c, "plain0", 20)
            _add(c, "po", 30, SamplingParams(max_tokens=0, prompt_logprobs=1))
            _add(c, "lp", 12, SamplingParams(temperature=0, max_tokens=5, logprobs=1))
            _add(c, "plain1", 25)

        return {0: add, 3: lambda c: _add(c, "late_lp", 9, SamplingParams(temperature=0,
                max_tokens=4, logprobs=0, ignore_eos=True))}  # fmt: skip

    (st, sf, sp, _), (at, af, ap, _) = _compare(llama, script)
    assert at == st and af == sf and ap == sp


# ------------------------------------------------------- the bugs the review found (fixed)
def test_swap_out_of_an_empty_following_plan_is_not_lost(llama) -> None:
    """4 usable blocks of 16 tokens, a host tier. "a" (28 prompt tokens, 4 outputs) ends with
    step 3; "r" (29 prompt tokens) needs a third block for position 32 in step 4. Sync: "a" is
    done before step 4 is planned, its blocks are free, "r" goes on. Async: step 4 is planned
    while step 3 is in flight: "a" (set aside, still holding 2 blocks) leaves no free block,
    so "r" preempts itself by swap-out and cannot be re-admitted: the plan schedules nothing
    but carries the swap-out copies. StepPipeline dropped such an empty plan without running
    `_begin`, so the copies never happened and "r" later swapped garbage back in."""

    def script():
        return {
            0: lambda c: (
                _add(c, "a", 28, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
                _add(c, "r", 29, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
            )
        }

    (st, sf, _, _), (at, af, _, acore) = _compare(
        llama,
        script,
        kv_cache_memory_bytes=5 * BLOCK_BYTES,
        swap_space=64 * BLOCK_BYTES / 2**30,
        enable_prefix_caching=False,
    )
    assert acore.scheduler.swapper.stats.num_swap_preemptions == 1  # the async run swapped
    assert at["a"] == st["a"]
    assert at["r"] == st["r"]  # the swap-out copies ran before the swap-in


def test_finished_ids_of_an_empty_following_plan_reach_the_runner(llama) -> None:
    """A request aborted between steps while the next plan comes out empty (the only other
    request ends with the step in flight): its finished id rides on that empty plan, which
    StepPipeline dropped, so the runner kept its sampling state (and `_sync_ids`,
    `_prompt_logprob_ids` entries) forever: a leak per such abort."""
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def script():
        return {
            0: lambda c: (_add(c, "a", 10, short), _add(c, "b", 12, long)),
            1: lambda c: c.finish_requests(["b"]),
            10: lambda c: _add(c, "c", 9, short),
        }

    (_, sf, _, score), (_, af, _, acore) = _compare(llama, script)
    assert af == sf
    assert set(score.runner._states) == {"c"}
    assert set(acore.runner._states) == {"c"}  # "b" was dropped with the empty plan
