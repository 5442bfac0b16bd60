"""INT4 weight-only (w4a16) checkpoints and online INT4: each format's tiny checkpoint (packed
here with plain torch in its documented layout, independently of `sits`) runs like the same
model with the weights dequantized to float32.

References: the "dequantized" checkpoint holds (code - zero) * scale in float32 for every
quantized tensor (with the scales as stored, fp16 for GPTQ / AWQ) and the original tensors
elsewhere; sits loads it as a plain float32 model.
Tolerance: prompt logits agree within 1e-5 absolute (both sides multiply the same small
integers by the same float32 scales, so the weights are bit-identical; only matmul order may
differ); greedy tokens are equal.

Layouts (as vLLM and the compressed-tensors / AutoGPTQ / AutoAWQ packers write them), for a
weight [N, K], group G (16 here: the tiny models' K is 32 .. 128):
- compressed-tensors pack-quantized: `weight_packed` [N, K / 8] int32, code k of a row at bits
  4 * (k % 8) of word k // 8, code = signed value + 8; `weight_scale` [N, K / G];
  `weight_shape` [2].
- GPTQ: `qweight` [K / 8, N] (packed along K), `qzeros` [K / G, N / 8] (packed along N, zero - 1),
  `scales` [K / G, N] fp16, `g_idx` [K] (k // G, or a permutation's groups with desc_act).
- AWQ GEMM: `qweight` [K, N / 8] and `qzeros` [K / G, N / 8] packed along N in the order
  (0, 2, 4, 6, 1, 3, 5, 7), `scales` [K / G, N] fp16.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sits.core.errors import InvalidParameterError, UnsupportedModelError
from sits.layers.quant import config as quant_config
from sits.layers.quant.int4_linear import Int4QKVLinear
from sits.layers.quant.int4_moe import Int4SparseMoeBlock
from sits.models.loader import load_model
from tests.models.paged import PagedRunner
from tests.models.quant_checkpoints import (
    PROMPT,
    greedy_tokens,
    prompt_logits,
    write_checkpoint,
)

GROUP = 16
QUANTIZED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
QUANTIZED |= {"w1", "w2", "w3"}  # Mixtral experts
ATOL = 1e-5
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

FORMATS: dict[str, dict] = {
    "ct": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": GROUP, "dynamic": False, "actorder": None,
                },  # fmt: skip
                "input_activations": None,
            }
        },
        "ignore": ["lm_head"],
    },
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False},
    "gptq_act": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
            "zero_point": True},
}  # fmt: skip


def _is_quantized(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes in 0..15 -> [R, C / 8] int32, code j of each word at bits 4 * j."""
    words = codes.long().reshape(codes.shape[0], -1, 8)
    value = sum(words[..., j] << (4 * j) for j in range(8))
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def _group_quantize(weight: torch.Tensor, g_idx: torch.Tensor, symmetric: bool):
    """(codes [N, K] 0..15, scale [N, K / G], zero [N, K / G]) with w ~= (code - zero) * scale."""
    num_rows, num_groups = weight.shape[0], int(g_idx.max()) + 1
    scale, zero = torch.empty(num_rows, num_groups), torch.empty(num_rows, num_groups)
    for g in range(num_groups):
        cols = weight[:, g_idx == g]
        if symmetric:
            scale[:, g], zero[:, g] = cols.abs().amax(1) / 7, 8
        else:
            low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale[:, g] = (high - low) / 15
            zero[:, g] = (-low / scale[:, g]).round().clamp(0, 15)
    if not symmetric:
        scale = scale.half().float()  # the checkpoint stores fp16 scales
    codes = (weight / scale[:, g_idx]).round() + zero[:, g_idx]
    return codes.clamp(0, 15).long(), scale, zero.long()


