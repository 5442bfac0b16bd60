"""`AttentionMetadata`: the flat batch layout of one step that every paged attention kernel reads.

It lives beside the kernels that consume it (the runner fills it, `layers.forward_context`
carries it to each attention layer), so kernels need no import from the layers above them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Flat (padding-free) batch layout of one step.

    The step's tokens are the concatenation of each sequence's new tokens. Sequence i's new
    tokens are `query_start_loc[i]:query_start_loc[i+1]`; they sit at positions
    `seq_lens[i] - query_len_i .. seq_lens[i] - 1`, and each attends causally to all of the
    sequence's cached and new tokens up to its own position.

    Attributes:
        query_start_loc: [num_seqs + 1] int32, cumulative new-token counts.
        seq_lens: [num_seqs] int32, tokens in the KV cache after this step (context length).
        block_tables: [num_seqs, max_num_blocks] int32, KV block ids (padding 0).
        slot_mapping: [num_tokens] int64, block_id * block_size + offset of each new token;
            -1 means do not write.
        query_start_loc_cpu: the same as a Python list (for CPU loops without device syncs).
        seq_lens_cpu: the same as a Python list.
        max_query_len: largest new-token count of a sequence.
        max_seq_len: largest context length.
        block_size: tokens per KV block.
    """

    query_start_loc: Tensor
    seq_lens: Tensor
    block_tables: Tensor
    slot_mapping: Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
