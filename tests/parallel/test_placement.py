"""Load-aware expert placement, the pure parts (issue 27): `parallel.placement` on hand-made
loads (exact replica counts, rank assignments, slots kept, weight moves, imbalance figures),
the replica routing tables of `layers.expert_replicas` (every pair on exactly one rank), a
block's `enable_replicas`, and the refusal of bad flags. No process group needed."""

from __future__ import annotations

import pytest
import torch

from sits.cli.main import build_parser
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.engine.arg_utils import engine_kwargs
from sits.layers.expert_replicas import ExpertReplicas
from sits.layers.moe import MoeConfig, SparseMoeBlock
from sits.parallel import TensorParallel
from sits.parallel.placement import (
    Placement,
    WeightMove,
    combined_imbalance,
    contiguous_placement,
    imbalance,
    pack_replicas,
    rank_loads,
    rebalance,
    replica_counts,
    weight_moves,
)


def test_contiguous_placement_is_the_static_layout() -> None:
    assert contiguous_placement(4, 2, 3).slots == ((0, 1, -1), (2, 3, -1))
    assert contiguous_placement(8, 2, 4).slots == ((0, 1, 2, 3), (4, 5, 6, 7))
    with pytest.raises(InvalidParameterError, match="2 ranks of 1 slots cannot hold 4"):
        contiguous_placement(4, 2, 1)
    with pytest.raises(InvalidParameterError):
        contiguous_placement(5, 2, 3)


def test_replica_counts_go_to_the_largest_load_per_replica() -> None:
    assert replica_counts([60, 10, 40, 10], 2) == [2, 1, 2, 1]  # 60 -> 30 < 40 -> e2
    assert replica_counts([90, 10], 4) == [5, 1]  # 90/4 = 22.5 > 10: past the ranks
    assert replica_counts([10, 10, 10, 10], 2) == [2, 2, 1, 1]  # ties: lowest id
    assert replica_counts([0, 0, 0], 1) == [2, 1, 1]
    assert replica_counts([5, 7], 0) == [1, 1]


def test_packing_heaviest_first_to_the_least_loaded_rank() -> None:
    # replicas (weight): e0 30, e0 30, e2 20, e2 20, e1 10, e3 10
    assert pack_replicas([60, 10, 40, 10], [2, 1, 2, 1], 2, 3) == [[0, 2, 1], [0, 2, 3]]
    assert pack_replicas([40, 30, 20, 10], [1, 1, 1, 1], 2, 2) == [[0, 3], [1, 2]]
    # five replicas of e0 on two ranks: a rank takes a second one once both hold it
    assert pack_replicas([90, 10], [5, 1], 2, 3) == [[0, 0, 0], [0, 0, 1]]


def test_rebalance_with_redundant_slots() -> None:
    load = [60, 10, 40, 10]
    old = contiguous_placement(4, 2, 3)
    new = rebalance(load, old)
    assert new == Placement(((0, 1, 2), (2, 3, 0)), 4)  # kept experts stay in their slots
    assert new.replica_counts() == [2, 1, 2, 1]
    assert new.replicas()[0] == [(0, 0), (1, 2)] and new.replicas()[2] == [(0, 2), (1, 0)]
    assert rank_loads(old, load) == [70, 50] and rank_loads(new, load) == [60, 60]
    assert imbalance(old, load) == 70 / 60 and imbalance(new, load) == 1.0
    assert weight_moves(old, new) == [
        WeightMove(rank=0, slot=2, expert=2, src_rank=1, src_slot=0),
        WeightMove(rank=1, slot=2, expert=0, src_rank=0, src_slot=0),
    ]


def test_rebalance_without_redundant_slots_moves_whole_experts() -> None:
    load = [40, 30, 20, 10]
    old = contiguous_placement(4, 2, 2)
    new = rebalance(load, old)
    assert new.slots == ((0, 3), (2, 1))
    assert (imbalance(old, load), imbalance(new, load)) == (1.4, 1.0)
    assert weight_moves(old, new) == [
        WeightMove(rank=0, slot=1, expert=3, src_rank=1, src_slot=1),
        WeightMove(rank=1, slot=1, expert=1, src_rank=0, src_slot=1),
    ]


