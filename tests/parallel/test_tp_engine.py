"""The tensor-parallel engine (issue 27, `sits.runner.tp_executor`) on the CPU over gloo: with
two ranks greedy tokens equal one rank's under chunked prefill, a prefix-cache hit and an
abort on all five architectures, under recompute preemption (as many as with one rank), and
with expert parallelism (whose expert counts equal one rank's); a worker killed mid-run fails
the next step with `TensorParallelWorkerError` and the engine still shuts down; the flags and
the misconfigurations are refused with the numbers.

Each engine of two ranks spawns one worker; every test shuts its engines down (joining the
worker) in a finally, and `_no_worker_left` checks that no worker outlives its test.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from sits import LLM, SamplingParams
from sits.cli.main import build_parser
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, TensorParallelWorkerError
from sits.core.request import FinishReason
from sits.engine.arg_utils import engine_kwargs
from sits.engine.output_processor import make_engine_requests
from sits.layers.moe import SparseMoeBlock
from sits.parallel.topology import RankBinding
from sits.runner.expert_health import ExpertMonitor
from sits.runner.tp_executor import TensorParallelRunner, check_devices
from tests.conftest import ARCHS
from tests.engine.hf_reference import random_prompts
from tests.waits import HANG_S, wait_until

MAX_TOKENS = 8
TIMEOUT_S = 60.0  # the collectives' timeout: the ranks' start on a loaded machine fits in it
HUNG_TIMEOUT_S = 8.0  # the hung-worker test's: short, yet room for its start


def _llm(model_dir, tensor_parallel_size: int, timeout_s: float = TIMEOUT_S, **kwargs) -> LLM:
    options = {
        "dtype": "float32",
        "max_model_len": 128,
        "max_num_batched_tokens": 8,  # every prompt below is prefilled in chunks
        "kv_cache_memory_bytes": 2**21,
        "skip_tokenizer_init": True,
        **kwargs,
    }
    return LLM(
        model=str(model_dir),
        tensor_parallel_size=tensor_parallel_size,
        tensor_parallel_timeout_s=timeout_s,
        **options,
    )


def _add(core, request_id: str, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for request in make_engine_requests(
        request_id, prompt, params, eos_token_ids=(), max_model_len=128,
        enable_prefix_caching=True,
    ):  # fmt: skip
        core.add_request(request)


def _scenario(llm: LLM, prompts: list[list[int]]) -> tuple[dict, dict, dict]:
    """Requests "p0" (short), "p1" (long) and "x" from the start; "x" aborted after step 3;
    "p2" (p1's first block and more) added once p1 has finished, so it hits the prefix cache.

    Returns:
        (tokens by request, finish reasons by request, cached prompt tokens by request).
    """
    core = llm.engine_core
    p0, p1, p2, x = prompts
    _add(core, "p0", p0)
    _add(core, "p1", p1)
    _add(core, "x", x)
    tokens: dict[str, list[int]] = {"p0": [], "p1": [], "p2": [], "x": []}
    reasons: dict[str, FinishReason | None] = {}
    cached: dict[str, int] = {}
    steps = 0
    added_p2 = False
    while core.has_unfinished_requests() or not added_p2:
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        if steps == 3:
            for out in core.finish_requests(["x"], FinishReason.ABORT):
                reasons[out.request_id] = out.finish_reason
        if "p1" in reasons and not added_p2:
            _add(core, "p2", p2)
            added_p2 = True
    return tokens, reasons, cached


@pytest.fixture(autouse=True)
def _no_worker_left():
    """No tensor-parallel worker outlives its test (each is a child of this process)."""
    yield
    import multiprocessing

    left = [p for p in multiprocessing.active_children() if p.name.startswith("sits-tp-rank")]
    assert not left, f"workers left running: {left}"


def _shutdown_all(*llms: LLM | None) -> None:
    for llm in llms:
        if llm is not None:
            llm.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_give_one_ranks_greedy_tokens(tiny_model_factory, caplog, arch: str) -> None:
    """Chunked prefill (8-token budget), a prefix-cache hit and an abort: TP=2 equals TP=1.
    On the CPU the ranks are placed without a GPU topology and bound to no cores (one log
    line)."""
    model_dir = tiny_model_factory(arch)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    p0, p1, tail, x = random_prompts([5, 23, 12, 19], vocab, seed=3)
    prompts = [p0, p1, p1[:16] + tail, x]
    one = two = None
    try:
        one = _llm(model_dir, 1)
        expected = _scenario(one, prompts)
        one_blocks = one.engine_core.scheduler.num_total_blocks
        assert one.engine_core.scheduler.num_free_blocks == one_blocks  # every block freed
        one.shutdown()
        with caplog.at_level(logging.INFO, logger="sits.parallel.topology"):
            two = _llm(model_dir, 2)
        assert isinstance(two.engine_core.runner, TensorParallelRunner)
        placed = [r.getMessage() for r in caplog.records if r.name == "sits.parallel.topology"]
        assert placed == [
            "tensor parallel on the CPU: no GPU topology, ranks are not bound to cores"
        ]
        assert two.engine_core.runner.bindings == [RankBinding(None)] * 2
        got = _scenario(two, prompts)
        two_blocks = two.engine_core.scheduler.num_total_blocks
        assert two.engine_core.scheduler.num_free_blocks == two_blocks
        # each rank holds half the KV heads (or one replicated head), so the same KV bytes
        # per rank hold at least as many blocks
        assert two_blocks >= one_blocks
    finally:
        _shutdown_all(one, two)
    tokens, reasons, cached = got
    assert (tokens, reasons, cached) == expected
    assert [len(tokens[r]) for r in ("p0", "p1", "p2")] == [MAX_TOKENS] * 3
    assert reasons["x"] is FinishReason.ABORT and len(tokens["x"]) < MAX_TOKENS
    assert cached["p2"] == 16  # p1's first block, from the prefix cache


PREEMPT_BLOCKS = 8  # 7 usable; the four requests below need 15 together, 4 at most each


def _greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_preemption_under_two_ranks_gives_one_ranks_greedy_tokens(tiny_model_factory) -> None:
    """A KV cache of 8 blocks on every rank (TP=2 gives each rank half the bytes: half the
    KV heads) for four requests that need 15: the scheduler preempts running requests and
    recomputes them, as often with two ranks as with one, and the tokens are TP=1's."""
    model_dir = tiny_model_factory("mixtral")
    config = json.loads((model_dir / "config.json").read_text())
    # one rank's float32 K and V of every layer for a block of 16 tokens, with all KV heads
    block_bytes = 2 * config["num_hidden_layers"] * 16 * config["num_key_value_heads"] * 4
    block_bytes *= config["head_dim"]
    prompts = random_prompts([20, 30, 40, 25], config["vocab_size"], seed=4)
    one = two = None
    try:
        one = _llm(model_dir, 1, max_num_batched_tokens=32,
                   kv_cache_memory_bytes=PREEMPT_BLOCKS * block_bytes)  # fmt: skip
        assert one.engine_core.runner.num_blocks == PREEMPT_BLOCKS
        expected = _greedy_tokens(one, prompts, 24)
        expected_preemptions = one.engine_core.scheduler.num_preemptions
        one.shutdown()
        two = _llm(model_dir, 2, max_num_batched_tokens=32,
                   kv_cache_memory_bytes=PREEMPT_BLOCKS * block_bytes // 2)  # fmt: skip
        assert two.engine_core.runner.num_blocks == PREEMPT_BLOCKS
        got = _greedy_tokens(two, prompts, 24)
        sched = two.engine_core.scheduler
        preemptions, swaps = sched.num_preemptions, sched.swap_stats
        assert sched.num_free_blocks == sched.num_total_blocks  # every block freed
    finally:
        _shutdown_all(one, two)
    assert got == expected and all(len(tokens) == 24 for tokens in got)
    assert preemptions == expected_preemptions and preemptions > 0
    assert swaps.num_recompute_preemptions == preemptions and swaps.num_swap_preemptions == 0


def test_async_scheduling_under_two_ranks_gives_one_ranks_greedy_tokens(tiny_model_factory):
    """--async-scheduling with two ranks: rank 0 launches step N+1 before it collects N (the
    workers fill N+1's placeholders from their own step N), chunked prefill included; the
    greedy tokens are TP=1's synchronous ones."""
    model_dir = tiny_model_factory("qwen3_moe")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts([5, 23, 12, 19], vocab, seed=6)
    one = two = None
    try:
        one = _llm(model_dir, 1)
        expected = _greedy_tokens(one, prompts, 12)
        one.shutdown()
        two = _llm(model_dir, 2, async_scheduling=True)
        runner = two.engine_core.runner
        launches: list[bool] = []  # per launch: after a step still in flight
        launch = runner.launch

        def counting_launch(plan, previous):
            launches.append(previous is not None)
            return launch(plan, previous)

        runner.launch = counting_launch
        got = _greedy_tokens(two, prompts, 12)
        sched = two.engine_core.scheduler
        assert sched.num_free_blocks == sched.num_total_blocks
    finally:
        _shutdown_all(one, two)
    assert got == expected and all(len(tokens) == 12 for tokens in got)
    # one pipeline from the first step to the last: 21 steps, each after the first launched
    # behind the one still in flight
    assert launches == [False] + [True] * 20


def _expert_counts(llm: LLM) -> list[list[int]]:
    """Rank 0's per-layer expert token counts, as the engine's `ExpertMonitor` reads them."""
    stats = ExpertMonitor.of_runner(llm.engine_core.runner).read()
    return [list(layer.num_tokens) for layer in stats.layers]


def test_expert_parallel_gives_one_ranks_greedy_tokens(tiny_model_factory) -> None:
    """enable_expert_parallel with two ranks: the scenario's tokens equal TP=1's, rank 0
    holds half of every MoE layer's experts, and its monitor reads TP=1's expert counts."""
    model_dir = tiny_model_factory("qwen3_moe")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    p0, p1, tail, x = random_prompts([5, 23, 12, 19], vocab, seed=3)
    prompts = [p0, p1, p1[:16] + tail, x]
    one = two = None
    try:
        one = _llm(model_dir, 1)
        expected = _scenario(one, prompts)
        expected_counts = _expert_counts(one)
        one.shutdown()
        two = _llm(model_dir, 2, enable_expert_parallel=True)
        got = _scenario(two, prompts)
        counts = _expert_counts(two)
        blocks = [
            m for m in two.engine_core.runner.model.modules() if isinstance(m, SparseMoeBlock)
        ]
    finally:
        _shutdown_all(one, two)
    assert got == expected
    assert counts == expected_counts and sum(counts[0]) > 0
    num_experts = blocks[0].config.num_experts
    assert [(b.expert_shard.start, b.expert_shard.stop) for b in blocks] == [
        (0, num_experts // 2)
    ] * len(blocks)
    assert all(b.w13.shape[0] == num_experts // 2 for b in blocks)


def test_a_killed_worker_fails_the_next_step(tiny_model_factory) -> None:
    """The worker is named sits-tp-rank1; SIGKILL to it between steps: the next step raises
    TensorParallelWorkerError naming the rank and its exit, every later step too, and
    shutdown still joins."""
    model_dir = tiny_model_factory("llama")
    llm = None
    try:
        llm = _llm(model_dir, 2)
        core = llm.engine_core
        runner = core.runner
        _add(core, "r", list(range(1, 30)))
        core.step()
        (pid,) = runner.worker_pids
        # its name in top and `ps -e` (set before the worker joined: the engine is built)
        assert Path(f"/proc/{pid}/comm").read_text() == "sits-tp-rank1\n"
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not runner.workers[0].process.is_alive())
        start_s = time.monotonic()
        with pytest.raises(TensorParallelWorkerError, match=r"rank 1 .*exited with code -9"):
            while core.has_unfinished_requests():
                core.step()
        assert time.monotonic() - start_s < HANG_S
        with pytest.raises(TensorParallelWorkerError):
            core.step()
    finally:
        _shutdown_all(llm)
    assert llm is not None and llm.engine_core.runner.workers == []


def test_a_hung_worker_fails_the_step_within_the_timeout(tiny_model_factory) -> None:
    """A stopped (SIGSTOP) worker still lives, but rank 0's step collective waits for it
    only until the timeout: the step raises TensorParallelWorkerError, and shutdown kills it."""
    model_dir = tiny_model_factory("llama")
    llm = None
    try:
        llm = _llm(model_dir, 2, timeout_s=HUNG_TIMEOUT_S)
        core = llm.engine_core
        _add(core, "r", list(range(1, 30)))
        core.step()
        os.kill(core.runner.worker_pids[0], signal.SIGSTOP)
        start_s = time.monotonic()
        with pytest.raises(TensorParallelWorkerError, match="sending the step"):
            while core.has_unfinished_requests():
                core.step()
        assert time.monotonic() - start_s >= HUNG_TIMEOUT_S * 0.9  # it waited on the collective
    finally:
        _shutdown_all(llm)


def test_flag_and_kwarg() -> None:
    parser = build_parser()
    for argv in (["-tp", "2"], ["--tensor-parallel-size", "2"]):
        args = parser.parse_args(["generate", "--model", "m", *argv, "--prompt", "hi"])
        assert engine_kwargs(args)["tensor_parallel_size"] == 2
    args = parser.parse_args(["serve", "--model", "m", "--tensor-parallel-timeout", "5"])
    kwargs = engine_kwargs(args)
    assert (kwargs["tensor_parallel_size"], kwargs["tensor_parallel_timeout_s"]) == (1, 5.0)
    assert EngineConfig(model="m", tensor_parallel_size=4).tensor_parallel_size == 4
    assert kwargs["enable_expert_parallel"] is False
    args = parser.parse_args(["serve", "--model", "m", "-tp", "2", "--enable-expert-parallel"])
    assert engine_kwargs(args)["enable_expert_parallel"] is True


@pytest.mark.parametrize(
    ("changes", "param", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", "must be >= 1, got 0"),
        ({"tensor_parallel_timeout_s": 0.0}, "tensor_parallel_timeout_s", "got 0.0"),
        (
            {
                "async_scheduling": True,
                "enable_expert_parallel": True,
                "expert_router_policy": "load-aware",
            },
            "async_scheduling",
            "async_scheduling is not supported with expert_router_policy 'load-aware'",
        ),
        ({"precision_switch": "fp8"}, "precision_switch", "tensor_parallel_size 2"),
        (
            {"num_spare_experts": 1, "enable_expert_parallel": True},
            "num_spare_experts",
            "not supported with enable_expert_parallel .* a spare slot would have to sit on "
            "the rank holding its expert",
        ),
    ],
)
def test_misconfiguration_is_refused(changes: dict, param: str, message: str) -> None:
    kwargs = {"model": "m", "tensor_parallel_size": 2, **changes}
    with pytest.raises(InvalidParameterError, match=message) as info:
        EngineConfig(**kwargs)
    assert info.value.param == param


def test_more_ranks_than_cuda_devices_is_refused() -> None:
    with pytest.raises(InvalidParameterError, match="needs 4 CUDA devices, but 2 are visible"):
        check_devices(4, "cuda", 2)
    check_devices(2, "cuda", 2)
    check_devices(8, "cpu", 0)  # a CPU runs any number of ranks


def test_engine_process_with_two_ranks_is_refused() -> None:
    from sits.engine.async_llm import AsyncLLM

    config = EngineConfig(model="m", tensor_parallel_size=2)
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size 2") as info:
        AsyncLLM(config, engine_process=True)
    assert info.value.param == "engine_process"


def test_a_size_the_model_does_not_fit_is_refused_before_any_worker(
    tiny_model_factory, monkeypatch
) -> None:
    """LLM(tensor_parallel_size=3) on a model of 4 heads: the error with the numbers, raised by
    rank 0's meta-device shard before a worker process is started."""
    from sits.runner import tp_executor

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(tp_executor.TensorParallelRunner, "_start_workers", no_workers)
    model_dir = tiny_model_factory("llama")
    with pytest.raises(InvalidParameterError, match="tensor parallel size 3 does not divide"):
        _llm(model_dir, 3)


def test_a_script_without_a_main_guard_gets_the_spawn_hint(tiny_model_factory, tmp_path) -> None:
    """A script that builds a TP engine at module level: its spawned worker re-imports the
    script and dies; the error tells the user to use a `__main__` guard."""
    import subprocess
    import sys

    model_dir = tiny_model_factory("llama")
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from sits import LLM\n"
        f"LLM({str(model_dir)!r}, tensor_parallel_size=2, max_model_len=64, max_num_seqs=2,\n"
        "    kv_cache_memory_bytes=1 << 20)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode != 0
    assert "TensorParallelWorkerError" in done.stderr
    assert 'under `if __name__ == "__main__":`' in done.stderr
