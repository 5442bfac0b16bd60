"""Changes to a model's MoE expert state that every tensor-parallel rank applies alike:
`ExpertOp` (the message) and `apply_expert_op` (its effect on one rank's blocks).

Rank 0 decides: its `runner.expert_health.ExpertMonitor` checks an operator's command (or its
own automatic restore), applies the op to rank 0's blocks between two steps and hands it to
`TensorParallelRunner.send_expert_op`, which carries it to the workers with the next plan
(`runner.tp_executor`); each worker applies the ops of a plan, in order, before that plan's
forward. So every rank runs each forward with the same frozen mask, streaks, freeze_after and
spare slot tables.

Invariants:
- `apply_expert_op` is a deterministic function of the op and the rank's blocks (their slot
  tables, shards and replica placements), none of which differ between the ranks in what the
  op reads, so ranks that start equal and apply the same ops in the same order stay equal.
- It validates nothing: rank 0's monitor checks layer, expert and the top_k room first, and
  sends only the ops it applied without an error.
- A restore reads the checkpoint's expert and writes the part this rank holds
  (`runner.expert_restore`): with a free spare slot into the oldest one, then the table is
  switched (the choice made alike on every rank, the tables being equal), else over the
  slots holding the expert. It does not unfreeze: the monitor sends an unfreeze after it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from sits.layers.moe import SparseMoeBlock
from sits.runner.expert_restore import restore_expert, restore_expert_into_spare


class ExpertOpKind(enum.Enum):
    """What an `ExpertOp` changes."""

    SET_FREEZE_AFTER = "set_freeze_after"  # every layer's freezing streak
    FREEZE = "freeze"  # the router masks the expert
    UNFREEZE = "unfreeze"  # routed again, its anomaly streak cleared
    RESTORE = "restore"  # its weights reloaded from the checkpoint (frozen mask unchanged)


@dataclass(frozen=True, slots=True)
class ExpertOp:
    """One change to the MoE experts' state (picklable: it rides the plan to the workers).

    Attributes:
        kind: what changes.
        layer_id: decoder layer index (-1 for SET_FREEZE_AFTER: every MoE layer).
        expert_id: logical expert id in that layer (-1 for SET_FREEZE_AFTER).
        freeze_after: SET_FREEZE_AFTER's consecutive anomalous checks (0 = never freeze).
        model_dir: RESTORE's checkpoint directory.
    """

    kind: ExpertOpKind
    layer_id: int = -1
    expert_id: int = -1
    freeze_after: int = 0
    model_dir: str = ""


def moe_blocks(model: nn.Module) -> dict[int, SparseMoeBlock]:
    """Decoder layer id -> its `SparseMoeBlock`, for the MoE layers of `model.model.layers`."""
    return {
        layer_id: layer.mlp
        for layer_id, layer in enumerate(model.model.layers)
        if isinstance(layer.mlp, SparseMoeBlock)
    }


def apply_expert_op(blocks: Mapping[int, SparseMoeBlock], op: ExpertOp) -> int | None:
    """Apply `op` to this rank's MoE blocks (decoder layer id -> block), between steps.

    Returns:
        For RESTORE, the expert's physical slot afterwards (`SparseMoeBlock.physical_slot`);
        None for the other kinds.

    Raises:
        UnsupportedModelError, ModelNotFoundError: a RESTORE the checkpoint cannot serve
            (`runner.expert_restore`); nothing has changed then.
    """
    if op.kind is ExpertOpKind.SET_FREEZE_AFTER:
        for block in blocks.values():
            block.expert_state().set_freeze_after(op.freeze_after)
        return None
    block = blocks[op.layer_id]
    expert_id = op.expert_id
    if op.kind is ExpertOpKind.RESTORE:
        slots = block.expert_slots()
        if slots is not None and slots.next_free_slot() is not None:
            return restore_expert_into_spare(block, op.model_dir, op.layer_id, expert_id)
        restore_expert(block, op.model_dir, op.layer_id, expert_id)
        return block.physical_slot(expert_id)
    state = block.expert_state()
    with torch.inference_mode():  # the state may be inference tensors (made in a forward)
        if op.kind is ExpertOpKind.FREEZE:
            state.frozen[expert_id] = True
        else:
            assert op.kind is ExpertOpKind.UNFREEZE, op.kind
            state.frozen[expert_id] = False
            state.streak[expert_id] = 0
    return None
