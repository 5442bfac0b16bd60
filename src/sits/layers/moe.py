"""Sparse Mixture-of-Experts block: a linear router, top-k routing and fused expert weights.

Invariants:
- Routing follows the checkpoint's config exactly: softmax over all experts in float32, top-k,
  renormalise the k weights only when `MoeConfig.renormalize` (Mixtral: always; Qwen3-MoE:
  `norm_topk_prob`).
- Expert weights are stored fused: w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I].
- The compute goes through a `MoeBackend` seam; the default is the PyTorch reference
  (`kernels.moe_ref.TorchMoe`) and a fused GPU kernel can replace it without touching weights.
- Load and health (`layers.moe_stats.ExpertState`, created lazily on the weights' device): every
  forward masks frozen experts' router logits with -inf before top-k, adds the routed tokens
  per expert and folds in the backend's per-expert non-finite flags, all on the device.
- Spare slots (`add_spare_slots`, `--num-spare-experts`; none by default): w13 / w2 then hold
  E + N physical slots and `expert_slots()` maps logical experts to them
  (`layers.expert_slots`): routing, counts and health stay logical, only the experts' compute
  reads `ExpertSlots.map_ids(topk_ids)` (one gather) and raises its non-finite flags per slot,
  folded back to logical ids after the experts. Without spares nothing of this runs.
- On CUDA with Triton installed the routing and the bookkeeping are two Triton kernels
  (`kernels.moe_routing_triton.fused_route` before the experts, or `gate_route`, which also
  computes the gate's logits, for steps of one or two tokens; `kernels.moe_health_triton.
  fused_health_update` after them; imported only on that path) and
  `MoeBackend.select_experts` is not called; elsewhere the PyTorch path of `ExpertState` runs
  with `MoeBackend.select_experts`. Both give the same routing, counts and health updates,
  except for equal logits (torch.topk orders them arbitrarily, the kernel lowest id first) and
  non-finite rows (never checked on either path; torch.topk routes them to arbitrary experts,
  the kernel to the lowest-id unfrozen ones), which only move those rows' token counts.
- Tensor parallelism: the router `gate` is replicated, so every rank routes identically (and
  counts every expert's tokens alike); every expert's w13 gate and up rows and w2 columns
  hold this rank's slice `inter_shard` of the intermediate dimension, and the weighted expert
  sum is summed over the ranks once per layer. The experts' non-finite flags ride in the same
  all-reduce (appended to the output), so every rank folds the same `anomalous` flags and
  freezes the same experts at the same step. Spare slots work alike: every rank's spare slots
  hold its slice, and since every restore runs on every rank (`runner.expert_ops`) the slot
  tables stay equal. They are refused with expert parallelism (`add_spare_slots`).
- Expert parallelism (`tp.expert_parallel`, EP size = tp.size): rank r holds the whole
  experts `expert_shard` = [r * E / size, (r + 1) * E / size) in its w13 / w2 (local slot
  e - start). Routing stays replicated and logical; before the experts each rank maps the
  ids of experts it does not hold to -1 (no expert: those pairs add nothing) and its own to
  local slots, so its output is the partial weighted sum over its experts, and the same one
  all-reduce per layer combines the ranks: dispatch and combine by all-reduce, the simplest
  correct scheme (every rank sees every token; all-to-all dispatch of each token to the
  ranks of its experts is the later optimisation). A rank raises the non-finite flags of its
  own experts only; the all-reduce ORs them, so load and health stay identical on every
  rank, over all E logical experts.
- Replicated experts (`enable_replicas`, `--expert-router-policy load-aware`): the
  expert-parallel rank then holds S = (E + N) / size slots and `replicas()`
  (`layers.expert_replicas`) says which logical expert each slot holds, hot experts in
  several slots across the ranks; the experts' compute reads `ExpertReplicas.map_ids(topk_ids)`
  instead of the contiguous shard's ids, and its per-slot non-finite flags are folded back to
  logical ids. Every pair is still computed on exactly one rank, so the all-reduce is
  unchanged; without replicas (the static policy) nothing of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from sits.core.errors import InvalidParameterError
from sits.kernels.moe_ref import TorchMoe
from sits.kernels.triton_utils import has_triton
from sits.layers.expert_replicas import ExpertReplicas
from sits.layers.expert_slots import ExpertSlots
from sits.layers.linear import Shard
from sits.layers.moe_stats import ExpertState
from sits.parallel import SINGLE, TensorParallel
from sits.parallel.placement import contiguous_placement


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Shape and routing of a sparse MoE block.

    Attributes:
        num_experts: experts per layer (E).
        top_k: experts per token.
        intermediate_size: hidden width of one expert (I, the checkpoint's: all ranks).
        renormalize: rescale the top-k weights to sum to 1.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool


class MoeBackend(Protocol):
    """Computes routing and experts (PyTorch reference on CPU, fused kernels on GPU)."""

    def select_experts(
        self, router_logits: Tensor, top_k: int, renormalize: bool
    ) -> tuple[Tensor, Tensor]:
        """[T, E] logits -> ([T, k] float32 weights, [T, k] int64 expert ids)."""
        ...

    def experts(
        self,
        hidden: Tensor,
        w13: Tensor,
        w2: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        nonfinite_experts: Tensor | None = None,
    ) -> Tensor:
        """[T, H] hidden, [E, 2I, H] w13, [E, H, I] w2 -> [T, H] weighted expert sum.

        When `nonfinite_experts` ([E] bool) is given, set entry e when expert e's output holds
        a non-finite value in a row whose input row was finite (without a host sync).
        """
        ...


class SparseMoeBlock(nn.Module):
    """Router + experts of one decoder layer.

    Attributes:
        gate: router, Linear(hidden_size, num_experts, bias=False), on every rank.
        w13: [num_slots, 2 * I, hidden_size] parameter (num_slots =
            num_experts + num_spare_experts; logical expert e lives in slot
            `physical_slot(e)`, e itself without spares; I = `intermediate_size`).
        w2: [num_slots, hidden_size, I] parameter.
        intermediate_size: this rank's expert width I (config.intermediate_size / tp.size;
            all of it with expert parallelism).
        inter_shard: the intermediate indices of the checkpoint's experts this rank holds.
        expert_shard: the logical experts this rank loads (all of them without expert
            parallelism); expert e sits in local slot e - expert_shard.start, until
            `enable_replicas` hands the slots to a placement.
        tp: the tensor-parallel group (`tp.expert_parallel`: shard by whole experts).
        moe_backend: where routing and experts run.
        num_spare_experts: spare physical slots (0 = none, no routing table).
        fused_routing: use the Triton routing and health kernels when the input is on CUDA and
            Triton is installed (True by default; tests set False to run the PyTorch path).
    """

    def __init__(
        self,
        hidden_size: int,
        config: MoeConfig,
        moe_backend: MoeBackend | None = None,
        num_spare_experts: int = 0,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Raises InvalidParameterError when tp.size does not divide the experts' width (or,
        with `tp.expert_parallel`, the number of experts)."""
        super().__init__()
        self.config = config
        self.tp = tp
        num_experts = config.num_experts
        if tp.expert_parallel:
            self.expert_shard = Shard.of(num_experts, tp, "num_experts with expert parallelism")
            self.inter_shard = Shard.whole(config.intermediate_size)
        else:
            self.expert_shard = Shard.whole(num_experts)
            self.inter_shard = Shard.of(
                config.intermediate_size, tp, "the experts' intermediate_size"
            )
        num_local, inter = self.expert_shard.size, self.inter_shard.size
        self.intermediate_size = inter
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, inter))
        self._local_nonfinite: Tensor | None = None  # expert parallelism: [num_local] flags
        self._route_arrivals: Tensor | None = None  # `gate_route`'s [1] int32 counter
        self.moe_backend: MoeBackend = moe_backend if moe_backend is not None else TorchMoe()
        self._expert_state: ExpertState | None = None
        self.fused_routing = True
        self._kernels_fit: bool | None = None  # looked up once, at the first CUDA forward
        self.num_spare_experts = 0
        self._expert_slots: ExpertSlots | None = None
        self._replicas: ExpertReplicas | None = None
        self.add_spare_slots(num_spare_experts)

    def add_spare_slots(self, num_spare: int) -> None:
        """Grow w13 and w2 by `num_spare` zero physical slots (no memory on the meta device);
        0 does nothing. Call once, before the first forward (the loader does, on the meta
        model): it replaces both parameters.

        Raises:
            InvalidParameterError: num_spare < 0, or num_spare > 0 on a rank holding only
                some of the experts (expert parallelism).
        """
        if num_spare < 0:
            raise InvalidParameterError(
                "num_spare_experts", f"num_spare_experts must be >= 0, got {num_spare}"
            )
        if num_spare == 0:
            return
        if not self.expert_shard.is_whole:
            raise InvalidParameterError(
                "num_spare_experts",
                f"num_spare_experts={num_spare} is not supported with expert parallelism: a "
                "spare slot would have to sit on the rank holding its expert, while the spare "
                "table maps every expert into one rank's slots (and load-aware's replica "
                "tables already place experts across the ranks' slots)",
            )
        assert self.num_spare_experts == 0 and self._expert_slots is None, "spares added twice"
        num_experts = self.config.num_experts
        with torch.no_grad():
            for name in ("w13", "w2"):
                old = getattr(self, name)
                new = old.new_zeros((num_experts + num_spare, *old.shape[1:]))  # [E + N, ...]
                new[:num_experts].copy_(old)
                setattr(self, name, nn.Parameter(new, requires_grad=old.requires_grad))
        self.num_spare_experts = num_spare
        if hasattr(self.moe_backend, "tuned_num_experts"):  # tuned launch configs are per E
            self.moe_backend.tuned_num_experts = num_experts

    def enable_replicas(self, num_redundant: int) -> ExpertReplicas:
        """Hand this expert-parallel rank's slots to a placement (`layers.expert_replicas`):
        grow w13 / w2 on their device to S = (E + num_redundant) / size slots (the new ones
        zero) and start from the contiguous placement (the loaded experts where they are,
        the new slots empty). Call once, after the weights are loaded, before a forward.

        Returns:
            The layer's replica tables (also `replicas()`).

        Raises:
            InvalidParameterError: the block is not expert parallel, or num_redundant is
                negative or not a multiple of the expert-parallel size.
        """
        size, num_experts = self.tp.size, self.config.num_experts
        if self.expert_shard.is_whole:
            raise InvalidParameterError(
                "expert_router_policy", "replicated experts need expert parallelism"
            )
        if num_redundant < 0 or num_redundant % size:
            raise InvalidParameterError(
                "num_redundant_experts",
                f"num_redundant_experts must be a multiple of the expert-parallel size {size} "
                f"and >= 0, got {num_redundant}",
            )
        assert self._replicas is None, "replicas enabled twice"
        num_slots = (num_experts + num_redundant) // size
        with torch.no_grad():
            for name in ("w13", "w2"):
                old = getattr(self, name)
                new = old.new_zeros((num_slots, *old.shape[1:]))  # [S, ...]
                new[: old.shape[0]].copy_(old)
                setattr(self, name, nn.Parameter(new, requires_grad=False))
        placement = contiguous_placement(num_experts, size, num_slots)
        self._replicas = ExpertReplicas.of(
            placement, self.tp.rank, 1 + num_redundant, self.w13.device
        )
        return self._replicas

    def replicas(self) -> ExpertReplicas | None:
        """The layer's replica tables (`enable_replicas`), or None (static placement)."""
        return self._replicas

    def expert_slots(self) -> ExpertSlots | None:
        """The layer's logical -> physical slot table (made on the weights' device at first
        use: the identity, spares free), or None without spare slots."""
        if self.num_spare_experts == 0:
            return None
        if self._expert_slots is None:
            self._expert_slots = ExpertSlots.identity(
                self.config.num_experts, self.num_spare_experts, self.w13.device
            )
        return self._expert_slots

    def physical_slot(self, expert_id: int) -> int:
        """The slot of w13 / w2 holding logical expert `expert_id` (host bookkeeping)."""
        slots = self.expert_slots()
        return expert_id if slots is None else slots.slot_of[expert_id]

    def local_slots(self, expert_id: int) -> list[int]:
        """The slots of this rank's w13 / w2 holding logical expert `expert_id` (host
        bookkeeping): `physical_slot` when the rank holds every expert; with expert
        parallelism its local slot when it holds the expert, none when another rank does, and
        with replicas every local slot the placement gives the expert."""
        if self._replicas is not None:
            row = self._replicas.placement.slots[self.tp.rank]
            return [slot for slot, expert in enumerate(row) if expert == expert_id]
        shard = self.expert_shard
        if not shard.is_whole:
            return [expert_id - shard.start] if shard.start <= expert_id < shard.stop else []
        return [self.physical_slot(expert_id)]

    def clear_free_slots(self) -> None:
        """Zero the weights of the slots no expert holds (garbage after `to_empty`)."""
        slots = self.expert_slots()
        if slots is None:
            return
        with torch.no_grad():
            for slot in slots.free_slots:
                self.w13[slot].zero_()
                self.w2[slot].zero_()

    def expert_state(self) -> ExpertState:
        """The layer's expert counters and frozen mask (made on the weights' device at first
        use, so they survive meta-device construction; zeros, nothing frozen)."""
        if self._expert_state is None:
            self._expert_state = ExpertState.zeros(
                self.config.num_experts, self.config.top_k, self.w13.device
            )
        return self._expert_state

    def reset_expert_state(self) -> None:
        """Forget counters, streaks and frozen experts (keeps `freeze_after`), in place: a
        captured CUDA graph keeps reading and writing the same tensors."""
        state = self.expert_state()
        with torch.inference_mode():
            for tensor in (
                state.num_tokens,
                state.num_anomalous,
                state.streak,
                state.frozen,
                state.checked,
                state.anomalous,
            ):
                tensor.zero_()

    def forward(self, hidden: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """hidden: [num_tokens, hidden_size] -> [num_tokens, hidden_size], hidden's dtype.

        Frozen experts get no tokens (their logit is -inf before top-k); the step's routing
        and health flags are added to `expert_state()` on the device. `token_mask`
        ([num_tokens] bool, None = all) leaves padding tokens out of the counts and checks.
        """
        state = self.expert_state()
        if self._use_fused_kernels(hidden):
            return self._forward_fused(hidden, state, token_mask)
        router_logits = self.gate(hidden)  # [num_tokens, num_experts]
        topk_weights, topk_ids = self.moe_backend.select_experts(
            state.mask_logits(router_logits), self.config.top_k, self.config.renormalize
        )  # [num_tokens, top_k] each
        state.count(topk_ids, token_mask)
        state.mark_checked(topk_ids, state.finite_rows(router_logits, token_mask))
        out = self._run_experts(hidden, topk_weights, topk_ids, state)  # [num_tokens, hidden]
        state.update_health()
        return out

    def _run_experts(
        self, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, state: ExpertState
    ) -> Tensor:
        """The backend's experts on the physical slots of topk_ids [T, k] (logical ids), their
        non-finite flags folded into `state.anomalous` by logical id -> [T, hidden_size],
        summed (and the flags OR-ed) over the tensor-parallel ranks."""
        slots = self.expert_slots()
        replicas = self._replicas
        if replicas is not None:
            out = self._experts(
                hidden, topk_weights, replicas.map_ids(topk_ids), replicas.nonfinite
            )  # [num_tokens, hidden_size], this rank's replicas' partial sum
            replicas.fold_nonfinite(state.anomalous)
        elif not self.expert_shard.is_whole:
            out = self._run_local_experts(hidden, topk_weights, topk_ids, state.anomalous)
        elif slots is None:
            out = self._experts(hidden, topk_weights, topk_ids, state.anomalous)  # [T, hidden]
        else:
            out = self._experts(hidden, topk_weights, slots.map_ids(topk_ids), slots.nonfinite)
            slots.fold_nonfinite(state.anomalous)
        return self._reduce(out, state.anomalous)

    def _experts(
        self, hidden: Tensor, topk_weights: Tensor, ids: Tensor, nonfinite: Tensor | None
    ) -> Tensor:
        """The backend's experts over this rank's slots: hidden [T, hidden_size], topk_weights
        [T, k] float32, ids [T, k] int64 slots of w13 / w2 (-1: none) -> [T, hidden_size];
        nonfinite ([num_slots] bool) raised per slot. Quantized blocks run their own."""
        return self.moe_backend.experts(hidden, self.w13, self.w2, topk_weights, ids, nonfinite)

    def _run_local_experts(
        self, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, anomalous: Tensor
    ) -> Tensor:
        """Expert parallelism: the backend's experts over this rank's experts only ->
        [T, hidden_size], the partial weighted sum (rows routed elsewhere are zeros).

        topk_ids [T, k] int64 logical ids become local slots, and -1 for experts other ranks
        hold (a padding token's -1 stays -1); the local non-finite flags are OR-ed into
        anomalous [num_experts] bool at this rank's experts, then cleared.
        """
        shard = self.expert_shard
        held = (topk_ids >= shard.start) & (topk_ids < shard.stop)  # [T, k]
        local_ids = torch.where(held, topk_ids - shard.start, -1)  # [T, k]
        if self._local_nonfinite is None:
            self._local_nonfinite = torch.zeros(
                shard.size, dtype=torch.bool, device=self.w13.device
            )  # persistent, so a captured graph reuses it
        out = self._experts(hidden, topk_weights, local_ids, self._local_nonfinite)  # [T, hidden]
        anomalous[shard.start : shard.stop] |= self._local_nonfinite
        self._local_nonfinite.zero_()
        return out

    def _reduce(self, out: Tensor, anomalous: Tensor) -> Tensor:
        """Sum out [T, hidden_size] over the tensor-parallel ranks and OR their anomalous
        [num_experts] bool flags in place, in one all-reduce; out itself when tp.size is 1."""
        if self.tp.size == 1:
            return out
        packed = torch.cat([out.flatten(), anomalous.to(out.dtype)])  # [T * hidden + E]
        self.tp.all_reduce(packed)
        anomalous.copy_(packed[out.numel() :] > 0)
        return packed[: out.numel()].view_as(out)

    def _use_fused_kernels(self, hidden: Tensor) -> bool:
        """True when routing and health run as Triton kernels: CUDA input, Triton installed
        and the layer within the kernels' limits (E <= 256, top_k <= 16)."""
        if not self.fused_routing or hidden.device.type != "cuda":
            return False
        if self._kernels_fit is None:
            self._kernels_fit = has_triton()
            if self._kernels_fit:
                from sits.kernels.moe_routing_triton import MAX_EXPERTS, MAX_TOP_K

                config = self.config
                self._kernels_fit = config.num_experts <= MAX_EXPERTS and config.top_k <= MAX_TOP_K
        return self._kernels_fit

    def _forward_fused(
        self, hidden: Tensor, state: ExpertState, token_mask: Tensor | None
    ) -> Tensor:
        """The CUDA path: the gate GEMM and `fused_route` (one `gate_route` launch for up to
        GATE_ROUTE_FASTER_TOKENS tokens), the experts, `fused_health_update` (plus the slot
        gather and the flag fold with spare slots; no host synchronisation). Padding tokens
        (token_mask False) go to no expert, so their rows of the result are zeros."""
        from sits.kernels.moe_health_triton import fused_health_update
        from sits.kernels.moe_routing_triton import (
            GATE_ROUTE_FASTER_TOKENS,
            fused_route,
            gate_route,
        )

        top_k = self.config.top_k
        route_args = (state.frozen, top_k, self.config.renormalize, state.num_tokens)
        gate = self.gate.weight  # [num_experts, hidden_size]
        if (
            0 < hidden.shape[0] <= GATE_ROUTE_FASTER_TOKENS
            and gate.dtype == hidden.dtype
            and hidden.stride(1) == 1
        ):
            if self._route_arrivals is None:  # persistent, so a captured graph reuses it
                self._route_arrivals = torch.zeros(1, dtype=torch.int32, device=hidden.device)
            topk_weights, topk_ids = gate_route(
                hidden, gate, self._route_arrivals, *route_args, state.checked, token_mask
            )  # [num_tokens, top_k] each
        else:
            topk_weights, topk_ids = fused_route(
                self.gate(hidden), *route_args, state.checked, token_mask
            )  # [num_tokens, top_k] each
        out = self._run_experts(hidden, topk_weights, topk_ids, state)  # [num_tokens, hidden]
        fused_health_update(
            state.checked,
            state.anomalous,
            state.num_anomalous,
            state.streak,
            state.frozen,
            top_k,
            state.freeze_after,
        )
        return out

    def extra_repr(self) -> str:
        spares = f", num_spare_experts={self.num_spare_experts}" if self.num_spare_experts else ""
        shard = self.expert_shard
        experts = "" if shard.is_whole else f", experts=[{shard.start}, {shard.stop})"
        if self._replicas is not None:
            experts = f", replicated experts in {self.w13.shape[0]} slots"
        return f"{self.config}{spares}{experts}"
