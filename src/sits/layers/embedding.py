"""Token embeddings and the LM head, split by vocabulary under tensor parallelism.

Invariants (Megatron-LM's vocabulary-parallel layout, as vLLM applies it):
- Rank r holds vocabulary rows [r * V / size, (r + 1) * V / size) of both the embedding and
  the LM head (`row_shard`), so a tied LM head shares the embedding's local rows.
- `VocabParallelEmbedding`: an id outside this rank's rows embeds to zeros; the ranks' rows are
  summed (one all-reduce), so every id gets exactly its one row on every rank.
- `ParallelLMHead.logits`: each rank's [N, V / size] logits in float32, all-gathered in rank
  order to [N, V], identical on every rank.
- With size 1 both are their plain nn counterparts (no masking, no collective).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sits.layers.linear import Shard
from sits.parallel import SINGLE, TensorParallel


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's vocabulary rows.

    Attributes:
        weight: [vocab_size / tp.size, hidden_size].
        row_shard: the rows of the checkpoint's [vocab_size, hidden_size] this rank holds.
        tp: the tensor-parallel group.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        """Raises InvalidParameterError when tp.size does not divide vocab_size."""
        row_shard = Shard.of(vocab_size, tp, "vocab_size")
        super().__init__(row_shard.size, hidden_size)
        self.row_shard = row_shard
        self.tp = tp

    def forward(self, input_ids: Tensor) -> Tensor:
        """[num_tokens] int64 ids in [0, vocab_size) -> [num_tokens, hidden_size]."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.row_shard.start  # [num_tokens]
        outside = (local_ids < 0) | (local_ids >= self.row_shard.size)  # [num_tokens]
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden = hidden.masked_fill(outside[:, None], 0.0)  # [num_tokens, hidden_size]
        return self.tp.all_reduce(hidden)


class ParallelLMHead(nn.Linear):
    """Linear(hidden_size, vocab_size / tp.size, bias=False) over this rank's vocabulary rows.

    Attributes:
        weight: [vocab_size / tp.size, hidden_size] (the embedding's when tied).
        row_shard: the rows of the checkpoint's lm_head this rank holds.
        tp: the tensor-parallel group.
    """

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel = SINGLE) -> None:
        """Raises InvalidParameterError when tp.size does not divide vocab_size."""
        row_shard = Shard.of(vocab_size, tp, "vocab_size")
        super().__init__(hidden_size, row_shard.size, bias=False)
        self.row_shard = row_shard
        self.tp = tp

    def logits(self, hidden: Tensor) -> Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32, whole on every rank."""
        local = F.linear(hidden, self.weight).to(torch.float32)  # [num_rows, vocab / size]
        return self.tp.all_gather(local, dim=-1)
