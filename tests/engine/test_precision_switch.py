"""The runtime precision switch (`EngineConfig.precision_switch`, issue 25): the low-precision
twin, switching while requests run, and the errors.

References:
- The twin against an engine built with `quantization=` the same scheme (the online-quantized
  load of the checkpoint): its quantized tensors are bit-identical, so greedy tokens are equal.
- A request across switches against the models run step by step on one plain paged KV cache
  (`tests.models.paged.PagedRunner`): the full model (`load_model`) for the steps before a
  switch, the separately loaded quantized model (`load_model(quantization=)`) after it,
  continuing on the KV the full model wrote; greedy tokens are equal (float32 on the CPU).
Online INT4 uses group 16 here (the tiny models' K is 32 .. 128, under the real 128).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from sits import LLM, SamplingParams
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, PrecisionSwitchMemoryError
from sits.core.precision import PrecisionState
from sits.engine.arg_utils import add_engine_args, engine_kwargs
from sits.engine.output_processor import make_engine_requests
from sits.layers.quant import config as quant_config
from sits.models.loader import load_model
from sits.models.precision_twin import build_twin, check_unquantized, meta_twin
from sits.runner.precision import check_twin_fits
from tests.models.paged import PagedRunner

PROMPTS = [[5, 77, 300, 12, 9, 480, 31], [400, 2, 2, 71, 8], [17, 99, 260, 3, 44, 45]]
GROUP = 16


@pytest.fixture(autouse=True)
def _small_int4_groups(monkeypatch) -> None:
    monkeypatch.setattr(quant_config, "ONLINE_INT4_GROUP_SIZE", GROUP)


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(
        str(model_dir), dtype="float32", max_model_len=256, skip_tokenizer_init=True, **kwargs
    )


def _greedy(llm: LLM, prompts, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(("arch", "scheme"), [("qwen2", "fp8"), ("qwen3_moe", "int4")])
def test_the_twin_shares_unquantized_tensors_and_equals_a_quantized_engine(
    tiny_model_factory, arch, scheme
) -> None:
    model_dir = tiny_model_factory(arch)
    llm = _llm(model_dir, precision_switch=scheme)
    runner = llm.engine_core.runner
    full, twin = runner.models["fp32"], runner.models[scheme]
    assert list(runner.models) == ["fp32", scheme] and runner.precision == "fp32"
    full_params = dict(full.named_parameters(remove_duplicate=False))
    shared = {
        name
        for name, param in twin.named_parameters(remove_duplicate=False)
        if name in full_params and param.data_ptr() == full_params[name].data_ptr()
    }
    expected = {
        name
        for name in full_params
        if "embed" in name or "norm" in name or name.startswith("lm_head")
        or name.endswith((".bias", "mlp.gate.weight"))
    }  # fmt: skip
    assert shared == expected
    assert any(name.endswith(".bias") for name in shared) == (arch == "qwen2")
    assert any(name.endswith("mlp.gate.weight") for name in shared) == (arch == "qwen3_moe")
    if arch == "qwen3_moe":  # one expert state: a frozen expert is frozen in both sets
        blocks = (full.model.layers[1].mlp, twin.model.layers[1].mlp)
        assert blocks[0].expert_state() is blocks[1].expert_state()
    full_tokens = _greedy(llm, PROMPTS)
    assert llm.set_precision(scheme).current == scheme
    twin_tokens = _greedy(llm, PROMPTS)
    quantized = _greedy(_llm(model_dir, quantization=scheme), PROMPTS)
    assert twin_tokens == quantized
    assert llm.set_precision("fp32").num_switches == 2
    assert _greedy(llm, PROMPTS) == full_tokens


@pytest.mark.parametrize(("arch", "scheme"), [("qwen3", "fp8"), ("qwen3_moe", "int4")])
def test_a_float32_checkpoint_served_in_bf16_quantizes_its_bf16_values(
    tiny_model_factory, arch, scheme
) -> None:
    """The tiny checkpoints are float32: the loader's online quantization must quantize the
    bf16 values the engine serves, as the twin does (the GPU test runs bf16 and caught it)."""
    model_dir = tiny_model_factory(arch)
    full = load_model(str(model_dir), torch.bfloat16, "cpu")
    twin = build_twin(full, meta_twin(str(model_dir), scheme, torch.bfloat16), torch.device("cpu"))
    quantized = load_model(str(model_dir), torch.bfloat16, "cpu", quantization=scheme)
    expected = dict(quantized.named_parameters())
    compared = 0
    for name, param in twin.named_parameters():
        assert param.dtype == expected[name].dtype, name
        assert torch.equal(param.view(torch.uint8), expected[name].view(torch.uint8)), name
        compared += param.dtype in (torch.float8_e4m3fn, torch.int32)  # the quantized storage
    storage = (torch.float8_e4m3fn, torch.int32)
    assert compared == sum(p.dtype in storage for p in expected.values()) > 0


def _reference(model_dir, scheme: str, prompt: list[int], precisions: list[str]) -> list[int]:
    """Greedy tokens of `prompt` with token k made by the model `precisions[k]` names, every
    model reading and writing one paged KV cache (the prompt's KV by the first one)."""
    models = {
        "fp32": load_model(str(model_dir), torch.float32, "cpu"),
        scheme: load_model(str(model_dir), torch.float32, "cpu", quantization=scheme),
    }
    paged = PagedRunner(models["fp32"])
    tokens: list[int] = []
    for step, precision in enumerate(precisions):
        paged.model = models[precision]
        new = prompt if step == 0 else tokens[-1:]
        logits = paged.step([("r", new)])[0]  # [len(new), vocab]
        tokens.append(int(logits[-1].argmax()))
    return tokens


def run_with_switches(core, prompts, max_tokens: int, switch_before: dict[int, str]):
    """Step the engine core, switching before the steps `switch_before` names; per request
    its (token, precision) pairs and the switch count of its last output."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        for child in make_engine_requests(
            str(i), prompt, params, eos_token_ids=(0,), max_model_len=256,
            enable_prefix_caching=False,
        ):  # fmt: skip
            core.add_request(child)
    tokens: dict[str, list[tuple[int, str]]] = {}
    switches: dict[str, int] = {}
    step = 0
    while core.has_unfinished_requests():
        step += 1
        if step in switch_before:
            before = [kv.clone() for kv in core.runner.kv_caches]
            core.set_precision(switch_before[step])
            assert all(torch.equal(a, b) for a, b in zip(before, core.runner.kv_caches))
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(
                (t, out.precision) for t in out.new_token_ids
            )
            switches[out.request_id] = out.num_precision_switches
    return tokens, switches


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("arch", "scheme"), [("qwen3", "int4"), ("qwen3_moe", "fp8")])
def test_a_request_across_switches_equals_each_precision_where_it_ran(
    tiny_model_factory, arch, scheme, async_scheduling
) -> None:
    model_dir = tiny_model_factory(arch)
    llm = _llm(model_dir, precision_switch=scheme, async_scheduling=async_scheduling)
    schedule = {3: scheme, 6: "fp32", 8: scheme}  # step -> the set it and later steps run
    tokens, switches = run_with_switches(llm.engine_core, PROMPTS, 12, schedule)
    differs = False
    for i, prompt in enumerate(PROMPTS):
        got = tokens[str(i)]
        precisions = [p for _, p in got]
        if not async_scheduling:  # step k makes token k
            expected = [
                next((schedule[s] for s in sorted(schedule, reverse=True) if s <= k), "fp32")
                for k in range(1, 13)
            ]
            assert precisions == expected
        assert switches[str(i)] == 3
        ids = [t for t, _ in got]
        assert ids == _reference(model_dir, scheme, prompt, precisions)
        differs |= ids != _reference(model_dir, scheme, prompt, ["fp32"] * 12)
    assert differs or scheme == "fp8"  # int4 changes the tokens: the switch is observable
    state = llm.precision_state()
    assert (state.current, state.num_switches, state.available) == (scheme, 3, ("fp32", scheme))
    assert state.last_switch_delay_s is not None and state.last_switch_delay_s >= 0
    assert state.last_switch_step == (8 if not async_scheduling else 9)


def test_100_switches_while_16_requests_run(tiny_model_factory) -> None:
    llm = _llm(tiny_model_factory("qwen3"), precision_switch="int4", max_num_seqs=32)
    core = llm.engine_core
    prompts = [[1 + i, 40 + i, 300 - i, 7] for i in range(16)]
    names = ["int4", "fp32"]
    schedule = {step: names[step % 2] for step in range(2, 102)}  # before steps 2 .. 101
    tokens, switches = run_with_switches(core, prompts, 110, schedule)
    assert set(tokens) == {str(i) for i in range(16)}
    assert all(len(t) == 110 for t in tokens.values())
    assert all(n == 100 for n in switches.values())
    for got in tokens.values():
        assert [p for _, p in got][:4] == ["fp32", "int4", "fp32", "int4"]
        assert [p for _, p in got][100:] == ["fp32"] * 10
    state = core.precision_state()
    assert (state.num_switches, state.last_switch_step, state.current) == (100, 101, "fp32")
    assert not core.has_unfinished_requests()


def test_request_outputs_carry_the_precision_and_the_switches(tiny_model_factory) -> None:
    llm = _llm(tiny_model_factory("qwen3"), precision_switch="fp8")
    core = llm.engine_core
    step = core.step

    def switching_step(*args):
        if core.stats.num_steps in (2, 4):  # before steps 3 and 5
            llm.set_precision("fp8" if core.stats.num_steps == 2 else "fp32")
        return step(*args)

    core.step = switching_step
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    assert [(o.precision, o.num_precision_switches) for o in outs] == [("fp32", 2)] * 3
    plain = _llm(tiny_model_factory("qwen3")).generate(
        [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2)
    )[0]
    assert (plain.precision, plain.num_precision_switches) == (None, 0)


def test_errors(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3")
    llm = _llm(model_dir, precision_switch="fp8")
    with pytest.raises(InvalidParameterError) as info:
        llm.set_precision("int4")
    assert info.value.param == "precision" and "fp32, fp8" in str(info.value)
    assert llm.set_precision("fp32") == PrecisionState("fp32", ("fp32", "fp8"))  # no switch
    plain = _llm(model_dir)
    with pytest.raises(InvalidParameterError, match="no precision switch"):
        plain.set_precision("fp8")
    assert plain.precision_state() == PrecisionState("fp32", ("fp32",))
    with pytest.raises(InvalidParameterError, match="cannot be combined with quantization"):
        EngineConfig(model="m", precision_switch="int4", quantization="int4")
    with pytest.raises(InvalidParameterError, match="must be one of"):
        EngineConfig(model="m", precision_switch="awq")
    with pytest.raises(InvalidParameterError, match="num_spare_experts"):
        EngineConfig(model="m", precision_switch="fp8", num_spare_experts=1)


def test_the_flag_reaches_the_config_and_is_refused_with_quantization() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    args = parser.parse_args(["--model", "m", "--precision-switch", "int4"])
    assert EngineConfig(**engine_kwargs(args)).precision_switch == "int4"
    args = parser.parse_args(["--model", "m", "--precision-switch", "fp8", "-q", "fp8"])
    with pytest.raises(InvalidParameterError, match="cannot be combined"):
        EngineConfig(**engine_kwargs(args))


def test_a_quantized_checkpoint_is_refused(tiny_model_factory) -> None:
    quantized = load_model(
        str(tiny_model_factory("qwen3")), torch.float32, "cpu", quantization="fp8"
    )
    with pytest.raises(InvalidParameterError, match="already quantized") as info:
        check_unquantized(quantized)  # what the runner runs before building the twin
    assert info.value.param == "precision_switch"


def test_both_sets_that_do_not_fit_are_refused_with_the_numbers() -> None:
    check_twin_fits("int4", full_bytes=16, twin_bytes=5, min_kv_bytes=4, budget_bytes=9)
    check_twin_fits("int4", full_bytes=16, twin_bytes=5, min_kv_bytes=4, budget_bytes=None)
    with pytest.raises(PrecisionSwitchMemoryError) as info:
        check_twin_fits("int4", full_bytes=16, twin_bytes=5, min_kv_bytes=4, budget_bytes=8)
    err = info.value
    assert (err.full_bytes, err.twin_bytes, err.min_kv_bytes, err.budget_bytes) == (16, 5, 4, 8)
    assert "5 bytes for the int4 weights beside the 16 bytes" in str(err)
    assert "only 8 bytes" in str(err) and err.param == "precision_switch"


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_restoring_an_expert_requantizes_it_into_the_twin(tiny_model_factory, scheme) -> None:
    from sits.runner.expert_health import ExpertMonitor

    model_dir = tiny_model_factory("qwen3_moe")
    fresh = _llm(model_dir, precision_switch=scheme).engine_core.runner.models[scheme]
    llm = _llm(model_dir, precision_switch=scheme)
    runner = llm.engine_core.runner
    full, twin = runner.models["fp32"], runner.models[scheme]
    monitor = ExpertMonitor.of_model(full, model_dir=str(model_dir), twins=[twin])
    layer, expert = 1, 3
    storage = ("w13", "w13_scale", "w2", "w2_scale")
    with torch.no_grad():  # a corrupted expert in both sets
        full.model.layers[layer].mlp.w13[expert].fill_(float("nan"))
        for name in storage:
            getattr(twin.model.layers[layer].mlp, name)[expert].zero_()
    monitor.restore(layer, expert)
    got, want = twin.model.layers[layer].mlp, fresh.model.layers[layer].mlp
    for name in storage:
        assert torch.equal(
            getattr(got, name).view(torch.uint8), getattr(want, name).view(torch.uint8)
        ), name
    assert torch.isfinite(full.model.layers[layer].mlp.w13).all()
    reference = _llm(model_dir, precision_switch=scheme)
    for engine in (llm, reference):  # the restored expert, run in the low precision
        engine.set_precision(scheme)
    assert _greedy(llm, [[5, 9, 200, 31]]) == _greedy(reference, [[5, 9, 200, 31]])