def test_a_balanced_placement_stays_where_it_is() -> None:
    """The packing of [40, 30, 20, 10] is {0, 3} and {1, 2}; relabelled to the ranks holding
    those experts now (rank 1 holds 0 and 3), nothing moves."""
    old = Placement(((1, 2), (3, 0)), 4)
    new = rebalance([40, 30, 20, 10], old)
    assert new == old and weight_moves(old, new) == []


def test_replicas_past_the_ranks_share_a_rank() -> None:
    load = [90, 10]
    old = contiguous_placement(2, 2, 3)
    new = rebalance(load, old)
    assert new.slots == ((0, 0, 0), (1, 0, 0))
    assert rank_loads(new, load) == [54, 46]  # 3 and 2 of e0's 5 shares of 18, + 10
    assert (imbalance(old, load), imbalance(new, load)) == (1.8, 1.08)
    assert [(m.rank, m.slot, m.src_rank, m.src_slot) for m in weight_moves(old, new)] == [
        (0, 1, 0, 0), (0, 2, 0, 0), (1, 1, 0, 0), (1, 2, 0, 0),
    ]  # fmt: skip


def test_combined_imbalance_weights_layers_by_their_load() -> None:
    """(70 + 70) / (60 + 50), not the mean of 70/60 and 70/50; 0.0 without tokens."""
    layers = [
        (contiguous_placement(4, 2, 3), [60, 10, 40, 10]),
        (contiguous_placement(4, 2, 2), [40, 30, 20, 10]),
    ]
    assert combined_imbalance(layers) == 140 / 110
    assert imbalance(contiguous_placement(4, 2, 2), [0, 0, 0, 0]) == 0.0
    with pytest.raises(ValueError, match="3 loads for 4 experts"):
        rebalance([1, 2, 3], contiguous_placement(4, 2, 2))


def test_replica_tables_compute_every_pair_on_one_rank() -> None:
    """Placement ((0, 1, 2), (2, 3, 0)): pair p of expert e takes replica p % replicas(e);
    each rank maps the pairs it holds to its local slots, the rest (and padding) to -1."""
    placement = Placement(((0, 1, 2), (2, 3, 0)), 4)
    tables = [ExpertReplicas.of(placement, rank, 3, torch.device("cpu")) for rank in (0, 1)]
    assert tables[0].local_slot.tolist() == [[0, -1, -1], [1, -1, -1], [2, -1, -1], [-1] * 3]
    assert tables[1].local_slot.tolist() == [[-1, 2, -1], [-1] * 3, [-1, 0, -1], [1, -1, -1]]
    assert tables[0].num_replicas.tolist() == [2, 1, 2, 1]
    assert tables[1].slot_expert.tolist() == [2, 3, 0]
    topk_ids = torch.tensor([[0, 2], [0, 3], [-1, 1]])  # pairs 0..5
    assert tables[0].map_ids(topk_ids).tolist() == [[0, -1], [0, -1], [-1, 1]]
    assert tables[1].map_ids(topk_ids).tolist() == [[-1, 0], [-1, 1], [-1, -1]]
    anomalous = torch.zeros(4, dtype=torch.bool)
    tables[1].nonfinite[0] = True  # rank 1's slot 0 holds expert 2
    tables[1].fold_nonfinite(anomalous)
    assert anomalous.tolist() == [False, False, True, False]
    assert not tables[1].nonfinite.any()
    local_slot = tables[0].local_slot
    tables[0].set_placement(contiguous_placement(4, 2, 3))  # in place
    assert tables[0].local_slot is local_slot
    assert tables[0].map_ids(topk_ids).tolist() == [[0, -1], [0, -1], [-1, 1]]
    with pytest.raises(ValueError, match="more than 3 replicas"):
        tables[0].set_placement(Placement(((0, 0, 0), (0, 1, 2)), 4))
    with pytest.raises(ValueError, match="does not fit"):
        tables[0].set_placement(contiguous_placement(4, 2, 2))


