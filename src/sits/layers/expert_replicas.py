"""Replicated experts of one expert-parallel MoE layer: the routing table of a `Placement`.

With `--expert-router-policy load-aware` each rank's w13 / w2 hold S = (E + N) / size slots
and a `parallel.placement.Placement` says which logical expert each slot of each rank holds;
a hot expert may hold slots on several ranks (its replicas). `ExpertReplicas` is that
placement as this rank's device tables.

Invariants:
- Routing, counts and health stay in logical expert ids (as without replicas); only the
  experts' compute sees local slots. Pair (t, j) of the step (token row t, its j-th choice,
  expert e) takes replica (t * top_k + j) % num_replicas[e] of e, and `map_ids` maps it to
  this rank's local slot when that replica is here, else -1 (no expert). Every rank routes
  every token alike (the all-reduce scheme of `layers.moe`), so every pair is computed on
  exactly one rank, and the layer's all-reduce sums the same terms as without replicas.
- The device tables (`local_slot`, `num_replicas`, `slot_expert`, `nonfinite`) are
  persistent and only updated in place (`set_placement`, between steps), so a forward reads
  them with device ops only (no host sync), and a captured graph would read the new tables.
- `placement` (host) always equals the tables: every write goes through `set_placement`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sits.parallel.placement import EMPTY, Placement


@dataclass(slots=True)
class ExpertReplicas:
    """This rank's view of one layer's `Placement`, on the weights' device.

    Attributes:
        rank: this rank (its slots are row `rank` of the placement).
        placement: the placement the tables hold (host mirror).
        local_slot: [E, max_replicas] int64, this rank's local slot of replica j of expert e,
            -1 when that replica is on another rank or does not exist.
        num_replicas: [E] int64, replicas of each expert (>= 1).
        slot_expert: [S] int64, the logical expert of each local slot, -1 when empty.
        nonfinite: [S] bool, the experts' non-finite flags per local slot in the current
            forward (cleared by `fold_nonfinite`).
    """

    rank: int
    placement: Placement
    local_slot: Tensor
    num_replicas: Tensor
    slot_expert: Tensor
    nonfinite: Tensor

    @classmethod
    def of(
        cls, placement: Placement, rank: int, max_replicas: int, device: torch.device
    ) -> ExpertReplicas:
        """The tables of `placement` for `rank`; `max_replicas` (>= 1) bounds any later
        placement's replicas per expert (1 + the layer's redundant slots)."""
        num_experts, num_slots = placement.num_experts, placement.num_slots
        replicas = cls(
            rank=rank,
            placement=placement,
            local_slot=torch.full(
                (num_experts, max_replicas), -1, dtype=torch.int64, device=device
            ),
            num_replicas=torch.ones(num_experts, dtype=torch.int64, device=device),
            slot_expert=torch.full((num_slots,), -1, dtype=torch.int64, device=device),
            nonfinite=torch.zeros(num_slots, dtype=torch.bool, device=device),
        )
        replicas.set_placement(placement)
        return replicas

    @property
    def max_replicas(self) -> int:
        """Replicas one expert may have (the width of `local_slot`)."""
        return self.local_slot.shape[1]

    def map_ids(self, topk_ids: Tensor) -> Tensor:
        """topk_ids [T, k] int64 logical experts -> [T, k] int64 local slots of the replica
        each pair takes, -1 where that replica is on another rank; -1 (a padding token's
        choice) stays -1. Device ops only."""
        num_tokens, top_k = topk_ids.shape
        experts = topk_ids.clamp(min=0)  # [T, k]
        pairs = torch.arange(num_tokens * top_k, device=topk_ids.device).view(num_tokens, top_k)
        replica = pairs % self.num_replicas[experts]  # [T, k]
        slots = self.local_slot[experts, replica]  # [T, k]
        return torch.where(topk_ids >= 0, slots, -1)

    def fold_nonfinite(self, anomalous: Tensor) -> None:
        """anomalous [E] bool |= the flags of every local slot holding each expert; clear
        `nonfinite`. Empty slots are never routed to, so their flags stay clear."""
        held = self.slot_expert >= 0  # [S]
        hits = torch.zeros(anomalous.shape[0], dtype=torch.int64, device=anomalous.device)
        hits.index_add_(0, self.slot_expert.clamp(min=0), (self.nonfinite & held).long())
        anomalous |= hits > 0
        self.nonfinite.zero_()

    def set_placement(self, placement: Placement) -> None:
        """Point the tables at `placement` in place (its weights must already be in this
        rank's slots: `runner.expert_placement` copies them first).

        Raises:
            ValueError: another shape (experts, slots per rank, ranks past `rank`) or more
                replicas of an expert than `max_replicas`.
        """
        num_experts, num_slots = self.num_replicas.shape[0], self.slot_expert.shape[0]
        if (
            placement.num_experts != num_experts
            or placement.num_slots != num_slots
            or placement.size <= self.rank
        ):
            raise ValueError(
                f"placement of {placement.num_experts} experts in {placement.size} x "
                f"{placement.num_slots} slots does not fit rank {self.rank}'s tables "
                f"({num_experts} experts, {num_slots} slots)"
            )
        replicas = placement.replicas()
        if max(len(r) for r in replicas) > self.max_replicas:
            raise ValueError(f"an expert has more than {self.max_replicas} replicas")
        local = [
            [slot if rank == self.rank else -1 for rank, slot in expert_replicas]
            + [-1] * (self.max_replicas - len(expert_replicas))
            for expert_replicas in replicas
        ]
        mine = [e if e != EMPTY else -1 for e in placement.slots[self.rank]]
        device = self.local_slot.device
        with torch.inference_mode():  # may run inside a step's inference mode, or outside
            self.local_slot.copy_(torch.tensor(local, dtype=torch.int64).to(device))
            self.num_replicas.copy_(
                torch.tensor([len(r) for r in replicas], dtype=torch.int64).to(device)
            )
            self.slot_expert.copy_(torch.tensor(mine, dtype=torch.int64).to(device))
        self.placement = placement
