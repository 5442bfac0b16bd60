"""Dummy weights for quantized models: the random model of `models.dummy`, quantized.

`sits bench ... --random-weights NAME --quantization fp8|int4` runs real shapes with random
quantized weights. Every quantized module gets the online quantization
(`layers.quant.fill`) of the model-dtype dummy values its unquantized twin would hold (the
same parameter names, so the same seeded draws); every other parameter gets its plain dummy
value. A quantized dummy model is therefore exactly the online quantization of the dummy
model in the model dtype, with the same routing (`models.dummy`, "Routing").

Temporary memory: one module's model-dtype weight at a time (the largest is one MoE layer's
w13, e.g. 128 x 1,536 x 2,048 bf16 = 0.8 GB for Qwen3-30B-A3B).
"""

from __future__ import annotations

import torch
from torch import nn

from sits.layers.quant.fill import quantize_experts_, quantize_linear_, storage_names
from sits.layers.quant.fp8_moe import Fp8SparseMoeBlock
from sits.layers.quant.int4_moe import Int4SparseMoeBlock
from sits.models.dummy import DUMMY_STD, dummy_tensor, fill_dummy_


def init_dummy_quantized(
    model: nn.Module, dtype: torch.dtype, seed: int, std: float = DUMMY_STD
) -> None:
    """Fill a materialised quantized model with quantized dummy weights (module docstring).

    Args:
        model: a model with FP8 or INT4 modules (`layers.quant.apply.quantize_modules`), on
            its device.
        dtype: the model dtype (that of the unquantized twin's draws).
        seed: the model seed (as `models.dummy.init_dummy_weights`).
        std: the standard deviation of the model-dtype draws.

    Raises:
        UnsupportedModelError: a scheme whose storage cannot be derived from weights alone
            (static activation scales, GPTQ desc_act).
    """
    filled: set[str] = set()
    for name, module in model.named_modules():
        owned = storage_names(module)
        if not owned:
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, (Fp8SparseMoeBlock, Int4SparseMoeBlock)):
            num_experts, inter = module.w13.shape[0], module.intermediate_size  # the rank's
            hidden = module.w2.shape[1]
            device = module.w2.device
            w13_shape = (num_experts, 2 * inter, hidden)
            w13 = dummy_tensor(f"{prefix}w13", w13_shape, dtype, device, seed, std)
            w2_shape = (num_experts, hidden, inter)
            w2 = dummy_tensor(f"{prefix}w2", w2_shape, dtype, device, seed, std)
            quantize_experts_(module, w13, w2)
            del w13, w2
        else:
            shape = (sum(module.part_sizes), module.in_features)
            weight = dummy_tensor(f"{prefix}weight", shape, dtype, module.weight.device, seed, std)
            quantize_linear_(module, weight)
        filled.update(f"{prefix}{local}" for local in owned)
    for name, param in model.named_parameters():
        if name not in filled:
            fill_dummy_(param.data, name, seed, std)
