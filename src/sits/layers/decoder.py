"""The pre-norm decoder shared by every model family: embeddings, N decoder layers, final norm,
LM head. Dense and MoE families differ only in each layer's MLP, chosen by `DecoderConfig`.

Invariants:
- Parameter names follow Hugging Face Llama's module tree with fused projections:
  model.layers.{i}.self_attn.qkv_proj, mlp.gate_up_proj, mlp.w13/w2 (MoE); the loader maps
  checkpoint names onto them.
- The residual stream is carried unnormalised between layers and added inside the next
  RMSNorm (`RMSNorm.forward(x, residual)`), which matches HF's `residual + out` in order.
- With tied embeddings `lm_head.weight` is the same Parameter as `embed_tokens.weight`.
- Logits are returned in float32.
- Tensor parallelism (`tp`, Megatron-LM's layout): every layer holds its rank's shard
  (attention heads, MLP / expert intermediate slices, vocabulary rows) and sums or gathers
  over the ranks itself; norms, RoPE and the router are replicated. `arch.num_kv_heads` is
  this rank's KV heads (the runner sizes a per-rank KV cache), while `config` keeps the
  checkpoint's shapes and logits come back whole ([N, vocab_size], the same on every rank).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor, nn

from sits.layers.attention import Attention, AttentionConfig, shard_heads
from sits.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sits.layers.forward_context import ForwardContext
from sits.layers.mlp import GatedMLP
from sits.layers.moe import MoeBackend, MoeConfig, SparseMoeBlock
from sits.layers.norm import RMSNorm
from sits.layers.rotary import RotaryEmbedding
from sits.parallel import SINGLE, TensorParallel


@dataclass(frozen=True, slots=True)
class ModelArch:
    """What the runner needs to size the KV cache and inputs.

    Attributes:
        num_layers: decoder layers (one KV cache tensor each).
        num_kv_heads: key/value heads per layer (this tensor-parallel rank's).
        head_dim: size of one head.
        hidden_size: model width.
        vocab_size: rows of the LM head (logits width).
        max_position_embeddings: the checkpoint's context length.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Everything needed to build a decoder model; made from an HF config by `models`.

    Attributes:
        architecture: the HF architecture name (e.g. "LlamaForCausalLM").
        vocab_size: token ids in [0, vocab_size).
        num_layers: decoder layers.
        attention: shape and options shared by every layer's attention.
        intermediate_size: width of the dense MLP.
        mlp_bias: the dense MLP projections have biases (Llama `mlp_bias`).
        rms_norm_eps: eps of every RMSNorm.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        max_position_embeddings: context length of the checkpoint.
        moe: expert configuration, or None for a dense model.
        moe_layer_ids: layers whose MLP is a SparseMoeBlock (the others are dense).
    """

    architecture: str
    vocab_size: int
    num_layers: int
    attention: AttentionConfig
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    mlp_bias: bool = False
    moe: MoeConfig | None = None
    moe_layer_ids: tuple[int, ...] = ()

    @property
    def hidden_size(self) -> int:
        return self.attention.hidden_size

    @property
    def arch(self) -> ModelArch:
        return ModelArch(
            num_layers=self.num_layers,
            num_kv_heads=self.attention.num_kv_heads,
            head_dim=self.attention.head_dim,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
        )


class DecoderLayer(nn.Module):
    """input_layernorm -> self_attn -> post_attention_layernorm -> mlp, residual around each."""

    def __init__(
        self,
        config: DecoderConfig,
        layer_idx: int,
        moe_backend: MoeBackend | None = None,
        rotary_emb: RotaryEmbedding | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.input_layernorm = RMSNorm(hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config.attention, layer_idx, rotary_emb, tp)
        self.post_attention_layernorm = RMSNorm(hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.moe is not None and layer_idx in config.moe_layer_ids:
            self.mlp = SparseMoeBlock(hidden_size, config.moe, moe_backend, tp=tp)
        else:
            self.mlp = GatedMLP(hidden_size, config.intermediate_size, config.mlp_bias, tp)

    def forward(
        self, positions: Tensor, hidden: Tensor, residual: Tensor | None, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor]:
        """One layer on the flat batch.

        Args:
            positions: [num_tokens] int64.
            hidden: [num_tokens, hidden_size], the previous layer's MLP output (or embeddings).
            residual: [num_tokens, hidden_size] residual stream before `hidden` is added, or
                None at the first layer.
            ctx: the step's forward context.

        Returns:
            (mlp output, residual stream), each [num_tokens, hidden_size]; the layer's output
            is their sum.
        """
        normed, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(positions, normed, ctx)  # [num_tokens, hidden_size]
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp(normed, ctx.token_mask), residual
        return self.mlp(normed), residual


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `model.` submodule)."""

    def __init__(
        self,
        config: DecoderConfig,
        moe_backend: MoeBackend | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary_emb = RotaryEmbedding(config.attention.rope)  # one cos/sin cache for all layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer_idx, moe_backend, rotary_emb, tp)
            for layer_idx in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size] final hidden states."""
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual: Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A causal LM over the flat, padding-free batch of one engine step.

    Subclasses (one per architecture, in `sits.models`) map an HF config to `DecoderConfig`.

    Attributes:
        config: the decoder configuration (the checkpoint's shapes, whatever the rank).
        tp: the tensor-parallel group this model is a shard of (SINGLE: the whole model).
        arch: the runner's shapes (`ModelArch`), with this rank's KV heads.
        model: embeddings, layers and final norm.
        lm_head: `ParallelLMHead` (Linear(hidden_size, vocab_size / tp.size, bias=False)),
            tied to the embeddings when the config says so.
    """

    def __init__(
        self,
        config: DecoderConfig,
        moe_backend: MoeBackend | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Build this rank's shard (meta device or not, as the caller's default device).

        Raises:
            InvalidParameterError: tp.size does not fit the heads, KV heads, an intermediate
                size or the vocabulary (the message gives the numbers).
        """
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, moe_backend, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()
        heads = shard_heads(config.attention.num_heads, config.attention.num_kv_heads, tp)
        # the runner's shapes with this rank's KV heads, fixed at build (read per request)
        self.arch = dataclasses.replace(config.arch, num_kv_heads=heads.num_kv_heads)

    def tie_weights(self) -> None:
        """Point lm_head.weight at the embedding matrix when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads of this tensor-parallel rank (all of them without tensor parallelism)."""
        return self.arch.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.attention.head_dim

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """Run the decoder over the step's tokens.

        Args:
            input_ids: [num_tokens] int64.
            positions: [num_tokens] int64, each token's position in its sequence.
            ctx: attention metadata, one KV cache per layer, attention backend.

        Returns:
            [num_tokens, hidden_size] final (normed) hidden states, model dtype.
        """
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[num_rows, hidden_size] hidden states -> [num_rows, vocab_size] float32 logits
        (gathered over the tensor-parallel ranks: whole on every rank)."""
        return self.lm_head.logits(hidden)
