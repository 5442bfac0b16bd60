"""The low-precision twin of a loaded model-dtype model, for the runtime precision switch.

`EngineConfig.precision_switch` ("fp8" or "int4") keeps two weight sets resident and lets the
runner pick one per step. The twin is the model of the same checkpoint built with
`quantization=scheme` (`loader.build_meta_model`), filled from the full model on its device:

- Shared: every parameter of a module that is not quantized (embeddings, norms, lm_head, the
  MoE router gates) and the biases of the quantized projections are the full model's very
  tensor objects (no memory, one copy to update). The MoE blocks share their `ExpertState`
  (counters, health, frozen experts), so freezing an expert holds in both sets.
- Quantized: each projection and each expert (one at a time, so the temporary float32 copy is
  one expert's) is quantized on the device by `layers.quant.fill` with the online schemes
  (`kernels.fp8_ref.quantize_fp8_per_row`, `kernels.int4_ref.quantize_int4`), exactly as an
  online-quantized load (`loader._online_fp8_pairs` / `_online_int4_pairs`) writes them; for
  the same model-dtype weights the two agree bit for bit.

Invariants: the full model is never written; the twin's quantized parameters are its only own
memory (`twin_weight_bytes` on the meta twin says how much, before anything is allocated).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from sits.core.errors import InvalidParameterError
from sits.layers.decoder import DecoderForCausalLM
from sits.layers.moe import MoeBackend, SparseMoeBlock
from sits.layers.quant.apply import QUANT_LINEARS, QUANT_MOE_BLOCKS, is_quantized, keep_quant_dtypes
from sits.layers.quant.fill import quantize_experts_, quantize_linear_
from sits.models.loader import build_meta_model, model_quant_config

SHARED_QUANT_PARAMS = ("bias",)  # a quantized module's parameters kept in the model dtype


def meta_twin(
    model_dir: str, scheme: str, dtype: torch.dtype, moe_backend: MoeBackend | None = None
) -> DecoderForCausalLM:
    """The twin on the meta device (no memory): the checkpoint's model with `scheme` online
    quantization, cast to `dtype` with the quantized parameters in their storage dtypes.

    Raises:
        UnsupportedModelError: the scheme cannot hold a module's shape (`quantize_modules`).
    """
    twin = build_meta_model(model_dir, moe_backend, quantization=scheme).to(dtype)
    keep_quant_dtypes(twin)
    return twin


def _own_params(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """A quantized module's own (not shared) parameters, direct ones only."""
    for name, param in module.named_parameters(recurse=False):
        if name not in SHARED_QUANT_PARAMS:
            yield name, param


def _is_quant(module: nn.Module) -> bool:
    return isinstance(module, QUANT_LINEARS + QUANT_MOE_BLOCKS)


def twin_weight_bytes(twin: nn.Module) -> int:
    """Bytes the twin's own (quantized) parameters take once materialised."""
    return sum(
        param.numel() * param.element_size()
        for module in twin.modules()
        if _is_quant(module)
        for _, param in _own_params(module)
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters, each tensor counted once (tied weights once)."""
    seen: dict[int, int] = {}
    for param in model.parameters():
        seen[id(param)] = param.numel() * param.element_size()
    return sum(seen.values())


def check_unquantized(full: nn.Module) -> None:
    """Refuse a model whose checkpoint is already quantized.

    Raises:
        InvalidParameterError: it is ("precision_switch"), naming its scheme.
    """
    if is_quantized(full):
        raise InvalidParameterError(
            "precision_switch",
            f"the checkpoint is already quantized ({model_quant_config(full).describe()}); "
            "the precision switch needs model-dtype weights",
        )


def build_twin(
    full: DecoderForCausalLM, twin: DecoderForCausalLM, device: torch.device
) -> DecoderForCausalLM:
    """Materialise the meta `twin` (from `meta_twin`) on `device` from the loaded `full` model.

    Args:
        full: the loaded model-dtype model (unquantized), on `device`.
        twin: its meta twin; changed in place and returned.
        device: where `full` lives.

    Returns:
        The twin in eval mode, parameters without gradients.

    Raises:
        InvalidParameterError: `full` is already quantized (there is nothing to switch from).
    """
    check_unquantized(full)
    quant = model_quant_config(twin)
    assert quant is not None and quant.online, "the twin is built by meta_twin"
    full_modules = dict(full.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            source = full_modules[name]
            if _is_quant(module):
                _materialise(module, source, device)
                _fill(module, source)
            else:
                _share(module, source)
    twin.eval()
    twin.requires_grad_(False)
    return twin


def _share(module: nn.Module, source: nn.Module) -> None:
    """Point the module's direct parameters and buffers at `source`'s tensor objects."""
    for name in list(module._parameters):
        module._parameters[name] = source._parameters[name]
    for name in list(module._buffers):
        module._buffers[name] = source._buffers[name]


def _materialise(module: nn.Module, source: nn.Module, device: torch.device) -> None:
    """Allocate a quantized module's own parameters on `device`; share its bias; share an MoE
    block's expert state."""
    for name, param in list(_own_params(module)):
        empty = torch.empty(param.shape, dtype=param.dtype, device=device)
        setattr(module, name, nn.Parameter(empty, requires_grad=False))
    for name in SHARED_QUANT_PARAMS:
        if name in module._parameters and module._parameters[name] is not None:
            module._parameters[name] = source._parameters[name]
    if isinstance(module, SparseMoeBlock):
        assert isinstance(source, SparseMoeBlock)
        module._expert_state = source.expert_state()


def _fill(module: nn.Module, source: nn.Module) -> None:
    """Quantize `source`'s weights into the quantized `module` (`layers.quant.fill`: per
    expert slice for MoE blocks)."""
    if isinstance(module, QUANT_MOE_BLOCKS):
        assert isinstance(source, SparseMoeBlock) and not source.num_spare_experts
        quantize_experts_(module, source.w13, source.w2)
    else:
        quantize_linear_(module, source.weight)
