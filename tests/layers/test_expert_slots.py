"""Spare expert slots of `SparseMoeBlock`: same outputs as without spares, the logical -> slot
table, automatic restore of a NaN expert into a spare slot (FIFO reuse of freed slots), counts
and health in logical ids, and the operator's restore with and without spares."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from sits.core.errors import InvalidParameterError, UnsupportedModelError
from sits.kernels.moe_ref import select_experts
from sits.layers.expert_slots import ExpertSlots
from sits.layers.moe import MoeConfig, SparseMoeBlock
from sits.runner.expert_health import ExpertMonitor

HIDDEN = 16
NUM_EXPERTS = 6
CONFIG = MoeConfig(num_experts=NUM_EXPERTS, top_k=2, intermediate_size=8, renormalize=True)
LAYER = 2


def make_block(num_spare: int, seed: int = 1) -> SparseMoeBlock:
    """A block whose logical experts have the same weights whatever `num_spare`."""
    block = SparseMoeBlock(HIDDEN, CONFIG)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    block.add_spare_slots(num_spare)
    return block


def save_checkpoint(block: SparseMoeBlock, path) -> str:
    """The block's logical experts as a hub-style safetensors checkpoint of layer LAYER."""
    inter = CONFIG.intermediate_size
    tensors = {}
    for expert in range(NUM_EXPERTS):
        prefix = f"model.layers.{LAYER}.mlp.experts.{expert}"
        w13 = block.w13[block.physical_slot(expert)].detach().clone()
        tensors[f"{prefix}.gate_proj.weight"] = w13[:inter].contiguous()
        tensors[f"{prefix}.up_proj.weight"] = w13[inter:].contiguous()
        tensors[f"{prefix}.down_proj.weight"] = block.w2[block.physical_slot(expert)].clone()
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def routed_ids(block: SparseMoeBlock, hidden: torch.Tensor, masked=()) -> torch.Tensor:
    logits = block.gate(hidden)
    if masked:
        logits[:, list(masked)] = float("-inf")
    return select_experts(logits, CONFIG.top_k, CONFIG.renormalize)[1]


def busiest(block: SparseMoeBlock, hidden: torch.Tensor, exclude=()) -> int:
    counts = torch.bincount(routed_ids(block, hidden).flatten(), minlength=NUM_EXPERTS)
    return max((e for e in range(NUM_EXPERTS) if e not in exclude), key=lambda e: counts[e])


@torch.no_grad()
def test_spares_give_the_same_outputs_and_counts_with_an_identity_table() -> None:
    plain, spare = make_block(0), make_block(2)
    assert plain.expert_slots() is None and plain.physical_slot(4) == 4
    assert spare.w13.shape == (8, 16, HIDDEN) and spare.w2.shape == (8, HIDDEN, 8)
    assert torch.equal(spare.w13[:6], plain.w13) and not spare.w13[6:].any()
    slots = spare.expert_slots()
    assert slots.table.tolist() == [0, 1, 2, 3, 4, 5] and slots.table.dtype == torch.int64
    assert list(slots.free_slots) == [6, 7] and slots.num_relocated == 0
    for num_tokens in (9, 1, 23):
        hidden = torch.randn(num_tokens, HIDDEN)
        assert torch.equal(spare(hidden), plain(hidden))
    assert torch.equal(spare.expert_state().num_tokens, plain.expert_state().num_tokens)
    assert int(spare.expert_state().num_tokens.sum()) == 33 * 2
    assert not slots.nonfinite.any()


@torch.no_grad()
def test_nan_expert_restored_into_spare_slots_then_freed_slots_reused_oldest_first(
    tmp_path,
) -> None:
    block = make_block(2)
    model_dir = save_checkpoint(block, tmp_path / "ckpt")
    monitor = ExpertMonitor({LAYER: block}, freeze_after=3, model_dir=model_dir, auto_restore=True)
    hidden = torch.randn(32, HIDDEN)
    original = block(hidden)
    slots = block.expert_slots()

    expected_counts = torch.bincount(routed_ids(block, hidden).flatten(), minlength=6)
    bad = busiest(block, hidden)
    w13_bad, w2_bad = block.w13[bad].clone(), block.w2[bad].clone()
    block.w2[bad] = float("nan")  # slot bad == expert bad at load
    for check in range(1, 4):
        assert not torch.isfinite(block(hidden)).all()
        expected_counts += torch.bincount(routed_ids(block, hidden).flatten(), minlength=6)
        state = block.expert_state()
        assert state.num_anomalous.tolist() == [check * (e == bad) for e in range(6)]
        assert bool(state.frozen[bad]) == (check == 3)
    stats = monitor.read()  # the periodic read: restores the newly frozen expert
    assert monitor.newly_frozen == [(LAYER, bad)]
    assert stats.num_auto_freezes == 1
    assert stats.num_restores == stats.num_spare_restores == 1
    layer = stats.layers[0]
    assert layer.frozen == (False,) * 6 and layer.num_anomalous[bad] == 3
    assert layer.num_tokens == tuple(expected_counts.tolist())  # logical ids, 6 entries
    expected_table = [6 if e == bad else e for e in range(6)]
    assert slots.table.tolist() == expected_table == list(layer.expert_slots)
    assert list(slots.free_slots) == [7, bad]
    assert (layer.num_free_slots, layer.num_relocated) == (2, 1)
    assert torch.equal(block.w13[6], w13_bad) and torch.equal(block.w2[6], w2_bad)
    assert torch.equal(block(hidden), original)  # restored: the original outputs exactly
    assert block.expert_state().num_anomalous[bad] == 3

    other = busiest(block, hidden, exclude={bad})
    block.w13[other] = float("nan")
    for _ in range(3):
        block(hidden)
    stats = monitor.read()
    expected_table[other] = 7
    assert slots.table.tolist() == expected_table and list(slots.free_slots) == [bad, other]
    assert stats.num_spare_restores == 2 and not any(stats.layers[0].frozen)

    block.w2[6] = float("inf")  # the restored copy of `bad` fails too: back to its old slot
    for _ in range(3):
        block(hidden)
    stats = monitor.read()
    expected_table[bad] = bad
    assert slots.table.tolist() == expected_table and list(slots.free_slots) == [other, 6]
    assert stats.num_auto_freezes == 3 and stats.num_spare_restores == 3
    assert torch.equal(block(hidden), original)
    assert stats.to_json()["layers"][0]["expert_slots"] == expected_table
    assert stats.to_json()["num_spare_restores"] == 3


