"""Sparse MoE block with FP8 experts: w13 / w2 in float8_e4m3fn with float32 scales.

Invariants:
- Routing, the router gate (model dtype), counts, health and the fused-kernel routing path are
  those of `layers.moe.SparseMoeBlock`; only the experts' storage and compute differ.
- Storage: w13 [E, 2I, H] and w2 [E, H, I] float8_e4m3fn; w13_scale / w2_scale float32, block
  [E, ceil(2I / bn), ceil(H / bk)] / [E, ceil(H / bn), ceil(I / bk)] (I a multiple of bn, so
  gate and up own whole blocks), or per row [E, 2I] / [E, H]; with static activation scales
  also w13_input_scale [E, 2] (gate, up) and w2_input_scale [E] (kept for the kernels).
- The experts run through a backend's `experts_fp8` (`kernels.moe_triton.TritonMoe`: the
  fused W8A8 kernel of `kernels.moe_fp8_triton`, CUDA-graph safe); a backend without it is
  replaced by the PyTorch reference (`kernels.moe_ref.TorchMoe`), which dequantizes only the
  experts a step routes to and is not CUDA-graph safe (decode steps then run eagerly).
- Tensor and expert parallelism as `SparseMoeBlock`: w13 / w2 hold this rank's experts
  (`expert_shard`) and intermediate slice (`inter_shard`), with their scales: w13's gate and
  up rows and their per-row / block scales are cut by output rows, w2's columns and block
  scales by whole scale blocks along I (refused at build, with the numbers, when a rank's
  slice cuts through one), w2's per-row scales stay the full rows' on every rank.
- Spare expert slots, replicated experts and reloading an expert are not supported with FP8
  experts yet.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sits.core.errors import UnsupportedModelError
from sits.kernels.fp8_ref import FP8_DTYPE
from sits.kernels.moe_ref import TorchMoe
from sits.layers.expert_replicas import ExpertReplicas
from sits.layers.linear import Shard
from sits.layers.moe import MoeBackend, MoeConfig, SparseMoeBlock
from sits.layers.quant.config import QuantConfig, refuse_replicas, refuse_spare_slots
from sits.layers.quant.fp8_linear import (
    check_fp8,
    check_sharded_blocks,
    fp8_parameter,
    scale_converter,
    scale_parameter,
)
from sits.layers.quant.sharding import Target, tensor_shard
from sits.parallel import SINGLE, TensorParallel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8SparseMoeBlock(SparseMoeBlock):
    """`SparseMoeBlock` whose experts hold FP8 weights (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        config: MoeConfig,
        quant: QuantConfig,
        moe_backend: MoeBackend | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Raises UnsupportedModelError when block scales cut through the gate/up split or
        a tensor-parallel rank's slice of the experts' width (InvalidParameterError: as
        `SparseMoeBlock`)."""
        super().__init__(hidden_size, config, moe_backend, tp=tp)
        self.quant = quant
        self.block = quant.block_size if quant.strategy == "block" else None
        num_experts, inter = self.expert_shard.size, self.intermediate_size  # this rank's
        self.w13 = fp8_parameter((num_experts, 2 * inter, hidden_size))
        self.w2 = fp8_parameter((num_experts, hidden_size, inter))
        if self.block is not None:
            block_rows, block_cols = self.block
            whole_hidden = Shard.whole(hidden_size)
            scheme = f"{quant.describe()}, experts"
            check_sharded_blocks((self.inter_shard,), whole_hidden, self.block, scheme)  # w13
            check_sharded_blocks((whole_hidden,), self.inter_shard, self.block, scheme)  # w2
            if inter % block_rows:
                raise UnsupportedModelError(
                    f"expert width {inter} does not split into {block_rows}-row scale blocks "
                    f"({quant.describe()})"
                )
            self.w13_scale = scale_parameter(
                (num_experts, 2 * inter // block_rows, _cdiv(hidden_size, block_cols))
            )
            self.w2_scale = scale_parameter(
                (num_experts, _cdiv(hidden_size, block_rows), _cdiv(inter, block_cols))
            )
        else:
            self.w13_scale = scale_parameter((num_experts, 2 * inter))
            self.w2_scale = scale_parameter((num_experts, hidden_size))
        self.w13_input_scale = None
        self.w2_input_scale = None
        if quant.static_input_scale:
            self.w13_input_scale = scale_parameter((num_experts, 2))
            self.w2_input_scale = scale_parameter((num_experts,))
        if not hasattr(self.moe_backend, "experts_fp8"):
            # The reference syncs with the host (experts in use): no CUDA graph capture
            # (`runner.backends.graph_safe` reads the backend's `cuda_graph_safe`).
            self.moe_backend = TorchMoe()

    def add_spare_slots(self, num_spare: int) -> None:
        """Only 0 spares: spare slots are not supported with FP8 experts yet.

        Raises:
            InvalidParameterError: num_spare != 0.
        """
        refuse_spare_slots(num_spare, "FP8")

    def enable_replicas(self, num_redundant: int) -> ExpertReplicas:
        """Refused: replicated experts are not supported with FP8 experts yet.

        Raises:
            InvalidParameterError: always.
        """
        refuse_replicas("FP8")

    def quant_dtypes(self) -> dict[str, torch.dtype]:
        """Parameters that keep their own dtype when the model is cast (`quant.apply`)."""
        dtypes = {"w13": FP8_DTYPE, "w2": FP8_DTYPE}
        for name in ("w13_scale", "w2_scale", "w13_input_scale", "w2_input_scale"):
            dtypes[name] = torch.float32
        return dtypes

    def checkpoint_target(self, expert: int, part: str, kind: str) -> Target | None:
        """Where expert `expert`'s checkpoint tensor `<part>.<kind>` goes: (our parameter's
        local name, index, check/convert, this rank's cut of it or None), or None when there
        is no such tensor or another expert-parallel rank holds the expert.

        part: "gate", "up" or "down"; kind: "weight", the scheme's scale name or "input_scale".
        """
        shard = self.expert_shard
        if not shard.start <= expert < min(shard.stop, self.config.num_experts):
            return None
        slot, inter = expert - shard.start, self.intermediate_size
        if part == "down":  # [H, I]: this rank's columns
            param, rows, part_slot = "w2", slice(0, self.w2.shape[1]), 0
            row_shard, col_shard = Shard.whole(self.w2.shape[1]), self.inter_shard
        else:  # [I, H]: this rank's rows
            param, part_slot = "w13", int(part == "up")
            rows = slice(part_slot * inter, (part_slot + 1) * inter)
            row_shard, col_shard = self.inter_shard, Shard.whole(self.w13.shape[2])
        if kind == "weight":
            cut = tensor_shard((0, row_shard, 1), (1, col_shard, 1))
            return param, (slot, rows), check_fp8, cut
        if kind == "input_scale":
            if self.w13_input_scale is None:
                return None
            index = (slot,) if param == "w2" else (slot, part_slot)
            return f"{param}_input_scale", index, scale_converter((), ((), (1,))), None
        if kind != self.quant.scale_name:
            return None
        num_rows = rows.stop - rows.start
        if self.block is not None:
            block_rows, block_cols = self.block
            scale_rows = slice(rows.start // block_rows, _cdiv(rows.stop, block_rows))
            shape = (scale_rows.stop - scale_rows.start, getattr(self, f"{param}_scale").shape[2])
            cut = tensor_shard((0, row_shard, block_rows), (1, col_shard, block_cols))
            return f"{param}_scale", (slot, scale_rows), scale_converter(shape, (shape,)), cut
        if self.quant.strategy == "channel":  # per row: w2's are the full rows' on every rank
            allowed = ((num_rows,), (num_rows, 1))
            cut = tensor_shard((0, row_shard, 1), None)
        else:
            allowed, cut = ((), (1,)), None
        return f"{param}_scale", (slot, rows), scale_converter((num_rows,), allowed), cut

    def _experts(
        self, hidden: Tensor, topk_weights: Tensor, ids: Tensor, nonfinite: Tensor | None
    ) -> Tensor:
        """The FP8 experts of this rank's slots ids [T, k] (-1: none) -> [T, hidden_size]."""
        return self.moe_backend.experts_fp8(
            hidden,
            self.w13,
            self.w13_scale,
            self.w2,
            self.w2_scale,
            self.block,
            topk_weights,
            ids,
            nonfinite,
        )

    def extra_repr(self) -> str:
        return f"{self.config}, {self.quant.describe()}"
