"""Kernel warm-up at runner setup: eager dummy steps of every prefill shape class, so Triton
compiles their kernels before the server takes traffic instead of stalling a live step.

Why: decode CUDA graphs compile the decode-shaped kernels while they are captured, but steps
with prompt tokens run eagerly, and Triton compiles a kernel the first time it sees a new
combination of its compile-time keys. Without a warm-up, the first minutes of a loaded server
stall for seconds whenever a step of a new shape class arrives, and every running request's
next token waits. The keys that vary with a step's shape:
- the fused MoE's tuned launch config, one per token-count key 1, 2, 4, ..., 8192 of
  `kernels/configs/*.json` (a step of T tokens takes the smallest key >= T: one bucket per
  power of two), and with it the GEMMs' BLOCK_* constexprs and the alignment's block size;
- the MoE alignment's PAIRS = next_power_of_2(T * top_k) (single-program path, small steps)
  and the routing kernel's tokens per program (1 up to 512 tokens, 8 above);
- Triton's specialisation of integer arguments: a value divisible by 16 and a value equal to
  1 compile separately from other values (e.g. the fp8 calibration's num_tokens);
- the prefill attention's SKIP_SINGLE (a step mixing prompt chunks with decodes) and the decode
  kernel's split count (SPLIT on or off, the combine kernel's BLOCK_SPLITS =
  next_power_of_2(splits), and the divisibility of the split count and of the partial
  buffers' strides num_heads * splits), which eager mixed steps pick by a heuristic.

Which steps (`warmup_token_counts`, `decode_split_counts`): for each power of two p up to the
step budget B (`InputBuffers.max_num_tokens`), a step of p tokens (the top of bucket p, and
for p >= 16 the multiple-of-16 variant) and one of p - 1 (the non-multiple-of-16 variant; for
p < 16 it repeats p's keys except the alignment's PAIRS bucket when top_k is not a power of
two, and costs microseconds); B itself and, when B is not a power of two, a token count of the
other divisibility class in B's bucket. B = 8192 gives 26 steps, B = 2048 gives 22, B = 64
gives 12. Then a few tiny mixed steps (a 15-token prompt chunk and a decode sharing its
blocks): one per decode split class when the attention backend has a `config` with
`decode_num_splits` (Triton: 8 steps for 32 query heads), else one; the classes are those of
the heads the kernels see, this tensor-parallel rank's (`local_num_heads`). Counts above 8192
need no more steps: every key above the largest takes the largest config, and the large-step
alignment path has no token-count constexpr.

Invariants (the warm-up leaves no trace):
- It must run when no request owns a KV block (at setup, before the scheduler exists): each
  dummy sequence writes its K/V into blocks 1.. (never the null block 0), and contents of free
  blocks are never read (a block is written before any request reads it), so garbage there is
  harmless. Nothing of the block pool or prefix cache is touched: the warm-up does not know
  them.
- Every MoE layer's expert counters and health state (`ExpertState`, and the spare slots'
  non-finite flags) are snapshotted before and restored after, in place (the steps run
  unmasked, as real eager steps do, so their routing kernel variant compiles), and fp8 KV
  scales are restored to their (uncalibrated) values: the first real prefill calibrates them.
- Forward and logits only: no sampling, no random generator is drawn from, no runner state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sits.core.plan import ScheduledRequest, StepPlan
from sits.kernels.kv_quant_ref import QuantizedKVCache
from sits.layers.attention import Attention
from sits.layers.forward_context import AttentionBackend, ForwardContext
from sits.layers.moe import SparseMoeBlock
from sits.runner.input_buffers import InputBuffers

logger = logging.getLogger(__name__)

MIXED_CHUNK_TOKENS = 15  # prompt tokens of a mixed warm-up step (plus one decode token)
_TOKEN_STRIDE = 7919  # dummy token ids: position * stride mod vocab (spread over experts)


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What `warm_up_kernels` ran.

    Attributes:
        token_counts: tokens of each dummy step, in run order (prefill steps, then the mixed
            steps).
        elapsed_s: wall seconds of the whole warm-up (device synchronised at the end).
        prefill_tokens_per_s: tokens per second of one more full-budget prefill step, run
            once its kernels are compiled (forward and logits, device synchronised around
            it): the overload estimate's first measurement (`sits.engine.stats`); None when
            no prefill step fit.
    """

    token_counts: tuple[int, ...]
    elapsed_s: float
    prefill_tokens_per_s: float | None = None

    @property
    def num_steps(self) -> int:
        """Dummy steps (forward passes) run."""
        return len(self.token_counts)


