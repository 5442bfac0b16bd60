"""Roofline of an engine step: the bytes it must read, the FLOPs it must do, the ideal time.

Model (per step of T tokens over the step's sequences; weights in their dtype, b bytes each):
- weights read: every dense weight once (attention projections, norms, biases, routers, dense
  MLPs, the final norm), the T embedding rows, the LM head when the step samples a token, and
  per MoE layer the experts touched: E * (1 - (1 - k/E)^T) distinct experts expected when T
  tokens each pick k of E experts uniformly (each expert is missed by one token with
  probability 1 - k/E);
- KV read: for each sequence every key and value up to its last token this step
  (start_position + num_tokens), all layers, at the KV cache's element size;
- FLOPs: 2 * (matmul weights a token uses) * T, the LM head's 2 * vocab * hidden per sampled
  row, and causal attention 4 * heads * head_dim per (query, key) pair per layer (QK^T and PV);
- ideal time = max(bytes / bandwidth, FLOPs / matmul rate) (Williams et al., "Roofline",
  CACM 2009); the fraction achieved = ideal time / measured time.
Activations, KV writes and norms' FLOPs are left out (small beside the terms above).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch stays unimported: the bench client runs without it
    from sits.layers.decoder import DecoderConfig


@dataclass(frozen=True, slots=True)
class Hardware:
    """The two ceilings of a roofline.

    Attributes:
        name: what they belong to.
        bandwidth_bytes_s: memory bandwidth in bytes/s.
        matmul_flops_s: dense matrix rate in FLOP/s.
        source: where the numbers come from.
    """

    name: str
    bandwidth_bytes_s: float
    matmul_flops_s: float
    source: str


H200 = Hardware(
    name="NVIDIA H200 (measured)",
    bandwidth_bytes_s=4.2e12,
    matmul_flops_s=790e12,
    source="one H200, torch 2.11, 2026-11-29: device-to-device copy 4.21 TB/s (bytes read + "
    "written), bf16 8192^3 matmul 792 TFLOP/s (shared/notes/h200-calibration.md)",
)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that set a decoder's bytes and FLOPs (counts of parameters, not bytes).

    Attributes:
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size: as in the HF
            config.
        intermediate_size: width of the dense MLP (used by the dense layers only).
        num_moe_layers: layers whose MLP is sparse (0 = dense model).
        num_experts, top_k, moe_intermediate_size: E, k and one expert's width.
        tie_word_embeddings, qkv_bias, o_bias, qk_norm, mlp_bias: the family's options.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    num_moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_decoder_config(cls, config: DecoderConfig) -> ModelShape:
        """The shape of a model built from `config`."""
        attn = config.attention
        moe = config.moe
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            vocab_size=config.vocab_size,
            intermediate_size=config.intermediate_size,
            num_moe_layers=len(config.moe_layer_ids) if moe is not None else 0,
            num_experts=moe.num_experts if moe is not None else 0,
            top_k=moe.top_k if moe is not None else 0,
            moe_intermediate_size=moe.intermediate_size if moe is not None else 0,
            tie_word_embeddings=config.tie_word_embeddings,
            qkv_bias=attn.qkv_bias,
            o_bias=attn.o_bias,
            qk_norm=attn.qk_norm,
            mlp_bias=config.mlp_bias,
        )

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attn_matmul_params(self) -> int:
        """Per layer: q, k, v and o projection weights."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return h * q + 2 * h * kv + q * h

    @property
    def layer_small_params(self) -> int:
        """Per layer: the two RMSNorms, q/k norms and attention biases."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n = 2 * self.hidden_size
        n += 2 * self.head_dim if self.qk_norm else 0
        n += q + 2 * kv if self.qkv_bias else 0
        n += self.hidden_size if self.o_bias else 0
        return n

    @property
    def dense_mlp_matmul_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        bias = 2 * self.intermediate_size + self.hidden_size if self.mlp_bias else 0
        return self.dense_mlp_matmul_params + bias

    @property
    def expert_params(self) -> int:
        """One expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.num_experts * self.hidden_size

    @property
    def total_params(self) -> int:
        """Every parameter of the model (a tied LM head counted once)."""
        embed = self.vocab_size * self.hidden_size
        per_layer = self.attn_matmul_params + self.layer_small_params
        return (
            embed * (1 if self.tie_word_embeddings else 2)
            + self.hidden_size
            + self.num_layers * per_layer
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * (self.router_params + self.num_experts * self.expert_params)
        )

    def kv_elems_per_token(self) -> int:
        """Key and value elements one token keeps in the cache over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes.

    Attributes:
        num_tokens: tokens computed (prompt chunks + decodes).
        num_seqs: sequences in the step.
        num_sampled: rows sent through the LM head.
        num_kv_tokens: sum over sequences of start_position + num_tokens (keys read).
        num_attn_pairs: causal (query, key) pairs: per sequence n * s + n * (n + 1) / 2 for a
            chunk of n tokens starting at position s.
    """

    num_tokens: int
    num_seqs: int
    num_sampled: int
    num_kv_tokens: int
    num_attn_pairs: int


