"""Roofline arithmetic on a hand-computed example, and the shapes' parameter counts."""

from __future__ import annotations

import pytest

from sits.bench.roofline import (
    Hardware,
    ModelShape,
    expected_experts_touched,
    roofline_json,
    step_cost,
    step_shape,
)

# 2 layers (layer 1 MoE), hidden 8, 2 query heads and 1 KV head of 4, vocab 16, dense MLP 12,
# 4 experts of width 6, top-2.
TOY = ModelShape(
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=16,
    intermediate_size=12,
    num_moe_layers=1,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=6,
)
SLOW = Hardware("toy", bandwidth_bytes_s=1000.0, matmul_flops_s=1000.0, source="test")


def test_model_shape_counts_by_hand() -> None:
    assert TOY.attn_matmul_params == 8 * 8 + 2 * 8 * 4 + 8 * 8 == 192
    assert TOY.layer_small_params == 16
    assert TOY.dense_mlp_params == 288
    assert TOY.expert_params == 144
    assert TOY.router_params == 32
    # embed + lm_head 256, final norm 8, layers 2 * 208, dense MLP 288, MoE 32 + 4 * 144.
    assert TOY.total_params == 256 + 8 + 416 + 288 + 608 == 1576
    assert TOY.kv_elems_per_token() == 16


def test_step_shape_of_a_prefill_chunk_and_a_decode() -> None:
    step = step_shape([(0, 3), (5, 1)], num_sampled=2)
    assert step.num_tokens == 4
    assert step.num_seqs == 2
    assert step.num_kv_tokens == 3 + 6
    # Chunk: 1 + 2 + 3 pairs; decode at position 5: 6 keys.
    assert step.num_attn_pairs == 6 + 6


def test_expected_experts_touched() -> None:
    assert expected_experts_touched(4, 2, 4) == 4 * (1 - 0.5**4) == 3.75
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8.0, abs=1e-12)
    assert expected_experts_touched(128, 8, 0) == 0.0
    assert expected_experts_touched(0, 0, 5) == 0.0


def test_step_cost_by_hand() -> None:
    cost = step_cost(TOY, step_shape([(0, 3), (5, 1)], 2), SLOW, 2, 2)
    # Dense: layers 2 * (192 + 16), dense MLP 288, router 32, final norm 8, 4 embedding rows
    # of 8, LM head 16 * 8 = 904 parameters of 2 bytes.
    assert cost.weight_bytes == 904 * 2 == 1808
    assert cost.expert_bytes == 3.75 * 144 * 2 == 1080
    assert cost.kv_bytes == 9 * 16 * 2 == 288
    assert cost.total_bytes == 3176
    # Per token 2 * 192 + 288 + (32 + 2 * 144) = 992 matmul weights; LM head 2 rows;
    # attention 2 layers * 4 * 2 heads * 4 * 12 pairs.
    assert cost.flops == 2 * 4 * 992 + 2 * 2 * 16 * 8 + 2 * 4 * 2 * 4 * 12 == 9216
    assert cost.memory_s == pytest.approx(3.176)
    assert cost.compute_s == pytest.approx(9.216)
    assert cost.ideal_s == pytest.approx(9.216)


def test_decode_without_sampling_reads_no_lm_head() -> None:
    cost = step_cost(TOY, step_shape([(5, 1)], 0), SLOW, 1, 1)
    assert cost.weight_bytes == 416 + 288 + 32 + 8 + 8
    assert cost.expert_bytes == 2 * 144  # one token touches exactly k = 2 experts


def test_roofline_summary_of_two_steps() -> None:
    steps = [step_shape([(0, 3), (5, 1)], 2), step_shape([(5, 1)], 0)]
    costs = [step_cost(TOY, s, SLOW, 2, 2) for s in steps]
    second = costs[1]
    ideal = 9.216 + second.ideal_s
    doc = roofline_json("two", costs, 2 * ideal, SLOW)
    assert doc["num_steps"] == 2
    assert doc["ideal_s"] == pytest.approx(ideal)
    assert doc["fraction"] == pytest.approx(0.5)
    assert doc["bound"] == "compute"
    assert doc["bytes_per_step"] == pytest.approx((3176 + second.total_bytes) / 2)
    assert doc["achieved_flops_s"] == pytest.approx((9216 + second.flops) / (2 * ideal))
    assert roofline_json("none", [], 0.0, SLOW)["fraction"] is None