def warmup_token_counts(max_num_tokens: int) -> list[int]:
    """Token counts of the prefill warm-up steps for a step budget (see the module docstring).

    Every power of two p <= max_num_tokens and p - 1 (when >= 1); max_num_tokens itself; and,
    when max_num_tokens is not a power of two, one count of the other divisibility-by-16 class
    in (largest power of two, max_num_tokens] where one exists. Ascending, no repeats.

    Raises:
        ValueError: max_num_tokens < 1.
    """
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    counts = {max_num_tokens}
    power = 1
    while power <= max_num_tokens:
        counts.update((power, power - 1))
        top_power = power
        power *= 2
    if max_num_tokens != top_power:
        if max_num_tokens % 16 == 0:
            partner = max_num_tokens - 1
        else:
            partner = max_num_tokens - max_num_tokens % 16
        if partner > top_power:
            counts.add(partner)
    counts.discard(0)
    return sorted(counts)


def decode_split_counts(max_splits: int, num_heads: int) -> list[int]:
    """One decode split count per compile class of the decode kernels, ascending.

    The class of s splits: s == 1 (no split, no combine pass), s % 16 == 0 and
    (num_heads * s) % 16 == 0 (Triton's divisibility specialisation of the split count and of
    the partial buffers' strides), and next_power_of_2(s) (the combine kernel's BLOCK_SPLITS);
    the smallest s of each class in [1, max_splits] is kept. 32 heads, 32 splits:
    [1, 2, 3, 5, 9, 16, 17, 32].
    """
    chosen: dict[tuple, int] = {}
    for splits in range(1, max_splits + 1):
        key = (
            splits == 1,
            splits % 16 == 0,
            (num_heads * splits) % 16 == 0,
            1 << (splits - 1).bit_length(),
        )
        chosen.setdefault(key, splits)
    return sorted(chosen.values())


def local_num_heads(model: nn.Module) -> int:
    """Query heads of each attention layer on this tensor-parallel rank: what the attention
    kernels see (the checkpoint's heads / tensor_parallel_size; all of them with one rank).

    Raises:
        ValueError: the model has no `Attention` layer.
    """
    for module in model.modules():
        if isinstance(module, Attention):
            return module.num_heads
    raise ValueError("the model has no attention layer")


def _num_blocks(kv_cache: Tensor | QuantizedKVCache) -> int:
    """Blocks of one layer's cache ([2, num_blocks, block_size, kv_heads, head_dim])."""
    data = kv_cache.data if isinstance(kv_cache, QuantizedKVCache) else kv_cache
    return data.shape[1]