def step_shape(chunks: Iterable[tuple[int, int]], num_sampled: int) -> StepShape:
    """The StepShape of chunks given as (start_position, num_tokens) per sequence."""
    num_tokens = num_seqs = num_kv = num_pairs = 0
    for start, n in chunks:
        num_tokens += n
        num_seqs += 1
        num_kv += start + n
        num_pairs += n * start + n * (n + 1) // 2
    return StepShape(num_tokens, num_seqs, num_sampled, num_kv, num_pairs)


@dataclass(frozen=True, slots=True)
class StepCost:
    """Bytes and FLOPs of one step (or a sum of steps).

    Attributes:
        weight_bytes: dense weights, embedding rows and LM head read.
        expert_bytes: expected expert weights read.
        kv_bytes: KV cache read.
        flops: floating-point operations.
        ideal_s: max(bytes / bandwidth, flops / matmul rate), summed over steps.
        memory_s, compute_s: the two terms, summed over steps.
    """

    weight_bytes: float
    expert_bytes: float
    kv_bytes: float
    flops: float
    ideal_s: float
    memory_s: float
    compute_s: float

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.expert_bytes + self.kv_bytes


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """E * (1 - (1 - k/E)^T): distinct experts expected when T tokens each pick k of E."""
    if num_experts == 0 or num_tokens == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def step_cost(
    model: ModelShape,
    step: StepShape,
    hardware: Hardware,
    weight_elem_bytes: float,
    kv_elem_bytes: float,
) -> StepCost:
    """Bytes, FLOPs and ideal time of one step (formulas in the module docstring)."""
    m, t = model, step.num_tokens
    h = m.hidden_size
    dense_params = (
        m.num_layers * (m.attn_matmul_params + m.layer_small_params)
        + m.num_dense_layers * m.dense_mlp_params
        + m.num_moe_layers * m.router_params
        + h
        + min(t, m.vocab_size) * h
        + (m.vocab_size * h if step.num_sampled > 0 else 0)
    )
    touched = expected_experts_touched(m.num_experts, m.top_k, t)
    expert_params = m.num_moe_layers * touched * m.expert_params
    kv_bytes = step.num_kv_tokens * m.kv_elems_per_token() * kv_elem_bytes
    matmul_per_token = (
        m.num_layers * m.attn_matmul_params
        + m.num_dense_layers * m.dense_mlp_matmul_params
        + m.num_moe_layers * (m.router_params + m.top_k * m.expert_params)
    )
    flops = (
        2 * t * matmul_per_token
        + 2 * step.num_sampled * m.vocab_size * h
        + m.num_layers * 4 * m.num_heads * m.head_dim * step.num_attn_pairs
    )
    weight_bytes = dense_params * weight_elem_bytes
    expert_bytes = expert_params * weight_elem_bytes
    memory_s = (weight_bytes + expert_bytes + kv_bytes) / hardware.bandwidth_bytes_s
    compute_s = flops / hardware.matmul_flops_s
    return StepCost(
        weight_bytes, expert_bytes, kv_bytes, flops, max(memory_s, compute_s), memory_s, compute_s
    )


def sum_costs(costs: Iterable[StepCost]) -> StepCost:
    """The element-wise sum of step costs (ideal times add: steps run one after another)."""
    total = [0.0] * 7
    for cost in costs:
        for i, value in enumerate(
            (
                cost.weight_bytes,
                cost.expert_bytes,
                cost.kv_bytes,
                cost.flops,
                cost.ideal_s,
                cost.memory_s,
                cost.compute_s,
            )
        ):
            total[i] += value
    return StepCost(*total)


def roofline_json(
    label: str, costs: Sequence[StepCost], measured_s: float, hardware: Hardware
) -> dict[str, Any]:
    """A roofline summary of `costs` measured together in `measured_s` seconds.

    Returns:
        {"label", "num_steps", "measured_s", "ideal_s", "fraction" (ideal / measured),
         "bound" ("memory" or "compute": the larger summed term), "bytes_per_step",
         "flops_per_step", "weight_bytes", "expert_bytes", "kv_bytes", "flops",
         "achieved_bytes_s", "achieved_flops_s", "hardware": {...}}; per-step values are means.
    """
    total = sum_costs(costs)
    num_steps = len(costs)
    per = max(num_steps, 1)
    return {
        "label": label,
        "num_steps": num_steps,
        "measured_s": measured_s,
        "ideal_s": total.ideal_s,
        "fraction": total.ideal_s / measured_s if measured_s > 0 else None,
        "bound": "memory" if total.memory_s >= total.compute_s else "compute",
        "bytes_per_step": total.total_bytes / per,
        "flops_per_step": total.flops / per,
        "weight_bytes": total.weight_bytes,
        "expert_bytes": total.expert_bytes,
        "kv_bytes": total.kv_bytes,
        "flops": total.flops,
        "achieved_bytes_s": total.total_bytes / measured_s if measured_s > 0 else None,
        "achieved_flops_s": total.flops / measured_s if measured_s > 0 else None,
        "hardware": {
            "name": hardware.name,
            "bandwidth_bytes_s": hardware.bandwidth_bytes_s,
            "matmul_flops_s": hardware.matmul_flops_s,
            "source": hardware.source,
        },
    }
