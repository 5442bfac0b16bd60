"""Spare expert slots of one MoE layer: the logical -> physical routing table and its free pool.

With N spare slots a layer's w13 / w2 hold E + N physical slots; `ExpertSlots.table` ([E]
int64, on the weights' device) says which slot holds each logical expert. A frozen expert is
restored by loading its checkpoint weights into a free slot and pointing its table entry
there (`runner.expert_restore.restore_expert_into_spare`); its old slot then becomes a spare.

Invariants:
- The router, the counters, the health flags and the frozen mask stay in logical expert ids
  [0, E); only the experts' compute sees physical slots [0, E + N): `map_ids` is one gather
  through `table` on the device (no host sync), and the experts' non-finite flags are raised
  per physical slot in `nonfinite` and folded back into the logical `anomalous` flags by
  `fold_nonfinite` (one gather), which also clears them.
- `table` and `nonfinite` are persistent tensors updated in place only, so a CUDA graph
  captured before a switch reads the new table when replayed.
- The host mirror `slot_of` always equals `table` (every write goes through `switch`), so the
  host never reads the table back. Each logical expert holds exactly one slot; the other N
  slots are the free ones, in `free_slots`, oldest first: a switch takes the oldest free slot
  and queues the slot it leaves last, so a slot that held a faulty expert is reused last.
- At load the table is the identity and the free slots are E .. E + N - 1. Switches run
  between steps on the engine thread (the engine steps on one thread).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class ExpertSlots:
    """Where each logical expert of one layer lives among E + N physical slots.

    Attributes:
        table: [num_experts] int64 on the weights' device, logical expert -> physical slot.
        nonfinite: [num_experts + num_spare] bool on the same device, the experts' non-finite
            flags per physical slot in the current forward (cleared by `fold_nonfinite`).
        slot_of: host mirror of `table`.
        free_slots: physical slots no logical expert holds, oldest first (N of them).
        num_spare: spare slots of the layer (N).
        num_switches: experts moved into a free slot since load.
    """

    table: Tensor
    nonfinite: Tensor
    slot_of: list[int]
    free_slots: deque[int]
    num_spare: int
    num_switches: int = 0

    @classmethod
    def identity(cls, num_experts: int, num_spare: int, device: torch.device) -> ExpertSlots:
        """Expert e in slot e; slots E .. E + N - 1 free.

        Raises:
            ValueError: num_spare < 1 (a layer without spares has no table).
        """
        if num_spare < 1:
            raise ValueError(f"num_spare must be >= 1, got {num_spare}")
        num_slots = num_experts + num_spare
        return cls(
            table=torch.arange(num_experts, dtype=torch.int64, device=device),
            nonfinite=torch.zeros(num_slots, dtype=torch.bool, device=device),
            slot_of=list(range(num_experts)),
            free_slots=deque(range(num_experts, num_slots)),
            num_spare=num_spare,
        )

    @property
    def num_experts(self) -> int:
        """Logical experts of the layer (E)."""
        return len(self.slot_of)

    @property
    def num_slots(self) -> int:
        """Physical weight slots (E + spares)."""
        return len(self.slot_of) + self.num_spare

    @property
    def num_relocated(self) -> int:
        """Logical experts served from a slot other than their load-time one."""
        return sum(slot != expert for expert, slot in enumerate(self.slot_of))

    def map_ids(self, topk_ids: Tensor) -> Tensor:
        """topk_ids [T, k] int64 logical experts -> [T, k] int64 physical slots (device ops, no
        sync); -1 (no expert: a padding token's choice) stays -1."""
        slots = self.table[topk_ids.clamp(min=0)]  # [T, k]
        return torch.where(topk_ids >= 0, slots, -1)

    def fold_nonfinite(self, anomalous: Tensor) -> None:
        """anomalous [num_experts] bool |= the flags of each expert's slot; clear `nonfinite`.

        Slots that no expert holds are never routed to, so their flags stay clear.
        """
        anomalous |= self.nonfinite[self.table]  # [num_experts]
        self.nonfinite.zero_()

    def next_free_slot(self) -> int | None:
        """The slot the next switch takes (the oldest free one), or None when none is free."""
        return self.free_slots[0] if self.free_slots else None

    def switch(self, expert_id: int, slot: int) -> int:
        """Point logical expert `expert_id` at free physical `slot` (its weights must already be
        there), in place on the device; the slot it leaves joins the back of the free queue.

        Returns:
            The slot the expert left.

        Raises:
            ValueError: expert_id out of range or `slot` not free.
        """
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} not in [0, {self.num_experts})")
        if slot not in self.free_slots:
            raise ValueError(f"slot {slot} is not free (free: {list(self.free_slots)})")
        old_slot = self.slot_of[expert_id]
        with torch.inference_mode():  # made in a forward: may be an inference tensor
            self.table[expert_id] = slot
        self.free_slots.remove(slot)
        self.slot_of[expert_id] = slot
        self.free_slots.append(old_slot)
        self.num_switches += 1
        return old_slot
