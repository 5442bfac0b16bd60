"""Load-aware placement of one MoE layer's experts on the expert-parallel ranks (pure, host).

A `Placement` says which logical expert each of the size * S physical slots holds (S slots per
rank, S * size = E + N with N redundant slots); an expert may hold several slots (its
replicas), and the layer splits the expert's tokens evenly over them
(`layers.expert_replicas`). `rebalance` computes a placement from the per-expert load of a
window (tokens routed), in the two steps of DeepSeek's EPLB (github.com/deepseek-ai/EPLB,
`replicate_experts` and `balanced_packing`), as vLLM's expert-parallel load balancer uses it
(docs.vllm.ai, "Expert Parallel Deployment", EPLB; `--num-redundant-experts`):

1. replica counts: every expert one, then each of the N extra replicas to the expert with the
   largest load / replicas (ties: the lowest expert id);
2. packing: the replicas, heaviest (load / replicas) first (ties: lowest expert id), each to
   the least-loaded rank (ties: lowest rank) with a free slot that does not hold that expert
   yet; when every rank with a free slot holds it already, to the least-loaded of those (two
   replicas on one rank: still correct, each takes its share of the tokens).

Two steps of ours on top, which change no rank's load: the packed ranks are relabelled to keep
as many experts as possible on the rank that holds them now (greedy, largest overlap first),
and on each rank an expert it keeps stays in its slot, so a re-placement moves only the
experts that change rank (`weight_moves`).

Invariants: every function is a pure function of its arguments (plain ints, exact
arithmetic with `fractions.Fraction`, deterministic ties), so every rank computing it from the
same counts gets the same placement. A rank's load is the sum over its replicas of the
expert's load / the expert's replicas; imbalance = max rank load / mean rank load (1.0 =
perfect; 0.0 when the window routed nothing).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from sits.core.errors import InvalidParameterError

EMPTY = -1  # a slot that holds no expert


@dataclass(frozen=True, slots=True)
class Placement:
    """Which logical expert each physical slot of one MoE layer holds.

    Attributes:
        slots: slots[r][s] is the logical expert in local slot s of rank r (global slot
            r * S + s), or EMPTY; every rank has the same number S of slots.
        num_experts: logical experts of the layer (E); each holds at least one slot.
    """

    slots: tuple[tuple[int, ...], ...]
    num_experts: int

    @property
    def size(self) -> int:
        """Expert-parallel ranks."""
        return len(self.slots)

    @property
    def num_slots(self) -> int:
        """Slots per rank (S)."""
        return len(self.slots[0])

    def replica_counts(self) -> list[int]:
        """[E] slots each expert holds."""
        counts = [0] * self.num_experts
        for rank_slots in self.slots:
            for expert in rank_slots:
                if expert != EMPTY:
                    counts[expert] += 1
        return counts

    def replicas(self) -> list[list[tuple[int, int]]]:
        """Per expert, its (rank, local slot) pairs in global slot order: replica j of
        expert e is replicas()[e][j]."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for rank, rank_slots in enumerate(self.slots):
            for slot, expert in enumerate(rank_slots):
                if expert != EMPTY:
                    out[expert].append((rank, slot))
        return out


@dataclass(frozen=True, slots=True)
class WeightMove:
    """One expert's weights to copy into a slot for a re-placement.

    Attributes:
        rank, slot: the destination (rank, local slot).
        expert: the logical expert.
        src_rank, src_slot: where the old placement holds it (the destination rank itself
            when it holds the expert already, else the lowest global slot holding it).
    """

    rank: int
    slot: int
    expert: int
    src_rank: int
    src_slot: int


def contiguous_placement(num_experts: int, size: int, num_slots: int) -> Placement:
    """Today's static layout: rank r holds experts [r * E / size, (r + 1) * E / size) in its
    first E / size slots; its other slots are EMPTY.

    Raises:
        InvalidParameterError: size does not divide num_experts, or num_slots < E / size.
    """
    if num_experts % size or num_slots * size < num_experts:
        raise InvalidParameterError(
            "num_redundant_experts",
            f"{size} ranks of {num_slots} slots cannot hold {num_experts} experts evenly",
        )
    local = num_experts // size
    return Placement(
        tuple(
            tuple(range(r * local, (r + 1) * local)) + (EMPTY,) * (num_slots - local)
            for r in range(size)
        ),
        num_experts,
    )


def replica_counts(load: Sequence[int], num_redundant: int) -> list[int]:
    """Step 1: [E] replicas per expert: one each, then every one of the `num_redundant` extra
    replicas to the expert with the largest load / replicas (ties: lowest id).

    Args:
        load: [E] tokens routed to each expert in the window (>= 0).
        num_redundant: extra replicas (N >= 0).
    """
    counts = [1] * len(load)
    for _ in range(num_redundant):
        best = 0
        for expert in range(1, len(load)):  # load[e] / counts[e] > load[b] / counts[b]
            if load[expert] * counts[best] > load[best] * counts[expert]:
                best = expert
        counts[best] += 1
    return counts


