"""FP8 checkpoints and online FP8: each format's tiny checkpoint (made here with plain torch in
its documented layout) runs like the same model with the weights dequantized to float32.

References: the "dequantized" checkpoint holds q.float() * scale for every quantized tensor
and the original tensors elsewhere; sits loads it as a plain float32 model.
Tolerance: prompt logits agree within 1e-5 absolute (the quantized path dequantizes the same
float8 values with the same float32 scales, so they are in fact bit-identical on the CPU);
greedy tokens are equal.

Layouts (as vLLM and transformers' FineGrainedFP8 read them):
- fp8 block: `quant_method: fp8`, `weight_block_size: [bn, bk]`, `<m>.weight` float8_e4m3fn
  [N, K] and `<m>.weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)] (w = q * scale_inv).
- fp8 per-tensor, static activations: `<m>.weight_scale` [] and `<m>.input_scale` [].
- compressed-tensors float-quantized: channel `weight_scale` [N, 1]; tensor `weight_scale` [1]
  with a static `input_scale` [1]; `ignore` lists unquantized modules.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sits import LLM
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, UnsupportedModelError
from sits.engine.arg_utils import add_engine_args, engine_kwargs
from sits.kernels.fp8_ref import (
    FP8_DTYPE,
    dequantize_fp8,
    expand_block_scale,
    quantize_fp8_block,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
)
from sits.kernels.moe_ref import TorchMoe
from sits.layers.quant.fp8_linear import Fp8QKVLinear
from sits.layers.quant.fp8_moe import Fp8SparseMoeBlock
from sits.models.loader import load_model
from sits.runner.backends import graph_safe
from tests.models.paged import PagedRunner
from tests.models.quant_checkpoints import (
    PROMPT,
    greedy_tokens,
    prompt_logits,
    write_checkpoint,
)

BLOCK = (16, 24)  # bk does not divide hidden 64: ragged last column blocks
QUANTIZED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
QUANTIZED |= {"w1", "w2", "w3"}  # Mixtral experts
ATOL = 1e-5


def _is_quantized(name: str, ignore: tuple[str, ...] = ()) -> bool:
    module = name.removesuffix(".weight")
    return (
        name.endswith(".weight")
        and name.split(".")[-2] in QUANTIZED
        and not any(module.startswith(i) for i in ignore)
    )


def _ct_group(strategy: str, activations: dict | None) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**weights, "dynamic": False},
                "input_activations": activations,
            }
        },
    }


CT_DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
CT_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
FORMATS: dict[str, dict] = {
    "fp8_block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    },
    "fp8_tensor_static": {"quant_method": "fp8", "activation_scheme": "static"},
    "ct_channel": {**_ct_group("channel", CT_DYNAMIC), "ignore": ["lm_head"]},
    "ct_tensor_static": _ct_group("tensor", CT_STATIC),
    "ct_block": _ct_group("block", CT_DYNAMIC),
}
FORMATS["ct_block"]["config_groups"]["group_0"]["weights"]["block_structure"] = list(BLOCK)


def _quantize(
    fmt: str, name: str, weight: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[dict, torch.Tensor]:
    """(checkpoint tensors of one quantized weight, its float32 dequantization); `block`:
    the scale blocks of the block formats."""
    if fmt in ("fp8_block", "ct_block"):
        q, scale = quantize_fp8_block(weight, block)
        dq = q.float() * expand_block_scale(scale, *weight.shape, block)
        suffix = "_scale_inv" if fmt == "fp8_block" else "_scale"
        return {name: q, f"{name}{suffix}": scale}, dq
    if fmt == "ct_channel":
        q, scale = quantize_fp8_per_row(weight)
        return {name: q, f"{name}_scale": scale[:, None]}, q.float() * scale[:, None]
    q, scale = quantize_fp8_per_tensor(weight)
    module = name.removesuffix(".weight")
    input_scale = torch.tensor(0.02 + 0.001 * len(name))
    if fmt == "ct_tensor_static":
        scale, input_scale = scale.reshape(1), input_scale.reshape(1)
    return {
        name: q,
        f"{name}_scale": scale,
        f"{module}.input_scale": input_scale,
    }, q.float() * scale


@pytest.fixture(scope="module")
def fp8_pair(tiny_checkpoint, tmp_path_factory) -> Callable[[str, str], tuple[Path, Path]]:
    """`make(arch, fmt) -> (quantized checkpoint, dequantized float32 checkpoint)`."""
    base = tmp_path_factory.mktemp("fp8")
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(arch: str, fmt: str) -> tuple[Path, Path]:
        if (arch, fmt) not in made:
            src = tiny_checkpoint(arch)
            ignore = ("lm_head",) if fmt == "ct_channel" else ()
            quantized, dequantized = {}, {}
            for name, tensor in load_file(str(src / "model.safetensors")).items():
                if _is_quantized(name, ignore):
                    tensors, dequantized[name] = _quantize(fmt, name, tensor)
                    quantized.update(tensors)
                else:
                    quantized[name] = dequantized[name] = tensor
            made[arch, fmt] = (
                write_checkpoint(src, base / f"{arch}-{fmt}-q", quantized, FORMATS[fmt]),
                write_checkpoint(src, base / f"{arch}-{fmt}-dq", dequantized, None),
            )
        return made[arch, fmt]

    return make


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
def test_fp8_checkpoint_logits_equal_the_dequantized_model(fp8_pair, arch, fmt) -> None:
    quantized, dequantized = fp8_pair(arch, fmt)
    model = load_model(str(quantized), torch.float32, "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8QKVLinear) and qkv.weight.dtype == FP8_DTYPE
    assert model.lm_head.weight.dtype == torch.float32  # lm_head, norms, router: model dtype
    if arch != "llama":
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp, Fp8SparseMoeBlock) and mlp.w13.dtype == FP8_DTYPE
        assert mlp.gate.weight.dtype == torch.float32
    got = PagedRunner(model).step([("a", PROMPT)])[0]
    want = prompt_logits(dequantized)
    assert torch.allclose(got, want, rtol=0, atol=ATOL), (got - want).abs().max()


@pytest.mark.parametrize(
    ("arch", "fmt"), [("qwen3", "fp8_block"), ("qwen3_moe", "fp8_block"), ("llama", "ct_channel")]
)
def test_fp8_checkpoint_greedy_tokens_equal_the_dequantized_model(fp8_pair, arch, fmt) -> None:
    quantized, dequantized = fp8_pair(arch, fmt)
    assert greedy_tokens(quantized) == greedy_tokens(dequantized)


def _online_reference(src: Path, dst: Path) -> Path:
    """The float32 checkpoint whose quantized weights are the per-row FP8 ones dequantized."""
    weights = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _is_quantized(name):
            q, scale = quantize_fp8_per_row(tensor)
            tensor = q.float() * scale[:, None]
        weights[name] = tensor
    return write_checkpoint(src, dst, weights, None)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_online_fp8_equals_the_dequantized_fp8_weights(tiny_checkpoint, tmp_path, arch) -> None:
    src = tiny_checkpoint(arch)
    reference = _online_reference(src, tmp_path / "ref")
    model = load_model(str(src), torch.float32, "cpu", quantization="fp8")
    scale = model.model.layers[1].self_attn.qkv_proj.weight_scale
    assert scale.shape == (128,) and scale.dtype == torch.float32  # per output row
    got = PagedRunner(model).step([("a", PROMPT)])[0]
    assert torch.allclose(got, prompt_logits(reference), rtol=0, atol=ATOL)
    assert not torch.equal(got, prompt_logits(src))  # the weights really were rounded to FP8
    assert greedy_tokens(src, quantization="fp8") == greedy_tokens(reference)


def test_the_ignore_list_keeps_modules_unquantized(fp8_pair, tmp_path) -> None:
    quantized, dequantized = fp8_pair("llama", "fp8_block")
    weights = load_file(str(quantized / "model.safetensors"))
    plain = load_file(str(dequantized / "model.safetensors"))
    for name in [n for n in weights if n.startswith("model.layers.1.mlp.")]:
        del weights[name]
    weights.update({n: t for n, t in plain.items() if n.startswith("model.layers.1.mlp.")})
    config = {**FORMATS["fp8_block"], "modules_to_not_convert": ["model.layers.1.mlp"]}
    partial = write_checkpoint(quantized, tmp_path / "partial", weights, config)
    model = load_model(str(partial), torch.float32, "cpu")
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    got = PagedRunner(model).step([("a", PROMPT)])[0]
    assert torch.allclose(got, prompt_logits(dequantized), rtol=0, atol=ATOL)


def test_fp8_experts_fall_back_to_the_reference_off_the_fused_kernel(fp8_pair) -> None:
    """A backend without `experts_fp8` (the bf16 Triton MoE) is swapped for the reference,
    which is not CUDA-graph safe."""

    class Bf16Only:
        cuda_graph_safe = True

    quantized, dequantized = fp8_pair("qwen3_moe", "fp8_block")
    model = load_model(str(quantized), torch.float32, "cpu", moe_backend=Bf16Only())
    assert isinstance(model.model.layers[0].mlp.moe_backend, TorchMoe)
    triton_attention = type("TritonPagedAttention", (), {})()  # graph_safe reads its name
    assert graph_safe(
        load_model(str(dequantized), torch.float32, "cpu", moe_backend=Bf16Only()), triton_attention
    )
    assert not graph_safe(model, triton_attention)


def test_the_cli_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    config = EngineConfig(**engine_kwargs(parser.parse_args(["--model", "m", "-q", "fp8"])))
    assert config.quantization == "fp8"
    assert EngineConfig(model="m").quantization is None


# ---- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["awq_marlin", "bitsandbytes", "gguf", "nonsense"])
def test_unimplemented_quantization_flags_are_refused_at_start(name) -> None:
    with pytest.raises(InvalidParameterError) as info:
        LLM("/nonexistent", quantization=name)
    assert info.value.param == "quantization"
    supported = "supported: fp8, compressed-tensors, gptq, awq, int4"
    assert repr(name) in str(info.value) and supported in str(info.value)


@pytest.mark.parametrize(
    ("config", "found"),
    [
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "awq bits 8"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits 3"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported yet"),
        ({"quant_method": "hqq2"}, "unknown quant_method 'hqq2'"),
        (
            {**_ct_group("group", None), "format": "pack-quantized"},
            "pack-quantized weights",
        ),
        ({**_ct_group("group", None), "format": "int-quantized"}, "format 'int-quantized'"),
        ({**FORMATS["fp8_block"], "fmt": "e5m2"}, "fp8 fmt 'e5m2'"),
    ],
)
def test_unsupported_checkpoint_schemes_are_refused(tiny_checkpoint, tmp_path, config, found):
    src = tiny_checkpoint("llama")
    bad = write_checkpoint(src, tmp_path / "bad", load_file(str(src / "model.safetensors")), config)
    with pytest.raises(UnsupportedModelError, match="supported") as info:
        load_model(str(bad), torch.float32, "cpu")
    assert found in str(info.value)


def test_a_flag_that_disagrees_with_the_checkpoint_is_refused(fp8_pair) -> None:
    quantized, _ = fp8_pair("llama", "fp8_block")
    with pytest.raises(UnsupportedModelError, match="does not match the checkpoint's quant_method"):
        load_model(str(quantized), torch.float32, "cpu", quantization="compressed-tensors")


def _broken(fp8_pair, tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    quantized, _ = fp8_pair("qwen3_moe", "fp8_block")
    weights = load_file(str(quantized / "model.safetensors"))
    edit(weights)
    return write_checkpoint(quantized, tmp_path / "broken", weights, FORMATS["fp8_block"])


def test_a_missing_weight_scale_inv_is_named(fp8_pair, tmp_path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    broken = _broken(fp8_pair, tmp_path, lambda w: w.pop(name))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(broken), torch.float32, "cpu")
    message = str(info.value)
    assert "missing [model.layers.0.self_attn.{q,k,v}_proj.weight_scale_inv" in message
    assert "fp8 block [16, 24] weight_scale_inv" in message


def test_a_missing_expert_scale_is_named(fp8_pair, tmp_path) -> None:
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    broken = _broken(fp8_pair, tmp_path, lambda w: w.pop(name))
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.mlp\.experts\.<e>\.down_proj"):
        load_model(str(broken), torch.float32, "cpu")


def test_a_wrong_scale_shape_is_named_with_both_shapes(fp8_pair, tmp_path) -> None:
    name = "model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"  # [2, 3] for [32, 64]

    def edit(weights: dict) -> None:
        weights[name] = torch.ones(2, 4)

    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(_broken(fp8_pair, tmp_path, edit)), torch.float32, "cpu")
    assert f"checkpoint tensor {name} has shape (2, 4), expected (2, 3)" in str(info.value)


def test_a_weight_that_is_not_fp8_is_named_with_its_dtype(fp8_pair, tmp_path) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"

    def edit(weights: dict) -> None:
        weights[name] = weights[name].float()

    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(_broken(fp8_pair, tmp_path, edit)), torch.float32, "cpu")
    assert f"{name} has dtype torch.float32, expected torch.float8_e4m3fn" in str(info.value)


def test_spare_experts_are_refused_with_fp8(fp8_pair) -> None:
    quantized, _ = fp8_pair("qwen3_moe", "fp8_block")
    with pytest.raises(InvalidParameterError, match="not supported with FP8 experts"):
        load_model(str(quantized), torch.float32, "cpu", num_spare_experts=2)


def test_dummy_weights_of_a_block_fp8_checkpoint_are_block_quantized(fp8_pair) -> None:
    quantized, _ = fp8_pair("qwen3_moe", "fp8_block")
    model = load_model(str(quantized), torch.float32, "cpu", load_format="dummy", seed=3)
    experts = next(m for m in model.modules() if isinstance(m, Fp8SparseMoeBlock))
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.block == BLOCK
    # each 16 x 24 block's largest magnitude maps onto 448 (amax / scale)
    dequantized = dequantize_fp8(experts.w13[0], experts.w13_scale[0], BLOCK, torch.float32)
    assert torch.isfinite(dequantized).all() and dequantized.abs().max() > 0
    assert experts.w13[0].float().abs().max().item() == 448.0
