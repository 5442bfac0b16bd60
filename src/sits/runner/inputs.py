"""Builds the flat model inputs of one step from a `StepPlan`.

Tokens of all scheduled requests are concatenated in plan order (no padding). Invariants: the
slot of token `p` of a request is `block_ids[p // block_size] * block_size + p % block_size`;
`seq_lens[i] = start_position + num_tokens` of request i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sits.core.plan import StepPlan
from sits.layers.forward_context import AttentionMetadata


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Model inputs of one step.

    Attributes:
        input_ids: [num_tokens] int64.
        positions: [num_tokens] int64.
        metadata: the attention layout.
        last_token_indices: per scheduled request, the flat index of its last token this step.
    """

    input_ids: Tensor
    positions: Tensor
    metadata: AttentionMetadata
    last_token_indices: list[int]


def build_step_inputs(plan: StepPlan, block_size: int, device: torch.device) -> StepInputs:
    """Flatten a plan into input ids, positions, slot mapping and block tables.

    Args:
        plan: the scheduled requests (non-empty).
        block_size: tokens per KV block.
        device: where the tensors go.

    Returns:
        StepInputs on `device`.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    last_token_indices: list[int] = []
    max_num_blocks = 1
    for sr in plan.scheduled:
        start, count = sr.start_position, sr.num_tokens
        assert count > 0 and len(sr.block_ids) * block_size >= start + count, sr.request_id
        input_ids.extend(sr.token_ids)
        pos = range(start, start + count)
        positions.extend(pos)
        blocks = sr.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        query_start_loc.append(query_start_loc[-1] + count)
        seq_lens.append(start + count)
        last_token_indices.append(query_start_loc[-1] - 1)
        max_num_blocks = max(max_num_blocks, len(blocks))
    block_tables = torch.zeros((len(plan.scheduled), max_num_blocks), dtype=torch.int32)
    for i, sr in enumerate(plan.scheduled):
        block_tables[i, : len(sr.block_ids)] = torch.tensor(sr.block_ids, dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=metadata,
        last_token_indices=last_token_indices,
    )