def _block(rank: int, size: int = 2, expert_parallel: bool = True) -> SparseMoeBlock:
    config = MoeConfig(num_experts=8, top_k=2, intermediate_size=4, renormalize=True)
    block = SparseMoeBlock(
        6, config, tp=TensorParallel(rank=rank, size=size, expert_parallel=expert_parallel)
    )
    with torch.no_grad():
        block.w13.copy_(torch.randn(block.w13.shape))
        block.w2.copy_(torch.randn(block.w2.shape))
    return block


def test_enable_replicas_grows_the_slots_and_starts_contiguous() -> None:
    block = _block(rank=1)
    w13, w2 = block.w13.clone(), block.w2.clone()  # experts 4..7
    replicas = block.enable_replicas(2)
    assert block.replicas() is replicas
    assert block.w13.shape == (5, 8, 6) and block.w2.shape == (5, 6, 4)
    assert torch.equal(block.w13[:4], w13) and torch.equal(block.w2[:4], w2)
    assert not block.w13[4].any() and not block.w2[4].any()
    assert replicas.placement == contiguous_placement(8, 2, 5)
    assert replicas.max_replicas == 3
    assert replicas.map_ids(torch.tensor([[0, 5], [7, 4]])).tolist() == [[-1, 1], [3, 0]]
    with pytest.raises(InvalidParameterError, match="multiple of the expert-parallel size 2"):
        _block(rank=0).enable_replicas(3)
    with pytest.raises(InvalidParameterError, match="need expert parallelism"):
        _block(rank=0, expert_parallel=False).enable_replicas(2)


LOAD_AWARE = {"tensor_parallel_size": 2, "enable_expert_parallel": True}


@pytest.mark.parametrize(
    ("changes", "param", "message"),
    [
        ({"expert_router_policy": "hot"}, "expert_router_policy", "one of .*got 'hot'"),
        (
            {"expert_router_policy": "load-aware"},
            "expert_router_policy",
            "needs enable_expert_parallel with tensor_parallel_size > 1, got "
            "enable_expert_parallel=False and tensor_parallel_size 1",
        ),
        (
            {"expert_router_policy": "load-aware", "tensor_parallel_size": 2},
            "expert_router_policy",
            "enable_expert_parallel=False and tensor_parallel_size 2",
        ),
        (
            {"expert_router_policy": "load-aware", "enable_expert_parallel": True},
            "expert_router_policy",
            "enable_expert_parallel=True and tensor_parallel_size 1",
        ),
        (
            {**LOAD_AWARE, "num_redundant_experts": 2},
            "num_redundant_experts",
            "needs expert_router_policy 'load-aware', got 2 with 'static'",
        ),
        (
            {**LOAD_AWARE, "expert_router_policy": "load-aware", "num_redundant_experts": 3},
            "num_redundant_experts",
            r"3 must be a multiple of the expert-parallel size \(tensor_parallel_size 2\)",
        ),
        (
            {**LOAD_AWARE, "expert_router_policy": "load-aware", "num_redundant_experts": -2},
            "num_redundant_experts",
            "must be >= 0",
        ),
        (
            {**LOAD_AWARE, "expert_router_policy": "load-aware", "expert_rebalance_interval": 0},
            "expert_rebalance_interval",
            ">= 1 step, got 0",
        ),
    ],
)
def test_bad_placement_flags_are_refused(changes: dict, param: str, message: str) -> None:
    with pytest.raises(InvalidParameterError, match=message) as info:
        EngineConfig(model="m", **changes)
    assert info.value.param == param


def test_placement_flags_and_kwargs() -> None:
    parser = build_parser()
    kwargs = engine_kwargs(parser.parse_args(["serve", "--model", "m"]))
    assert (
        kwargs["expert_router_policy"],
        kwargs["num_redundant_experts"],
        kwargs["expert_rebalance_interval"],
    ) == ("static", 0, 3000)
    argv = ["serve", "--model", "m", "-tp", "2", "--enable-expert-parallel"]
    argv += ["--expert-router-policy", "load-aware", "--num-redundant-experts", "4"]
    argv += ["--expert-rebalance-interval", "50"]
    config = EngineConfig(**engine_kwargs(parser.parse_args(argv)))
    assert (config.expert_router_policy, config.num_redundant_experts) == ("load-aware", 4)
    assert config.expert_rebalance_interval == 50
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--expert-router-policy", "hot"])
