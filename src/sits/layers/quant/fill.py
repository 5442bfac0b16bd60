"""Filling a quantized module's storage from model-dtype weights already on the device.

The loader quantizes online while it streams checkpoint tensors (`models.loader`); this module
does the same for weights that are not read from a checkpoint: random weights of real shapes
(`models.dummy_quant`) and the low-precision twin of a loaded model (the precision switch).
Each function writes exactly what a per-channel FP8 / block FP8 / per-tensor FP8 or INT4
checkpoint of those weights would have loaded.

Invariants:
- The values equal the module's online quantization of `weight`: FP8 per output row
  (`kernels.fp8_ref.quantize_fp8_per_row`), per block or per part (per-tensor schemes); INT4
  symmetric group-wise (`kernels.int4_ref.quantize_int4`), with zero points of 8 and
  sequential GPTQ groups where the format stores them.
- MoE experts are quantized one expert at a time: the float32 temporaries are those of one
  expert's weight, never of the whole [E, rows, cols] tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from sits.core.errors import UnsupportedModelError
from sits.kernels.fp8_ref import quantize_fp8_block, quantize_fp8_per_row, quantize_fp8_per_tensor
from sits.kernels.int4_ref import SYMMETRIC_ZERO, quantize_int4
from sits.layers.quant.fp8_linear import Fp8Weights
from sits.layers.quant.fp8_moe import Fp8SparseMoeBlock
from sits.layers.quant.int4_linear import Int4Weights
from sits.layers.quant.int4_moe import Int4SparseMoeBlock

# Parameters of a quantized module that the fill functions write (the rest, e.g. biases, are
# the module's model-dtype parameters).
_LINEAR_STORAGE = ("weight", "weight_scale", "weight_zero", "weight_g_idx", "weight_shape")
_EXPERT_STORAGE = tuple(
    f"{w}{suffix}" for w in ("w13", "w2") for suffix in ("", "_scale", "_zero", "_g_idx", "_shape")
)


def storage_names(module: torch.nn.Module) -> tuple[str, ...]:
    """Local names of the parameters `quantize_linear_` / `quantize_experts_` fill."""
    if isinstance(module, (Fp8Weights, Int4Weights)):
        return _LINEAR_STORAGE
    if isinstance(module, (Fp8SparseMoeBlock, Int4SparseMoeBlock)):
        return _EXPERT_STORAGE
    return ()


def _refuse_static_input_scales(module: torch.nn.Module) -> None:
    if module.quant.static_input_scale:
        raise UnsupportedModelError(
            f"quantizing weights on the device needs dynamic activation scales, not "
            f"{module.quant.describe()}"
        )


def _fp8_rows(
    weight: Tensor, part_sizes: tuple[int, ...], strategy: str, block: tuple[int, int] | None
) -> tuple[Tensor, Tensor]:
    """FP8 (values [N, K], scales) of one [N, K] weight under the module's scale strategy."""
    if block is not None:
        return quantize_fp8_block(weight, block)
    if strategy == "channel":
        return quantize_fp8_per_row(weight)
    values, scales, start = [], [], 0
    for size in part_sizes:  # "tensor": one scale per part, held per row
        q, scale = quantize_fp8_per_tensor(weight[start : start + size])
        values.append(q)
        scales.append(scale.expand(size))
        start += size
    return torch.cat(values), torch.cat(scales)


def _fill_int4(
    target: Callable[[str], Tensor | None],
    weight: Tensor,
    part_sizes: tuple[int, ...],
    group_size: int,
) -> None:
    """Write INT4 storage (via `target(local suffix)`) of one [N, K] weight."""
    packed, scale = quantize_int4(weight, group_size)  # [N, K / 8] int32, [N, K / G]
    target("").copy_(packed)
    target("_scale").copy_(scale)
    zero = target("_zero")
    if zero is not None:
        zero.fill_(SYMMETRIC_ZERO)
    g_idx = target("_g_idx")  # [parts, K]
    if g_idx is not None:
        num_cols = weight.shape[-1]
        groups = torch.arange(num_cols, device=g_idx.device, dtype=torch.int32) // group_size
        g_idx.copy_(groups.expand_as(g_idx))
    shape = target("_shape")  # [parts, 2]
    if shape is not None:
        sizes = torch.tensor([[n, weight.shape[-1]] for n in part_sizes], dtype=torch.int64)
        shape.copy_(sizes)


@torch.no_grad()
def quantize_linear_(module: torch.nn.Module, weight: Tensor) -> None:
    """Fill an FP8 or INT4 fused linear's storage with the quantization of `weight`.

    Args:
        module: an `Fp8Weights` or `Int4Weights` linear (materialised on its device).
        weight: [sum(part_sizes), in_features], any float dtype, on the module's device.

    Raises:
        UnsupportedModelError: a scheme with static activation scales (nothing to derive them
            from) or GPTQ act-order; ValueError: `weight` has the wrong shape.
    """
    expected = (sum(module.part_sizes), module.in_features)
    if tuple(weight.shape) != expected:
        raise ValueError(f"weight of shape {tuple(weight.shape)}, expected {expected}")
    if isinstance(module, Fp8Weights):
        _refuse_static_input_scales(module)
        values, scale = _fp8_rows(weight, module.part_sizes, module.quant.strategy, module.block)
        module.weight.copy_(values)
        module.weight_scale.copy_(scale)
        return
    if module.quant.desc_act:
        raise UnsupportedModelError("quantizing weights on the device with GPTQ desc_act")
    group = module.quant.group_size or 0
    _fill_int4(lambda s: getattr(module, f"weight{s}"), weight, module.part_sizes, group)


@torch.no_grad()
def quantize_experts_(
    block: torch.nn.Module, w13: Tensor, w2: Tensor, experts: Sequence[int] | None = None
) -> None:
    """Fill an FP8 or INT4 sparse MoE block's expert storage with the quantization of the
    model-dtype expert weights, one expert at a time.

    Args:
        block: an `Fp8SparseMoeBlock` or `Int4SparseMoeBlock` (materialised).
        w13: [E, 2 * I, H] gate and up rows; w2: [E, H, I]; any float dtype, on the device
            (E and I: the block's, this tensor-parallel rank's experts and width).
        experts: the experts (slots of w13 / w2) to fill (default: all E), e.g. one just
            restored.

    Raises:
        UnsupportedModelError: static activation scales; ValueError: wrong shapes.
    """
    num_experts, inter = block.w13.shape[0], block.intermediate_size
    hidden = block.w2.shape[1]
    for name, tensor, shape in (
        ("w13", w13, (num_experts, 2 * inter, hidden)),
        ("w2", w2, (num_experts, hidden, inter)),
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} of shape {tuple(tensor.shape)}, expected {shape}")
    chosen = range(num_experts) if experts is None else experts
    if isinstance(block, Fp8SparseMoeBlock):
        _refuse_static_input_scales(block)
        for expert in chosen:
            for name, tensor, parts in (("w13", w13, (inter, inter)), ("w2", w2, (hidden,))):
                values, scale = _fp8_rows(tensor[expert], parts, block.quant.strategy, block.block)
                getattr(block, name)[expert].copy_(values)
                getattr(block, f"{name}_scale")[expert].copy_(scale)
        return
    group = block.quant.group_size or 0
    for expert in chosen:
        for name, tensor, parts in (("w13", w13, (inter, inter)), ("w2", w2, (hidden,))):

            def target(suffix: str, name: str = name, expert: int = expert) -> Tensor | None:
                param = getattr(block, f"{name}{suffix}")
                return None if param is None else param[expert]

            _fill_int4(target, tensor[expert], parts, group)
