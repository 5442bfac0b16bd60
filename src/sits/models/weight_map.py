"""Where each checkpoint (Hugging Face) tensor goes in our model: parameter, index into it and,
under tensor parallelism, the slice of the checkpoint tensor this rank keeps.

Weight names are mapped from Hugging Face checkpoints onto our fused parameters:
- self_attn.{q,k,v}_proj.{weight,bias} -> self_attn.qkv_proj (rows of part q, k, v);
- mlp.{gate,up}_proj.{weight,bias} -> mlp.gate_up_proj (rows of part gate, up);
- per-expert weights, hub style: mlp.experts.{e}.{gate,up,down}_proj.weight (Qwen3-MoE; also
  what transformers 5 `save_pretrained` writes) and block_sparse_moe.experts.{e}.{w1,w3,w2}.weight
  (Mixtral; w1 = gate, w3 = up, w2 = down) -> mlp.w13[e] rows gate/up, mlp.w2[e];
- fused experts as transformers 5 holds them in memory: mlp.experts.gate_up_proj [E, 2I, H]
  (gate rows first) -> mlp.w13, mlp.experts.down_proj [E, H, I] -> mlp.w2;
- block_sparse_moe.gate -> mlp.gate (router);
- a quantized module's tensors (scales, packed INT4) where its `checkpoint_target` says;
- everything else by identical name.

A tensor-parallel shard's layers say which rows / columns they hold
(`FusedLinear.part_shards`, `RowParallelLinear.col_shard`, `row_shard` of the vocabulary
layers, `SparseMoeBlock.inter_shard`); `TensorSlice` cuts the checkpoint tensor to them, per
fused part and per expert, before anything is copied; a quantized module names its own cut
of each of its tensors (`layers.quant.sharding`: scales and packed codes by whole blocks,
groups and words, per-row scales of a row-parallel layer whole). With expert parallelism
(`SparseMoeBlock.expert_shard`) a rank keeps whole experts: its experts' per-expert tensors go
to their local slots, the fused [E, ...] tensors are cut to its experts along dim 0, and the
per-expert tensors of the other ranks' experts are skipped (`is_skipped`).

Invariant: the mapping reads only module types and shapes, so it works on a meta-device model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sits.core.errors import UnsupportedModelError
from sits.layers.decoder import DecoderForCausalLM
from sits.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sits.layers.linear import FusedLinear, RowParallelLinear, Shard
from sits.layers.moe import SparseMoeBlock
from sits.layers.quant.apply import QUANT_LINEARS, QUANT_MOE_BLOCKS

QUANT_KINDS = (
    "weight_scale_inv", "weight_scale", "input_scale",  # FP8
    "weight_packed", "weight_shape", "qweight", "qzeros", "scales", "g_idx",  # INT4
)  # fmt: skip
_KIND = rf"(weight|bias|{'|'.join(QUANT_KINDS)})"
_QKV = re.compile(rf"^(.*\.self_attn)\.([qkv])_proj\.{_KIND}$")
_GATE_UP = re.compile(rf"^(.*\.mlp)\.(gate|up)_proj\.{_KIND}$")
_EXPERT_W13 = re.compile(rf"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|w1|w3)\.{_KIND}$")
_EXPERT_W2 = re.compile(rf"^(.*\.mlp)\.experts\.(\d+)\.(down_proj|w2)\.{_KIND}$")
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(\.weight)?$")
_SKIPPED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """The part of a checkpoint tensor one tensor-parallel rank keeps: along `dim` (of size
    `full` in the checkpoint), the ranges `keep`, concatenated in order."""

    dim: int
    full: int
    keep: tuple[slice, ...]

    @classmethod
    def of(cls, dim: int, shard: Shard) -> TensorSlice | None:
        """A layer's Shard along `dim`; None when it keeps everything (no slicing)."""
        return None if shard.is_whole else cls(dim, shard.full, (slice(shard.start, shard.stop),))

    def apply(self, tensor: Tensor, name: str) -> Tensor:
        """This rank's part of checkpoint `tensor` (a view for one range).

        Raises:
            UnsupportedModelError: the tensor's size along `dim` is not `full`.
        """
        if tensor.dim() <= self.dim or tensor.shape[self.dim] != self.full:
            raise UnsupportedModelError(
                f"checkpoint weight {name} has shape {tuple(tensor.shape)}, expected size "
                f"{self.full} in dimension {self.dim}"
            )
        parts = [tensor.narrow(self.dim, r.start, r.stop - r.start) for r in self.keep]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes: param[index] (index () = the whole parameter), after
    `shard` (this tensor-parallel rank's slice) and `convert(tensor, name)` when set
    (quantized modules: dtype checks, scale reshapes)."""

    param_name: str
    index: tuple[int | slice, ...]
    convert: Callable[[Tensor, str], Tensor] | None = None
    shard: TensorSlice | None = None


def checkpoint_target(
    model: DecoderForCausalLM, name: str
) -> tuple[str, tuple[int | slice, ...]] | None:
    """Where a checkpoint (Hugging Face) weight goes in `model`: (our parameter name, index
    into it; () = the whole parameter), or None for a skipped or unknown name.

    E.g. "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight",
    (slice(q_rows, q_rows + kv_rows),)). Works on a meta-device model.
    """
    if is_skipped(model, name):
        return None
    target = target_of(model, name, dict(model.named_parameters()))
    return None if target is None else (target.param_name, target.index)


def is_skipped(model: DecoderForCausalLM, name: str) -> bool:
    """Checkpoint tensors that carry no parameter: RoPE buffers, a tied LM head's copy, and
    with expert parallelism the per-expert tensors of experts another rank holds."""
    if _SKIPPED.search(name):
        return True
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return True
    return _is_other_ranks_expert(model, name)


def _is_other_ranks_expert(model: nn.Module, name: str) -> bool:
    """A per-expert checkpoint tensor of an expert this expert-parallel rank does not hold."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = _EXPERT_W13.match(name) or _EXPERT_W2.match(name)
    if match is None:
        return False
    module = submodule(model, match.group(1))
    if not isinstance(module, SparseMoeBlock) or module.expert_shard.is_whole:
        return False
    expert, shard = int(match.group(2)), module.expert_shard
    return expert < shard.full and not shard.start <= expert < shard.stop


