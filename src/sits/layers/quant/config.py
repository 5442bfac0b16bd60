"""What a quantized checkpoint (or `--quantization`) asks for: `QuantConfig`, parsed from
config.json's `quantization_config` the way vLLM reads it.

Implemented (FP8 float8_e4m3fn weights, float32 scales):
- `quant_method: "fp8"` with `weight_block_size: [bn, bk]`: block scales `weight_scale_inv`
  [ceil(N / bn), ceil(K / bk)], dynamic activation scales (the official Qwen3-*-FP8 layout);
  without `weight_block_size`: one `weight_scale` per tensor, plus `input_scale` when
  `activation_scheme` is "static".
- `quant_method: "compressed-tensors"`, format `float-quantized`: 8-bit float weights with
  strategy "channel" (`weight_scale` [N, 1]), "tensor" (`weight_scale` [1]) or "block"
  (`block_structure`), activations absent, dynamic, or static per tensor (`input_scale` [1]).
- Online (`--quantization fp8` on an unquantized checkpoint): per-output-channel scales made at
  load.

Implemented (INT4 weight-only, w4a16, `group_size` set; layouts in `quant.int4_formats`):
- compressed-tensors `pack-quantized`: int 4-bit, symmetric, strategy "group", no actorder.
- `quant_method: "gptq"`: bits 4, a positive group size, `desc_act` true or false (dense
  layers only for true), checkpoint_format "gptq" (zeros stored minus one).
- `quant_method: "awq"`: bits 4, GEMM version, zero points.
- Online (`--quantization int4`): symmetric, group ONLINE_INT4_GROUP_SIZE (128), halved for
  a model whose widths it does not divide (`apply.fit_online_int4_group`).

Invariants: everything else (other bit widths, asymmetric compressed-tensors, AWQ GEMV, the
marlin / exllama variants) raises `UnsupportedModelError` naming what was found and what is
supported, before any weight is read; `--quantization` must agree with the checkpoint's method.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sits.config import IMPLEMENTED_QUANTIZATION as IMPLEMENTED_METHODS
from sits.config import QUANTIZATION_METHODS as KNOWN_METHODS
from sits.core.errors import InvalidParameterError, UnsupportedModelError

_SUPPORTED_TEXT = (
    "supported: fp8 (block-scaled `weight_block_size`, or per-tensor), compressed-tensors "
    "float-quantized FP8 (channel, tensor or block weights) and pack-quantized INT4 "
    "(symmetric, group), gptq and awq (4 bits, group-wise), and --quantization fp8 / int4 "
    "of an unquantized checkpoint"
)
ONLINE_INT4_GROUP_SIZE = 128


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """How the quantized layers store their weights.

    Attributes:
        method: "fp8" or "compressed-tensors" (the checkpoint's `quant_method`).
        strategy: weight scales: "block", "channel" (one per output row) or "tensor" (one per
            checkpoint tensor, held per row after loading so fused parts keep their own).
        block_size: (bn, bk) rows and columns of one scale block ("block" only).
        scale_name: the checkpoint's scale tensor suffix: "weight_scale_inv" or "weight_scale".
        static_input_scale: the checkpoint carries a per-tensor `input_scale` (static
            activation quantization); else activation scales are dynamic.
        ignore: module names kept unquantized (`modules_to_not_convert` / `ignore`; "re:"
            entries are regular expressions, others match whole dotted components).
        online: weights are quantized at load from an unquantized checkpoint.
        group_size: INT4 (w4a16) weights with one scale per this many input columns; None
            for FP8.
        zero_points: INT4 weights carry zero points (gptq, awq); else symmetric (zero 8).
        desc_act: GPTQ act-order: `g_idx` is any grouping of the input columns.
    """

    method: str
    strategy: str
    block_size: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    static_input_scale: bool = False
    ignore: tuple[str, ...] = ()
    online: bool = False
    group_size: int | None = None
    zero_points: bool = False
    desc_act: bool = False

    @property
    def is_int4(self) -> bool:
        """INT4 weight-only (w4a16) storage, else FP8."""
        return self.group_size is not None

    def describe(self) -> str:
        """One line for errors and logs, e.g. "fp8 block [128, 128] weight_scale_inv"."""
        block = f" {list(self.block_size)}" if self.block_size else ""
        online = " (online)" if self.online else ""
        if self.is_int4:
            extra = " zero points" if self.zero_points else " symmetric"
            extra += " desc_act" if self.desc_act else ""
            method = "" if self.method == "int4" else f"{self.method} "
            return f"{method}int4 group {self.group_size}{extra}{online}"
        return f"{self.method} {self.strategy}{block} {self.scale_name}{online}"

    def is_ignored(self, module_name: str) -> bool:
        """True when the checkpoint keeps `module_name` (an HF module path) unquantized."""
        parts = module_name.split(".")
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
                continue
            want = entry.split(".")
            if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
                return True
        return False


def online_fp8() -> QuantConfig:
    """The scheme of `--quantization fp8` on an unquantized checkpoint."""
    return QuantConfig(method="fp8", strategy="channel", online=True)


def check_method_name(name: str | None) -> None:
    """Refuse a `--quantization` value we do not implement (ValueError subclasses only).

    Raises:
        UnsupportedModelError: a known method not implemented yet, or an unknown name.
    """
    if name is None or name in IMPLEMENTED_METHODS:
        return
    if name in KNOWN_METHODS:
        raise UnsupportedModelError(
            f"quantization {name!r} is not supported yet; {_SUPPORTED_TEXT}"
        )
    raise UnsupportedModelError(
        f"unknown quantization {name!r}; known names: {', '.join(KNOWN_METHODS)}; {_SUPPORTED_TEXT}"
    )


def quant_config_of(hf_quant: dict[str, Any] | None, requested: str | None) -> QuantConfig | None:
    """The scheme of a checkpoint's `quantization_config` and the `--quantization` flag.

    Args:
        hf_quant: config.json's `quantization_config` (None or {} when absent).
        requested: `EngineConfig.quantization` (None = what the checkpoint says).

    Returns:
        The scheme, or None for an unquantized model.

    Raises:
        UnsupportedModelError: an unknown or unimplemented method or option, or a flag that
            disagrees with the checkpoint.
    """
    check_method_name(requested)
    if not hf_quant:
        if requested is None:
            return None
        if requested == "fp8":
            return online_fp8()
        if requested == "int4":
            return QuantConfig("int4", "group", group_size=ONLINE_INT4_GROUP_SIZE, online=True)
        raise UnsupportedModelError(
            f"--quantization {requested} needs a checkpoint quantized with it, but config.json "
            "has no quantization_config (online quantization: --quantization fp8 or int4)"
        )
    method = str(hf_quant.get("quant_method", "")).lower()
    if requested is not None and requested != method:
        raise UnsupportedModelError(
            f"--quantization {requested} does not match the checkpoint's quant_method {method!r}"
        )
    if method == "fp8":
        return _fp8_config(hf_quant)
    if method == "compressed-tensors":
        return _compressed_tensors_config(hf_quant)
    if method == "gptq":
        return _gptq_config(hf_quant)
    if method == "awq":
        return _awq_config(hf_quant)
    if method == "int4":
        raise UnsupportedModelError(
            "quant_method 'int4' is the online scheme (--quantization int4 of an unquantized "
            f"checkpoint), not a checkpoint format; {_SUPPORTED_TEXT}"
        )
    if method in KNOWN_METHODS:
        check_method_name(method)
    raise UnsupportedModelError(
        f"unknown quant_method {method!r} in quantization_config; {_SUPPORTED_TEXT}"
    )


def _fp8_config(hf_quant: dict[str, Any]) -> QuantConfig:
    fmt = hf_quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(
            f"fp8 fmt {fmt!r} is not supported (only 'e4m3'); {_SUPPORTED_TEXT}"
        )
    scheme = hf_quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise UnsupportedModelError(f"fp8 activation_scheme {scheme!r} is not supported")
    ignore = tuple(hf_quant.get("modules_to_not_convert") or hf_quant.get("ignored_layers") or ())
    block = hf_quant.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", "tensor", static_input_scale=scheme == "static", ignore=ignore)
    if scheme != "dynamic":
        raise UnsupportedModelError(
            "fp8 weight_block_size needs activation_scheme 'dynamic', found 'static'"
        )
    return QuantConfig(
        "fp8", "block", _block_of(block, "weight_block_size"), "weight_scale_inv", ignore=ignore
    )


def _block_of(value: Any, field: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(int(v) > 0 for v in value)):
        raise UnsupportedModelError(f"{field} must be two positive sizes [bn, bk], found {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors_config(hf_quant: dict[str, Any]) -> QuantConfig:
    """One float-quantized FP8 scheme shared by every config group."""
    groups = hf_quant.get("config_groups") or {}
    if not groups:
        raise UnsupportedModelError("compressed-tensors quantization_config has no config_groups")
    schemes = {_group_scheme(hf_quant, name, group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise UnsupportedModelError(
            f"compressed-tensors config groups with different schemes are not supported: "
            f"{sorted(map(str, schemes))}"
        )
    strategy, block, static_input, group_size = schemes.pop()
    return QuantConfig(
        "compressed-tensors",
        strategy,
        block,
        "weight_scale",
        static_input,
        tuple(hf_quant.get("ignore") or ()),
        group_size=group_size,
    )


def _group_size_of(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 8:
        raise UnsupportedModelError(
            f"{where} group_size {value!r} is not supported (a positive multiple of 8, e.g. 128; "
            "per-channel -1 is not supported yet)"
        )
    return value


def _int4_group_scheme(name: str, group: dict[str, Any]) -> tuple[str, None, bool, int]:
    """A compressed-tensors pack-quantized (w4a16) group, or refuse it."""
    weights = group.get("weights") or {}
    if (
        weights.get("type") != "int"
        or weights.get("num_bits") != 4
        or not weights.get("symmetric", True)
        or weights.get("dynamic", False)
        or weights.get("strategy") != "group"
        or weights.get("actorder") not in (None, False)
        or group.get("input_activations") is not None
    ):
        raise UnsupportedModelError(
            f"compressed-tensors pack-quantized weights {weights} in group {name!r} are not "
            "supported (int, 4 bits, symmetric, strategy group, no actorder, no activation "
            f"quantization); {_SUPPORTED_TEXT}"
        )
    return "group", None, False, _group_size_of(weights.get("group_size"), "compressed-tensors")


def _gptq_config(hf_quant: dict[str, Any]) -> QuantConfig:
    bits = hf_quant.get("bits")
    fmt = hf_quant.get("checkpoint_format", "gptq")
    if bits != 4 or fmt != "gptq":
        raise UnsupportedModelError(
            f"gptq bits {bits!r} checkpoint_format {fmt!r} is not supported (bits 4, "
            f"checkpoint_format 'gptq'); {_SUPPORTED_TEXT}"
        )
    return QuantConfig(
        "gptq",
        "group",
        scale_name="scales",
        ignore=tuple(hf_quant.get("modules_to_not_convert") or ()),
        group_size=_group_size_of(hf_quant.get("group_size"), "gptq"),
        zero_points=True,
        desc_act=bool(hf_quant.get("desc_act", False)),
    )


def _awq_config(hf_quant: dict[str, Any]) -> QuantConfig:
    bits = hf_quant.get("bits", hf_quant.get("w_bit"))
    version = str(hf_quant.get("version", "gemm")).lower()
    zero_point = hf_quant.get("zero_point", True)
    if bits != 4 or version != "gemm" or not zero_point:
        raise UnsupportedModelError(
            f"awq bits {bits!r} version {version!r} zero_point {zero_point!r} is not supported "
            f"(bits 4, version 'gemm', zero_point true); {_SUPPORTED_TEXT}"
        )
    size = hf_quant.get("group_size", hf_quant.get("q_group_size"))
    return QuantConfig(
        "awq",
        "group",
        scale_name="scales",
        ignore=tuple(hf_quant.get("modules_to_not_convert") or ()),
        group_size=_group_size_of(size, "awq"),
        zero_points=True,
    )


def _group_scheme(
    hf_quant: dict[str, Any], name: str, group: dict[str, Any]
) -> tuple[str, tuple[int, int] | None, bool, int | None]:
    """(weight strategy, block, static input scale, INT4 group size or None) of one config
    group, or refuse it."""
    fmt = group.get("format") or hf_quant.get("format")
    if fmt not in ("float-quantized", "pack-quantized"):
        raise UnsupportedModelError(
            f"compressed-tensors format {fmt!r} in group {name!r} is not supported yet; "
            f"{_SUPPORTED_TEXT}"
        )
    targets = group.get("targets") or []
    if "Linear" not in targets:
        raise UnsupportedModelError(
            f"compressed-tensors group {name!r} targets {targets}; only 'Linear' is supported"
        )
    if fmt == "pack-quantized":
        return _int4_group_scheme(name, group)
    weights = group.get("weights") or {}
    strategy = weights.get("strategy")
    if (
        weights.get("type") != "float"
        or weights.get("num_bits") != 8
        or not weights.get("symmetric", True)
        or weights.get("dynamic", False)
        or strategy not in ("channel", "tensor", "block")
    ):
        raise UnsupportedModelError(
            f"compressed-tensors weights {weights} in group {name!r} are not supported; "
            f"{_SUPPORTED_TEXT}"
        )
    block = (
        _block_of(weights.get("block_structure"), "block_structure")
        if strategy == "block"
        else None
    )
    acts = group.get("input_activations")
    if acts is None:
        return strategy, block, False, None
    if acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise UnsupportedModelError(
            f"compressed-tensors input_activations {acts} in group {name!r} are not supported"
        )
    if acts.get("dynamic", False):
        return strategy, block, False, None
    if acts.get("strategy") != "tensor" or block is not None:
        raise UnsupportedModelError(
            f"compressed-tensors static input_activations {acts} in group {name!r} are "
            "supported per tensor and with channel or tensor weights only"
        )
    return strategy, block, True, None


def refuse_spare_slots(num_spare: int, experts: str) -> None:
    """Quantized experts take no spare slots yet: only `num_spare == 0` passes.

    Args:
        num_spare: spare expert slots asked for (`--num-spare-experts`).
        experts: the experts' kind in the message ("FP8", "INT4").

    Raises:
        InvalidParameterError: num_spare != 0.
    """
    if num_spare != 0:
        raise InvalidParameterError(
            "num_spare_experts",
            f"num_spare_experts={num_spare} is not supported with {experts} experts yet (use 0)",
        )


def refuse_replicas(experts: str) -> None:
    """Quantized experts take no replicas yet (`--expert-router-policy load-aware`).

    Args:
        experts: the experts' kind in the message ("FP8", "INT4").

    Raises:
        InvalidParameterError: always.
    """
    raise InvalidParameterError(
        "expert_router_policy",
        f"expert_router_policy 'load-aware' is not supported with {experts} experts yet "
        "(use 'static')",
    )
