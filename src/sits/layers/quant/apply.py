"""Turning a model-dtype decoder into its quantized twin by module swaps, before weights load.

Invariants:
- Quantized (FP8 or INT4 modules, by the scheme): every attention qkv_proj / o_proj, dense
  MLP gate_up_proj / down_proj and sparse MoE experts, unless the scheme's ignore list names
  the checkpoint module (all fused parts ignored: the module stays in the model dtype; some
  only: refused). The router gate, norms,
  embeddings and lm_head are never swapped.
- Swaps happen on the meta device (no memory); `keep_quant_dtypes` re-creates the quantized
  parameters in their storage dtypes after the model is cast to the model dtype, since
  `Module.to(dtype)` casts float8 and float32 parameters too.
- Unquantized models are untouched: no module of theirs changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from sits.core.errors import UnsupportedModelError
from sits.layers.attention import Attention
from sits.layers.mlp import GatedMLP
from sits.layers.moe import SparseMoeBlock
from sits.layers.quant.config import QuantConfig
from sits.layers.quant.fp8_linear import Fp8FusedLinear, Fp8GateUpLinear, Fp8QKVLinear
from sits.layers.quant.fp8_moe import Fp8SparseMoeBlock
from sits.layers.quant.int4_linear import Int4FusedLinear, Int4GateUpLinear, Int4QKVLinear
from sits.layers.quant.int4_moe import Int4SparseMoeBlock

# (fused linear, QKV, gate-up, MoE block) classes per storage.
_FP8 = (Fp8FusedLinear, Fp8QKVLinear, Fp8GateUpLinear, Fp8SparseMoeBlock)
_INT4 = (Int4FusedLinear, Int4QKVLinear, Int4GateUpLinear, Int4SparseMoeBlock)
QUANT_LINEARS = (Fp8FusedLinear, Fp8QKVLinear, Fp8GateUpLinear) + _INT4[:3]
QUANT_MOE_BLOCKS = (Fp8SparseMoeBlock, Int4SparseMoeBlock)


def _all_or_none(quant: QuantConfig, names: list[str]) -> bool:
    """True when every checkpoint module in `names` is ignored, False when none is.

    Raises:
        UnsupportedModelError: some fused parts are ignored and others not.
    """
    ignored = [quant.is_ignored(name) for name in names]
    if any(ignored) and not all(ignored):
        raise UnsupportedModelError(
            f"the quantization ignore list keeps only some of the fused modules {names} "
            "unquantized; sits fuses them into one weight"
        )
    return all(ignored)


MIN_ONLINE_INT4_GROUP = 16  # online INT4 halves its group down to this to fit a model


def fit_online_int4_group(model: nn.Module, quant: QuantConfig) -> QuantConfig:
    """The online INT4 scheme with the largest group, halving from `quant.group_size` (128)
    down to MIN_ONLINE_INT4_GROUP, that divides the input width of every module it quantizes
    (small models: a 64-wide hidden state takes group 64); `quant` itself when none fits (the
    swap then names the module) or for any other scheme.

    Under tensor parallelism the widths are this rank's (a row-parallel projection's and the
    experts' slice of their input columns), so the groups never straddle two ranks; where
    the group that fits one rank divides the slices too (e.g. Qwen3-30B-A3B on 2 ranks) the
    weights are those of one rank, else the group is smaller (halved until it fits)."""
    if not (quant.online and quant.is_int4 and quant.group_size):
        return quant
    widths: set[int] = set()
    for module in model.modules():
        if isinstance(module, Attention):
            widths |= {module.qkv_proj.in_features, module.o_proj.in_features}
        elif isinstance(module, GatedMLP):
            widths |= {module.gate_up_proj.in_features, module.down_proj.in_features}
        elif isinstance(module, SparseMoeBlock):
            widths |= {module.gate.in_features, module.intermediate_size}
    group = quant.group_size
    while group >= MIN_ONLINE_INT4_GROUP:
        if all(width % group == 0 for width in widths):
            return dataclasses.replace(quant, group_size=group)
        group //= 2
    return quant


def quantize_modules(model: nn.Module, quant: QuantConfig) -> int:
    """Swap the quantizable modules of `model` (on the meta device) for FP8 or INT4 ones.

    Args:
        model: a `DecoderForCausalLM` built on the meta device.
        quant: the scheme (online INT4 takes the group `fit_online_int4_group` fits).

    Returns:
        The number of modules swapped.

    Raises:
        UnsupportedModelError: an ignore list splitting fused parts, or shapes the scheme
            cannot hold (block scales cutting a fused part, an INT4 group size not dividing
            the input columns), naming the module.
    """
    quant = fit_online_int4_group(model, quant)
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for name, module in model.named_modules():
        swaps += _swaps_of(model, name, module, quant)
    for parent, attr, new in swaps:
        setattr(parent, attr, new)
    return len(swaps)


def _named(name: str, build: Callable[[], nn.Module]) -> nn.Module:
    """`build()`, its UnsupportedModelError prefixed with the module's name."""
    try:
        return build()
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{name}: {err}") from err