def _quantize(fmt: str, name: str, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(checkpoint tensors of one quantized weight, its float32 dequantization)."""
    num_rows, num_cols = weight.shape
    module = name.removesuffix(".weight")
    g_idx = torch.arange(num_cols) // GROUP
    if fmt == "gptq_act":
        g_idx = g_idx[torch.randperm(num_cols, generator=torch.Generator().manual_seed(len(name)))]
    codes, scale, zero = _group_quantize(weight, g_idx, symmetric=fmt == "ct")
    dequantized = (codes - zero[:, g_idx]).float() * scale[:, g_idx]
    if fmt == "ct":
        return {
            f"{module}.weight_packed": _pack(codes),
            f"{module}.weight_scale": scale,
            f"{module}.weight_shape": torch.tensor([num_rows, num_cols]),
        }, dequantized
    if fmt == "awq":
        by_order = lambda t: t.reshape(t.shape[0], -1, 8)[..., AWQ_ORDER].reshape(t.shape)  # noqa: E731
        return {
            f"{module}.qweight": _pack(by_order(codes.T)),
            f"{module}.qzeros": _pack(by_order(zero.T)),
            f"{module}.scales": scale.T.half(),
        }, dequantized
    return {
        # packed along K: word i of column n holds codes 8i .. 8i + 7 of row n
        f"{module}.qweight": _pack(codes).T.contiguous(),
        f"{module}.qzeros": _pack((zero.T - 1) & 0xF),
        f"{module}.scales": scale.T.half(),
        f"{module}.g_idx": g_idx.to(torch.int32),
    }, dequantized


@pytest.fixture(scope="module")
def int4_pair(tiny_checkpoint, tmp_path_factory) -> Callable[[str, str], tuple[Path, Path]]:
    """`make(arch, fmt) -> (quantized checkpoint, dequantized float32 checkpoint)`."""
    base = tmp_path_factory.mktemp("int4")
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(arch: str, fmt: str) -> tuple[Path, Path]:
        if (arch, fmt) not in made:
            src = tiny_checkpoint(arch)
            quantized, dequantized = {}, {}
            for name, tensor in load_file(str(src / "model.safetensors")).items():
                if _is_quantized(name):
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


CASES = [(arch, fmt) for fmt in ("ct", "gptq", "awq") for arch in ("llama", "qwen3_moe", "mixtral")]


@pytest.mark.parametrize(("arch", "fmt"), [*CASES, ("qwen3", "gptq_act")])
def test_int4_checkpoint_logits_equal_the_dequantized_model(int4_pair, arch, fmt) -> None:
    quantized, dequantized = int4_pair(arch, fmt)
    model = load_model(str(quantized), torch.float32, "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4QKVLinear) and qkv.weight.dtype == torch.int32
    assert model.lm_head.weight.dtype == torch.float32  # lm_head, norms, router: model dtype
    if arch not in ("llama", "qwen3"):
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp, Int4SparseMoeBlock) and mlp.w13.dtype == torch.int32
        assert mlp.gate.weight.dtype == torch.float32
    got = PagedRunner(model).step([("a", PROMPT)])[0]
    want = prompt_logits(dequantized)
    assert torch.allclose(got, want, rtol=0, atol=ATOL), (got - want).abs().max()


@pytest.mark.parametrize(
    ("arch", "fmt"), [("qwen3", "ct"), ("qwen3_moe", "gptq"), ("mixtral", "awq")]
)
def test_int4_checkpoint_greedy_tokens_equal_the_dequantized_model(int4_pair, arch, fmt) -> None:
    quantized, dequantized = int4_pair(arch, fmt)
    assert greedy_tokens(quantized) == greedy_tokens(dequantized)


def _online_reference(src: Path, dst: Path) -> Path:
    """The float32 checkpoint whose quantized weights are the symmetric INT4 ones dequantized:
    per group of 16, scale = r * amax / 7 for the r of 1.0, 0.95, ..., 0.7 whose codes in
    -8 .. 7 give the least squared error (the first such r on ties)."""
    weights = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _is_quantized(name):
            groups = tensor.reshape(tensor.shape[0], -1, GROUP)
            amax = groups.abs().amax(-1, keepdim=True)
            candidates = []
            for ratio in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
                scale = torch.where(amax > 0, amax * ratio / 7, torch.ones_like(amax))
                rounded = (groups / scale).round().clamp(-8, 7) * scale
                candidates.append((((rounded - groups) ** 2).sum(-1), rounded))
            errors = torch.stack([error for error, _ in candidates])  # [R, N, K / G]
            best = errors.argmin(dim=0)  # the first least error
            rounded = torch.stack([r for _, r in candidates])  # [R, N, K / G, G]
            pick = best[None, ..., None].expand(1, *rounded.shape[1:])
            tensor = rounded.gather(0, pick)[0].reshape(tensor.shape)
        weights[name] = tensor
    return write_checkpoint(src, dst, weights, None)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_online_int4_equals_the_dequantized_int4_weights(
    tiny_checkpoint, tmp_path, monkeypatch, arch
) -> None:
    monkeypatch.setattr(quant_config, "ONLINE_INT4_GROUP_SIZE", GROUP)  # tiny K: 32 .. 128
    src = tiny_checkpoint(arch)
    reference = _online_reference(src, tmp_path / "ref")
    model = load_model(str(src), torch.float32, "cpu", quantization="int4")
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.shape == (128, 8) and qkv.weight_scale.shape == (128, 64 // GROUP)
    got = PagedRunner(model).step([("a", PROMPT)])[0]
    assert torch.allclose(got, prompt_logits(reference), rtol=0, atol=ATOL)
    assert not torch.equal(got, prompt_logits(src))  # the weights really were rounded to INT4
    assert greedy_tokens(src, quantization="int4") == greedy_tokens(reference)


# ---- refusals -----------------------------------------------------------------------------


def test_online_int4_halves_its_group_to_fit_a_small_model(tiny_checkpoint) -> None:
    # hidden 64 and MLP 128: group 128 does not divide 64, group 64 divides both
    model = load_model(str(tiny_checkpoint("llama")), torch.float32, "cpu", quantization="int4")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant.group_size == 64 and qkv.weight_scale.shape == (128, 1)
    assert qkv.quant.describe() == "int4 group 64 symmetric (online)"
    down = model.model.layers[0].mlp.down_proj  # K = 128: still one group of 64 per half
    assert down.weight_scale.shape == (64, 2)


def test_online_int4_refuses_widths_no_group_divides(tiny_checkpoint) -> None:
    # intermediate 136 = 8 x 17: no group of 128 .. 16 divides it
    src = tiny_checkpoint("llama", intermediate_size=136)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(src), torch.float32, "cpu", quantization="int4")
    message = str(info.value)  # the first module the scheme cannot hold, named
    assert "self_attn" in message and "does not divide its 64 input columns" in message
    assert "int4 group 128 symmetric (online)" in message


def _broken(int4_pair, tmp_path: Path, fmt: str, edit: Callable[[dict], None]) -> Path:
    quantized, _ = int4_pair("qwen3_moe", fmt)
    weights = load_file(str(quantized / "model.safetensors"))
    edit(weights)
    return write_checkpoint(quantized, tmp_path / "broken", weights, FORMATS[fmt])


def _refusal(path: Path) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(path), torch.float32, "cpu")
    return str(info.value)


def test_missing_qzeros_are_named(int4_pair, tmp_path) -> None:
    name = "model.layers.0.self_attn.k_proj.qzeros"
    message = _refusal(_broken(int4_pair, tmp_path, "awq", lambda w: w.pop(name)))
    assert "missing [model.layers.0.self_attn.{q,k,v}_proj.qzeros" in message
    assert "awq int4 group 16 zero points" in message


def test_a_missing_expert_scale_is_named(int4_pair, tmp_path) -> None:
    name = "model.layers.1.mlp.experts.3.down_proj.scales"
    message = _refusal(_broken(int4_pair, tmp_path, "gptq", lambda w: w.pop(name)))
    assert "layers.1.mlp.experts.<e>.down_proj.scales" in message


@pytest.mark.parametrize(
    ("fmt", "name", "bad", "found", "expected"),
    [
        ("ct", "model.layers.0.self_attn.o_proj.weight_packed", (64, 4), (64, 4), (64, 8)),
        ("gptq", "model.layers.0.mlp.experts.2.up_proj.qweight", (4, 32), (4, 32), (8, 32)),
        ("awq", "model.layers.1.self_attn.v_proj.qweight", (64, 8), (64, 8), (64, 4)),
    ],
)
def test_a_wrong_packed_shape_is_named_with_both_shapes(
    int4_pair, tmp_path, fmt, name, bad, found, expected
) -> None:
    def edit(weights: dict) -> None:
        weights[name] = torch.zeros(bad, dtype=torch.int32)

    message = _refusal(_broken(int4_pair, tmp_path, fmt, edit))
    assert f"checkpoint tensor {name} has shape {found}, expected {expected}" in message


def test_a_wrong_weight_shape_and_a_sequential_g_idx_are_checked(int4_pair, tmp_path) -> None:
    name = "model.layers.0.mlp.experts.1.gate_proj.weight_shape"
    message = _refusal(
        _broken(int4_pair, tmp_path, "ct", lambda w: w.update({name: torch.tensor([64, 32])}))
    )
    assert f"{name} is [64, 32], expected [32, 64]" in message
    g_idx = "model.layers.1.self_attn.q_proj.g_idx"
    path = _broken(int4_pair, tmp_path / "g", "gptq", lambda w: w[g_idx].copy_(w[g_idx].flip(0)))
    assert "is not k // 16 but desc_act is false" in _refusal(path)


def test_a_group_size_that_does_not_divide_k_is_refused(int4_pair, tmp_path) -> None:
    quantized, _ = int4_pair("qwen3_moe", "gptq")
    config = {**FORMATS["gptq"], "group_size": 48}
    bad = write_checkpoint(
        quantized, tmp_path / "g48", load_file(str(quantized / "model.safetensors")), config
    )
    assert "group size 48 does not divide its 64 input columns" in _refusal(bad)


@pytest.mark.parametrize(
    ("config", "found"),
    [
        ({**FORMATS["gptq"], "bits": 8}, "gptq bits 8"),
        ({**FORMATS["awq"], "version": "gemv"}, "version 'gemv'"),
        ({**FORMATS["gptq"], "group_size": -1}, "group_size -1"),
        ({**FORMATS["gptq_act"]}, "GPTQ desc_act experts are not supported yet"),
    ],
)
def test_unsupported_int4_schemes_are_refused(int4_pair, tmp_path, config, found) -> None:
    quantized, _ = int4_pair("qwen3_moe", "gptq")
    bad = write_checkpoint(
        quantized, tmp_path / "bad", load_file(str(quantized / "model.safetensors")), config
    )
    assert found in _refusal(bad)


def test_asymmetric_compressed_tensors_is_refused(int4_pair, tmp_path) -> None:
    quantized, _ = int4_pair("llama", "ct")
    config = json.loads(json.dumps(FORMATS["ct"]))
    config["config_groups"]["group_0"]["weights"]["symmetric"] = False
    bad = write_checkpoint(
        quantized, tmp_path / "asym", load_file(str(quantized / "model.safetensors")), config
    )
    assert "pack-quantized weights" in _refusal(bad)


def test_spare_experts_are_refused_with_int4(int4_pair) -> None:
    quantized, _ = int4_pair("qwen3_moe", "awq")
    with pytest.raises(InvalidParameterError, match="not supported with INT4 experts"):
        load_model(str(quantized), torch.float32, "cpu", num_spare_experts=2)
