"""Persistent step-input buffers: a plan's tokens, positions, slots and block tables filled with
vectorised numpy on host staging arrays and copied once per tensor to fixed device buffers (on
the CPU the host arrays are the device buffers: nothing is copied).

The same buffers feed eager steps and CUDA-graph replays: a graph captured over
`buffers.view(batch_size)` reads whatever the next `prepare` wrote there, so device addresses
never change after construction.

Invariants:
- Flat layout, no padding between sequences: tokens of the scheduled requests concatenated in
  plan order; slot of position p = block_ids[p // block_size] * block_size + p % block_size;
  seq_lens[i] = start_position + num_tokens of request i.
- Padding (a decode batch padded up to a captured graph size) adds one-token sequences that
  read the null block 0 with context length 1, write nowhere (slot -1), and are masked out of
  the MoE statistics by `token_mask`. Token padding (a mixed step padded to a token bucket,
  `pad_to_tokens`) instead adds tokens that belong to no sequence (token 0, position 0, slot
  -1, masked) and sequences without tokens (q_len 0, context length 0), which every attention
  kernel skips.
- Block-table entries past a sequence's last block are stale (left from earlier steps): every
  reader reads only the first ceil(seq_len / block_size) entries of a row.
- Host staging arrays are pinned on CUDA and copied with non_blocking=True. A step that samples
  nothing (a middle prefill chunk) ends without a device sync, so the CPU may run ahead: each
  `prepare` first waits for the event recorded after the previous step's copies, so the host
  arrays are never rewritten while a copy from them is pending.
- A pure decode step (one token per sequence) takes a shorter path with the same result, and
  the device views of each (sequences, tokens) size are made once and reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from sits.core.plan import ScheduledRequest, StepPlan
from sits.kernels.attention_metadata import AttentionMetadata

_MAX_CACHED_VIEWS = 1024  # sizes of `InputBuffers.view` kept (decode steps reuse a few)
_MAX_ROWS_BY_ROW = 8  # block tables of at most this many rows are written row by row


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Model inputs of one step.

    Attributes:
        input_ids: [num_tokens] int64.
        positions: [num_tokens] int64.
        metadata: the attention layout.
        last_token_indices: per scheduled request, the flat index of its last token this step.
        token_mask: [num_tokens] bool, False on padding tokens; None when there is no padding.
    """

    input_ids: Tensor
    positions: Tensor
    metadata: AttentionMetadata
    last_token_indices: list[int]
    token_mask: Tensor | None = None


@dataclass(frozen=True, slots=True)
class BufferViews:
    """Device views of the first rows of the buffers, as a captured graph sees them.

    Attributes:
        input_ids, positions, slot_mapping: [num_tokens] int64.
        token_mask: [num_tokens] bool, False on padding.
        query_start_loc: [num_seqs + 1] int32.
        seq_lens: [num_seqs] int32.
        block_tables: [num_seqs, max_blocks_per_seq] int32.
    """

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    token_mask: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    block_tables: Tensor


