"""Building a model from a checkpoint directory: config -> class -> safetensors weights.

Checkpoint names are mapped onto our fused parameters by `models.weight_map` (q/k/v ->
qkv_proj, gate/up -> gate_up_proj, per-expert and fused expert tensors -> w13 / w2, the rest
by identical name).

Spare expert slots (`num_spare_experts`, `SparseMoeBlock.add_spare_slots`): the checkpoint's
experts fill the logical slots 0 .. E-1 of w13 / w2 (the routing table starts as the
identity); the N spare slots are not in the checkpoint, are zeroed and do not count as
missing.

Quantized checkpoints (`layers.quant`): the scheme comes from config.json's
`quantization_config` (or `quantization="fp8"` for online quantization); the quantizable
modules are swapped for FP8 ones on the meta device, and each checkpoint tensor of theirs
(`weight`, `weight_scale_inv` / `weight_scale`, `input_scale`, per part and per expert) goes
where the module's `checkpoint_target` says, checked for dtype and shape. Online quantization
turns each model-dtype weight of a quantized module into FP8 values plus per-row scales as it
streams by (`_online_fp8_pairs`), so no model-dtype copy of those weights is ever made.
INT4 checkpoints (compressed-tensors `weight_packed` / `weight_scale` / `weight_shape`, GPTQ and
AWQ `qweight` / `qzeros` / `scales` / `g_idx`) are converted tensor by tensor into one packed
layout (`layers.quant.int4_formats`); online INT4 (`quantization="int4"`) streams each weight
as the compressed-tensors tensors of its symmetric group-wise quantization
(`_online_int4_pairs`).

Tensor parallelism (`tp`, `sits.parallel`): the model is built as this rank's shard
(`DecoderForCausalLM(config, tp=tp)`), and each checkpoint tensor is sliced on the CPU to the
rows / columns the rank holds (`weight_map.TensorSlice`: per fused part, per expert) before it
is cast and copied, so a rank never holds more of the model on its device than its shard.
With `tp.expert_parallel` a rank's MoE layers hold whole experts (`SparseMoeBlock.expert_shard`):
the other ranks' per-expert tensors are skipped unread, and the coverage check counts this
rank's experts exactly.
Spare expert slots hold the rank's slice of an expert; with tp.expert_parallel they are
refused (`SparseMoeBlock.add_spare_slots`).
Quantized weights under tensor parallelism: each quantized module cuts its checkpoint
tensors itself (`layers.quant.sharding`): weights and scales by output rows (column-parallel)
or by input columns in whole scale blocks / groups (row-parallel; a rank's slice that cuts
through one is refused when the model is built, with the numbers), the per-row scales of a
row-parallel layer whole. Online quantization quantizes the checkpoint's whole tensor, as one
rank does (a rank holds one full tensor at a time on its device), and keeps its slice of the
values and scales. With expert parallelism a rank's experts come with their scales.

Invariants: every parameter element is written exactly once, or loading fails with
UnsupportedModelError naming the missing / unexpected / duplicated / misshapen weights. The
model is built on the meta device and materialised on the target device in the target dtype, so
no full-size float32 copy is ever made.

Weights come from safetensors files, from any (name, tensor) pairs (`load_weights_from`, e.g. a
transformers model's state dict), or are dummy (`sits.models.dummy`: load_format "dummy", or
"auto" on a dummy directory).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import Tensor, nn
from tqdm import tqdm

from sits.core.errors import ModelNotFoundError, UnsupportedModelError
from sits.layers.decoder import DecoderForCausalLM
from sits.layers.moe import MoeBackend, SparseMoeBlock
from sits.layers.quant.apply import (
    QUANT_LINEARS,
    QUANT_MOE_BLOCKS,
    is_quantized,
    keep_quant_dtypes,
    quantize_modules,
)
from sits.layers.quant.config import QuantConfig, quant_config_of
from sits.models.dummy import fill_dummy_, init_dummy_weights, read_dummy_seed
from sits.models.dummy_quant import init_dummy_quantized
from sits.models.hf_config import load_hf_config
from sits.models.registry import get_model_class
from sits.models.weight_map import WeightTarget, is_skipped, submodule, target_of
from sits.models.weight_map import checkpoint_target as checkpoint_target
from sits.parallel import SINGLE, TensorParallel

HUB_ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja", "tokenizer*"]
_MAX_NAMES_IN_ERROR = 8

logger = logging.getLogger(__name__)


def resolve_model_path(
    name_or_path: str, *, revision: str | None = None, download_dir: str | None = None
) -> str:
    """A local checkpoint directory for a path or a Hugging Face Hub id.

    An existing directory is returned as is. Otherwise the name is looked up in the local
    Hugging Face cache, then downloaded (safetensors, json and tokenizer files only).

    Args:
        name_or_path: a directory or a Hub id.
        revision: the Hub revision (branch, tag or commit hash); None: the default branch.
        download_dir: the cache directory to look in and download to (vLLM's
            `--download-dir`); None: huggingface_hub's default.

    Raises:
        ModelNotFoundError: not a directory and not obtainable from the Hub (no network, no
            such repository, no access).
    """
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.exists(name_or_path) or name_or_path.startswith(("/", "./", "../", "~")):
        raise ModelNotFoundError(f"model path {name_or_path!r} is not a checkpoint directory")
    try:
        from huggingface_hub import snapshot_download

        hub = {
            "revision": revision,
            "cache_dir": download_dir,
            "allow_patterns": HUB_ALLOW_PATTERNS,
        }
        try:
            return snapshot_download(name_or_path, local_files_only=True, **hub)
        except Exception:  # not cached: try the network below
            return snapshot_download(name_or_path, **hub)
    except Exception as err:
        raise ModelNotFoundError(
            f"model {name_or_path!r}"
            + (f" at revision {revision!r}" if revision else "")
            + " is neither a local directory nor downloadable from the "
            f"Hugging Face Hub ({type(err).__name__}: {err})"
        ) from err


def build_meta_model(
    model_dir: str,
    moe_backend: MoeBackend | None = None,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
) -> DecoderForCausalLM:
    """The model (this tensor-parallel rank's shard) of a checkpoint directory's config.json
    on the meta device (no memory), with quantized modules where its `quantization_config`
    (or `quantization`) asks.

    Args:
        model_dir: the checkpoint directory.
        moe_backend: MoE compute backend for sparse layers (default: PyTorch reference).
        quantization: `EngineConfig.quantization` (None: what the checkpoint says; "fp8" on
            an unquantized checkpoint: online FP8).
        tp: the tensor-parallel rank and size (SINGLE: the whole model).

    Raises:
        ModelNotFoundError: no config.json.
        UnsupportedModelError: unsupported architecture, option or quantization scheme, or
            a tensor-parallel slice of quantized weights that cuts through their scale
            blocks or groups (the message names the module and gives the numbers).
        InvalidParameterError: tp.size does not fit the heads, KV heads, an intermediate size,
            the vocabulary or (with tp.expert_parallel) num_experts (the message gives the
            numbers).
    """
    hf_config = load_hf_config(model_dir)
    quant = quant_config_of(_quantization_config(hf_config), quantization)
    model_class = get_model_class(hf_config)
    config = model_class.config_from_hf(hf_config)
    with torch.device("meta"):
        model = model_class(config, moe_backend, tp)
        if quant is not None:
            quantize_modules(model, quant)
    return model


def _quantization_config(hf_config: object) -> dict | None:
    """The config's `quantization_config` as a dict (transformers may hold an object)."""
    value = getattr(hf_config, "quantization_config", None)
    if value is None or isinstance(value, dict):
        return value
    return value.to_dict() if hasattr(value, "to_dict") else dict(vars(value))


def model_quant_config(model: nn.Module) -> QuantConfig | None:
    """The scheme of a model's quantized modules (None: unquantized)."""
    for module in model.modules():
        if isinstance(module, QUANT_LINEARS + QUANT_MOE_BLOCKS):
            return module.quant
    return None


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device | str,
    moe_backend: MoeBackend | None = None,
    *,
    load_format: str = "auto",
    seed: int = 0,
    num_spare_experts: int = 0,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
) -> DecoderForCausalLM:
    """Build the model (this tensor-parallel rank's shard) of a checkpoint directory and load
    (or make) its weights.

    Args:
        model_dir: directory with config.json and model.safetensors (or sharded
            model-*.safetensors with model.safetensors.index.json).
        dtype: parameter dtype (checkpoint tensors are cast).
        device: where the parameters live.
        moe_backend: MoE compute backend for sparse layers (default: PyTorch reference).
        load_format: "safetensors"; "dummy" (seeded random weights made on the device,
            `sits.models.dummy`); "auto": dummy with the directory's seed when model_dir is a
            dummy directory (`prepare_dummy_dir`), else safetensors.
        seed: the dummy weights' seed (load_format "dummy" only).
        num_spare_experts: spare expert slots added to every sparse MoE layer (zeroed; the
            logical experts' weights are those of a load without spares; under tensor
            parallelism each slot holds the rank's slice).
        quantization: `EngineConfig.quantization` (see `build_meta_model`).
        tp: the tensor-parallel rank and size (SINGLE: the whole model). With size > 1 the
            rank's shard is built and only its slice of each checkpoint tensor is copied;
            dummy weights are then the shard's own seeded values (replicated parameters
            equal on every rank), not slices of the whole model's dummy weights. With
            tp.expert_parallel each MoE layer holds its rank's whole experts.

    Returns:
        The model in eval mode, parameters without gradients.

    Raises:
        ModelNotFoundError: no config.json or no safetensors files.
        UnsupportedModelError: unsupported architecture, option or quantization, a
            tensor-parallel slice that cuts through scale blocks or groups
            (`build_meta_model`), or weights that do not match the model (missing,
            unexpected, duplicated, wrong shape or dtype).
        InvalidParameterError: tp.size does not fit the model's shapes (`build_meta_model`),
            or num_spare_experts > 0 with tp.expert_parallel.
    """
    model = build_meta_model(model_dir, moe_backend, quantization, tp)
    if (
        tp.expert_parallel
        and tp.rank == 0
        and not any(isinstance(module, SparseMoeBlock) for module in model.modules())
    ):
        logger.info("expert parallel: the model has no MoE layers, so it changes nothing")
    spare_blocks = _add_spare_slots(model, num_spare_experts)
    model = model.to(dtype)
    keep_quant_dtypes(model)
    model = model.to_empty(device=torch.device(device))
    model.tie_weights()
    dummy_seed = seed if load_format == "dummy" else None
    if load_format == "auto":
        dummy_seed = read_dummy_seed(model_dir)
    if dummy_seed is not None and is_quantized(model):
        init_dummy_quantized(model, dtype, dummy_seed)
    elif dummy_seed is not None:
        init_dummy_weights(model, dummy_seed)
        for name, block in spare_blocks.items():  # the values of a load without spares
            num_experts = block.config.num_experts
            fill_dummy_(block.w13.data[:num_experts], f"{name}.w13", dummy_seed)
            fill_dummy_(block.w2.data[:num_experts], f"{name}.w2", dummy_seed)
    else:
        load_weights(model, safetensors_files(model_dir))
    for block in spare_blocks.values():
        block.clear_free_slots()
    model.eval()
    model.requires_grad_(False)
    return model


