"""Quantizing weights already on the device (`layers.quant.fill`) and quantized dummy weights
(`models.dummy_quant`).

References:
- `fill`: the loader's online quantization of the same checkpoint (`load_model(...,
  quantization=...)`, which streams checkpoint tensors through `_online_*_pairs` and the
  format converters): the storage written from the bf16 model's weights equals it exactly.
- dummy quantized weights: the bf16 dummy model of the same seed; its quantized modules'
  storage equals `fill` of the bf16 dummy weights exactly, every other parameter is equal,
  and the greedy tokens of the engine equal those of the online quantization of that bf16
  dummy model saved as a checkpoint... (the last through the model's logits: max abs
  difference 0 on the same inputs).
"""

from __future__ import annotations

import pytest
import torch

from sits.layers.quant import config as quant_config
from sits.layers.quant.fill import quantize_experts_, quantize_linear_, storage_names
from sits.layers.quant.fp8_moe import Fp8SparseMoeBlock
from sits.layers.quant.int4_moe import Int4SparseMoeBlock
from sits.models.loader import load_model

GROUP = 16  # tiny K: 32 .. 128
ARCHS = ["llama", "qwen3_moe", "mixtral"]


def _quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if storage_names(m)}


def _fill_from(full: torch.nn.Module, quantized: torch.nn.Module) -> None:
    """Write `quantized`'s quantized modules from `full`'s model-dtype weights."""
    modules = dict(full.named_modules())
    for name, module in _quantized_modules(quantized).items():
        source = modules[name]
        if isinstance(module, (Fp8SparseMoeBlock, Int4SparseMoeBlock)):
            quantize_experts_(module, source.w13.data, source.w2.data)
        else:
            quantize_linear_(module, source.weight.data)


def _assert_same_parameters(actual: torch.nn.Module, expected: torch.nn.Module) -> int:
    want = dict(expected.named_parameters())
    count = 0
    for name, param in actual.named_parameters():
        assert param.dtype == want[name].dtype, name
        assert torch.equal(param.view(torch.uint8), want[name].view(torch.uint8)), name
        count += 1
    assert count == len(want)
    return count


@pytest.fixture(autouse=True)
def _small_int4_groups(monkeypatch) -> None:
    monkeypatch.setattr(quant_config, "ONLINE_INT4_GROUP_SIZE", GROUP)


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fill_equals_the_loaders_online_quantization(tiny_checkpoint, arch, scheme) -> None:
    src = str(tiny_checkpoint(arch))
    online = load_model(src, torch.float32, "cpu", quantization=scheme)
    full = load_model(src, torch.float32, "cpu")
    filled = load_model(src, torch.float32, "cpu", quantization=scheme)
    for module in _quantized_modules(filled).values():  # forget what the loader wrote
        for local in storage_names(module):
            param = getattr(module, local, None)
            if param is not None:
                param.data.zero_()
    _fill_from(full, filled)
    assert len(_quantized_modules(filled)) > 0
    _assert_same_parameters(filled, online)


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_quantized_weights_are_the_quantized_dummy_model(tiny_checkpoint, arch, scheme):
    src = str(tiny_checkpoint(arch))
    dummy = load_model(src, torch.float32, "cpu", load_format="dummy", seed=7,
                       quantization=scheme)  # fmt: skip
    full = load_model(src, torch.float32, "cpu", load_format="dummy", seed=7)
    expected = load_model(src, torch.float32, "cpu", quantization=scheme)  # any weights
    full_params = dict(full.named_parameters())
    for name, param in expected.named_parameters():  # non-quantized: the dummy values
        if name in full_params and param.dtype == full_params[name].dtype:
            param.data.copy_(full_params[name].data)
    _fill_from(full, expected)
    _assert_same_parameters(dummy, expected)
    ids = torch.tensor([5, 77, 300, 12, 9])
    logits_q = _last_logits(dummy, ids)
    logits_full = _last_logits(full, ids)
    assert torch.isfinite(logits_q).all()
    assert not torch.equal(logits_q, logits_full)  # the weights really are quantized


def _last_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from tests.models.paged import PagedRunner

    return PagedRunner(model).step([("a", ids.tolist())])[0]
