"""Reload one MoE expert's weights from its safetensors checkpoint (self-healing after a fault).

Invariants:
- Only the one expert's tensors are read (safetensors slices), whatever the checkpoint layout
  the loader accepts: per-expert hub names (`layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`,
  Mixtral's `layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}`) or fused expert tensors
  (`layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H], `.down_proj` [E, H, I]).
- The copy goes into the block's weights in place (same storage, the block's dtype and
  device): `restore_expert` overwrites the slots the expert uses now; with spare slots
  (`layers.expert_slots`) `restore_expert_into_spare` fills the oldest free slot first and
  only then points the routing table at it, so the expert's old slot is never read while
  half written. Callers run both between steps (the engine thread; with tensor parallelism
  every rank, `runner.expert_ops`).
- Tensor parallelism: a rank writes only what it holds of the expert: its slice
  `SparseMoeBlock.inter_shard` of the intermediate dimension (the gate rows and up rows of
  w13, the columns of w2, as the loader slices them), or, with expert parallelism, the whole
  expert into each of its local slots holding it (`SparseMoeBlock.local_slots`: none on a
  rank without it, which reads nothing; several with replicas).
"""

from __future__ import annotations

import re

import torch
from safetensors import safe_open
from torch import Tensor

from sits.core.errors import UnsupportedModelError
from sits.models.loader import safetensors_files

_PER_EXPERT = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_FUSED = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}


def read_expert_weights(model_dir: str, layer_id: int, expert_id: int) -> tuple[Tensor, Tensor]:
    """The checkpoint's weights of one expert.

    Args:
        model_dir: the checkpoint directory (`ModelInfo.model_dir`).
        layer_id: decoder layer index.
        expert_id: expert index in that layer.

    Returns:
        (w13 [2I, H] gate rows then up rows, w2 [H, I]), the checkpoint's dtype, on the CPU.

    Raises:
        UnsupportedModelError: the checkpoint lacks a part of that expert.
    """
    parts: dict[str, Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                match = _PER_EXPERT.search(name)
                if match and (int(match[1]), int(match[2])) == (layer_id, expert_id):
                    parts[_PART.get(match[3], "down")] = f.get_tensor(name)
                    continue
                match = _FUSED.search(name)
                if match and int(match[1]) == layer_id:
                    fused = f.get_slice(name)[expert_id]  # [2I, H] or [H, I]
                    if match[2] == "gate_up_proj":
                        parts["gate"], parts["up"] = fused.chunk(2, dim=0)
                    else:
                        parts["down"] = fused
    missing = {"gate", "up", "down"} - parts.keys()
    if missing:
        raise UnsupportedModelError(
            f"{model_dir!r} has no {sorted(missing)} weights for layer {layer_id} expert "
            f"{expert_id}"
        )
    return torch.cat([parts["gate"], parts["up"]], dim=0), parts["down"]


def _read_checked(block, model_dir: str, layer_id: int, expert_id: int) -> tuple[Tensor, Tensor]:
    """`read_expert_weights`, checked against the checkpoint's expert shapes, cut to this
    rank's slice of the intermediate dimension: (w13 [2I_r, H], w2 [H, I_r]), I_r =
    `block.intermediate_size`."""
    if getattr(block, "quant", None) is not None:
        raise UnsupportedModelError("reloading an expert is not supported with FP8 experts yet")
    w13, w2 = read_expert_weights(model_dir, layer_id, expert_id)
    inter, hidden_size = block.inter_shard, block.w13.shape[2]
    expected = ((2 * inter.full, hidden_size), (hidden_size, inter.full))
    if (tuple(w13.shape), tuple(w2.shape)) != expected:
        raise UnsupportedModelError(
            f"checkpoint expert {layer_id}.{expert_id} has shapes {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}; the model expects {expected[0]}, {expected[1]}"
        )
    if not inter.is_whole:
        gate, up = w13.chunk(2, dim=0)  # [I, H] each
        w13 = torch.cat([gate[inter.start : inter.stop], up[inter.start : inter.stop]])
        w2 = w2[:, inter.start : inter.stop]  # [H, I_r]
    return w13, w2


def _write_slot(block, slot: int, w13: Tensor, w2: Tensor) -> None:
    with torch.no_grad():
        block.w13[slot].copy_(w13)  # [2I, H]
        block.w2[slot].copy_(w2)  # [H, I]


def restore_expert(block, model_dir: str, layer_id: int, expert_id: int) -> None:
    """Copy the checkpoint's weights of expert `expert_id` (this rank's part) into every slot
    of `block` (a SparseMoeBlock) that holds it now (`block.local_slots`); a rank holding
    none of it (expert parallelism) reads nothing.

    Raises:
        UnsupportedModelError: missing weights, or shapes that do not match the block.
    """
    slots = block.local_slots(expert_id)
    if not slots:
        return
    w13, w2 = _read_checked(block, model_dir, layer_id, expert_id)
    for slot in slots:
        _write_slot(block, slot, w13, w2)


def restore_expert_into_spare(block, model_dir: str, layer_id: int, expert_id: int) -> int:
    """Load the checkpoint's weights of expert `expert_id` (this rank's slice under tensor
    parallelism) into the oldest free slot of `block` (a SparseMoeBlock with spare slots),
    then point its routing table there; the slot it leaves becomes a free spare
    (`ExpertSlots.switch`).

    Returns:
        The expert's new physical slot.

    Raises:
        UnsupportedModelError: missing weights, or shapes that do not match the block (the
            table is then unchanged).
        ValueError: the block has no free slot.
    """
    slots = block.expert_slots()
    slot = slots.next_free_slot() if slots is not None else None
    if slot is None:
        raise ValueError("the MoE layer has no free spare slot")
    w13, w2 = _read_checked(block, model_dir, layer_id, expert_id)
    _write_slot(block, slot, w13, w2)
    slots.switch(expert_id, slot)
    return slot
