"""Expert health of a model's MoE layers, host side: snapshots, operator freeze/unfreeze and
restore from the checkpoint (`ExpertMonitor`, run by the engine thread between steps).

Invariants:
- The device state is each block's `layers.moe_stats.ExpertState`; `ExpertMonitor.read()`
  copies it to the host (one copy per layer) and never runs inside a step.
- Freezing changes routing only: the expert's weights stay where they are; `restore` reloads
  them from the checkpoint (`runner.expert_restore`) and unfreezes the expert: into the oldest
  free spare slot when the layer has spare slots (`layers.expert_slots`; the routing table is
  switched after the copy), else over the expert's own slot. Every count, flag and id here is
  a logical expert id, whichever slot serves the expert.
- With `auto_restore`, `read` restores each expert the health check froze since the previous
  read (once; a failed reload is logged and the expert stays frozen): the engine thread calls
  `read` every few steps, so the reload runs between steps without a per-step host sync.
- With the load-aware expert placement (`placement`, `runner.expert_placement`) each read
  also carries its figures (`ExpertStats.placement`), read on the host with no device sync.
- Every change to the experts' state (freeze_after, freeze, unfreeze, restore) is an
  `runner.expert_ops.ExpertOp`, applied here and, with tensor parallelism, handed to the
  other ranks (`peers`: `TensorParallelRunner.send_expert_op`), which apply it before the
  next step's forward; so every rank freezes, unfreezes and restores alike. The device
  state is read on this rank (rank 0) only: the ranks' states are equal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from sits.core.errors import InvalidParameterError
from sits.layers.moe_stats import DEFAULT_FREEZE_AFTER, ExpertState
from sits.layers.quant.fill import quantize_experts_
from sits.runner.expert_ops import ExpertOp, ExpertOpKind, apply_expert_op, moe_blocks
from sits.runner.expert_placement import ExpertPlacer, PlacementStats
from sits.runner.model_runner import ModelRunner
from sits.runner.tp_executor import TensorParallelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExpertLayerStats:
    """One MoE layer's experts as last read.

    Attributes:
        layer_id: decoder layer index.
        num_tokens: tokens routed to each expert since start.
        num_anomalous: anomalous (non-finite output) checks of each expert since start.
        frozen: whether the router masks each expert.
        imbalance: max / mean of `num_tokens` (1.0 = perfectly even; 0.0 before any token).
        expert_slots: the physical weight slot of each expert (the identity without spares).
        num_free_slots: spare slots free for the next restore (0 without spares).
        num_relocated: experts served from a spare slot, i.e. restored into a slot other than
            their load-time one (the spare slots in use).
    """

    layer_id: int
    num_tokens: tuple[int, ...]
    num_anomalous: tuple[int, ...]
    frozen: tuple[bool, ...]
    imbalance: float
    expert_slots: tuple[int, ...] = ()
    num_free_slots: int = 0
    num_relocated: int = 0


@dataclass(frozen=True, slots=True)
class ExpertStats:
    """A snapshot of every MoE layer's experts.

    Attributes:
        layers: one entry per MoE layer, in layer order.
        num_experts: experts per layer.
        freeze_after: consecutive anomalous checks that freeze an expert (0 = never).
        num_auto_freezes: experts frozen by the health check since start (the alert counter).
        num_restores: experts reloaded from the checkpoint since start (into spares or not).
        num_steps: engine steps when read (-1 when unknown).
        num_spare_experts: spare weight slots per MoE layer (0 = none).
        num_spare_restores: of `num_restores`, those into a spare slot.
        placement: the load-aware expert placement's figures, or None (static policy).
    """

    layers: tuple[ExpertLayerStats, ...] = ()
    num_experts: int = 0
    freeze_after: int = DEFAULT_FREEZE_AFTER
    num_auto_freezes: int = 0
    num_restores: int = 0
    num_steps: int = -1
    num_spare_experts: int = 0
    num_spare_restores: int = 0
    placement: PlacementStats | None = None

    def to_json(self) -> dict:
        """A JSON-ready dict (the body of GET /v1/admin/experts)."""
        return {
            "num_experts": self.num_experts,
            "freeze_after": self.freeze_after,
            "num_auto_freezes": self.num_auto_freezes,
            "num_restores": self.num_restores,
            "num_steps": self.num_steps,
            "num_spare_experts": self.num_spare_experts,
            "num_spare_restores": self.num_spare_restores,
            "layers": [
                {
                    "layer": layer.layer_id,
                    "num_tokens": list(layer.num_tokens),
                    "num_anomalous": list(layer.num_anomalous),
                    "frozen": list(layer.frozen),
                    "imbalance": layer.imbalance,
                    "expert_slots": list(layer.expert_slots),
                    "num_free_slots": layer.num_free_slots,
                    "num_relocated": layer.num_relocated,
                }
                for layer in self.layers
            ],
            "placement": self.placement.to_json() if self.placement is not None else None,
        }


def imbalance_of(num_tokens: tuple[int, ...]) -> float:
    """max / mean of the per-expert token counts; 0.0 when no token was routed."""
    total = sum(num_tokens)
    if total == 0:
        return 0.0
    return max(num_tokens) * len(num_tokens) / total


class ExpertMonitor:
    """Reads and steers the expert state of a model's MoE layers (host side, one thread).

    Args:
        blocks: decoder layer id -> that layer's `SparseMoeBlock` (its `config`,
            `expert_state()` and `expert_slots()` are used).
        freeze_after: consecutive anomalous checks that freeze an expert; 0 disables freezing.
        model_dir: the checkpoint `restore` reads by default (None: it must be given).
        auto_restore: `read` restores the experts the health check froze (needs `model_dir`).
        twin_blocks: decoder layer id -> the same layer's quantized MoE block in each other
            resident weight set (the precision switch's twin); `restore` re-quantizes the
            restored expert into them, so both sets hold the checkpoint's expert again.
        placement: the runner's load-aware `ExpertPlacer` (its `stats()` go in each read),
            or None.
        peers: with tensor parallelism, hands each op applied here to the other ranks
            (`TensorParallelRunner.send_expert_op`; `of_runner` passes it); None with one
            rank.

    Attributes:
        newly_frozen: (layer, expert) frozen by the health check since the previous `read`.
        num_restores: experts reloaded from the checkpoint since start.
        num_spare_restores: of those, the ones loaded into a spare slot.

    Raises:
        InvalidParameterError: negative `freeze_after`, or `auto_restore` without `model_dir`.
        ValueError: blocks of a tensor-parallel shard without `peers` (its operations would
            reach rank 0 alone).
    """

    def __init__(
        self,
        blocks: Mapping[int, nn.Module],
        freeze_after: int = DEFAULT_FREEZE_AFTER,
        *,
        model_dir: str | None = None,
        auto_restore: bool = False,
        twin_blocks: Mapping[int, Sequence[nn.Module]] | None = None,
        placement: ExpertPlacer | None = None,
        peers: Callable[[ExpertOp], None] | None = None,
    ):
        if freeze_after < 0:
            raise InvalidParameterError("freeze_after", f"must be >= 0, got {freeze_after}")
        if auto_restore and model_dir is None:
            raise InvalidParameterError("model_dir", "auto_restore needs the checkpoint dir")
        self.blocks = dict(sorted(blocks.items()))
        self.twin_blocks = {layer: tuple(twins) for layer, twins in (twin_blocks or {}).items()}
        self.freeze_after = freeze_after
        self.model_dir = model_dir
        self.auto_restore = auto_restore
        self.placement = placement
        self.peers = peers
        if peers is None and any(block.tp.size > 1 for block in self.blocks.values()):
            raise ValueError(
                "a tensor-parallel model's ExpertMonitor needs peers (ExpertMonitor.of_runner)"
            )
        self.num_auto_freezes = 0
        self.num_restores = 0
        self.num_spare_restores = 0
        self.newly_frozen: list[tuple[int, int]] = []
        self._operator_frozen: set[tuple[int, int]] = set()
        self._known_frozen: set[tuple[int, int]] = set()
        if self.blocks:
            self._apply(ExpertOp(ExpertOpKind.SET_FREEZE_AFTER, freeze_after=freeze_after))

    @classmethod
    def of_model(
        cls,
        model: nn.Module,
        freeze_after: int = DEFAULT_FREEZE_AFTER,
        *,
        model_dir: str | None = None,
        auto_restore: bool = False,
        twins: Sequence[nn.Module] = (),
        placement: ExpertPlacer | None = None,
        peers: Callable[[ExpertOp], None] | None = None,
    ) -> ExpertMonitor:
        """The monitor of every `SparseMoeBlock` in `model.model.layers` (may be empty);
        `twins`: the other resident weight sets of the same model (see `twin_blocks`);
        `placement`, `peers`: as the constructor's."""
        blocks = moe_blocks(model)
        twin_blocks = {
            layer_id: [moe_blocks(twin)[layer_id] for twin in twins] for layer_id in blocks
        }
        return cls(
            blocks,
            freeze_after,
            model_dir=model_dir,
            auto_restore=auto_restore,
            twin_blocks=twin_blocks,
            placement=placement,
            peers=peers,
        )

    @classmethod
    def of_runner(
        cls,
        runner: ModelRunner,
        freeze_after: int = DEFAULT_FREEZE_AFTER,
        *,
        model_dir: str | None = None,
        auto_restore: bool = False,
    ) -> ExpertMonitor:
        """The monitor of a runner's model (`of_model`), its other weight sets as twins, its
        load-aware placer, and, for a `TensorParallelRunner`, its workers as peers."""
        peers = runner.send_expert_op if isinstance(runner, TensorParallelRunner) else None
        return cls.of_model(
            runner.model,
            freeze_after,
            model_dir=model_dir,
            auto_restore=auto_restore,
            twins=[m for m in runner.models.values() if m is not runner.model],
            placement=runner.expert_placer,
            peers=peers,
        )

    @property
    def num_experts(self) -> int:
        return next(iter(self.blocks.values())).config.num_experts if self.blocks else 0

    @property
    def num_spare_experts(self) -> int:
        """Spare weight slots per MoE layer (0 = none)."""
        return max((block.num_spare_experts for block in self.blocks.values()), default=0)

    def read(self, num_steps: int = -1) -> ExpertStats:
        """Copy the device counters to the host (one sync per layer), log newly frozen experts
        and, with `auto_restore`, restore them (then read again)."""
        stats = self._read(num_steps)
        if not (self.auto_restore and self.newly_frozen):
            return stats
        newly_frozen = self.newly_frozen
        restored = [key for key in newly_frozen if self._try_restore(*key)]
        if restored:
            stats = self._read(num_steps)
            self.newly_frozen = newly_frozen
        return stats

    def _try_restore(self, layer_id: int, expert_id: int) -> bool:
        """`restore`, logging instead of raising when the checkpoint cannot give the weights
        (missing or unreadable files, dummy weights); the table then is unchanged."""
        try:
            self.restore(layer_id, expert_id)
        except Exception:  # noqa: BLE001 - a failed reload must never stop the engine's reads
            logger.exception(
                "cannot restore MoE expert %d.%d; it stays frozen", layer_id, expert_id
            )
            return False
        return True

    def _read(self, num_steps: int) -> ExpertStats:
        layers = []
        self.newly_frozen = []
        for layer_id, block in self.blocks.items():
            state = block.expert_state()
            host = torch.stack(
                [state.num_tokens, state.num_anomalous, state.frozen.long()]
            ).tolist()  # [3, E]
            num_tokens = tuple(int(v) for v in host[0])
            frozen = tuple(bool(v) for v in host[2])
            for expert_id, is_frozen in enumerate(frozen):
                key = (layer_id, expert_id)
                if is_frozen and key not in self._known_frozen:
                    self._known_frozen.add(key)
                    if key not in self._operator_frozen:
                        self.num_auto_freezes += 1
                        self.newly_frozen.append(key)
                        logger.warning(
                            "MoE expert frozen: layer %d expert %d gave non-finite outputs in "
                            "%d consecutive checks; routing around it",
                            layer_id,
                            expert_id,
                            self.freeze_after,
                        )
                elif not is_frozen:
                    self._known_frozen.discard(key)
            layers.append(
                ExpertLayerStats(
                    layer_id=layer_id,
                    num_tokens=num_tokens,
                    num_anomalous=tuple(int(v) for v in host[1]),
                    frozen=frozen,
                    imbalance=imbalance_of(num_tokens),
                    **_slot_stats(block),
                )
            )
        return ExpertStats(
            layers=tuple(layers),
            num_experts=self.num_experts,
            freeze_after=self.freeze_after,
            num_auto_freezes=self.num_auto_freezes,
            num_restores=self.num_restores,
            num_steps=num_steps,
            num_spare_experts=self.num_spare_experts,
            num_spare_restores=self.num_spare_restores,
            placement=self.placement.stats() if self.placement is not None else None,
        )

    def _apply(self, op: ExpertOp) -> int | None:
        """Apply `op` here, then hand it to the other ranks (when it did not raise)."""
        result = apply_expert_op(self.blocks, op)
        if self.peers is not None:
            self.peers(op)
        return result

    def _state(self, layer_id: int, expert_id: int) -> ExpertState:
        block = self.blocks.get(layer_id)
        if block is None:
            raise InvalidParameterError(
                "layer", f"layer {layer_id} is not an MoE layer (MoE layers: {list(self.blocks)})"
            )
        num_experts = block.config.num_experts
        if not 0 <= expert_id < num_experts:
            raise InvalidParameterError("expert", f"expert must be in [0, {num_experts})")
        return block.expert_state()

    def freeze(self, layer_id: int, expert_id: int) -> None:
        """Mask an expert in its layer's router from the next forward on (operator command).

        Raises:
            InvalidParameterError: no such MoE layer or expert, or freezing it would leave
                fewer than top_k experts.
        """
        state = self._state(layer_id, expert_id)
        with torch.inference_mode():  # the state may be inference tensors (made in a forward)
            frozen = state.frozen.clone()
            frozen[expert_id] = True
            if int(frozen.sum()) > frozen.numel() - state.top_k:
                raise InvalidParameterError(
                    "expert", f"freezing it would leave fewer than top_k={state.top_k} experts"
                )
        self._apply(ExpertOp(ExpertOpKind.FREEZE, layer_id, expert_id))
        self._operator_frozen.add((layer_id, expert_id))
        logger.warning("MoE expert frozen by an operator: layer %d expert %d", layer_id, expert_id)

    def unfreeze(self, layer_id: int, expert_id: int) -> None:
        """Route to the expert again and clear its anomaly streak (operator command).

        Raises:
            InvalidParameterError: no such MoE layer or expert.
        """
        self._state(layer_id, expert_id)
        self._apply(ExpertOp(ExpertOpKind.UNFREEZE, layer_id, expert_id))
        self._operator_frozen.discard((layer_id, expert_id))
        logger.warning("MoE expert unfrozen: layer %d expert %d", layer_id, expert_id)

    def restore(self, layer_id: int, expert_id: int, model_dir: str | None = None) -> int:
        """Reload the expert's weights from the checkpoint in `model_dir` (default: the
        monitor's), then unfreeze it. With a free spare slot in the layer the weights go there
        and the routing table is switched to it (the old slot becomes a spare); otherwise
        they overwrite the expert's current slot.

        Returns:
            The expert's physical slot afterwards.

        Raises:
            InvalidParameterError: no such MoE layer or expert, or no checkpoint directory.
            UnsupportedModelError: the checkpoint lacks that expert's weights.
            ModelNotFoundError: the directory holds no safetensors weights (dummy weights).
        """
        self._state(layer_id, expert_id)
        model_dir = model_dir if model_dir is not None else self.model_dir
        if model_dir is None:
            raise InvalidParameterError("model_dir", "no checkpoint directory to restore from")
        block = self.blocks[layer_id]
        slots = block.expert_slots()
        into_spare = slots is not None and slots.next_free_slot() is not None
        old_slot = block.physical_slot(expert_id)
        slot = self._apply(ExpertOp(ExpertOpKind.RESTORE, layer_id, expert_id, model_dir=model_dir))
        assert slot is not None, "a restore gives the expert's slot"
        if into_spare:
            self.num_spare_restores += 1
            logger.warning(
                "MoE expert restored from the checkpoint into spare slot %d: layer %d expert %d "
                "(slot %d is now a spare)",
                slot,
                layer_id,
                expert_id,
                old_slot,
            )
        else:
            for twin in self.twin_blocks.get(layer_id, ()):
                quantize_experts_(twin, block.w13, block.w2, experts=(expert_id,))
            logger.warning(
                "MoE expert restored from the checkpoint: layer %d expert %d", layer_id, expert_id
            )
        self.num_restores += 1
        self.unfreeze(layer_id, expert_id)
        return slot


def _slot_stats(block: nn.Module) -> dict:
    """The `ExpertLayerStats` slot fields of a block (host bookkeeping, no device read)."""
    slots = block.expert_slots()
    if slots is None:
        return {"expert_slots": tuple(range(block.config.num_experts))}
    return {
        "expert_slots": tuple(slots.slot_of),
        "num_free_slots": len(slots.free_slots),
        "num_relocated": slots.num_relocated,
    }
