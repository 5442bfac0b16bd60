"""A faster experts forward for training the demo model, and the probe that decides to use it.

One responsibility: offer transformers' Qwen3-MoE experts module a grouped-matmul forward
(registered under GROUPED_EXPERTS in transformers' ExpertsInterface) and choose, on the first
training batch, between it and transformers' own per-expert loop.

Invariants:
- Same maths as ``Qwen3MoeExperts.forward`` (the loop): the probe checks loss and gradients
  against the loop before the grouped path is used, and any error in it means the loop.
- Training-only: the choice lives in the in-memory config (``_experts_implementation``), which
  transformers does not save, so checkpoints never name it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

GROUPED_EXPERTS = "sits_grouped_bf16"


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[rows, k] @ [groups, k, n] -> [rows, n]; group g owns rows offsets[g-1]:offsets[g]."""
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped_mm(x, weight, offs=offsets)


def grouped_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Experts forward for training: one grouped matmul per projection, no host syncs.

    Same maths as transformers' per-expert loop (``Qwen3MoeExperts.forward``): token-expert
    pairs are sorted by expert, each projection is one ``grouped_mm`` over the sorted rows
    (weights cast to the autocast dtype, so bf16 tensor cores run it), the pairs are put back
    in order and each token's top-k outputs summed in float32. The sort-then-grouped-GEMM
    layout is the one of MegaBlocks (Gale et al., 2022) without its padding.

    Args:
        self: the ``Qwen3MoeExperts`` module (gate_up_proj [experts, 2 * inter, hidden],
            down_proj [experts, hidden, inter], act_fn, num_experts).
        hidden_states: [num_tokens, hidden], the router input.
        top_k_index: [num_tokens, top_k] int64 expert ids.
        top_k_weights: [num_tokens, top_k] routing weights.
    Returns:
        [num_tokens, hidden] in hidden_states' dtype.
    """
    device = hidden_states.device
    dtype = (
        torch.get_autocast_dtype(device.type)
        if torch.is_autocast_enabled(device.type)
        else self.gate_up_proj.dtype
    )
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)  # [num_pairs]
    perm = torch.argsort(expert_ids, stable=True)  # [num_pairs]
    counts = torch.zeros(self.num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [num_experts]
    x = hidden_states[perm // top_k].to(dtype)  # [num_pairs, hidden]
    gate_up = _grouped_mm(x, self.gate_up_proj.to(dtype).transpose(1, 2), offsets)
    gate, up = gate_up.chunk(2, dim=-1)  # [num_pairs, inter] each
    y = _grouped_mm(self.act_fn(gate) * up, self.down_proj.to(dtype).transpose(1, 2), offsets)
    y = y * top_k_weights.reshape(-1)[perm, None].to(y.dtype)  # [num_pairs, hidden]
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=device)
    out = y[inverse].view(num_tokens, top_k, hidden).float().sum(dim=1)  # [num_tokens, hidden]
    return out.to(hidden_states.dtype)


def register() -> None:
    """Make GROUPED_EXPERTS a valid ``experts_implementation`` for transformers models."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(GROUPED_EXPERTS, grouped_experts_forward)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _fwd_bwd(model, batch: torch.Tensor, loss_fn: Callable, device: torch.device) -> torch.Tensor:
    """One forward and backward of loss_fn(logits, batch) under bf16 autocast (no sync)."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = loss_fn(model(input_ids=batch, use_cache=False).logits, batch)
    loss.backward()
    return loss.detach()


def pick_experts(model, batch: torch.Tensor, loss_fn: Callable, device: torch.device) -> str:
    """Set the model's experts implementation for training; returns a one-line account.

    Runs the loop and the grouped matmul on `batch` ([batch, seq] int64) in eval mode (no
    dropout), compares the loss (relative difference <= 1e-2) and all gradients (cosine
    > 0.99), times 3 forward+backward passes of each, and keeps the grouped one only if it
    agrees and is faster. Any error in the grouped path falls back to the loop. Gradients are
    cleared afterwards and the model is left in train mode.

    Args:
        loss_fn: (logits [batch, seq, vocab], input_ids [batch, seq]) -> scalar loss.
    """
    register()
    model.eval()
    measured: dict[str, tuple[float, torch.Tensor, float]] = {}
    note = ""
    for impl in ("eager", GROUPED_EXPERTS):
        model.set_experts_implementation(impl)
        try:
            model.zero_grad(set_to_none=True)
            loss = _fwd_bwd(model, batch, loss_fn, device).item()
            grads = torch.cat([p.grad.flatten().float() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(3):
                _fwd_bwd(model, batch, loss_fn, device)
            _sync(device)
            measured[impl] = (loss, grads, (time.perf_counter() - t0) / 3)
        except Exception as exc:  # noqa: BLE001 - any failure of the optional path: the loop
            if impl == "eager":
                raise
            note = f"grouped failed: {type(exc).__name__}: {str(exc)[:200]}"
    model.zero_grad(set_to_none=True)
    model.train()
    chosen = "eager"
    if GROUPED_EXPERTS in measured:
        (l0, g0, s0), (l1, g1, s1) = measured["eager"], measured[GROUPED_EXPERTS]
        cosine = F.cosine_similarity(g0.double(), g1.double(), dim=0).item()
        agree = abs(l1 - l0) <= 1e-2 * abs(l0) and cosine > 0.99
        note = (
            f"loop {s0 * 1e3:.1f} ms, grouped {s1 * 1e3:.1f} ms per fwd+bwd of "
            f"{batch.numel()} tokens; loss {l0:.5f} vs {l1:.5f}, grad cosine {cosine:.5f}"
        )
        if agree and s1 < s0:
            chosen = GROUPED_EXPERTS
    model.set_experts_implementation(chosen)
    return f"{chosen} ({note})"
