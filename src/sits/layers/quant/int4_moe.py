"""Sparse MoE block with INT4 weight-only (w4a16) experts: w13 / w2 as packed 4-bit codes with
float32 group scales and optional zero points.

Invariants:
- Routing, the router gate (model dtype), counts, health and the fused-kernel routing path are
  those of `layers.moe.SparseMoeBlock`; only the experts' storage and compute differ.
- Storage (the layout of `kernels.int4_ref`, per expert): w13 [E, 2I, H / 8] and w2
  [E, H, I / 8] int32; w13_scale / w2_scale [E, 2I, H / G] / [E, H, I / G] float32; w13_zero /
  w2_zero uint8 of the scales' shapes (gptq, awq; None: symmetric); w13_g_idx [E, 2, H] /
  w2_g_idx [E, 1, I] int32 (gptq: checked to be k // G, desc_act experts are refused);
  w13_shape [E, 2, 2] / w2_shape [E, 1, 2] int64 (compressed-tensors `weight_shape`).
- The experts run through a backend's `experts_int4` (the seam of the fused w4a16 MoE
  kernel); a backend without it is replaced by the PyTorch reference (`kernels.moe_ref.TorchMoe`,
  not CUDA-graph safe), as for FP8 experts.
- Tensor and expert parallelism as `SparseMoeBlock`: this rank's experts (`expert_shard`)
  and intermediate slice (`inter_shard`): w13's gate and up rows cut out of every checkpoint
  tensor, w2's columns by whole groups (a slice that cuts through a group is refused at
  build, with the numbers).
- Spare expert slots and replicated experts are not supported with INT4 experts yet.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sits.core.errors import UnsupportedModelError
from sits.kernels.int4_ref import PACK
from sits.kernels.moe_ref import TorchMoe
from sits.layers.expert_replicas import ExpertReplicas
from sits.layers.linear import Shard
from sits.layers.moe import MoeBackend, MoeConfig, SparseMoeBlock
from sits.layers.quant.config import QuantConfig, refuse_replicas, refuse_spare_slots
from sits.layers.quant.int4_formats import (
    LOCAL_OF,
    checkpoint_kind,
    format_of,
    int4_converter,
    int4_cut,
)
from sits.layers.quant.int4_linear import (
    check_int4_shape,
    check_sharded_groups,
    int4_dtypes,
    int_parameter,
)
from sits.layers.quant.sharding import Target
from sits.parallel import SINGLE, TensorParallel


class Int4SparseMoeBlock(SparseMoeBlock):
    """`SparseMoeBlock` whose experts hold INT4 weights (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        config: MoeConfig,
        quant: QuantConfig,
        moe_backend: MoeBackend | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Raises UnsupportedModelError for shapes the scheme cannot hold, desc_act, or a
        tensor-parallel slice that cuts through groups (InvalidParameterError: as
        `SparseMoeBlock`)."""
        super().__init__(hidden_size, config, moe_backend, tp=tp)
        self.quant = quant
        self.fmt = format_of(quant.method)
        if quant.desc_act:
            raise UnsupportedModelError(
                f"GPTQ desc_act experts are not supported yet ({quant.describe()})"
            )
        num_experts, inter = self.expert_shard.size, self.intermediate_size  # this rank's
        whole_hidden = Shard.whole(hidden_size)
        check_sharded_groups(quant, (self.inter_shard, self.inter_shard), whole_hidden)
        check_sharded_groups(quant, (whole_hidden,), self.inter_shard)
        check_int4_shape(
            quant, hidden_size, [inter, inter], f"experts w13 {2 * inter} x {hidden_size}"
        )
        check_int4_shape(quant, inter, [hidden_size], f"experts w2 {hidden_size} x {inter}")
        for param, rows, cols, parts in (
            ("w13", 2 * inter, hidden_size, 2),
            ("w2", hidden_size, inter, 1),
        ):
            groups = cols // (quant.group_size or 1)
            setattr(self, param, int_parameter((num_experts, rows, cols // PACK), torch.int32))
            scale = nn.Parameter(torch.empty(num_experts, rows, groups), requires_grad=False)
            setattr(self, f"{param}_scale", scale)
            zero = int_parameter((num_experts, rows, groups), torch.uint8)
            setattr(self, f"{param}_zero", zero if quant.zero_points else None)
            g_idx = int_parameter((num_experts, parts, cols), torch.int32)
            setattr(self, f"{param}_g_idx", g_idx if self.fmt == "gptq" else None)
            shape = int_parameter((num_experts, parts, 2), torch.int64)
            setattr(self, f"{param}_shape", shape if self.fmt == "ct" else None)
        if not hasattr(self.moe_backend, "experts_int4"):
            self.moe_backend = TorchMoe()  # the reference: no CUDA graph capture

    def add_spare_slots(self, num_spare: int) -> None:
        """Only 0 spares: spare slots are not supported with INT4 experts yet.

        Raises:
            InvalidParameterError: num_spare != 0.
        """
        refuse_spare_slots(num_spare, "INT4")

    def enable_replicas(self, num_redundant: int) -> ExpertReplicas:
        """Refused: replicated experts are not supported with INT4 experts yet.

        Raises:
            InvalidParameterError: always.
        """
        refuse_replicas("INT4")

    def quant_dtypes(self) -> dict[str, torch.dtype]:
        """Parameters that keep their own dtype when the model is cast (`quant.apply`)."""
        return {**int4_dtypes("w13"), **int4_dtypes("w2")}

    def checkpoint_kind(self, local: str) -> str:
        """The checkpoint tensor kind filling our parameter `local` (for error messages)."""
        return checkpoint_kind(self.fmt, local.removeprefix("w13").removeprefix("w2"))

    def checkpoint_target(self, expert: int, part: str, kind: str) -> Target | None:
        """Where expert `expert`'s checkpoint tensor `<part>.<kind>` goes: (our parameter's
        local name, index, check/convert, this rank's cut of it or None), or None when there
        is no such tensor or another expert-parallel rank holds the expert.

        part: "gate", "up" or "down"; kind: a kind of the format (`int4_formats.LOCAL_OF`).
        """
        shard = self.expert_shard
        if kind not in LOCAL_OF[self.fmt]:
            return None
        if not shard.start <= expert < min(shard.stop, self.config.num_experts):
            return None
        slot, inter, hidden = expert - shard.start, self.intermediate_size, self.w2.shape[1]
        if part == "down":  # [H, I]: this rank's columns
            param, part_slot, rows, num_cols = "w2", 0, slice(0, hidden), inter
            row_shard, col_shard = Shard.whole(hidden), self.inter_shard
        else:  # [I, H]: this rank's rows
            param, part_slot, num_cols = "w13", int(part == "up"), hidden
            rows = slice(part_slot * inter, (part_slot + 1) * inter)
            row_shard, col_shard = self.inter_shard, Shard.whole(hidden)
        local = param + LOCAL_OF[self.fmt][kind]
        if getattr(self, local) is None:
            return None
        group = self.quant.group_size or 0
        convert = int4_converter(
            self.fmt, kind, rows.stop - rows.start, num_cols, group,
            whole=(row_shard.full, col_shard.full), first_col=col_shard.start,
        )  # fmt: skip
        per_part = local.endswith(("_g_idx", "_shape"))
        index = (slot, part_slot) if per_part else (slot, rows)
        return local, index, convert, int4_cut(self.fmt, kind, row_shard, col_shard, group)

    def _experts(
        self, hidden: Tensor, topk_weights: Tensor, ids: Tensor, nonfinite: Tensor | None
    ) -> Tensor:
        """The INT4 experts of this rank's slots ids [T, k] (-1: none) -> [T, hidden_size]."""
        return self.moe_backend.experts_int4(
            hidden,
            (self.w13, self.w13_scale, self.w13_zero),
            (self.w2, self.w2_scale, self.w2_zero),
            self.quant.group_size,
            topk_weights,
            ids,
            nonfinite,
        )

    def extra_repr(self) -> str:
        return f"{self.config}, {self.quant.describe()}"