def _add_spare_slots(model: nn.Module, num_spare_experts: int) -> dict[str, SparseMoeBlock]:
    """Give every sparse MoE block `num_spare_experts` spare slots; name -> block of those."""
    if num_spare_experts == 0:
        return {}
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    for block in blocks.values():
        block.add_spare_slots(num_spare_experts)
    return blocks


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files (from the shard index when there is one).

    Raises:
        ModelNotFoundError: no safetensors file.
        UnsupportedModelError: only PyTorch .bin weights.
    """
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    if glob.glob(os.path.join(model_dir, "*.bin")):
        raise UnsupportedModelError(
            f"{model_dir!r} has only PyTorch .bin weights; sits loads safetensors only"
        )
    raise ModelNotFoundError(
        f"no *.safetensors weights in {model_dir!r} (--load-format dummy makes random weights)"
    )


def load_weights(model: DecoderForCausalLM, files: list[str]) -> None:
    """Copy every tensor of the safetensors `files` into its (slice of a) parameter, checking
    full coverage (see `load_weights_from`).

    Raises:
        UnsupportedModelError: missing, unexpected, duplicated or misshapen weights.
    """
    pairs = _safetensors_pairs(files, lambda name: is_skipped(model, name))
    quant = model_quant_config(model)
    if quant is not None and quant.online:
        pairs = (
            _online_int4_pairs(model, pairs) if quant.is_int4 else _online_fp8_pairs(model, pairs)
        )
    load_weights_from(model, pairs)


def _safetensors_pairs(
    files: list[str], skip: Callable[[str], bool]
) -> Iterator[tuple[str, Tensor]]:
    """(name, CPU tensor) of every tensor in the files but those `skip` names (never read),
    one at a time; a sharded checkpoint (more than one file) shows vLLM's bar over its files
    on stderr."""
    shards = tqdm(files, desc="Loading safetensors checkpoint shards", disable=len(files) < 2)
    for path in shards:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if not skip(name):
                    yield name, f.get_tensor(name)


def _online_fp8_pairs(
    model: DecoderForCausalLM, pairs: Iterable[tuple[str, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """Online FP8: each weight bound for an FP8 parameter becomes (name, FP8 values) and
    (name + "_scale", per-row scales), the pairs of a per-channel checkpoint (of the whole
    tensor under tensor parallelism: the targets keep the rank's slice). The weight is
    cast to the model dtype and moved to the model's device first, as vLLM quantizes what it
    loaded: a float32 checkpoint served in bf16 quantizes its bf16 values, on the device,
    exactly as the precision switch's twin (`layers.quant.fill`) does (INT4's clip search
    sums in another order on a GPU than on the CPU, so the place matters too)."""
    from sits.kernels.fp8_ref import FP8_DTYPE, quantize_fp8_per_row

    params = dict(model.named_parameters())
    embed = model.model.embed_tokens.weight  # the model's dtype and device
    for name, tensor in pairs:
        target = None if is_skipped(model, name) else target_of(model, name, params)
        quantized = target is not None and params[target.param_name].dtype == FP8_DTYPE
        if not quantized or tensor.dtype == FP8_DTYPE or not name.endswith(".weight"):
            yield name, tensor
            continue
        weight = tensor.to(embed.device, embed.dtype)
        values, scale = quantize_fp8_per_row(weight)  # [N, K] fp8, [N] float32
        yield name, values
        yield f"{name}_scale", scale


def _online_int4_pairs(
    model: DecoderForCausalLM, pairs: Iterable[tuple[str, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """Online INT4: each model-dtype weight bound for an INT4 module becomes the tensors of a
    compressed-tensors pack-quantized checkpoint (`weight_packed`, `weight_scale`,
    `weight_shape`), quantized symmetric group-wise (`kernels.int4_ref.quantize_int4`) from
    its model-dtype values (as `_online_fp8_pairs`, whole tensors as one rank does)."""
    from sits.kernels.int4_ref import quantize_int4

    params = dict(model.named_parameters())
    embed = model.model.embed_tokens.weight  # the model's dtype and device
    quant = model_quant_config(model)
    assert quant is not None and quant.group_size is not None
    for name, tensor in pairs:
        module = name.removesuffix(".weight")
        packed_name = f"{module}.weight_packed"
        quantized = name.endswith(".weight") and not is_skipped(model, name)
        target = target_of(model, packed_name, params) if quantized else None
        if target is None:
            yield name, tensor
            continue
        # [N, K / 8] int32 and [N, K / G] float32
        packed, scale = quantize_int4(tensor.to(embed.device, embed.dtype), quant.group_size)
        yield packed_name, packed
        yield f"{module}.weight_scale", scale
        yield f"{module}.weight_shape", torch.tensor(tuple(tensor.shape))


def load_weights_from(model: DecoderForCausalLM, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Copy (name, tensor) pairs with Hugging Face names (checkpoint or transformers in-memory
    names, e.g. a `state_dict().items()`) into our parameters, checking full coverage.

    Tensors are cast to each parameter's dtype and device; pairs are consumed one at a time.

    Raises:
        UnsupportedModelError: missing, unexpected, duplicated or misshapen weights.
    """
    params = dict(model.named_parameters())
    expected_numel = _checkpoint_numel(model, params)
    loaded_numel = dict.fromkeys(params, 0)
    seen_regions: set[tuple[str, str]] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if is_skipped(model, name):
            continue
        target = target_of(model, name, params)
        if target is None:
            unexpected.append(name)
            continue
        region = (target.param_name, repr(target.index))
        if region in seen_regions:
            raise UnsupportedModelError(f"checkpoint weight {name} is loaded twice")
        seen_regions.add(region)
        param = params[target.param_name]
        loaded_numel[target.param_name] += _copy(param, target, tensor, name)
    repeated = [n for n in params if loaded_numel[n] > expected_numel[n]]
    if repeated:
        raise UnsupportedModelError(
            f"checkpoint weights written more than once: {_names(repeated)}"
        )
    missing = [n for n in params if loaded_numel[n] < expected_numel[n]]
    if missing or unexpected:
        quant = model_quant_config(model)
        scheme = f" (quantized {quant.describe()})" if quant is not None else ""
        raise UnsupportedModelError(
            f"checkpoint weights do not match {type(model).__name__}{scheme}: "
            f"missing {_names([_checkpoint_names(model, n) for n in missing])}; "
            f"unexpected {_names(unexpected)}"
        )


