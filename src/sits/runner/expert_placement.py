"""Load-aware expert placement while serving (`--expert-router-policy load-aware`): one rank's
`ExpertPlacer`, run by its `ModelRunner` before the forward of every step.

Every `expert_rebalance_interval` steps (the non-empty plans every rank runs alike) each rank,
before the next step's forward:
1. takes the MoE layers' token counts (`ExpertState.num_tokens`, [L, E]) as rank 0 has them,
   broadcast over the default group (one collective and one host sync per interval, none per
   step; routing is replicated, so the counts agree anyway, but rank 0's are the ones every
   rank then computes from), and the window's load = the counts since the last re-placement;
2. computes each layer's new placement (`parallel.placement.rebalance`, a pure function, so
   every rank gets the same) and keeps it only where it lowers the layer's imbalance on that
   load (so after <= before, and an even layer moves no weights);
3. copies the weights of the experts each rank newly holds into their slots: from its own
   current slot when it holds the expert already, else from the old placement's holder over
   point-to-point sends (`torch.distributed.batch_isend_irecv`, as vLLM's EPLB moves weights
   between GPUs; no checkpoint read, so dummy weights work too), all of one layer received
   before any slot is written;
4. switches the layer's tables in place (`layers.expert_replicas`).
Requests keep running: their KV cache, sampling state and the plan are untouched; only expert
weights move between two steps, and every pair is still computed exactly once, so the
tokens are those of the static placement (and of one rank).

Rank 0 keeps the figures (`stats()`, the metrics and /v1/admin/experts): the re-placements,
the imbalance of the last one before and after (`parallel.placement.combined_imbalance` over
the layers, on the window's load) and a log line per re-placement with the worst layer's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sits.config import EngineConfig
from sits.layers.moe import SparseMoeBlock
from sits.parallel.placement import (
    Placement,
    combined_imbalance,
    imbalance,
    rebalance,
    weight_moves,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rebalance:
    """One re-placement check, as every rank computed it.

    Attributes:
        num_steps: steps run when it ran (before the next step's forward).
        window_tokens: per MoE layer, [E] tokens routed to each expert since the last check.
        before: per MoE layer, the placement in effect during the window.
        after: per MoE layer, the placement from now on (`before`'s where no better one).
        imbalance_before, imbalance_after: `combined_imbalance` of before / after on
            window_tokens.
        worst_before, worst_after: the largest layer imbalance of before / after.
        num_moved_experts: expert weight copies it made, over all ranks and layers.
    """

    num_steps: int
    window_tokens: tuple[tuple[int, ...], ...]
    before: tuple[Placement, ...]
    after: tuple[Placement, ...]
    imbalance_before: float
    imbalance_after: float
    worst_before: float
    worst_after: float
    num_moved_experts: int

    @property
    def changed(self) -> bool:
        """Whether some layer's placement changed."""
        return self.before != self.after


@dataclass(frozen=True, slots=True)
class PlacementStats:
    """The load-aware placement as last applied (rank 0's figures).

    Attributes:
        num_redundant_experts: redundant slots per layer over all ranks (N).
        interval_steps: steps between two checks.
        num_replacements: checks that changed some layer's placement.
        num_moved_experts: expert weight copies since start, over all ranks.
        imbalance_before, imbalance_after: the last re-placement's figures (0.0 before one).
        layers: per MoE layer, the experts of each rank's slots now.
    """

    num_redundant_experts: int
    interval_steps: int
    num_replacements: int = 0
    num_moved_experts: int = 0
    imbalance_before: float = 0.0
    imbalance_after: float = 0.0
    layers: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def to_json(self) -> dict:
        """A JSON-ready dict (in GET /v1/admin/experts)."""
        return {
            "num_redundant_experts": self.num_redundant_experts,
            "interval_steps": self.interval_steps,
            "num_replacements": self.num_replacements,
            "num_moved_experts": self.num_moved_experts,
            "imbalance_before": self.imbalance_before,
            "imbalance_after": self.imbalance_after,
            "layers": [[list(rank) for rank in layer] for layer in self.layers],
        }


class ExpertPlacer:
    """Re-places one rank's replicated MoE experts every `interval_steps` steps.

    Args:
        blocks: decoder layer id -> its expert-parallel `SparseMoeBlock` (loaded; this
            enables its replicas: `SparseMoeBlock.enable_replicas`).
        rank, size: this rank and the expert-parallel size.
        num_redundant: redundant slots per layer over all ranks (a multiple of size).
        interval_steps: steps between two checks (>= 1).

    Attributes:
        last: the latest check that found tokens in its window, or None.
        num_replacements: checks that changed some layer's placement.
        num_moved_experts: expert weight copies since start, over all ranks.

    Raises:
        InvalidParameterError: as `SparseMoeBlock.enable_replicas`.
    """

    def __init__(
        self,
        blocks: dict[int, SparseMoeBlock],
        *,
        rank: int,
        size: int,
        num_redundant: int,
        interval_steps: int,
    ) -> None:
        self.blocks = dict(sorted(blocks.items()))
        self.rank = rank
        self.size = size
        self.num_redundant = num_redundant
        self.interval_steps = interval_steps
        for block in self.blocks.values():
            block.enable_replicas(num_redundant)
        num_experts = next(iter(self.blocks.values())).config.num_experts
        self._seen_tokens = [[0] * num_experts for _ in self.blocks]  # [L][E] at the last check
        self._steps_since = 0
        self._num_steps = 0
        self.last: Rebalance | None = None
        self.num_replacements = 0
        self.num_moved_experts = 0

    @classmethod
    def of_model(cls, model: nn.Module, config: EngineConfig, rank: int) -> ExpertPlacer | None:
        """The placer of a loaded model's rank under `config`: None with the static policy
        or a model without MoE layers."""
        if config.expert_router_policy != "load-aware":
            return None
        blocks = {
            layer_id: layer.mlp
            for layer_id, layer in enumerate(model.model.layers)
            if isinstance(layer.mlp, SparseMoeBlock)
        }
        if not blocks:
            if rank == 0:
                logger.info("expert router policy load-aware: the model has no MoE layers")
            return None
        placer = cls(
            blocks,
            rank=rank,
            size=config.tensor_parallel_size,
            num_redundant=config.num_redundant_experts,
            interval_steps=config.expert_rebalance_interval,
        )
        if rank == 0:
            block = next(iter(blocks.values()))
            logger.info(
                "expert router policy load-aware: %d MoE layers, %d slots per rank (%d "
                "redundant in all), re-placed every %d steps",
                len(blocks),
                block.w13.shape[0],
                config.num_redundant_experts,
                config.expert_rebalance_interval,
            )
        return placer

    def before_step(self) -> Rebalance | None:
        """Call before each non-empty step's forward, on every rank alike: every
        `interval_steps` steps, the check (`rebalance_now`); returns it when it ran."""
        done = None
        if self._steps_since >= self.interval_steps:
            done = self.rebalance_now()
            self._steps_since = 0
        self._steps_since += 1
        self._num_steps += 1
        return done

    @torch.inference_mode()
    def rebalance_now(self) -> Rebalance | None:
        """One check (module docstring, steps 1-4), on every rank at the same point.

        Returns:
            The check, or None when its window routed no token (nothing changes).
        """
        blocks = list(self.blocks.values())
        tokens = torch.stack([b.expert_state().num_tokens for b in blocks])  # [L, E] int64
        if self.size > 1:
            dist.broadcast(tokens, src=0)
        counts = tokens.tolist()
        window = [
            tuple(now - seen for now, seen in zip(row, seen_row, strict=True))
            if all(now >= seen for now, seen in zip(row, seen_row, strict=True))
            else tuple(row)  # the counters were reset: the window is all they hold
            for row, seen_row in zip(counts, self._seen_tokens, strict=True)
        ]
        self._seen_tokens = counts
        if not any(any(row) for row in window):
            return None
        before = tuple(b.replicas().placement for b in blocks)
        after = tuple(_better(load, old) for load, old in zip(window, before, strict=True))
        num_moved = 0
        for block, old, new in zip(blocks, before, after, strict=True):
            if new != old:
                num_moved += move_expert_weights(block, old, new, self.rank)
                block.replicas().set_placement(new)
        done = Rebalance(
            num_steps=self._num_steps,
            window_tokens=tuple(window),
            before=before,
            after=after,
            imbalance_before=combined_imbalance(list(zip(before, window, strict=True))),
            imbalance_after=combined_imbalance(list(zip(after, window, strict=True))),
            worst_before=max(imbalance(p, load) for p, load in zip(before, window, strict=True)),
            worst_after=max(imbalance(p, load) for p, load in zip(after, window, strict=True)),
            num_moved_experts=num_moved,
        )
        self.last = done
        if done.changed:
            self.num_replacements += 1
            self.num_moved_experts += num_moved
            if self.rank == 0:
                _log(done, sum(a != b for a, b in zip(before, after, strict=True)))
        return done

    def stats(self) -> PlacementStats:
        """The figures of the last re-placement and the placement now."""
        last = self.last if self.last is not None and self.last.changed else None
        return PlacementStats(
            num_redundant_experts=self.num_redundant,
            interval_steps=self.interval_steps,
            num_replacements=self.num_replacements,
            num_moved_experts=self.num_moved_experts,
            imbalance_before=last.imbalance_before if last else 0.0,
            imbalance_after=last.imbalance_after if last else 0.0,
            layers=tuple(b.replicas().placement.slots for b in self.blocks.values()),
        )


def _better(load: Sequence[int], current: Placement) -> Placement:
    """`rebalance`'s placement when it lowers the imbalance of `load`, else `current`."""
    new = rebalance(load, current)
    return new if imbalance(new, load) < imbalance(current, load) else current


def _log(done: Rebalance, num_layers: int) -> None:
    logger.info(
        "MoE experts re-placed at step %d: imbalance %.3f -> %.3f over the window's tokens "
        "(worst layer %.3f -> %.3f); %d layers changed, %d experts moved",
        done.num_steps,
        done.imbalance_before,
        done.imbalance_after,
        done.worst_before,
        done.worst_after,
        num_layers,
        done.num_moved_experts,
    )


def move_expert_weights(block: SparseMoeBlock, old: Placement, new: Placement, rank: int) -> int:
    """Copy into this rank's slots of `block` the weights of the experts `new` puts there
    (`parallel.placement.weight_moves`): from its own slot, or received from the rank `old`
    holds the expert on, while this rank sends the experts other ranks need from it. Every
    rank calls it with the same placements (the sends and receives pair up in move order);
    every copy is staged before a slot is written, so a slot read for a move is never
    overwritten first.

    Returns:
        The moves of the layer, over all ranks.
    """
    moves = weight_moves(old, new)
    ops: list[dist.P2POp] = []
    staged = []  # (local slot, w13 [2I, H], w2 [H, I])
    for move in moves:
        if move.rank == rank:
            if move.src_rank == rank:
                w13, w2 = block.w13[move.src_slot].clone(), block.w2[move.src_slot].clone()
            else:
                w13, w2 = torch.empty_like(block.w13[0]), torch.empty_like(block.w2[0])
                ops += [
                    dist.P2POp(dist.irecv, w13, move.src_rank),
                    dist.P2POp(dist.irecv, w2, move.src_rank),
                ]
            staged.append((move.slot, w13, w2))
        elif move.src_rank == rank:
            ops += [
                dist.P2POp(dist.isend, block.w13[move.src_slot], move.rank),
                dist.P2POp(dist.isend, block.w2[move.src_slot], move.rank),
            ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for slot, w13, w2 in staged:
        block.w13[slot].copy_(w13)
        block.w2[slot].copy_(w2)
    return len(moves)
