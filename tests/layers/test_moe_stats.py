"""Expert load counters, the non-finite health check and freezing of `SparseMoeBlock`."""

from __future__ import annotations

import pytest
import torch

from sits.core.errors import InvalidParameterError
from sits.kernels.moe_ref import TorchMoe, select_experts
from sits.layers.moe import MoeConfig, SparseMoeBlock
from sits.runner.expert_health import ExpertMonitor, imbalance_of

HIDDEN = 16
CONFIG = MoeConfig(num_experts=6, top_k=2, intermediate_size=8, renormalize=True)


class RecordingMoe(TorchMoe):
    """The reference backend, remembering the routing of each call."""

    def __init__(self) -> None:
        self.topk_ids: list[torch.Tensor] = []

    def select_experts(self, router_logits, top_k, renormalize):
        weights, ids = super().select_experts(router_logits, top_k, renormalize)
        self.topk_ids.append(ids)
        return weights, ids


def make_block(config: MoeConfig = CONFIG) -> tuple[SparseMoeBlock, RecordingMoe]:
    backend = RecordingMoe()
    block = SparseMoeBlock(HIDDEN, config, backend)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return block, backend


def reference_counts(block: SparseMoeBlock, batches: list[torch.Tensor], masked=()) -> list[int]:
    counts = torch.zeros(block.config.num_experts, dtype=torch.int64)
    for hidden in batches:
        logits = block.gate(hidden)
        if masked:
            logits[:, list(masked)] = float("-inf")
        _, ids = select_experts(logits, block.config.top_k, block.config.renormalize)
        counts += torch.bincount(ids.flatten(), minlength=block.config.num_experts)
    return counts.tolist()


@torch.no_grad()
def test_counts_equal_reference_topk_and_imbalance() -> None:
    block, _ = make_block()
    batches = [torch.randn(n, HIDDEN) for n in (5, 1, 17)]
    for hidden in batches:
        block(hidden)
    monitor = ExpertMonitor({3: block})
    stats = monitor.read(num_steps=3)
    expected = reference_counts(block, batches)
    assert sum(expected) == 23 * 2
    (layer,) = stats.layers
    assert layer.layer_id == 3 and layer.num_tokens == tuple(expected)
    assert layer.imbalance == pytest.approx(max(expected) / (46 / 6))
    assert layer.frozen == (False,) * 6 and layer.num_anomalous == (0,) * 6
    assert imbalance_of((0, 0)) == 0.0 and imbalance_of((2, 2)) == 1.0


@torch.no_grad()
def test_nan_expert_frozen_after_three_checks_then_routed_around() -> None:
    block, backend = make_block()
    monitor = ExpertMonitor({0: block}, freeze_after=3)
    hidden = torch.randn(32, HIDDEN)
    bad = int(torch.bincount(reference_counts_ids(block, hidden).flatten()).argmax())
    block.w2[bad] = float("nan")
    for check in range(1, 4):
        out = block(hidden)
        assert not torch.isfinite(out).all()
        stats = monitor.read()
        assert stats.layers[0].num_anomalous[bad] == check
        assert stats.layers[0].frozen[bad] == (check == 3)
        assert sum(stats.layers[0].num_anomalous) == check  # healthy experts never flagged
    assert stats.num_auto_freezes == 1
    out = block(hidden)
    assert torch.isfinite(out).all()
    logits = block.gate(hidden)
    logits[:, bad] = float("-inf")
    weights, ids = select_experts(logits, 2, True)
    assert torch.equal(backend.topk_ids[-1], ids) and not (ids == bad).any()
    expected = torch.zeros_like(out)
    for slot in range(2):
        for row in range(hidden.shape[0]):
            expert = int(ids[row, slot])
            gate, up = (block.w13[expert] @ hidden[row]).chunk(2)
            mlp = block.w2[expert] @ (torch.nn.functional.silu(gate) * up)
            expected[row] += weights[row, slot] * mlp
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert monitor.read().num_auto_freezes == 1  # logged once


def reference_counts_ids(block: SparseMoeBlock, hidden: torch.Tensor) -> torch.Tensor:
    return select_experts(block.gate(hidden), block.config.top_k, block.config.renormalize)[1]


@torch.no_grad()
def test_clean_check_resets_streak_and_nonfinite_inputs_do_not_count() -> None:
    block, _ = make_block()
    monitor = ExpertMonitor({0: block}, freeze_after=2)
    hidden = torch.randn(8, HIDDEN)
    ids = reference_counts_ids(block, hidden)
    bad = int(ids[0, 0])
    poisoned = hidden.clone()
    poisoned[1:] = float("nan")  # rows already non-finite on entry: not the experts' fault
    block(poisoned)
    assert monitor.read().layers[0].num_anomalous == (0,) * 6
    saved = block.w2[bad].clone()
    block.w2[bad] = float("inf")
    block(hidden)  # anomalous 1
    block.w2[bad] = saved
    block(hidden)  # clean: streak reset
    block.w2[bad] = float("inf")
    block(hidden)  # anomalous 1 again
    block(hidden[:0])  # no tokens: no check
    stats = monitor.read().layers[0]
    assert stats.num_anomalous[bad] == 2 and not stats.frozen[bad]
    block(hidden)  # anomalous 2 in a row: frozen
    assert monitor.read().layers[0].frozen[bad]


@torch.no_grad()
def test_never_freezes_below_top_k_and_operator_commands() -> None:
    config = MoeConfig(num_experts=3, top_k=2, intermediate_size=8, renormalize=False)
    block, backend = make_block(config)
    monitor = ExpertMonitor({0: block}, freeze_after=1)
    block.w2[:] = float("nan")
    block(torch.randn(16, HIDDEN))
    frozen = monitor.read().layers[0].frozen
    assert sum(frozen) == 1  # 3 experts - top_k 2: at most one frozen
    (auto,) = [e for e, f in enumerate(frozen) if f]
    other = (auto + 1) % 3
    with pytest.raises(InvalidParameterError):
        monitor.freeze(0, other)
    with pytest.raises(InvalidParameterError):
        monitor.freeze(1, 0)
    with pytest.raises(InvalidParameterError):
        monitor.unfreeze(0, 3)
    monitor.unfreeze(0, auto)
    monitor.freeze(0, other)
    stats = monitor.read()
    assert stats.layers[0].frozen == tuple(e == other for e in range(3))
    assert stats.num_auto_freezes == 1  # the operator's freeze is not an alert
    block(torch.randn(4, HIDDEN))
    assert not (backend.topk_ids[-1] == other).any()


@torch.no_grad()
def test_meta_construction_then_to_empty_starts_clean() -> None:
    with torch.device("meta"):
        block = SparseMoeBlock(HIDDEN, CONFIG)
    block = block.to_empty(device="cpu")
    state = block.expert_state()
    assert state.num_tokens.device.type == "cpu"
    assert state.num_tokens.tolist() == [0] * 6 and not state.frozen.any()
    state.frozen[0] = True
    block.reset_expert_state()
    assert not block.expert_state().frozen.any()
