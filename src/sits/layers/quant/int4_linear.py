"""INT4 weight-only (w4a16) linear layers: the fused QKV / gate-up and the plain projections
with packed 4-bit weights, float32 group scales and optional zero points, swapped in for their
model-dtype twins (`quant.apply`).

Invariants:
- Same module tree, part layout and `forward` / `forward_split` contract as `layers.linear`;
  only the storage differs (the layout of `kernels.int4_ref`, whatever the checkpoint format):
  `weight` [N, K / 8] int32 packed codes, `weight_scale` [N, K / G] float32, `weight_zero`
  [N, K / G] uint8 (gptq, awq; None: symmetric), `g_idx` [num_parts, K] int32 (gptq only: each
  part's column groups), `weight_shape` [num_parts, 2] int64 (compressed-tensors only: the
  checked `weight_shape` tensors), `bias` in the model dtype.
- K is a multiple of G and G of 8; with zero points every part's rows are a multiple of 8
  (zeros are packed along N): refused at build otherwise.
- The forward is the Triton w4a16 GEMM (`kernels.w4a16_gemm_triton`, dequantized in the
  kernel) on CUDA, else `kernels.int4_ref.w4a16_linear` (dequantize, then matmul); with GPTQ
  `desc_act` each part is dequantized with its own `g_idx` by the reference.
- Tensor parallelism (`quant.sharding`, `int4_formats.int4_cut`): the fused QKV / gate-up keep
  their twin's `part_shards` and take those rows of every checkpoint tensor; a projection made
  from a `RowParallelLinear` keeps its `col_shard`, takes those columns (whole groups: a shard
  that cuts through a group is refused at build, with the numbers; so is GPTQ `desc_act`,
  whose groups span the whole row) and sums its partial products over the ranks, adding its
  bias once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from sits.core.errors import UnsupportedModelError
from sits.kernels.int4_ref import PACK, w4a16_linear
from sits.kernels.triton_utils import has_triton
from sits.layers.linear import (
    FusedLinear,
    GateUpLinear,
    QKVLinear,
    Shard,
    sum_partial,
)
from sits.layers.quant.config import QuantConfig
from sits.layers.quant.int4_formats import (
    LOCAL_OF,
    checkpoint_kind,
    format_of,
    int4_converter,
    int4_cut,
)
from sits.layers.quant.sharding import Target, check_aligned, input_columns, tensor_shard
from sits.parallel import SINGLE, TensorParallel


def int_parameter(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised integer parameter (no gradient)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def check_int4_shape(quant: QuantConfig, num_cols: int, part_rows: list[int], what: str) -> None:
    """Refuse a weight the scheme cannot hold.

    Raises:
        UnsupportedModelError: G does not divide K, or zero points with part rows not a
            multiple of 8.
    """
    group = quant.group_size
    assert group is not None
    if num_cols % group:
        raise UnsupportedModelError(
            f"{what}: group size {group} does not divide its {num_cols} input columns "
            f"({quant.describe()})"
        )
    if quant.zero_points and any(rows % PACK for rows in part_rows):
        raise UnsupportedModelError(
            f"{what}: {part_rows} output rows are not multiples of 8, as packed zero points "
            f"need ({quant.describe()})"
        )


def check_sharded_groups(
    quant: QuantConfig, part_shards: tuple[Shard, ...], col_shard: Shard
) -> None:
    """Refuse a tensor-parallel cut through INT4 groups or packed words: the input columns on
    G-column group boundaries (and no GPTQ act-order across them), each part's rows on
    8-row words where zero points are packed along N.

    Raises:
        UnsupportedModelError: with the rank's rows or columns and the unit.
    """
    group = quant.group_size
    assert group is not None
    check_aligned(col_shard, group, "input columns", f"INT4 groups ({quant.describe()})")
    if quant.desc_act and not col_shard.is_whole:
        raise UnsupportedModelError(
            f"GPTQ desc_act groups span a whole row, so its input columns [{col_shard.start}, "
            f"{col_shard.stop}) of {col_shard.full} cannot be split by tensor parallelism "
            f"({quant.describe()})"
        )
    if quant.zero_points:
        for part, shard in enumerate(part_shards):
            check_aligned(
                shard,
                PACK,
                f"output rows of part {part}",
                f"packed zero points ({quant.describe()})",
            )


def int4_dtypes(prefix: str) -> dict[str, torch.dtype]:
    """Storage dtypes of the INT4 parameters named `<prefix>`, `<prefix>_scale`, ..."""
    return {
        prefix: torch.int32,
        f"{prefix}_scale": torch.float32,
        f"{prefix}_zero": torch.uint8,
        f"{prefix}_g_idx": torch.int32,
        f"{prefix}_shape": torch.int64,
    }


class Int4Weights:
    """Mixin over a `FusedLinear`: INT4 storage, the reference forward and checkpoint targets."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    part_sizes: tuple[int, ...]
    part_shards: tuple[Shard, ...]
    in_features: int
    part_rows: Callable[[int], slice]

    def _make_int4(
        self, quant: QuantConfig, col_shard: Shard | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        """Replace the model-dtype weight with INT4 storage (see the module docstring).

        Raises:
            UnsupportedModelError: shapes the scheme cannot hold (`check_int4_shape`), or a
                tensor-parallel shard that cuts through groups (`check_sharded_groups`).
        """
        self.quant = quant
        self.fmt = format_of(quant.method)
        self.col_shard = col_shard if col_shard is not None else Shard.whole(self.in_features)
        self.tp = tp
        num_rows, num_cols = sum(self.part_sizes), self.in_features
        check_sharded_groups(quant, self.part_shards, self.col_shard)
        check_int4_shape(quant, num_cols, list(self.part_sizes), f"{num_rows} x {num_cols}")
        groups, parts = num_cols // (quant.group_size or 1), len(self.part_sizes)
        self.weight = int_parameter((num_rows, num_cols // PACK), torch.int32)
        self.weight_scale = nn.Parameter(torch.empty(num_rows, groups), requires_grad=False)
        self.weight_zero = (
            int_parameter((num_rows, groups), torch.uint8) if quant.zero_points else None
        )
        self.weight_g_idx = (
            int_parameter((parts, num_cols), torch.int32) if self.fmt == "gptq" else None
        )
        self.weight_shape = int_parameter((parts, 2), torch.int64) if self.fmt == "ct" else None

    def quant_dtypes(self) -> dict[str, torch.dtype]:
        """Parameters that keep their own dtype when the model is cast (`quant.apply`)."""
        return int4_dtypes("weight")

    def forward(self, x: Tensor) -> Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, sum(part_sizes)], x's dtype (summed
        over `tp`'s ranks, one all-reduce, when it has several)."""
        if self.tp.size == 1:
            return self._linear(x, self.bias)
        return sum_partial(self._linear(x, None), self.bias, self.tp)

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """x @ dequantize(weight).T (+ bias): [num_tokens, sum(part_sizes)], x's dtype."""
        group = self.quant.group_size or 0
        if not self.quant.desc_act:
            if x.is_cuda and has_triton():  # the w4a16 GEMM, dequantized in the kernel
                from sits.kernels.w4a16_gemm_triton import (
                    triton_w4a16_linear,
                    w4a16_gemm_supported,
                )

                if w4a16_gemm_supported(x.device):
                    return triton_w4a16_linear(
                        x, self.weight, self.weight_scale, self.weight_zero, group, bias
                    )
            return w4a16_linear(x, self.weight, self.weight_scale, self.weight_zero, group, bias)
        outs = []
        for part in range(len(self.part_sizes)):
            rows = self.part_rows(part)
            zero = None if self.weight_zero is None else self.weight_zero[rows]
            part_bias = None if bias is None else bias[rows]
            outs.append(
                w4a16_linear(
                    x,
                    self.weight[rows],
                    self.weight_scale[rows],
                    zero,
                    group,
                    part_bias,
                    self.weight_g_idx[part],
                )  # fmt: skip
            )
        return torch.cat(outs, dim=-1)

    def checkpoint_kind(self, local: str) -> str:
        """The checkpoint tensor kind filling our parameter `local` (for error messages)."""
        return checkpoint_kind(self.fmt, local.removeprefix("weight"))

    def checkpoint_target(self, kind: str, part: int) -> Target | None:
        """Where the checkpoint tensor `<part>.<kind>` goes: (our parameter's local name,
        index, check/convert, this rank's cut of it or None), or None when this module has
        no such tensor.

        kind: "bias" or a kind of the format (`int4_formats.LOCAL_OF`).
        """
        rows = self.part_rows(part)
        row_shard, col_shard = self.part_shards[part], self.col_shard
        group = self.quant.group_size or 0
        if kind == "bias":
            if self.bias is None:
                return None
            return "bias", (rows,), None, tensor_shard((0, row_shard, 1), None)
        convert = int4_converter(
            self.fmt, kind, rows.stop - rows.start, self.in_features, group,
            self.quant.desc_act, (row_shard.full, col_shard.full), col_shard.start,
        )  # fmt: skip
        if convert is None:
            return None
        local = "weight" + LOCAL_OF[self.fmt][kind]
        if getattr(self, local) is None:
            return None
        index = (part,) if local in ("weight_g_idx", "weight_shape") else (rows,)
        return local, index, convert, int4_cut(self.fmt, kind, row_shard, col_shard, group)


class Int4FusedLinear(Int4Weights, FusedLinear):
    """`FusedLinear` with INT4 weights (one part: a plain projection such as o_proj)."""

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
        self._make_int4(quant, col_shard, tp)

    @classmethod
    def from_linear(cls, module: nn.Linear, quant: QuantConfig) -> Int4FusedLinear:
        """The INT4 twin of an `nn.Linear` (same shape and bias, and a `RowParallelLinear`'s
        input columns and ranks; weights uninitialised)."""
        bias = module.bias is not None
        return cls(module.in_features, [module.out_features], bias, quant, *input_columns(module))

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"


class Int4QKVLinear(Int4Weights, QKVLinear):
    """`QKVLinear` with INT4 weights; `forward_split` as the model-dtype one."""

    def __init__(self, module: QKVLinear, quant: QuantConfig) -> None:
        QKVLinear.__init__(
            self, module.in_features, module.num_heads, module.num_kv_heads, module.head_dim,
            bias=module.bias is not None,
        )  # fmt: skip
        self.part_shards = module.part_shards  # this rank's heads' rows
        self._make_int4(quant)

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"


class Int4GateUpLinear(Int4Weights, GateUpLinear):
    """`GateUpLinear` with INT4 weights."""

    def __init__(self, module: GateUpLinear, quant: QuantConfig) -> None:
        GateUpLinear.__init__(
            self, module.in_features, module.part_sizes[0], bias=module.bias is not None,
            shard=module.part_shards[0],
        )  # fmt: skip
        self._make_int4(quant)

    def extra_repr(self) -> str:
        return f"{FusedLinear.extra_repr(self)}, {self.quant.describe()}"