@dataclass(slots=True)
class _StepBuilder:
    """Makes the dummy plans: sequences of at most `max_seq_tokens` tokens whose blocks are
    taken in turn from 1 .. num_blocks - 1 (wrapping around when the cache is smaller than the
    step: the tokens then overwrite each other's slots, harmless for a dummy step)."""

    block_size: int
    num_blocks: int
    max_seq_tokens: int
    max_num_seqs: int
    vocab_size: int

    def _blocks(self, first: int, num_tokens: int) -> list[int]:
        num = -(-num_tokens // self.block_size)
        usable = self.num_blocks - 1
        return [1 + (first + j) % usable for j in range(num)]

    def _tokens(self, start: int, num_tokens: int) -> list[int]:
        return [(start + i) * _TOKEN_STRIDE % self.vocab_size for i in range(num_tokens)]

    def prefill(self, num_tokens: int) -> StepPlan | None:
        """A step of `num_tokens` prompt tokens from position 0 in as few sequences as fit,
        or None when they do not fit in max_num_seqs sequences."""
        scheduled = []
        next_block = 0
        for start in range(0, num_tokens, self.max_seq_tokens):
            length = min(self.max_seq_tokens, num_tokens - start)
            blocks = self._blocks(next_block, length)
            next_block += len(blocks)
            scheduled.append(
                ScheduledRequest(
                    f"warmup-{len(scheduled)}", self._tokens(start, length), 0, blocks, True
                )
            )
        return StepPlan(scheduled) if len(scheduled) <= self.max_num_seqs else None

    def mixed(self, max_num_tokens: int) -> StepPlan | None:
        """A prompt chunk at position 0 and a decode at the position after it, sharing the
        chunk's blocks (the decode attends to the chunk's K/V, written in the same step), or
        None when the budget, the sequences or the context length are too small."""
        chunk = min(MIXED_CHUNK_TOKENS, max_num_tokens - 1, self.max_seq_tokens - 1)
        if chunk < 2 or self.max_num_seqs < 2:
            return None
        blocks = self._blocks(0, chunk + 1)
        tokens = self._tokens(0, chunk + 1)
        return StepPlan(
            [
                ScheduledRequest("warmup-chunk", tokens[:chunk], 0, blocks, True),
                ScheduledRequest("warmup-decode", tokens[chunk:], chunk, blocks, True),
            ]
        )


def _mixed_backends(attn_backend: AttentionBackend, num_heads: int) -> list[AttentionBackend]:
    """The backend once per decode split class when it has a dataclass `config` with
    `decode_num_splits` and `decode_max_splits` (Triton), else the backend itself."""
    config = getattr(attn_backend, "config", None)
    if not dataclasses.is_dataclass(config):
        return [attn_backend]
    if not {"decode_num_splits", "decode_max_splits"} <= {
        f.name for f in dataclasses.fields(config)
    }:
        return [attn_backend]
    return [
        type(attn_backend)(dataclasses.replace(config, decode_num_splits=splits))
        for splits in decode_split_counts(config.decode_max_splits, num_heads)
    ]


@dataclass(slots=True)
class _StateSnapshot:
    """Copies of the state a forward changes besides the KV blocks: every MoE layer's expert
    counters and health (and spare slots' flags), and fp8 KV scales."""

    tensors: list[tuple[Tensor, Tensor]]  # (live tensor, saved copy)

    @classmethod
    def take(cls, model: nn.Module, kv_caches: list) -> _StateSnapshot:
        live: list[Tensor] = []
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                state = module.expert_state()
                live += [state.num_tokens, state.num_anomalous, state.streak, state.frozen]
                live += [state.checked, state.anomalous, state.freeze_after]
                slots = module.expert_slots()
                if slots is not None:
                    live.append(slots.nonfinite)
        for cache in kv_caches:
            if isinstance(cache, QuantizedKVCache) and cache.kind == "fp8":
                live.append(cache.scales)  # [2, num_kv_heads]: 0 = not calibrated yet
        return cls([(tensor, tensor.clone()) for tensor in live])

    def restore(self) -> None:
        for tensor, saved in self.tensors:
            tensor.copy_(saved)


@torch.inference_mode()
def warm_up_kernels(
    model: nn.Module,
    buffers: InputBuffers,
    kv_caches: list,
    attn_backend: AttentionBackend,
    *,
    max_model_len: int,
    max_num_tokens: int | None = None,
) -> WarmupReport:
    """Run the eager dummy steps of the module docstring, restore the state they changed, and
    synchronise the device.

    Call only while no request owns a KV block (at runner setup): the steps write K/V into
    blocks 1 .. num_blocks - 1.

    Args:
        model: the decoder, this rank's shard (forward(input_ids, positions, ctx) ->
            [T, hidden]; compute_logits; `arch.vocab_size`; its `Attention` layers' heads).
        buffers: the runner's persistent inputs (rewritten by every step anyway).
        kv_caches: one cache per layer (plain tensors or `QuantizedKVCache`s).
        attn_backend: the runner's attention backend.
        max_model_len: longest sequence (a dummy sequence never exceeds it).
        max_num_tokens: step budget; None = buffers.max_num_tokens.

    Returns:
        WarmupReport with the token count of each step run and the seconds taken.
    """
    start = time.perf_counter()
    budget = buffers.max_num_tokens if max_num_tokens is None else max_num_tokens
    assert budget <= buffers.max_num_tokens, "warm-up budget beyond the input buffers"
    builder = _StepBuilder(
        block_size=buffers.block_size,
        num_blocks=_num_blocks(kv_caches[0]),
        max_seq_tokens=min(max_model_len, buffers.max_blocks_per_seq * buffers.block_size),
        max_num_seqs=buffers.max_num_seqs,
        vocab_size=model.arch.vocab_size,
    )
    snapshot = _StateSnapshot.take(model, kv_caches)
    steps: list[tuple[StepPlan, AttentionBackend]] = []
    for num_tokens in warmup_token_counts(budget):
        plan = builder.prefill(num_tokens)
        if plan is None:
            logger.warning("warm-up: %d tokens do not fit in one step; skipped", num_tokens)
            continue
        steps.append((plan, attn_backend))
    mixed = builder.mixed(budget)
    if mixed is not None:
        backends = _mixed_backends(attn_backend, local_num_heads(model))
        steps += [(mixed, backend) for backend in backends]
    token_counts = []

    def run(plan: StepPlan, backend: AttentionBackend) -> None:
        inputs = buffers.prepare(plan)
        ctx = ForwardContext(inputs.metadata, kv_caches, backend, token_mask=inputs.token_mask)
        hidden = model(inputs.input_ids, inputs.positions, ctx)  # [num_tokens, hidden]
        model.compute_logits(hidden[inputs.last_token_indices])  # [num_seqs, vocab] float32

    for plan, backend in steps:
        run(plan, backend)
        token_counts.append(plan.num_scheduled_tokens)
    rate = None
    full = max((plan for plan, _ in steps), key=lambda p: p.num_scheduled_tokens, default=None)
    if full is not None:
        _synchronize(buffers.device)
        step_start = time.perf_counter()
        run(full, attn_backend)
        _synchronize(buffers.device)
        rate = full.num_scheduled_tokens / max(time.perf_counter() - step_start, 1e-9)
    snapshot.restore()
    _synchronize(buffers.device)
    elapsed_s = time.perf_counter() - start
    logger.info(
        "warmed up %d prefill shapes in %.1f s (a %d-token prefill step: %s tok/s)",
        len(token_counts), elapsed_s, full.num_scheduled_tokens if full else 0,
        f"{rate:,.0f}" if rate else "-",
    )  # fmt: skip
    return WarmupReport(tuple(token_counts), elapsed_s, rate)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
