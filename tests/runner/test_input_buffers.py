"""`InputBuffers.prepare` equals a plain per-token construction of the step inputs, with and
without padding to a graph batch size; stale block-table entries never leak into slots."""

from __future__ import annotations

import pytest
import torch

from sits.core.plan import ScheduledRequest, StepPlan
from sits.runner.cuda_graphs import decode_splits_for, graph_batch_sizes, mixed_token_buckets
from sits.runner.input_buffers import InputBuffers

BLOCK_SIZE = 4


def _sr(rid: str, tokens: list[int], start: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, start, blocks, sample=True)


def _expected(plan: StepPlan) -> dict[str, list]:
    """The inputs written out token by token (the layout's definition)."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for sr in plan.scheduled:
        for i, tok in enumerate(sr.token_ids):
            p = sr.start_position + i
            ids.append(tok)
            pos.append(p)
            slots.append(sr.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        qsl.append(qsl[-1] + sr.num_tokens)
        lens.append(sr.start_position + sr.num_tokens)
    return {"ids": ids, "pos": pos, "slots": slots, "qsl": qsl, "lens": lens}


def _buffers() -> InputBuffers:
    return InputBuffers(
        max_num_tokens=32, max_num_seqs=8, max_blocks_per_seq=6, block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
    )  # fmt: skip


def test_mixed_step_matches_the_definition() -> None:
    plan = StepPlan(
        [
            _sr("a", [5, 6, 7, 8, 9], 3, [7, 2, 9]),  # a chunk over a cached prefix (positions 3-7)
            _sr("b", [11], 9, [4, 1, 3]),  # decode at position 9: block 3, offset 1
            _sr("c", [21, 22], 0, [8]),
        ]
    )
    buffers = _buffers()
    inputs = buffers.prepare(plan)
    want = _expected(plan)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == want["ids"]
    assert inputs.positions.tolist() == want["pos"]
    assert md.slot_mapping.tolist() == want["slots"] == [31, 8, 9, 10, 11, 13, 32, 33]
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu == want["qsl"]
    assert md.seq_lens.tolist() == md.seq_lens_cpu == want["lens"] == [8, 10, 2]
    assert md.block_tables[0, :3].tolist() == [7, 2, 9]
    assert md.block_tables[1, :3].tolist() == [4, 1, 3]
    assert md.block_tables[2, :1].tolist() == [8]
    assert (md.max_query_len, md.max_seq_len) == (5, 10)
    assert inputs.last_token_indices == [4, 5, 7]
    assert inputs.token_mask is None


def test_decode_padding_and_stale_entries() -> None:
    buffers = _buffers()
    # A first, wide step leaves stale block ids in the rows.
    buffers.prepare(StepPlan([_sr("x", [1] * 20, 0, [1, 2, 3, 4, 5])] * 1))
    plan = StepPlan([_sr("a", [3], 4, [6, 7]), _sr("b", [4], 0, [9])])
    inputs = buffers.prepare(plan, pad_to_seqs=4)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [3, 4, 0, 0]
    assert inputs.positions.tolist() == [4, 0, 0, 0]
    assert md.slot_mapping.tolist() == [28, 36, -1, -1]
    assert md.seq_lens.tolist() == [5, 1, 1, 1]
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.block_tables[:, 0].tolist() == [6, 9, 0, 0]
    assert inputs.token_mask is not None and inputs.token_mask.tolist() == [
        True, True, False, False,
    ]  # fmt: skip
    # CPU fields and last-token indices cover the real sequences only.
    assert md.seq_lens_cpu == [5, 1] and md.query_start_loc_cpu == [0, 1, 2]
    assert inputs.last_token_indices == [0, 1]


def test_token_padding_for_a_mixed_step_graph() -> None:
    plan = StepPlan(
        [
            _sr("a", [5, 6, 7, 8, 9], 3, [7, 2, 9]),
            _sr("b", [11], 9, [4, 1, 3]),
            _sr("c", [21, 22], 0, [8]),
        ]
    )
    buffers = _buffers()
    buffers.prepare(StepPlan([_sr("x", [1] * 20, 0, [1, 2, 3, 4, 5])]))  # stale rows first
    inputs = buffers.prepare(plan, pad_to_seqs=6, pad_to_tokens=12)
    want = _expected(plan)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == want["ids"] + [0, 0, 0, 0]
    assert inputs.positions.tolist() == want["pos"] + [0, 0, 0, 0]
    assert md.slot_mapping.tolist() == want["slots"] + [-1, -1, -1, -1]
    assert inputs.token_mask is not None
    assert inputs.token_mask.tolist() == [True] * 8 + [False] * 4
    # Three empty sequences: q_len 0 (query_start_loc stays at 8), context length 0.
    assert md.query_start_loc.tolist() == want["qsl"] + [8, 8, 8]
    assert md.seq_lens.tolist() == want["lens"] + [0, 0, 0]
    assert md.seq_lens.shape[0] == md.block_tables.shape[0] == 6 and md.num_seqs == 3
    # CPU fields and last-token indices cover the real sequences only.
    assert md.query_start_loc_cpu == want["qsl"] and md.seq_lens_cpu == want["lens"]
    assert (md.max_query_len, md.max_seq_len) == (5, 10)
    assert inputs.last_token_indices == [4, 5, 7]


@pytest.mark.parametrize("num_seqs", [3, 12])  # block tables written row by row, scattered
def test_decode_steps_match_the_definition(num_seqs: int) -> None:
    buffers = InputBuffers(
        max_num_tokens=64, max_num_seqs=16, max_blocks_per_seq=6, block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
    )  # fmt: skip
    # A mixed step first, then decode steps of other sizes: cached views and stale rows.
    buffers.prepare(StepPlan([_sr("x", [1] * 20, 0, [1, 2, 3, 4, 5]), _sr("y", [2], 3, [6])]))
    for step in range(2):
        plan = StepPlan(
            [
                _sr(f"r{i}", [100 + i], nb * BLOCK_SIZE - 2 + step, [10 + i, 30 + i, 50 + i][:nb])
                for i, nb in ((i, i % 3 + 1) for i in range(num_seqs))
            ]
        )
        inputs = buffers.prepare(plan)
        want = _expected(plan)
        md = inputs.metadata
        assert inputs.input_ids.tolist() == want["ids"]
        assert inputs.positions.tolist() == want["pos"]
        assert md.slot_mapping.tolist() == want["slots"]
        assert md.query_start_loc.tolist() == md.query_start_loc_cpu == want["qsl"]
        assert md.seq_lens.tolist() == md.seq_lens_cpu == want["lens"]
        for i, sr in enumerate(plan.scheduled):
            assert md.block_tables[i, : len(sr.block_ids)].tolist() == sr.block_ids
        assert (md.max_query_len, md.max_seq_len) == (1, max(want["lens"]))
        assert inputs.last_token_indices == list(range(num_seqs))
        assert inputs.token_mask is None
    assert buffers.view(num_seqs) is buffers.view(num_seqs, num_seqs)  # made once


def test_too_wide_block_table_is_refused() -> None:
    with pytest.raises(AssertionError, match="block table"):
        _buffers().prepare(StepPlan([_sr("a", [1], 0, list(range(1, 8)))]))


def test_graph_batch_sizes_and_splits() -> None:
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(256)) == 4 + 31
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert decode_splits_for(1, 4, 264, 32) == 32  # capped
    assert decode_splits_for(64, 4, 264, 32) == 2  # ceil(264 / 256)
    assert decode_splits_for(256, 4, 264, 32) == 1


def test_padding_only_batch_for_graph_capture() -> None:
    buffers = _buffers()
    buffers.prepare(StepPlan([_sr("x", [1] * 20, 0, [1, 2, 3, 4, 5])]))  # leaves stale rows
    inputs = buffers.prepare_padding(3)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [0, 0, 0] and inputs.positions.tolist() == [0, 0, 0]
    assert md.slot_mapping.tolist() == [-1, -1, -1]
    assert md.seq_lens.tolist() == [1, 1, 1] and md.query_start_loc.tolist() == [0, 1, 2, 3]
    assert md.block_tables[:, 0].tolist() == [0, 0, 0]
    assert inputs.token_mask is not None and inputs.token_mask.tolist() == [False] * 3
    assert md.query_start_loc_cpu == [0, 1, 2, 3] and md.seq_lens_cpu == [1, 1, 1]
    assert (md.max_query_len, md.max_seq_len) == (1, 1)


def test_token_padding_only_batch_for_mixed_graph_capture() -> None:
    buffers = _buffers()
    buffers.prepare(StepPlan([_sr("x", [1] * 20, 0, [1, 2, 3, 4, 5])]))  # leaves stale rows
    inputs = buffers.prepare_token_padding(num_tokens=12, num_seqs=5)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [0] * 12 and inputs.positions.tolist() == [0] * 12
    assert md.slot_mapping.tolist() == [-1] * 12
    assert inputs.token_mask is not None and inputs.token_mask.tolist() == [False] * 12
    assert md.query_start_loc.tolist() == [0] * 6 and md.seq_lens.tolist() == [0] * 5
    assert md.block_tables[:, 0].tolist() == [0] * 5
    assert md.query_start_loc_cpu == [0] and md.seq_lens_cpu == [] and md.max_query_len == 0
    assert inputs.last_token_indices == []


def test_mixed_token_buckets() -> None:
    assert mixed_token_buckets(2048) == [64, 128, 256, *range(512, 2048 + 1, 128)]
    assert mixed_token_buckets(4096) == mixed_token_buckets(2048) + [2560, 3072, 3584, 4096]
    assert mixed_token_buckets(1000) == [64, 128, 256, 512, 640, 768, 896, 1000]
    assert mixed_token_buckets(300) == [64, 128, 256, 300]
    assert mixed_token_buckets(64) == [64] and mixed_token_buckets(16) == [16]
