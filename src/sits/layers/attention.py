"""Self-attention block: fused QKV projection, optional per-head q/k RMSNorm, RoPE, paged
attention through the step's backend, output projection.

Invariants: the module holds no KV state; it reads and writes `ctx.kv_caches[layer_idx]` through
`ctx.attn_backend`, which writes the step's K/V before attending. q/k norms (Qwen3) are applied
per head before RoPE, as in Hugging Face Qwen3; on CUDA with Triton both run in one kernel
(`RotaryEmbedding.forward` with `qk_norm`), in place on the q/k views of the QKV output.

Tensor parallelism (`shard_heads`, Megatron-LM's layout): rank r holds q heads
[r * H / size, (r + 1) * H / size); KV heads are split the same way when size divides them, or
replicated when size is a multiple of them (rank r holds KV head r * K // size, the one its q
heads read); the fused qkv_proj holds those heads' rows, o_proj (`RowParallelLinear`) the
matching input columns, and sums its output over the ranks. q/k norms act per head: unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from sits.core.errors import InvalidParameterError
from sits.layers.forward_context import ForwardContext
from sits.layers.linear import QKVLinear, RowParallelLinear
from sits.layers.norm import RMSNorm
from sits.layers.rotary import RopeConfig, RotaryEmbedding
from sits.parallel import SINGLE, TensorParallel


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Shape and options of one attention block.

    Attributes:
        hidden_size: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (num_heads % num_kv_heads == 0).
        head_dim: size of one head.
        rope: rotary embedding parameters.
        qkv_bias: q/k/v projections have a bias (Qwen2; Llama/Qwen3 `attention_bias`).
        o_bias: the output projection has a bias.
        qk_norm: RMSNorm over each q/k head before RoPE (Qwen3), with eps `rms_norm_eps`.
        rms_norm_eps: eps of the q/k norms.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rms_norm_eps: float = 1e-6


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The heads one tensor-parallel rank holds.

    Attributes:
        num_heads: q heads of this rank, from q head `first_head`.
        num_kv_heads: KV heads of this rank, from KV head `first_kv_head`.
    """

    num_heads: int
    first_head: int
    num_kv_heads: int
    first_kv_head: int


def shard_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel = SINGLE) -> HeadShard:
    """Rank tp.rank's q and KV heads (module docstring).

    Raises:
        InvalidParameterError: tp.size does not divide num_heads, or neither divides nor is a
            multiple of num_kv_heads (the message gives the numbers).
    """
    local_heads = tp.split(num_heads, "num_attention_heads")
    if num_kv_heads % tp.size == 0:
        local_kv = num_kv_heads // tp.size
        first_kv = tp.rank * local_kv
    elif tp.size % num_kv_heads == 0:
        local_kv = 1
        first_kv = tp.rank * num_kv_heads // tp.size
    else:
        raise InvalidParameterError(
            "tensor_parallel_size",
            f"tensor parallel size {tp.size} neither divides num_key_value_heads "
            f"({num_kv_heads}) nor is a multiple of it",
        )
    return HeadShard(local_heads, tp.rank * local_heads, local_kv, first_kv)


class Attention(nn.Module):
    """Multi-head causal self-attention with grouped-query heads over the paged KV cache.

    Attributes:
        layer_idx: which `ctx.kv_caches` entry this layer uses.
        num_heads, num_kv_heads, head_dim: head layout (this rank's heads).
        scale: softmax scale, head_dim ** -0.5.
    """

    def __init__(
        self,
        config: AttentionConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Build the projections, q/k norms and RoPE of one layer.

        Args:
            config: the block's shape and options.
            layer_idx: index of this layer's KV cache in `ctx.kv_caches`.
            rotary_emb: a RotaryEmbedding of `config.rope` shared by all layers (one cos/sin
                cache per model); None = this layer builds its own.
            tp: the tensor-parallel group (its rank's heads, `shard_heads`).

        Raises:
            InvalidParameterError: tp.size does not fit the heads (`shard_heads`).
        """
        super().__init__()
        assert config.num_heads % config.num_kv_heads == 0, "heads must group evenly"
        heads = shard_heads(config.num_heads, config.num_kv_heads, tp)
        self.layer_idx = layer_idx
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = QKVLinear(
            config.hidden_size, heads.num_heads, heads.num_kv_heads, config.head_dim,
            bias=config.qkv_bias,
            first_head=heads.first_head, total_heads=config.num_heads,
            first_kv_head=heads.first_kv_head, total_kv_heads=config.num_kv_heads,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.o_bias, tp,
            "num_attention_heads * head_dim",
        )  # fmt: skip
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        if rotary_emb is None:
            rotary_emb = RotaryEmbedding(config.rope)
        assert rotary_emb.rope == config.rope, "a shared RotaryEmbedding must match the config"
        self.rotary_emb = rotary_emb

    def forward(self, positions: Tensor, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        """Attend over the step's tokens and the sequences' cached tokens.

        Args:
            positions: [num_tokens] int64, each token's position in its sequence.
            hidden: [num_tokens, hidden_size].
            ctx: the step's metadata, KV caches and attention backend.

        Returns:
            [num_tokens, hidden_size], hidden's dtype (summed over the tensor-parallel ranks).
        """
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)  # [T, H, D], [T, K, D], [T, K, D]
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = (self.q_norm, self.k_norm)
        # q and k are views of this step's fresh QKV output: the Triton path rotates in place.
        q, k = self.rotary_emb(positions, q, k, qk_norm=qk_norm, in_place=True)
        out = ctx.attn_backend.forward(
            q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata, self.scale
        )  # [num_tokens, num_heads, head_dim] (this rank's heads)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
