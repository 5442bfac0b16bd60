"""Plain PyTorch Mixture-of-Experts: router top-k and the expert loop (reference for kernels).

Invariants:
- Routing is computed in float32 whatever the logits dtype: softmax over all experts, top-k,
  then (when asked) renormalisation of the k weights to sum to 1. Softmax is shift-invariant,
  so strongly negative logits route exactly like their shifted copies.
- Expert weights use the fused layouts of `layers.moe`: w13 [E, 2I, H] (rows 0:I = gate,
  I:2I = up) and w2 [E, H, I]; an expert computes w2 @ (SiLU(w1 @ x) * (w3 @ x)).
- `moe_forward` accumulates the weighted expert outputs in float32 and returns hidden's dtype.
- `moe_forward_fp8` (FP8 experts, `layers.quant.fp8_moe`) dequantizes only the experts the
  step routes to (`kernels.fp8_ref.dequantize_fp8`, into hidden's dtype) and runs
  `moe_forward` on them: the same result as `moe_forward` on the dequantized weights;
  `moe_forward_int4` (INT4 w4a16 experts, `layers.quant.int4_moe`) likewise with
  `kernels.int4_ref.dequantize_int4`. Both share `moe_forward_dequantized`.

Algorithm: sparsely-gated top-k Mixture-of-Experts (Shazeer et al. 2017); the Mixtral router
(Jiang et al. 2024, "Mixtral of Experts") is softmax -> top-k -> renormalise, which equals a
softmax over the top-k logits; Qwen3-MoE renormalises only when `norm_topk_prob` is set.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from sits.kernels.fp8_ref import dequantize_fp8
from sits.kernels.int4_ref import dequantize_int4


def select_experts(
    router_logits: Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[Tensor, Tensor]:
    """Pick each token's top-k experts and their weights.

    Args:
        router_logits: [num_tokens, num_experts], any float dtype.
        top_k: experts per token, 1 <= top_k <= num_experts.
        renormalize: divide the k weights by their sum (Mixtral; Qwen3-MoE `norm_topk_prob`).
        scoring: "softmax" (the only scoring these models use).

    Returns:
        (topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64), the
        experts in descending weight order.

    Raises:
        ValueError: an unknown scoring function or top_k out of range.
    """
    if scoring != "softmax":
        raise ValueError(f"unknown MoE scoring function {scoring!r} (supported: 'softmax')")
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)  # [num_tokens, num_experts]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [num_tokens, top_k]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.long()


def expert_mlp(hidden: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """One expert's gated MLP.

    Args:
        hidden: [num_tokens, hidden_size].
        w13: [2 * intermediate_size, hidden_size], gate rows then up rows.
        w2: [hidden_size, intermediate_size].

    Returns:
        [num_tokens, hidden_size], hidden's dtype.
    """
    gate, up = F.linear(hidden, w13).chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
    return F.linear(F.silu(gate) * up, w2)  # [num_tokens, hidden_size]


def moe_forward(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    nonfinite_experts: Tensor | None = None,
) -> Tensor:
    """Weighted sum of each token's selected experts, looping over experts that got tokens.

    Args:
        hidden: [num_tokens, hidden_size].
        w13: [num_experts, 2 * intermediate_size, hidden_size].
        w2: [num_experts, hidden_size, intermediate_size].
        topk_weights: [num_tokens, top_k] float32.
        topk_ids: [num_tokens, top_k] int64, expert ids in [0, num_experts), or -1 for no
            expert (a padding token's choices, `moe_routing_triton.fused_route`): skipped, so
            a token whose ids are all -1 gets a zero row.
        nonfinite_experts: optional [num_experts] bool, set in place for each expert whose
            output holds a non-finite value in a row whose input row was finite (the health
            check of `layers.moe_stats`).

    Returns:
        [num_tokens, hidden_size], hidden's dtype.
    """
    num_experts = w13.shape[0]
    output = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    routed_ids = topk_ids.flatten()  # [T * k]
    routed_ids = routed_ids[routed_ids >= 0]
    tokens_per_expert = torch.bincount(routed_ids, minlength=num_experts).tolist()
    finite_rows = torch.isfinite(hidden).all(dim=-1) if nonfinite_experts is not None else None
    for expert_id, num_expert_tokens in enumerate(tokens_per_expert):
        if num_expert_tokens == 0:
            continue
        token_idx, choice_idx = torch.nonzero(topk_ids == expert_id, as_tuple=True)  # [n] each
        expert_out = expert_mlp(hidden[token_idx], w13[expert_id], w2[expert_id])  # [n, hidden]
        if finite_rows is not None:
            bad_rows = ~torch.isfinite(expert_out).all(dim=-1) & finite_rows[token_idx]  # [n]
            nonfinite_experts[expert_id] |= bad_rows.any()
        weights = topk_weights[token_idx, choice_idx].float()[:, None]  # [n, 1]
        output.index_add_(0, token_idx, expert_out.float() * weights)
    return output.to(hidden.dtype)


def moe_forward_fp8(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    block: tuple[int, int] | None,
    topk_weights: Tensor,
    topk_ids: Tensor,
    nonfinite_experts: Tensor | None = None,
) -> Tensor:
    """`moe_forward` over FP8 experts, dequantizing only the experts that got tokens.

    Args:
        hidden: [num_tokens, hidden_size].
        w13: [num_experts, 2 * intermediate_size, hidden_size] float8_e4m3fn.
        w13_scale: float32, [num_experts, ceil(2I / bn), ceil(H / bk)] when `block`, else
            [num_experts, 2I] (per row).
        w2: [num_experts, hidden_size, intermediate_size] float8_e4m3fn.
        w2_scale: float32, [num_experts, ceil(H / bn), ceil(I / bk)] or [num_experts, H].
        block: (bn, bk) of block scales, None for per-row scales.
        topk_weights, topk_ids, nonfinite_experts: as `moe_forward` (ids -1 = no expert).

    Returns:
        [num_tokens, hidden_size], hidden's dtype.
    """
    return moe_forward_dequantized(
        hidden,
        w13.shape[0],
        lambda used: (
            dequantize_fp8(w13[used], w13_scale[used], block, hidden.dtype),  # [U, 2I, H]
            dequantize_fp8(w2[used], w2_scale[used], block, hidden.dtype),  # [U, H, I]
        ),
        topk_weights,
        topk_ids,
        nonfinite_experts,
    )


def moe_forward_int4(
    hidden: Tensor,
    w13: tuple[Tensor, Tensor, Tensor | None],
    w2: tuple[Tensor, Tensor, Tensor | None],
    group_size: int,
    topk_weights: Tensor,
    topk_ids: Tensor,
    nonfinite_experts: Tensor | None = None,
) -> Tensor:
    """`moe_forward` over INT4 (w4a16) experts, dequantizing only the experts that got tokens.

    Args:
        hidden: [num_tokens, hidden_size].
        w13: (packed [E, 2I, H // 8] int32, scale [E, 2I, H // G] float32, zero [E, 2I, H // G]
            uint8 or None), the layout of `kernels.int4_ref`.
        w2: (packed [E, H, I // 8], scale [E, H, I // G], zero [E, H, I // G] or None).
        group_size: G.
        topk_weights, topk_ids, nonfinite_experts: as `moe_forward` (ids -1 = no expert).

    Returns:
        [num_tokens, hidden_size], hidden's dtype.
    """

    def dequantize(used: Tensor) -> tuple[Tensor, Tensor]:
        out = []
        for packed, scale, zero in (w13, w2):
            zero_used = None if zero is None else zero[used]
            out.append(
                dequantize_int4(packed[used], scale[used], zero_used, group_size, hidden.dtype)
            )
        return out[0], out[1]

    return moe_forward_dequantized(
        hidden, w13[0].shape[0], dequantize, topk_weights, topk_ids, nonfinite_experts
    )


def moe_forward_dequantized(
    hidden: Tensor,
    num_experts: int,
    dequantize: Callable[[Tensor], tuple[Tensor, Tensor]],
    topk_weights: Tensor,
    topk_ids: Tensor,
    nonfinite_experts: Tensor | None = None,
) -> Tensor:
    """`moe_forward` over quantized experts: `dequantize(used)` gives (w13 [U, 2I, H], w2
    [U, H, I]) in hidden's dtype for the sorted expert ids `used` [U] that got tokens."""
    used = torch.unique(topk_ids[topk_ids >= 0])  # [U] sorted expert ids
    w13_used, w2_used = dequantize(used)
    local = torch.full((num_experts,), -1, dtype=torch.int64, device=topk_ids.device)
    local[used] = torch.arange(used.numel(), device=topk_ids.device)
    local_ids = torch.where(topk_ids >= 0, local[topk_ids.clamp(min=0)], -1)  # [T, k]
    flags = None
    if nonfinite_experts is not None:
        flags = torch.zeros(used.numel(), dtype=torch.bool, device=hidden.device)
    out = moe_forward(hidden, w13_used, w2_used, topk_weights, local_ids, flags)
    if nonfinite_experts is not None:
        nonfinite_experts[used] |= flags
    return out


class TorchMoe:
    """The CPU/reference MoE backend: `select_experts`, `moe_forward`, `moe_forward_fp8` and
    `moe_forward_int4` as methods."""

    def select_experts(
        self, router_logits: Tensor, top_k: int, renormalize: bool
    ) -> tuple[Tensor, Tensor]:
        """See `select_experts`: ([T, k] float32 weights, [T, k] int64 ids)."""
        return select_experts(router_logits, top_k, renormalize)

    def experts(
        self,
        hidden: Tensor,
        w13: Tensor,
        w2: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        nonfinite_experts: Tensor | None = None,
    ) -> Tensor:
        """See `moe_forward`: [T, H] in hidden's dtype."""
        return moe_forward(hidden, w13, w2, topk_weights, topk_ids, nonfinite_experts)

    def experts_fp8(
        self,
        hidden: Tensor,
        w13: Tensor,
        w13_scale: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
        block: tuple[int, int] | None,
        topk_weights: Tensor,
        topk_ids: Tensor,
        nonfinite_experts: Tensor | None = None,
    ) -> Tensor:
        """See `moe_forward_fp8`: [T, H] in hidden's dtype."""
        return moe_forward_fp8(
            hidden, w13, w13_scale, w2, w2_scale, block, topk_weights, topk_ids, nonfinite_experts
        )

    def experts_int4(
        self,
        hidden: Tensor,
        w13: tuple[Tensor, Tensor, Tensor | None],
        w2: tuple[Tensor, Tensor, Tensor | None],
        group_size: int,
        topk_weights: Tensor,
        topk_ids: Tensor,
        nonfinite_experts: Tensor | None = None,
    ) -> Tensor:
        """See `moe_forward_int4`: [T, H] in hidden's dtype."""
        return moe_forward_int4(
            hidden, w13, w2, group_size, topk_weights, topk_ids, nonfinite_experts
        )
