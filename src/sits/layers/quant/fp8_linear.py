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
- Tensor parallelism (`quant.sharding`): the fused QKV / gate-up keep their model-dtype twin's
  `part_shards` (output rows) and cut the checkpoint's weight, per-row and block scales by
  them; a projection made from a `RowParallelLinear` keeps its `col_shard` (input columns),
  cuts the weight and block scales by it, keeps every per-row scale whole (the full row's, as
  one rank's) and sums its partial products over the ranks, adding its bias once. Shards that
  cut through a scale block are refused at build, with the numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from sits.core.errors import UnsupportedModelError
from sits.kernels.fp8_ref import FP8_DTYPE, fp8_linear
from sits.layers.linear import (
    FusedLinear,
    GateUpLinear,
    QKVLinear,
    Shard,
    sum_partial,
)
from sits.layers.quant.config import QuantConfig
from sits.layers.quant.sharding import Convert, Target, check_aligned, input_columns, tensor_shard
from sits.parallel import SINGLE, TensorParallel

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


def check_sharded_blocks(
    part_shards: tuple[Shard, ...], col_shard: Shard, block: tuple[int, int], scheme: str
) -> None:
    """Refuse a tensor-parallel cut through FP8 scale blocks: every part's rows on bn-row
    block boundaries, the input columns on bk-column ones.

    Raises:
        UnsupportedModelError: with the rank's rows or columns and the block (`check_aligned`).
    """
    block_rows, block_cols = block
    units = f"FP8 scale blocks ({scheme})"
    for part, shard in enumerate(part_shards):
        what = "output rows" if len(part_shards) == 1 else f"output rows of part {part}"
        check_aligned(shard, block_rows, what, units)
    check_aligned(col_shard, block_cols, "input columns", units)


class Fp8Weights:
    """Mixin over a `FusedLinear`: FP8 storage, the reference forward and checkpoint targets.

    Attributes (besides FusedLinear's):
        col_shard: the checkpoint's input columns this module holds (all but for a
            row-parallel projection).
        tp: the ranks its partial products are summed over (SINGLE: none, also for the
            column-parallel fused projections).
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    part_sizes: tuple[int, ...]
    part_shards: tuple[Shard, ...]
    in_features: int
    part_rows: Callable[[int], slice]

    def _make_fp8(
        self, quant: QuantConfig, col_shard: Shard | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        """Replace the model-dtype weight with FP8 storage and add the scales.

        Raises:
            UnsupportedModelError: block scales whose rows cut through a fused part, or a
                tensor-parallel shard that cuts through scale blocks.
        """
        self.quant = quant
        self.block = quant.block_size if quant.strategy == "block" else None
        self.col_shard = col_shard if col_shard is not None else Shard.whole(self.in_features)
        self.tp = tp
        num_rows, num_cols = sum(self.part_sizes), self.in_features
        self.weight = fp8_parameter((num_rows, num_cols))
        if self.block is not None:
            block_rows, block_cols = self.block
            check_sharded_blocks(self.part_shards, self.col_shard, self.block, quant.describe())
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
        """x: [num_tokens, in_features] -> [num_tokens, sum(part_sizes)], x's dtype (summed
        over `tp`'s ranks, one all-reduce, when it has several)."""
        if self.tp.size == 1:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.block)
        partial = fp8_linear(x, self.weight, self.weight_scale, None, self.block)
        return sum_partial(partial, self.bias, self.tp)

    def checkpoint_target(self, kind: str, part: int) -> Target | None:
        """Where the checkpoint tensor `<part>.<kind>` goes: (our parameter's local name,
        index, check/convert or None, this rank's cut of it or None), or None when this
        module has no such tensor.

        kind: "weight", "bias", the scheme's scale name, or "input_scale".
        """
        rows = self.part_rows(part)
        num_rows = rows.stop - rows.start
        row_shard, col_shard = self.part_shards[part], self.col_shard
        if kind == "weight":  # [N, K]
            return "weight", (rows,), check_fp8, tensor_shard((0, row_shard, 1), (1, col_shard, 1))
        if kind == "bias":  # [N]
            if self.bias is None:
                return None
            return "bias", (rows,), None, tensor_shard((0, row_shard, 1), None)
        if kind == "input_scale":
            if self.input_scale is None:
                return None
            return "input_scale", (part,), scale_converter((), ((), (1,))), None
        if kind != self.quant.scale_name:
            return None
        if self.block is not None:  # [ceil(N / bn), ceil(K / bk)]
            block_rows, block_cols = self.block
            scale_rows = slice(rows.start // block_rows, _cdiv(rows.stop, block_rows))
            shape = (scale_rows.stop - scale_rows.start, self.weight_scale.shape[1])
            cut = tensor_shard((0, row_shard, block_rows), (1, col_shard, block_cols))
            return "weight_scale", (scale_rows,), scale_converter(shape, (shape,)), cut
        if self.quant.strategy == "channel":  # [N] or [N, 1]: the full row's on every rank
            allowed = ((num_rows,), (num_rows, 1))
            cut = tensor_shard((0, row_shard, 1), None)
        else:
            allowed, cut = ((), (1,)), None
        return "weight_scale", (rows,), scale_converter((num_rows,), allowed), cut


class Fp8FusedLinear(Fp8Weights, FusedLinear):
    """`FusedLinear` with FP8 weights (one part: a plain projection such as o_proj; with
    `col_shard` and `tp`, a row-parallel one)."""

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        bias: bool,
        quant: QuantConfig,
        col_shard: Shard | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        FusedLinear.__init__(self, in_features, part_sizes, bias=bias)
        self._make_fp8(quant, col_shard, tp)

    @classmethod
    def from_linear(cls, module: nn.Linear, quant: QuantConfig) -> Fp8FusedLinear:
        """The FP8 twin of an `nn.Linear` (same shape and bias, and a `RowParallelLinear`'s
        input columns and ranks; weights uninitialised)."""
        bias = module.bias is not None
        return cls(module.in_features, [module.out_features], bias, quant, *input_columns(module))

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"


class Fp8QKVLinear(Fp8Weights, QKVLinear):
    """`QKVLinear` with FP8 weights; `forward_split` as the model-dtype one."""

    def __init__(self, module: QKVLinear, quant: QuantConfig) -> None:
        QKVLinear.__init__(
            self, module.in_features, module.num_heads, module.num_kv_heads, module.head_dim,
            bias=module.bias is not None,
        )  # fmt: skip
        self.part_shards = module.part_shards  # this rank's heads' rows
        self._make_fp8(quant)

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"


class Fp8GateUpLinear(Fp8Weights, GateUpLinear):
    """`GateUpLinear` with FP8 weights."""

    def __init__(self, module: GateUpLinear, quant: QuantConfig) -> None:
        GateUpLinear.__init__(
            self, module.in_features, module.part_sizes[0], bias=module.bias is not None,
            shard=module.part_shards[0],
        )  # fmt: skip
        self._make_fp8(quant)

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"
