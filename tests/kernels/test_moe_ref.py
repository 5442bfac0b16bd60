"""MoE reference: routing (case C15: strongly negative logits) and the expert loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sits.kernels.moe_ref import moe_forward, select_experts

NUM_TOKENS, NUM_EXPERTS, TOP_K, HIDDEN, INTER = 48, 64, 8, 16, 12


def routing_reference(logits: torch.Tensor, top_k: int, renormalize: bool):
    """float64 softmax -> top-k -> renormalise (the route HF Mixtral/Qwen3-MoE take)."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def dense_moe_reference(hidden, w13, w2, weights, ids) -> torch.Tensor:
    """Every expert on every token in float64, masked by the routing: [T, H]."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        gate, up = (hidden.double() @ w13[e].double().T).chunk(2, dim=-1)
        expert_out = (F.silu(gate) * up) @ w2[e].double().T  # [T, H]
        weight = (weights.double() * (ids == e)).sum(dim=-1, keepdim=True)  # [T, 1]
        out += weight * expert_out
    return out


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_c15_strongly_negative_router_logits(logits_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(15)
    logits = (torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=gen) - 8).to(logits_dtype)
    assert logits.max() < -3
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    ref_weights, ref_ids = routing_reference(logits, TOP_K, renormalize=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_weights, atol=1e-6, rtol=0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(NUM_TOKENS), atol=1e-6, rtol=0)
    # Renormalised softmax over all experts == softmax over the top-k logits (Mixtral).
    topk_softmax = torch.softmax(logits.double().gather(1, ref_ids), dim=-1)
    torch.testing.assert_close(weights.double(), topk_softmax, atol=1e-6, rtol=0)

    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.3
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
    out = moe_forward(hidden, w13, w2, weights, ids)
    expected = dense_moe_reference(hidden, w13, w2, ref_weights, ref_ids)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_without_renormalisation_weights_are_the_softmax_probabilities() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 8, generator=gen) * 3
    weights, ids = select_experts(logits, 2, renormalize=False)
    ref_weights, ref_ids = routing_reference(logits, 2, renormalize=False)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_weights, atol=1e-6, rtol=0)
    assert bool((weights.sum(-1) < 1).all())


def test_experts_without_tokens_are_skipped_and_output_keeps_dtype() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, HIDDEN, generator=gen).bfloat16()
    w13 = (torch.randn(4, 2 * INTER, HIDDEN, generator=gen) * 0.3).bfloat16()
    w2 = (torch.randn(4, HIDDEN, INTER, generator=gen) * 0.3).bfloat16()
    w2[0] = float("nan")  # expert 0 receives no token: its weights must never be read
    ids = torch.tensor([[1, 2], [2, 3], [3, 1], [1, 3], [2, 1]])
    weights = torch.full((5, 2), 0.5)
    out = moe_forward(hidden, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    expected = dense_moe_reference(
        hidden.float(), w13.float(), w2.float().nan_to_num(), weights, ids
    )
    torch.testing.assert_close(out.double(), expected, atol=0.03, rtol=0.02)


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="scoring"):
        select_experts(torch.zeros(2, 4), 2, True, scoring="sigmoid")
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.zeros(2, 4), 5, True)
