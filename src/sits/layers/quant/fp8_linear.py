"""FP8 linear layers: the fused QKV / gate-up and the plain projections with float8_e4m3fn
weights and float32 scales, swapped in for their model-dtype twins (`quant.apply`).

Invariants:
- Same module tree, part layout and `forward` / `forward_split` contract as `layers.linear`;
  only the storage differs: `weight` [N, K] float8_e4m3fn, `weight_scale` float32 (block
  [ceil(N / bn), ceil(K / bk)], or per row [N]), `bias` in the model dtype, `input_scale`
  [num_parts] float32 only for static activation scales (kept for the FP8 GEMM kernel; the
  reference path does not read it).
- Fused parts own whole scale blocks: with block scales every part's rows are a multiple of bn
  (refused at build otherwise), so part j's scale rows are its weight rows // bn.
- A per-tensor checkpoint scale is repeated over its part's rows, so q/k/v (gate/up) keep
  their own scales in the fused weight.
- The forward is `kernels.fp8_ref.fp8_linear` (dequantize, then matmul): the seam of the FP8
  GEMM kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from sits.core.errors import UnsupportedModelError
from sits.kernels.fp8_ref import FP8_DTYPE, fp8_linear
from sits.layers.linear import FusedLinear, GateUpLinear, QKVLinear
from sits.layers.quant.config import QuantConfig

Convert = Callable[[Tensor, str], Tensor]
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_parameter(shape: tuple[int, ...]) -> nn.Parameter:
    """An uninitialised float8_e4m3fn parameter (no gradient)."""
    return nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE), requires_grad=False)


def scale_parameter(shape: tuple[int, ...]) -> nn.Parameter:
    """An uninitialised float32 scale parameter (no gradient)."""
    return nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)


def check_fp8(tensor: Tensor, name: str) -> Tensor:
    """The checkpoint's quantized weight, refused unless float8_e4m3fn."""
    if tensor.dtype != FP8_DTYPE:
        raise UnsupportedModelError(
            f"checkpoint tensor {name} has dtype {tensor.dtype}, expected {FP8_DTYPE} "
            "(the quantization_config says FP8 weights)"
        )
    return tensor


def scale_converter(shape: tuple[int, ...], allowed: tuple[tuple[int, ...], ...]) -> Convert:
    """A check-and-reshape of a checkpoint scale into `shape` (float32).

    `allowed` lists the checkpoint shapes accepted; a single-element one is repeated over
    `shape` (per-tensor scale -> per-row). Refuses other shapes and non-float dtypes.
    """

    def convert(tensor: Tensor, name: str) -> Tensor:
        if tensor.dtype not in SCALE_DTYPES:
            raise UnsupportedModelError(
                f"checkpoint tensor {name} has dtype {tensor.dtype}, expected float32 "
                "(or bfloat16 / float16) scales"
            )
        if tuple(tensor.shape) not in allowed:
            raise UnsupportedModelError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                f"{' or '.join(str(s) for s in allowed)}"
            )
        tensor = tensor.float()
        if tensor.numel() == 1:
            return tensor.reshape(()).expand(shape)
        return tensor.reshape(shape)

    return convert


class Fp8Weights:
    """Mixin over a `FusedLinear`: FP8 storage, the reference forward and checkpoint targets."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    part_sizes: tuple[int, ...]
    in_features: int
    part_rows: Callable[[int], slice]

    def _make_fp8(self, quant: QuantConfig) -> None:
        """Replace the model-dtype weight with FP8 storage and add the scales.

        Raises:
            UnsupportedModelError: block scales whose rows cut through a fused part.
        """
        self.quant = quant
        self.block = quant.block_size if quant.strategy == "block" else None
        num_rows, num_cols = sum(self.part_sizes), self.in_features
        self.weight = fp8_parameter((num_rows, num_cols))
        if self.block is not None:
            block_rows, block_cols = self.block
            if len(self.part_sizes) > 1 and any(n % block_rows for n in self.part_sizes):
                raise UnsupportedModelError(
                    f"fused parts of {list(self.part_sizes)} rows do not split into "
                    f"{block_rows}-row scale blocks ({quant.describe()})"
                )
            self.weight_scale = scale_parameter(
                (_cdiv(num_rows, block_rows), _cdiv(num_cols, block_cols))
            )
        else:
            self.weight_scale = scale_parameter((num_rows,))
        self.input_scale = (
            scale_parameter((len(self.part_sizes),)) if quant.static_input_scale else None
        )

    def quant_dtypes(self) -> dict[str, torch.dtype]:
        """Parameters that keep their own dtype when the model is cast (`quant.apply`)."""
        return {"weight": FP8_DTYPE, "weight_scale": torch.float32, "input_scale": torch.float32}

    def forward(self, x: Tensor) -> Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, sum(part_sizes)], x's dtype."""
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.block)

    def checkpoint_target(
        self, kind: str, part: int
    ) -> tuple[str, tuple[int | slice, ...], Convert | None] | None:
        """Where the checkpoint tensor `<part>.<kind>` goes: (our parameter's local name,
        index, check/convert or None), or None when this module has no such tensor.

        kind: "weight", "bias", the scheme's scale name, or "input_scale".
        """
        rows = self.part_rows(part)
        num_rows = rows.stop - rows.start
        if kind == "weight":
            return "weight", (rows,), check_fp8
        if kind == "bias":
            return ("bias", (rows,), None) if self.bias is not None else None
        if kind == "input_scale":
            if self.input_scale is None:
                return None
            return "input_scale", (part,), scale_converter((), ((), (1,)))
        if kind != self.quant.scale_name:
            return None
        if self.block is not None:
            block_rows = self.block[0]
            scale_rows = slice(rows.start // block_rows, _cdiv(rows.stop, block_rows))
            shape = (scale_rows.stop - scale_rows.start, self.weight_scale.shape[1])
            return "weight_scale", (scale_rows,), scale_converter(shape, (shape,))
        if self.quant.strategy == "channel":
            allowed = ((num_rows,), (num_rows, 1))
        else:
            allowed = ((), (1,))
        return "weight_scale", (rows,), scale_converter((num_rows,), allowed)


class Fp8FusedLinear(Fp8Weights, FusedLinear):
    """`FusedLinear` with FP8 weights (one part: a plain projection such as o_proj)."""

    def __init__(
        self, in_features: int, part_sizes: list[int], bias: bool, quant: QuantConfig
    ) -> None:
        FusedLinear.__init__(self, in_features, part_sizes, bias=bias)
        self._make_fp8(quant)

    @classmethod
    def from_linear(cls, module: nn.Linear, quant: QuantConfig) -> Fp8FusedLinear:
        """The FP8 twin of an `nn.Linear` (same shape and bias; weights uninitialised)."""
        return cls(module.in_features, [module.out_features], module.bias is not None, quant)

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"


class Fp8QKVLinear(Fp8Weights, QKVLinear):
    """`QKVLinear` with FP8 weights; `forward_split` as the model-dtype one."""

    def __init__(self, module: QKVLinear, quant: QuantConfig) -> None:
        QKVLinear.__init__(
            self, module.in_features, module.num_heads, module.num_kv_heads, module.head_dim,
            bias=module.bias is not None,
        )  # fmt: skip
        self._make_fp8(quant)

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"


class Fp8GateUpLinear(Fp8Weights, GateUpLinear):
    """`GateUpLinear` with FP8 weights."""

    def __init__(self, module: GateUpLinear, quant: QuantConfig) -> None:
        GateUpLinear.__init__(
            self, module.in_features, module.part_sizes[0], bias=module.bias is not None
        )
        self._make_fp8(quant)

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"