def target_of(model: nn.Module, name: str, params: dict[str, Tensor]) -> WeightTarget | None:
    """Our parameter (and slice of it) for a checkpoint name; None if nothing matches."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    target: WeightTarget | None
    if match := _QKV.match(name):
        prefix, part, kind = match.groups()
        target = _fused_part(model, f"{prefix}.qkv_proj", "qkv".index(part), kind)
    elif match := _GATE_UP.match(name):
        prefix, part, kind = match.groups()
        target = _fused_part(model, f"{prefix}.gate_up_proj", ("gate", "up").index(part), kind)
    elif match := _EXPERT_W13.match(name):
        prefix, expert, part, kind = match.groups()
        target = _expert_part(
            model, prefix, int(expert), "up" if part in ("up_proj", "w3") else "gate", kind
        )
    elif match := _EXPERT_W2.match(name):
        prefix, expert, _, kind = match.groups()
        target = _expert_part(model, prefix, int(expert), "down", kind)
    elif match := _FUSED_EXPERTS.match(name):
        prefix, which, _ = match.groups()
        target = _fused_experts(model, prefix, "w13" if which == "gate_up_proj" else "w2")
    else:
        target = _plain_target(model, name)
    if target is None or target.param_name not in params:
        return None
    return target


def _fused_part(model: nn.Module, module_name: str, part: int, kind: str) -> WeightTarget | None:
    module = submodule(model, module_name)
    if isinstance(module, QUANT_LINEARS):
        return _quant_target(module_name, module.checkpoint_target(kind, part))
    if not isinstance(module, FusedLinear) or kind not in ("weight", "bias"):
        return None
    shard = TensorSlice.of(0, module.part_shards[part])
    return WeightTarget(f"{module_name}.{kind}", (module.part_rows(part),), shard=shard)


def _quant_target(module_name: str, found: tuple | None) -> WeightTarget | None:
    """A quantized module's (local name, index, convert, this rank's cut) as a WeightTarget."""
    if found is None:
        return None
    local, index, convert, cut = found
    shard = None if cut is None else TensorSlice.of(*cut)
    return WeightTarget(f"{module_name}.{local}", index, convert, shard)


def _plain_target(model: nn.Module, name: str) -> WeightTarget:
    """A name outside the fused patterns: a quantized single-part projection's tensor
    (o_proj, down_proj), else our parameter of the identical name, with this rank's slice
    of a row-parallel projection's columns or of the vocabulary rows."""
    prefix, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias", *QUANT_KINDS):
        return WeightTarget(name, ())
    module = submodule(model, prefix)
    if isinstance(module, QUANT_LINEARS):
        target = _quant_target(prefix, module.checkpoint_target(kind, 0))
        return target if target is not None else WeightTarget(name, ())
    if kind == "weight" and isinstance(module, RowParallelLinear):
        return WeightTarget(name, (), shard=TensorSlice.of(1, module.col_shard))
    if kind == "weight" and isinstance(module, VocabParallelEmbedding | ParallelLMHead):
        return WeightTarget(name, (), shard=TensorSlice.of(0, module.row_shard))
    return WeightTarget(name, ())