@torch.no_grad()
def test_operator_restore_with_and_without_spares(tmp_path) -> None:
    plain = make_block(0)
    model_dir = save_checkpoint(plain, tmp_path / "ckpt")
    hidden = torch.randn(8, HIDDEN)
    original = plain(hidden)
    monitor = ExpertMonitor({LAYER: plain})
    plain.w2[3] = float("nan")
    monitor.freeze(LAYER, 3)
    assert monitor.restore(LAYER, 3, model_dir) == 3  # no spares: in place
    assert torch.equal(plain(hidden), original)
    assert monitor.num_restores == 1 and monitor.num_spare_restores == 0
    stats = monitor.read()
    assert stats.num_spare_experts == 0 and stats.to_json()["num_spare_restores"] == 0
    assert stats.layers[0].expert_slots == tuple(range(NUM_EXPERTS))
    assert (stats.layers[0].num_free_slots, stats.layers[0].num_relocated) == (0, 0)
    with pytest.raises(InvalidParameterError):
        monitor.restore(LAYER, 3)  # no checkpoint known

    spare = make_block(1)
    monitor = ExpertMonitor({LAYER: spare}, model_dir=model_dir)
    assert monitor.restore(LAYER, 3) == 6  # not even frozen: still moved to the spare
    assert spare.expert_slots().table.tolist() == [0, 1, 2, 6, 4, 5]
    assert list(spare.expert_slots().free_slots) == [3]
    assert torch.equal(spare(hidden), original)
    stats = monitor.read()
    assert stats.num_spare_experts == 1 and stats.num_spare_restores == 1
    other = tmp_path / "other"
    other.mkdir()
    save_file({"model.norm.weight": torch.ones(HIDDEN)}, str(other / "model.safetensors"))
    with pytest.raises(UnsupportedModelError):
        monitor.restore(LAYER, 3, str(other))  # a checkpoint without the layer's experts
    assert spare.expert_slots().table.tolist() == [0, 1, 2, 6, 4, 5]  # unchanged on failure


@torch.no_grad()
def test_failed_auto_restore_leaves_the_expert_frozen(tmp_path) -> None:
    block = make_block(2)
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({"other": torch.zeros(1)}, str(empty / "model.safetensors"))
    monitor = ExpertMonitor({LAYER: block}, freeze_after=1, model_dir=str(empty), auto_restore=True)
    block.w2[:] = float("nan")
    hidden = torch.randn(4, HIDDEN)
    hit = sorted(set(routed_ids(block, hidden).flatten().tolist()))
    block(hidden)
    stats = monitor.read()
    frozen = [e for e, f in enumerate(stats.layers[0].frozen) if f]
    assert frozen == hit[: NUM_EXPERTS - CONFIG.top_k] and stats.num_restores == 0
    assert block.expert_slots().table.tolist() == list(range(6))
    with pytest.raises(InvalidParameterError):
        ExpertMonitor({LAYER: block}, auto_restore=True)  # nothing to restore from
    with pytest.raises(InvalidParameterError):
        block.add_spare_slots(-1)


def test_expert_slots_switch_rules() -> None:
    slots = ExpertSlots.identity(3, 2, torch.device("cpu"))
    assert slots.map_ids(torch.tensor([[2, 0]])).tolist() == [[2, 0]]
    assert slots.switch(1, 4) == 1
    assert slots.map_ids(torch.tensor([[1, 2], [0, 1]])).tolist() == [[4, 2], [0, 4]]
    assert slots.map_ids(torch.tensor([[-1, -1], [2, 1]])).tolist() == [[-1, -1], [2, 4]]
    assert list(slots.free_slots) == [3, 1] and slots.next_free_slot() == 3
    with pytest.raises(ValueError):
        slots.switch(0, 4)  # taken
    with pytest.raises(ValueError):
        slots.switch(3, 3)  # no expert 3
    anomalous = torch.zeros(3, dtype=torch.bool)
    slots.nonfinite[4] = True
    slots.nonfinite[1] = True  # a free slot is never routed; its flag means nothing
    slots.fold_nonfinite(anomalous)
    assert anomalous.tolist() == [False, True, False] and not slots.nonfinite.any()
    with pytest.raises(ValueError):
        ExpertSlots.identity(3, 0, torch.device("cpu"))


@torch.no_grad()
def test_meta_construction_with_spares() -> None:
    with torch.device("meta"):
        block = SparseMoeBlock(HIDDEN, CONFIG, num_spare_experts=3)
    assert block.w13.shape == (9, 16, HIDDEN) and block.w13.device.type == "meta"
    block = block.to_empty(device="cpu")
    block.clear_free_slots()
    assert not block.w13[6:].any() and not block.w2[6:].any()
    assert block.expert_slots().table.device.type == "cpu"
    assert "num_spare_experts=3" in repr(block)
