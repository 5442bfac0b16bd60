"""The precision switch on the GPU (Triton attention and GEMMs, decode and mixed-step CUDA
graphs for both weight sets): the twin's tokens equal a `quantization=` engine's, 100 switches
under load with async scheduling, and the memory refusal at start.

Run on the GPU machine: `pytest -m gpu tests/engine/test_precision_switch_gpu.py -s`
(-s prints the switch delays).
"""

from __future__ import annotations

import pytest
import torch

from sits import LLM, SamplingParams
from sits.core.errors import PrecisionSwitchMemoryError
from sits.layers.quant import config as quant_config
from sits.runner.backends import graph_safe
from tests.engine.test_precision_switch import run_with_switches

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 90 + 3 * i, 200 + i, 7, 8]} for i in range(8)]


@pytest.fixture(autouse=True)
def _small_int4_groups(monkeypatch) -> None:
    monkeypatch.setattr(quant_config, "ONLINE_INT4_GROUP_SIZE", 16)  # tiny K: 32 .. 128


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(
        model=str(model_dir), dtype="bfloat16", device="cuda", max_model_len=256,
        max_num_seqs=32, kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True, **kwargs,
    )  # fmt: skip


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_gpu_twin_tokens_equal_a_quantized_engine_under_graphs(
    tiny_model_factory, arch, scheme
) -> None:
    model_dir = tiny_model_factory(arch)
    llm = _llm(model_dir, precision_switch=scheme)
    runner = llm.engine_core.runner
    assert runner.graphs is not None and runner.mixed_graphs is not None
    twin_graphs = runner._graph_sets[scheme]
    if graph_safe(runner.models[scheme], runner.attn_backend):
        assert twin_graphs[0] is not None and twin_graphs[1] is not None
        assert twin_graphs[0].pool == runner.graphs.pool  # one memory pool for both sets
    full = _tokens(llm)
    assert full == _tokens(_llm(model_dir))
    llm.set_precision(scheme)
    assert _tokens(llm) == _tokens(_llm(model_dir, quantization=scheme))
    llm.set_precision("bf16")
    assert _tokens(llm) == full


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_100_switches_while_32_requests_run(tiny_model_factory, async_scheduling) -> None:
    llm = _llm(
        tiny_model_factory("qwen3_moe"), precision_switch="fp8", async_scheduling=async_scheduling
    )
    core = llm.engine_core
    prompts = [[1 + i, 40 + i, 300 - i, 7] for i in range(32)]
    schedule = {step: ("fp8", "bf16")[step % 2] for step in range(2, 102)}
    delays = []
    original = core.precision_control.mark_run

    def mark_run(plan):
        stamp = original(plan)
        if stamp.first_of_switch:
            delays.append(core.precision_state().last_switch_delay_s)
        return stamp

    core.precision_control.mark_run = mark_run
    tokens, switches = run_with_switches(core, prompts, 120, schedule)
    assert set(tokens) == {str(i) for i in range(32)}
    assert all(len(t) == 120 for t in tokens.values())
    assert all(n == 100 for n in switches.values())
    assert core.precision_state().num_switches == 100
    delays.sort()
    print(
        f"\nswitch delay (call -> launch of the first step in the new set), async "
        f"{async_scheduling}: median {delays[len(delays) // 2] * 1e3:.3f} ms, "
        f"max {delays[-1] * 1e3:.3f} ms over {len(delays)} switches"
    )


def test_gpu_two_sets_that_do_not_fit_are_refused_at_start(tiny_model_factory) -> None:
    with pytest.raises(PrecisionSwitchMemoryError) as info:
        LLM(
            model=str(tiny_model_factory("qwen3")), dtype="bfloat16", device="cuda",
            max_model_len=256, gpu_memory_utilization=0.001, precision_switch="fp8",
        )  # fmt: skip
    err = info.value
    assert err.twin_bytes > 0 and err.full_bytes > err.twin_bytes and err.budget_bytes < 0