def _fused_experts(model: nn.Module, prefix: str, param: str) -> WeightTarget:
    """All experts of w13 or w2 at once: the whole parameter, or its logical slots 0 .. E-1
    when the block has spare slots; under tensor parallelism this rank's gate rows and up
    rows of the checkpoint's [E, 2I, H] gate_up_proj, its columns of [E, H, I] down_proj;
    under expert parallelism this rank's experts (dim 0) of both."""
    module = submodule(model, prefix)
    if isinstance(module, QUANT_MOE_BLOCKS):
        raise UnsupportedModelError(
            f"fused expert tensors ({prefix}.experts.gate_up_proj / down_proj) are not "
            "supported with quantized experts; per-expert tensors (experts.<e>.gate_proj ...) are"
        )
    index: tuple[int | slice, ...] = ()
    if isinstance(module, SparseMoeBlock) and module.num_spare_experts:
        index = (slice(0, module.config.num_experts),)
    if isinstance(module, SparseMoeBlock) and not module.expert_shard.is_whole:
        return WeightTarget(f"{prefix}.{param}", (), shard=TensorSlice.of(0, module.expert_shard))
    if not isinstance(module, SparseMoeBlock) or module.inter_shard.is_whole:
        return WeightTarget(f"{prefix}.{param}", index)
    inter = module.inter_shard
    if param == "w2":
        return WeightTarget(f"{prefix}.w2", index, shard=TensorSlice.of(2, inter))
    gate = slice(inter.start, inter.stop)
    up = slice(inter.full + inter.start, inter.full + inter.stop)
    return WeightTarget(f"{prefix}.w13", index, shard=TensorSlice(1, 2 * inter.full, (gate, up)))


def _expert_part(
    model: nn.Module, prefix: str, expert: int, part: str, kind: str = "weight"
) -> WeightTarget | None:
    """Expert `expert`'s gate rows / up rows of w13, or its w2 ("gate", "up", "down"), in its
    local slot (expert - expert_shard.start: expert itself without expert parallelism; None
    for an expert this rank does not hold); for FP8 experts also their scales
    (`checkpoint_target` of the quantized MoE blocks)."""
    module = submodule(model, prefix)
    if isinstance(module, QUANT_MOE_BLOCKS):
        return _quant_target(prefix, module.checkpoint_target(expert, part, kind))
    if not isinstance(module, SparseMoeBlock) or kind != "weight":
        return None
    shard = module.expert_shard
    if not shard.start <= expert < shard.stop:
        return None
    slot = expert - shard.start
    if part == "down":  # [H, I]: this rank's columns
        return WeightTarget(f"{prefix}.w2", (slot,), shard=TensorSlice.of(1, module.inter_shard))
    inter = module.intermediate_size
    rows = slice(inter, 2 * inter) if part == "up" else slice(0, inter)
    return WeightTarget(f"{prefix}.w13", (slot, rows), shard=TensorSlice.of(0, module.inter_shard))


def submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