def _checkpoint_numel(model: nn.Module, params: dict[str, Tensor]) -> dict[str, int]:
    """Elements the checkpoint must write per parameter: all, but the logical expert slots
    only of an MoE block with spare slots."""
    numel = {name: param.numel() for name, param in params.items()}
    for prefix, module in model.named_modules():
        if isinstance(module, SparseMoeBlock) and module.num_spare_experts:
            for name in (f"{prefix}.w13", f"{prefix}.w2"):
                numel[name] = params[name][: module.config.num_experts].numel()
    return numel


def _checkpoint_names(model: nn.Module, param_name: str) -> str:
    """A missing parameter as the checkpoint would name it, for quantized modules' scales:
    e.g. "model.layers.0.self_attn.{q,k,v}_proj.weight_scale_inv (our ...qkv_proj.weight_scale)".
    """
    prefix, _, local = param_name.rpartition(".")
    module = submodule(model, prefix)
    quant = getattr(module, "quant", None)
    if quant is None or local in ("bias",):
        return param_name
    if hasattr(module, "checkpoint_kind"):  # INT4: every tensor has its own name
        kind = module.checkpoint_kind(local)
    elif local not in ("weight_scale", "input_scale", "w13_scale", "w2_scale"):
        return param_name
    else:
        kind = quant.scale_name if local != "input_scale" else "input_scale"
    if isinstance(module, QUANT_MOE_BLOCKS):
        parts = "down_proj" if local.startswith("w2") else "{gate,up}_proj"
        hf = f"{prefix}.experts.<e>.{parts}.{kind}"
    else:
        owner, _, leaf = prefix.rpartition(".")
        parts = {"qkv_proj": "{q,k,v}_proj", "gate_up_proj": "{gate,up}_proj"}.get(leaf, leaf)
        hf = f"{owner}.{parts}.{kind}"
    return f"{hf} (our {param_name})"


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


def _copy(param: Tensor, target: WeightTarget, tensor: Tensor, name: str) -> int:
    """Copy (casting dtype/device) into param[target.index]; returns the elements written."""
    destination = param.data[target.index] if target.index else param.data
    if target.shard is not None:
        tensor = target.shard.apply(tensor, name)
    if target.convert is not None:
        tensor = target.convert(tensor, name)
    if tuple(destination.shape) != tuple(tensor.shape):
        raise UnsupportedModelError(
            f"checkpoint weight {name} has shape {tuple(tensor.shape)}, expected "
            f"{tuple(destination.shape)} for {target.param_name}"
        )
    destination.copy_(tensor)
    return destination.numel()