def _swaps_of(
    model: nn.Module, name: str, module: nn.Module, quant: QuantConfig
) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, quantized module) for the quantizable children of `module`."""
    fused, qkv, gate_up_class, moe = _INT4 if quant.is_int4 else _FP8
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    if isinstance(module, Attention):
        parts = [f"{name}.{p}_proj" for p in "qkv"]
        if not _all_or_none(quant, parts):
            new = _named(f"{name}.qkv_proj", lambda: qkv(module.qkv_proj, quant))
            swaps.append((module, "qkv_proj", new))
        if not quant.is_ignored(f"{name}.o_proj"):
            new = _named(f"{name}.o_proj", lambda: fused.from_linear(module.o_proj, quant))
            swaps.append((module, "o_proj", new))
    elif isinstance(module, GatedMLP):
        parts = [f"{name}.gate_proj", f"{name}.up_proj"]
        if not _all_or_none(quant, parts):
            new = _named(f"{name}.gate_up_proj", lambda: gate_up_class(module.gate_up_proj, quant))
            swaps.append((module, "gate_up_proj", new))
        if not quant.is_ignored(f"{name}.down_proj"):
            new = _named(f"{name}.down_proj", lambda: fused.from_linear(module.down_proj, quant))
            swaps.append((module, "down_proj", new))
    elif isinstance(module, SparseMoeBlock) and not _experts_ignored(quant, name):
        parent_name, _, attr = name.rpartition(".")
        block = _named(
            name,
            lambda: moe(
                module.gate.in_features, module.config, quant, module.moe_backend, module.tp
            ),
        )
        swaps.append((model.get_submodule(parent_name), attr, block))
    return swaps


def _experts_ignored(quant: QuantConfig, block_name: str) -> bool:
    """The experts of MoE block `block_name` (ours: `...mlp`) are kept unquantized."""
    mixtral = block_name.replace(".mlp", ".block_sparse_moe")
    names = [f"{block_name}.experts", f"{mixtral}.experts"]
    return any(quant.is_ignored(name) for name in names)


def is_quantized(model: nn.Module) -> bool:
    """True when any module of `model` holds quantized weights."""
    return any(hasattr(module, "quant_dtypes") for module in model.modules())


def keep_quant_dtypes(model: nn.Module) -> None:
    """Re-create (on the meta device) the quantized parameters that a cast to the model dtype
    changed, in their storage dtypes (float8_e4m3fn or int32 weights, float32 scales)."""
    for module in model.modules():
        if not hasattr(module, "quant_dtypes"):
            continue
        for name, dtype in module.quant_dtypes().items():
            param = getattr(module, name)
            if param is None or param.dtype == dtype:
                continue
            assert param.device.type == "meta", "keep_quant_dtypes runs before materialising"
            setattr(
                module,
                name,
                nn.Parameter(torch.empty(param.shape, dtype=dtype, device="meta"), False),
            )
