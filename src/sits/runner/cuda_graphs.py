"""CUDA graphs of the forward, replayed over the persistent inputs: `DecodeGraphs` (one per
decode batch size) and `MixedGraphs` (one per token bucket, for steps with prompt chunks; on
by default, `EngineConfig.mixed_step_cuda_graphs`), both a `_GraphSet`.

A decode step (every scheduled sequence has one new token) of n sequences replays the graph
of the smallest captured batch size >= n, after `InputBuffers.prepare(plan, pad_to_seqs=size)`
wrote the real inputs and the padding into the buffers the graph reads.

Invariants:
- Batch sizes follow the issue's plan: 1, 2, 4, 8, then steps of 8 up to max_num_seqs (and
  max_num_seqs itself); captured largest first so smaller graphs reuse the one memory pool.
- Each size gets its own `TritonPagedAttention` with a fixed split count (the heuristic reads
  max_seq_len, which a graph cannot); the split length is computed per sequence in the kernel,
  so any context length works.
- Warm-up forwards (which compile the Triton kernels) run with token_mask all False, so the MoE
  statistics do not count them; they write no KV (slot -1).

Reference: CUDA graphs (NVIDIA CUDA Programming Guide, "CUDA Graphs"); the padded-replay scheme
is the one vLLM and SGLang describe for decode.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sits.kernels.triton_utils import cdiv
from sits.layers.forward_context import ForwardContext
from sits.runner.input_buffers import InputBuffers, StepInputs

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_num_seqs, plus max_num_seqs; ascending."""
    sizes = {size for size in (1, 2, 4, 8) if size <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def decode_splits_for(
    batch_size: int, num_kv_heads: int, target_programs: int, max_splits: int
) -> int:
    """Split-K count of a captured decode graph: enough (sequence, kv head, split) programs to
    reach `target_programs`, at most `max_splits` (the eager heuristic without its context-length
    term, which a graph cannot read; `TritonAttentionConfig.decode_target_programs` and
    `decode_max_splits` are passed in)."""
    return max(1, min(max_splits, cdiv(target_programs, batch_size * num_kv_heads)))


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: Tensor  # [batch_size, hidden_size], the graph's static output


def _smallest_at_least(sizes: list[int], n: int) -> int | None:
    """The first of the ascending `sizes` that is >= n, or None."""
    index = bisect.bisect_left(sizes, n)
    return sizes[index] if index < len(sizes) else None


def _capture(
    model: nn.Module, inputs: StepInputs, kv_caches: list, attention: object, pool: object
) -> _Graph:
    """Warm up (compile the kernels, settle the allocator) and capture one forward over the
    padding `inputs` with `attention`, in the memory pool `pool` (None: a new one)."""
    ctx = ForwardContext(inputs.metadata, kv_caches, attention, token_mask=inputs.token_mask)
    for _ in range(2):
        model(inputs.input_ids, inputs.positions, ctx)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        hidden = model(inputs.input_ids, inputs.positions, ctx)
    return _Graph(graph, hidden)


class _GraphSet:
    """Graphs of one model over one set of input buffers and KV caches, one per size (batch
    size or token bucket): captured largest first in one memory pool, looked up by the smallest
    size >= n, replayed on the buffers' current contents.

    Args:
        model: the decoder (forward(input_ids, positions, ctx) -> [T, hidden]).
        buffers: the persistent inputs the graphs read.
        kv_caches: one KV cache per layer (the graphs write the step's K/V into them).
        num_kv_heads, head_dim: attention shape (split counts and kernel defaults).

    Attributes:
        num_replays: replays so far (steps served by these graphs).
        pool: the graphs' memory pool once captured (None before).
    """

    kind = "CUDA"  # named in the capture log line

    def __init__(
        self,
        model: nn.Module,
        buffers: InputBuffers,
        kv_caches: list,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_replays = 0
        self._graphs: dict[int, _Graph] = {}
        self._sizes: list[int] = []
        self.pool: object = None  # the graphs' memory pool, once captured

    def _padded(self, n: int) -> int | None:
        return _smallest_at_least(self._sizes, n)

    def _inputs_and_attention(self, size: int) -> tuple[StepInputs, object]:
        """The padding inputs and the attention backend the graph of `size` is captured with."""
        raise NotImplementedError

    def _splits(self, num_seqs: int) -> int:
        from sits.kernels.attention_triton import TritonAttentionConfig

        defaults = TritonAttentionConfig.for_head_dim(self.head_dim)
        return decode_splits_for(
            num_seqs, self.num_kv_heads, defaults.decode_target_programs,
            defaults.decode_max_splits,
        )  # fmt: skip

    @torch.inference_mode()
    def capture(self, sizes: list[int], pool: object = None) -> float:
        """Capture one graph per size, largest first, in one memory pool.

        Args:
            sizes: the sizes to capture.
            pool: the memory pool to capture into (`pool` of another set whose graphs are
                never replayed at the same time, e.g. the other weight set's of the precision
                switch); None: a new one.

        Returns:
            Seconds the capture took.
        """
        start = time.perf_counter()
        for size in sorted(sizes, reverse=True):
            inputs, attention = self._inputs_and_attention(size)
            self._graphs[size] = _capture(self.model, inputs, self.kv_caches, attention, pool)
            pool = self._graphs[size].graph.pool()
        torch.cuda.synchronize()
        self._sizes = sorted(self._graphs)
        self.pool = pool
        elapsed = time.perf_counter() - start
        logger.info("captured %d %s graphs in %.1f s", len(self._sizes), self.kind, elapsed)
        return elapsed

    def replay(self, size: int) -> Tensor:
        """Run the graph of `size` (a captured size) on the buffers' current contents.

        Returns:
            [size or its tokens, hidden_size] hidden states (the graph's static output: read
            before the next replay).
        """
        entry = self._graphs[size]
        entry.graph.replay()
        self.num_replays += 1
        return entry.hidden


class DecodeGraphs(_GraphSet):
    """Captured decode graphs, one per batch size (see the module docstring); `capture` takes
    the batch sizes, `replay` a captured batch size. Args as `_GraphSet`."""

    kind = "decode CUDA"

    @property
    def batch_sizes(self) -> list[int]:
        """Captured batch sizes, ascending."""
        return list(self._sizes)

    def padded_size(self, num_seqs: int) -> int | None:
        """Smallest captured batch size >= num_seqs, or None (run eagerly)."""
        return self._padded(num_seqs)

    def _inputs_and_attention(self, size: int) -> tuple[StepInputs, object]:
        from sits.kernels.attention_triton import TritonAttentionConfig, TritonPagedAttention

        config = TritonAttentionConfig.for_head_dim(
            self.head_dim, decode_num_splits=self._splits(size)
        )
        inputs = self.buffers.prepare_padding(size)  # null block, no KV write, not counted
        return inputs, TritonPagedAttention(config)


def mixed_token_buckets(max_num_tokens: int, smallest: int = 64) -> list[int]:
    """Token counts of the mixed-step graphs, ascending: powers of two from `smallest` up to
    512, then every 128 tokens up to 2048 and every 512 beyond, plus `max_num_tokens`.

    A step pads its tokens up to its bucket, and a padded token costs nearly what a real one
    does in the dense layers: with powers of two alone, a server's typical mixed step (256
    decodes + ~1,024 prompt tokens) ran as 2,048 tokens. The linear steps keep the padding
    under 128 tokens (512 beyond 2,048) for ~0.4 s of capture per extra graph. TPOT pacing
    fills the largest bucket that fits a step's time (`sched.step_policy`), so the step between
    buckets is also the grain of a paced step's length: on the H200 a 256-token grain was
    ~3 ms, and paced steps averaged 43.7 ms against a 45 ms schedule (by their mean prompt
    tokens, about 4 in 10 took the bucket below 1,280).
    """
    buckets = {max_num_tokens}
    size = smallest
    while size < max_num_tokens:
        buckets.add(size)
        size = size * 2 if size < 512 else size + (128 if size < 2048 else 512)
    return sorted(buckets)


class MixedGraphs(_GraphSet):
    """CUDA graphs of whole steps with prompt chunks (mixed or prefill), one per token bucket.

    A step of n tokens in s <= max_num_seqs sequences replays the graph of the smallest bucket
    >= n after `InputBuffers.prepare(plan, pad_to_seqs=max_num_seqs, pad_to_tokens=bucket)`:
    padding tokens belong to no sequence (no KV write, masked out of the MoE statistics) and
    padding sequences have no new tokens. Attention runs in graph mode
    (`TritonAttentionConfig.fixed_max_query_len` = the bucket): both kernels launch over all
    max_num_seqs sequences with grids that depend on shapes only, and skip what is empty.
    `capture` takes the token buckets, `replay` a captured bucket.

    Args:
        model, buffers, kv_caches, num_kv_heads, head_dim: as `_GraphSet`.
        max_num_seqs: sequences every graph is captured for.
    """

    kind = "mixed-step CUDA"

    def __init__(
        self,
        model: nn.Module,
        buffers: InputBuffers,
        kv_caches: list,
        num_kv_heads: int,
        head_dim: int,
        max_num_seqs: int,
    ) -> None:
        super().__init__(model, buffers, kv_caches, num_kv_heads, head_dim)
        self.max_num_seqs = max_num_seqs

    @property
    def token_buckets(self) -> list[int]:
        """Captured token counts, ascending."""
        return list(self._sizes)

    def padded_tokens(self, num_tokens: int) -> int | None:
        """Smallest captured bucket >= num_tokens, or None (run eagerly)."""
        return self._padded(num_tokens)

    def _inputs_and_attention(self, size: int) -> tuple[StepInputs, object]:
        from sits.kernels.attention_triton import TritonAttentionConfig, TritonPagedAttention

        config = TritonAttentionConfig.for_head_dim(
            self.head_dim,
            decode_num_splits=self._splits(self.max_num_seqs),
            fixed_max_query_len=size,
        )
        inputs = self.buffers.prepare_token_padding(size, self.max_num_seqs)
        return inputs, TritonPagedAttention(config)