class InputBuffers:
    """Fixed host and device buffers for up to `max_num_tokens` tokens in `max_num_seqs` sequences.

    Args:
        max_num_tokens: tokens of the largest step (max_num_batched_tokens).
        max_num_seqs: sequences of the largest step.
        max_blocks_per_seq: block-table width, ceil(max_model_len / block_size).
        block_size: tokens per KV block.
        device: where the model runs.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"
        self._copied: torch.cuda.Event | None = None  # recorded after each step's copies
        self._host: dict[str, Tensor] = {}
        self._dev: dict[str, Tensor] = {}
        shapes = {
            "input_ids": ((max_num_tokens,), torch.int64),
            "positions": ((max_num_tokens,), torch.int64),
            "slot_mapping": ((max_num_tokens,), torch.int64),
            "token_mask": ((max_num_tokens,), torch.bool),
            "query_start_loc": ((max_num_seqs + 1,), torch.int32),
            "seq_lens": ((max_num_seqs,), torch.int32),
            "block_tables": ((max_num_seqs, max_blocks_per_seq), torch.int32),
            # Host staging of the step's [num_seqs, width] table, contiguous (one dense copy).
            "block_tables_stage": ((max_num_seqs * max_blocks_per_seq,), torch.int32),
        }
        for name, (shape, dtype) in shapes.items():
            if name.endswith("_stage") and device.type == "cpu":
                continue  # the CPU fills its block table in place
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self._host[name] = host
            if not name.endswith("_stage"):
                on_cpu = device.type == "cpu"
                self._dev[name] = host if on_cpu else torch.zeros_like(host, device=device)
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self._arange = np.arange(max(max_num_tokens, max_num_seqs) + 1)  # 0, 1, 2, ...
        self._views: dict[tuple[int, int], BufferViews] = {}

    def view(self, num_seqs: int, num_tokens: int | None = None) -> BufferViews:
        """Device views of the first `num_tokens` tokens (default num_seqs) and `num_seqs` rows.

        Views of a size are made once and cached (the buffers never move), at most
        `_MAX_CACHED_VIEWS` sizes at a time.
        """
        n = num_seqs if num_tokens is None else num_tokens
        views = self._views.get((num_seqs, n))
        if views is not None:
            return views
        d = self._dev
        views = BufferViews(
            input_ids=d["input_ids"][:n],
            positions=d["positions"][:n],
            slot_mapping=d["slot_mapping"][:n],
            token_mask=d["token_mask"][:n],
            query_start_loc=d["query_start_loc"][: num_seqs + 1],
            seq_lens=d["seq_lens"][:num_seqs],
            block_tables=d["block_tables"][:num_seqs],
        )
        if len(self._views) >= _MAX_CACHED_VIEWS:
            self._views.clear()
        self._views[(num_seqs, n)] = views
        return views

    def prepare(
        self, plan: StepPlan, pad_to_seqs: int | None = None, pad_to_tokens: int | None = None
    ) -> StepInputs:
        """Fill the buffers from a plan and copy them to the device.

        Args:
            plan: the scheduled requests (non-empty).
            pad_to_seqs: for a pure decode step replayed by a graph of this batch size, pad
                with one-token null sequences up to it (>= the plan's sequences); None = no
                padding. With `pad_to_tokens`: the sequence count to pad to with empty
                sequences instead.
            pad_to_tokens: for a step replayed by a mixed-step graph of this many tokens, pad
                with tokens outside every sequence up to it (>= the plan's tokens; needs
                `pad_to_seqs`); None = no token padding.

        Returns:
            StepInputs whose tensors are views of the device buffers (valid until the next
            `prepare`); last_token_indices and the metadata's CPU fields cover the real
            sequences only, the device tensors cover the padding too.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host arrays
        scheduled = plan.scheduled
        num_seqs = len(scheduled)
        token_ids = np.fromiter(
            chain.from_iterable([sr.token_ids for sr in scheduled]), np.int64
        )  # [num_tokens]
        num_tokens = token_ids.size
        starts = np.fromiter([sr.start_position for sr in scheduled], np.int64, num_seqs)
        assert num_tokens <= self.max_num_tokens and num_seqs <= self.max_num_seqs
        padded_seqs = num_seqs if pad_to_seqs is None else pad_to_seqs
        padded_tokens = num_tokens + (padded_seqs - num_seqs)
        if pad_to_tokens is not None:
            assert pad_to_seqs is not None and pad_to_tokens >= num_tokens
            padded_tokens = pad_to_tokens
        assert padded_seqs >= num_seqs and padded_tokens <= self.max_num_tokens
        assert padded_seqs <= self.max_num_seqs

        h = self._np
        tables = self._fill_block_tables(scheduled, padded_seqs)  # [padded_seqs, width]
        qsl = h["query_start_loc"]
        seq_index = self._arange[:num_seqs]
        if num_tokens == num_seqs:  # pure decode: one token per sequence (each has >= 1)
            token_seq, positions, max_query_len = seq_index, starts, 1
            qsl[: num_seqs + 1] = self._arange[: num_seqs + 1]
            seq_lens = starts + 1
        else:
            counts = np.fromiter([len(sr.token_ids) for sr in scheduled], np.int64, num_seqs)
            offsets = np.cumsum(counts) - counts  # [num_seqs] first flat index of each sequence
            token_seq = np.repeat(seq_index, counts)  # [num_tokens]
            positions = np.repeat(starts - offsets, counts) + self._arange[:num_tokens]
            max_query_len = int(counts.max())
            qsl[0] = 0
            np.cumsum(counts, out=qsl[1 : num_seqs + 1])
            seq_lens = starts + counts
        h["input_ids"][:num_tokens] = token_ids
        h["positions"][:num_tokens] = positions
        bs = self.block_size
        h["slot_mapping"][:num_tokens] = (
            tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
        )
        h["token_mask"][:num_tokens] = True
        h["seq_lens"][:num_seqs] = seq_lens
        if pad_to_tokens is None:
            self._write_padding(num_seqs, padded_seqs, num_tokens)
        else:
            self._write_token_padding(num_seqs, padded_seqs, num_tokens, padded_tokens)
        self._copy(padded_tokens, padded_seqs, tables.shape[1])
        views = self.view(padded_seqs, padded_tokens)
        return self._inputs(
            views, qsl[: num_seqs + 1].tolist(), seq_lens.tolist(), max_query_len,
            int(seq_lens.max()), last_token_indices=(qsl[1 : num_seqs + 1] - 1).tolist(),
            token_mask=padded_tokens != num_tokens,
        )  # fmt: skip

    def prepare_padding(self, num_seqs: int) -> StepInputs:
        """Fill the first `num_seqs` rows with padding sequences only (what a decode graph is
        captured over) and copy them to the device.

        Returns:
            StepInputs over the padding: its metadata's CPU fields describe the `num_seqs`
            one-token sequences (so a backend plans a pure decode), token_mask is all False.
        """
        if self._copied is not None:
            self._copied.synchronize()
        self._null_block_tables(num_seqs)
        self._np["query_start_loc"][0] = 0
        self._write_padding(0, num_seqs, 0)
        self._copy(num_seqs, num_seqs, 1)
        return self._inputs(
            self.view(num_seqs), list(range(num_seqs + 1)), [1] * num_seqs, 1, 1,
            last_token_indices=list(range(num_seqs)), token_mask=True,
        )  # fmt: skip

    def prepare_token_padding(self, num_tokens: int, num_seqs: int) -> StepInputs:
        """Fill `num_tokens` padding tokens and `num_seqs` empty sequences (what a mixed-step
        graph is captured over) and copy them to the device.

        Returns:
            StepInputs over the padding: token_mask all False, no KV writes, every sequence
            without new tokens; its metadata's CPU fields describe no sequence (a graph-mode
            backend ignores them).
        """
        if self._copied is not None:
            self._copied.synchronize()
        self._np["query_start_loc"][0] = 0
        self._write_token_padding(0, num_seqs, 0, num_tokens)
        self._null_block_tables(num_seqs)
        self._copy(num_tokens, num_seqs, 1)
        return self._inputs(
            self.view(num_seqs, num_tokens), [0], [], 0, 0, last_token_indices=[],
            token_mask=True,
        )  # fmt: skip

    def _null_block_tables(self, num_seqs: int) -> None:
        """Point the first `num_seqs` rows' block tables at the null block (width 1)."""
        if self.device.type == "cpu":
            self._np["block_tables"][:num_seqs, 0] = 0
        else:
            self._np["block_tables_stage"][:num_seqs] = 0  # [num_seqs, 1]: the null block

    def _inputs(
        self,
        views: BufferViews,
        query_start_loc_cpu: list[int],
        seq_lens_cpu: list[int],
        max_query_len: int,
        max_seq_len: int,
        *,
        last_token_indices: list[int],
        token_mask: bool,
    ) -> StepInputs:
        """The StepInputs over `views` with these CPU fields; `token_mask`: pass the views'
        mask (the step has padding tokens) rather than None."""
        metadata = AttentionMetadata(
            query_start_loc=views.query_start_loc,
            seq_lens=views.seq_lens,
            block_tables=views.block_tables,
            slot_mapping=views.slot_mapping,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
        )
        return StepInputs(
            input_ids=views.input_ids,
            positions=views.positions,
            metadata=metadata,
            last_token_indices=last_token_indices,
            token_mask=views.token_mask if token_mask else None,
        )

    def _write_padding(self, num_seqs: int, padded_seqs: int, num_tokens: int) -> None:
        """Host rows of the padding sequences num_seqs..padded_seqs-1 (tokens from num_tokens
        on): token 0 at position 0, no KV write (slot -1), masked out, context length 1; their
        block-table rows (written by the caller) read the null block 0."""
        if padded_seqs == num_seqs:
            return
        h = self._np
        pad = slice(num_tokens, num_tokens + padded_seqs - num_seqs)
        h["input_ids"][pad] = 0
        h["positions"][pad] = 0
        h["slot_mapping"][pad] = -1
        h["token_mask"][pad] = False
        h["seq_lens"][num_seqs:padded_seqs] = 1
        h["query_start_loc"][num_seqs + 1 : padded_seqs + 1] = (
            num_tokens + self._arange[1 : padded_seqs - num_seqs + 1]
        )

    def _write_token_padding(
        self, num_seqs: int, padded_seqs: int, num_tokens: int, padded_tokens: int
    ) -> None:
        """Host rows of a mixed step's padding: tokens num_tokens..padded_tokens-1 outside every
        sequence (token 0, position 0, no KV write, masked out) and sequences
        num_seqs..padded_seqs-1 without tokens (query_start_loc stays at num_tokens, context
        length 0)."""
        h = self._np
        pad = slice(num_tokens, padded_tokens)
        h["input_ids"][pad] = 0
        h["positions"][pad] = 0
        h["slot_mapping"][pad] = -1
        h["token_mask"][pad] = False
        h["seq_lens"][num_seqs:padded_seqs] = 0
        h["query_start_loc"][num_seqs + 1 : padded_seqs + 1] = num_tokens

    def _fill_block_tables(self, scheduled: list[ScheduledRequest], padded_seqs: int) -> np.ndarray:
        """Write the sequences' block ids into the host table rows (padding rows read the null
        block); returns the [padded_seqs, width] host array, width = the widest table.

        On CPU the rows are the device table itself; elsewhere a dense staging area copied by
        `_copy`.
        """
        num_seqs = len(scheduled)
        block_lists = [sr.block_ids for sr in scheduled]  # one pass over the plan (hot path)
        num_blocks_list = list(map(len, block_lists))
        width = max(num_blocks_list)
        assert width <= self.max_blocks_per_seq, "block table too wide"
        if self.device.type == "cpu":
            tables = self._np["block_tables"][:padded_seqs, :width]
        else:
            stage = self._np["block_tables_stage"]
            tables = stage[: padded_seqs * width].reshape(padded_seqs, width)
        if num_seqs <= _MAX_ROWS_BY_ROW:  # a few rows: one assignment each is cheaper
            for row, block_ids in enumerate(block_lists):
                tables[row, : len(block_ids)] = block_ids
        else:  # scatter the concatenated block ids into rows
            num_blocks = np.fromiter(num_blocks_list, np.int64, num_seqs)  # [num_seqs]
            flat_blocks = np.fromiter(
                chain.from_iterable(block_lists), np.int32, sum(num_blocks_list)
            )  # [total blocks]
            rows = np.repeat(self._arange[:num_seqs], num_blocks)
            row_starts = np.cumsum(num_blocks) - num_blocks  # [num_seqs]
            cols = np.arange(flat_blocks.size) - np.repeat(row_starts, num_blocks)
            tables[rows, cols] = flat_blocks
        tables[num_seqs:padded_seqs, 0] = 0  # padding reads the null block
        return tables

    def _copy(self, num_tokens: int, num_seqs: int, width: int) -> None:
        """Host staging -> device for the filled region (nothing on CPU: the host arrays are the
        device buffers)."""
        if self.device.type == "cpu":
            return
        stage = self._host["block_tables_stage"][: num_seqs * width].view(num_seqs, width)
        for name in ("input_ids", "positions", "slot_mapping", "token_mask"):
            self._dev[name][:num_tokens].copy_(self._host[name][:num_tokens], non_blocking=True)
        self._dev["query_start_loc"][: num_seqs + 1].copy_(
            self._host["query_start_loc"][: num_seqs + 1], non_blocking=True
        )
        self._dev["seq_lens"][:num_seqs].copy_(self._host["seq_lens"][:num_seqs], non_blocking=True)
        self._dev["block_tables"][:num_seqs, :width].copy_(stage, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