def pack_replicas(
    load: Sequence[int], counts: Sequence[int], size: int, num_slots: int
) -> list[list[int]]:
    """Step 2: the experts of each rank (the balanced packing, module docstring).

    Args:
        load: [E] window load per expert.
        counts: [E] replicas per expert (`replica_counts`); sum(counts) == size * num_slots.
        size: ranks; num_slots: slots per rank.

    Returns:
        Per rank, the experts it holds, in packing order.
    """
    assert sum(counts) == size * num_slots, "replicas must fill every slot"
    items = sorted(
        (expert for expert in range(len(load)) for _ in range(counts[expert])),
        key=lambda e: (-Fraction(load[e], counts[e]), e),
    )
    ranks: list[list[int]] = [[] for _ in range(size)]
    rank_load = [Fraction(0)] * size
    for expert in items:
        free = [r for r in range(size) if len(ranks[r]) < num_slots]
        fresh = [r for r in free if expert not in ranks[r]] or free
        rank = min(fresh, key=lambda r: (rank_load[r], r))
        ranks[rank].append(expert)
        rank_load[rank] += Fraction(load[expert], counts[expert])
    return ranks


def rebalance(load: Sequence[int], current: Placement) -> Placement:
    """The load-aware placement of `load` on `current`'s ranks and slots, laid out to move as
    few experts as possible from `current` (module docstring).

    Args:
        load: [E] tokens routed to each expert in the window.
        current: the placement in effect (its ranks, slots per rank and experts).

    Returns:
        A placement whose every slot holds an expert.

    Raises:
        ValueError: len(load) != current.num_experts.
    """
    if len(load) != current.num_experts:
        raise ValueError(f"{len(load)} loads for {current.num_experts} experts")
    size, num_slots = current.size, current.num_slots
    counts = replica_counts(load, size * num_slots - current.num_experts)
    groups = pack_replicas(load, counts, size, num_slots)
    order = _relabel(groups, current)
    return Placement(
        tuple(_keep_slots(current.slots[rank], groups[order[rank]]) for rank in range(size)),
        current.num_experts,
    )


def _relabel(groups: list[list[int]], current: Placement) -> list[int]:
    """order[rank] = the group rank `rank` takes: greedily the (group, rank) pair sharing the
    most experts (multiset overlap) first, ties lowest group then lowest rank."""
    held = [Counter(e for e in rank_slots if e != EMPTY) for rank_slots in current.slots]
    pairs = sorted(
        (
            (-sum((Counter(group) & held[rank]).values()), g, rank)
            for g, group in enumerate(groups)
            for rank in range(current.size)
        )
    )
    order = [-1] * current.size
    taken: set[int] = set()
    for _, g, rank in pairs:
        if order[rank] == -1 and g not in taken:
            order[rank] = g
            taken.add(g)
    return order


def _keep_slots(old: tuple[int, ...], experts: list[int]) -> tuple[int, ...]:
    """The rank's new slots: each expert it keeps stays in its old slot; the others fill the
    remaining slots in ascending order, experts ascending."""
    remaining = Counter(experts)
    slots = [EMPTY] * len(old)
    for slot, expert in enumerate(old):
        if expert != EMPTY and remaining[expert] > 0:
            slots[slot] = expert
            remaining[expert] -= 1
    incoming = iter(sorted(remaining.elements()))
    for slot in range(len(slots)):
        if slots[slot] == EMPTY:
            slots[slot] = next(incoming, EMPTY)
    return tuple(slots)


def weight_moves(old: Placement, new: Placement) -> list[WeightMove]:
    """The copies that turn `old`'s weights into `new`'s: one per slot whose expert changes
    (and is not EMPTY in `new`), in (rank, slot) order, each from the destination rank when
    `old` holds the expert there, else from the expert's first slot in `old`."""
    replicas = old.replicas()
    moves = []
    for rank, (old_slots, new_slots) in enumerate(zip(old.slots, new.slots, strict=True)):
        for slot, expert in enumerate(new_slots):
            if expert == EMPTY or expert == old_slots[slot]:
                continue
            own = [s for r, s in replicas[expert] if r == rank]
            src_rank, src_slot = (rank, own[0]) if own else replicas[expert][0]
            moves.append(WeightMove(rank, slot, expert, src_rank, src_slot))
    return moves


def rank_loads(placement: Placement, load: Sequence[int]) -> list[Fraction]:
    """[size] each rank's load: sum over its replicas of load[e] / replicas of e (exact)."""
    counts = placement.replica_counts()
    return [
        sum((Fraction(load[e], counts[e]) for e in rank_slots if e != EMPTY), Fraction(0))
        for rank_slots in placement.slots
    ]


def imbalance(placement: Placement, load: Sequence[int]) -> float:
    """max rank load / mean rank load of `load` on `placement` (1.0 = perfect; 0.0 when the
    load is all zeros)."""
    return combined_imbalance([(placement, load)])


def combined_imbalance(layers: Sequence[tuple[Placement, Sequence[int]]]) -> float:
    """The imbalance of several layers at once: sum over layers of the max rank load / sum of
    the mean rank loads (a step waits for each layer's busiest rank, so this is the step's
    expert time over a perfectly balanced one's); 0.0 when no layer routed anything."""
    worst = total = Fraction(0)
    for placement, load in layers:
        loads = rank_loads(placement, load)
        worst += max(loads)
        total += sum(loads) / len(loads)
    return float(worst / total) if total else 0.0
