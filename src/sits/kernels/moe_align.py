"""Align a step's (token, expert) pairs to experts in blocks of BLOCK_M rows for the grouped GEMMs.

Pair p = t * top_k + j is token t's j-th choice, expert `topk_ids[t, j]`. The alignment lists
the pairs grouped by expert (experts in id order, pairs of one expert in increasing p), each
expert's group padded with the sentinel `num_pairs` to a multiple of BLOCK_M, so every block
of BLOCK_M consecutive rows belongs to one expert. A pair with expert id -1 (a padding token's,
`moe_routing_triton.fused_route`) goes to no expert: it gets no row.

Invariants:
- Everything stays on the device and no value is read back to the host: output sizes depend
  only on (num_pairs, num_experts, block_m), via the fixed bound `max_padded_rows`, so the
  alignment can be captured in a CUDA graph and replayed with new routing.
- Rows in [num_padded_rows, max_padded_rows) hold the sentinel and their blocks' expert id is
  -1; a GEMM launched over `cdiv(max_padded_rows, block_m)` row blocks exits early in them.
- The result is a pure function of topk_ids (stable order): the three implementations below
  (one Triton program for small steps, three Triton launches over chunks of pairs for large
  ones, PyTorch device ops as the reference) give identical tensors.

Algorithm: counting sort of the pairs by expert id (histogram, exclusive prefix sums of the
padded counts, stable rank within each expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.triton_utils import cdiv, next_power_of_2

MAX_SINGLE_PROGRAM_ELEMENTS = 32768  # pairs x max(pairs, experts) (powers of two), one program
CHUNK_ELEMENTS = 16384  # pairs x experts of one program of the chunked path


@dataclass(frozen=True, slots=True)
class ExpertAlignment:
    """Pairs sorted by expert and padded per expert to block_m rows (all on the device).

    Attributes:
        sorted_pair_ids: [max_padded_rows] int32, pair id t * top_k + j per row; `num_pairs`
            marks padding.
        block_expert_ids: [max_num_blocks] int32, expert of each block of block_m rows; -1 for
            blocks at or past num_padded_rows.
        num_padded_rows: [1] int32, rows in use (a multiple of block_m).
        block_m: rows per block.
        num_pairs: num_tokens * top_k.
        one_pair_per_block: `pair_blocks`'s layout: block b holds pair b alone (row b *
            block_m; the rest padding) and its expert is `block_expert_ids[b]` (the flat
            topk_ids, -1: no block); sorted_pair_ids and num_padded_rows are not read.
    """

    sorted_pair_ids: Tensor
    block_expert_ids: Tensor
    num_padded_rows: Tensor
    block_m: int
    num_pairs: int
    one_pair_per_block: bool = False

    @property
    def max_num_blocks(self) -> int:
        """Row blocks a GEMM grid must cover (the static bound)."""
        return self.block_expert_ids.shape[0]


def pair_blocks(topk_ids: Tensor, block_m: int) -> ExpertAlignment:
    """The alignment of a one-token step without a launch: its k pairs go to k distinct
    experts, so giving each pair a block of its own is what sorting would give (same blocks,
    other order), and the GEMMs read the expert ids straight from topk_ids.

    Args:
        topk_ids: [1, top_k] int32/int64 distinct expert ids, or -1 (a padding token).
        block_m: rows per GEMM block.

    Returns:
        An `ExpertAlignment` with one_pair_per_block set and k blocks.
    """
    assert topk_ids.shape[0] == 1, "pair_blocks is for one-token steps"
    flat_ids = topk_ids.reshape(-1)  # [top_k]
    return ExpertAlignment(flat_ids, flat_ids, flat_ids, block_m, flat_ids.shape[0], True)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded rows: every pair plus block_m - 1 padding rows per expert
    that can receive a pair (at most min(num_experts, num_pairs) experts do)."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


@triton.jit
def _write_layout(
    counts,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    max_rows,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,
    FILL: tl.constexpr,
):
    """From the per-expert counts [EXPERTS]: write the padding rows (sentinel), the tail past
    the padded count, the padded count and every block's expert; return each expert's first
    row [EXPERTS]."""
    experts = tl.arange(0, EXPERTS)  # [EXPERTS]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [EXPERTS]
    padded_end = tl.cumsum(padded, axis=0)  # [EXPERTS]
    padded_start = padded_end - padded
    total = tl.sum(padded, axis=0)
    pad = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    pad_rows = (padded_start + counts)[:, None] + pad[None, :]  # [EXPERTS, BLOCK_M]
    sentinel = tl.zeros([EXPERTS, BLOCK_M], dtype=tl.int32) + num_pairs
    tl.store(sorted_ptr + pad_rows, sentinel, mask=pad_rows < padded_end[:, None])
    fill = tl.arange(0, FILL)  # [FILL]
    for row0 in range(total, max_rows, FILL):
        rows = row0 + fill
        tl.store(sorted_ptr + rows, fill * 0 + num_pairs, mask=rows < max_rows)
    tl.store(num_padded_ptr, total)
    real_end = tl.where(experts < num_experts, padded_end, 2147483647)  # [EXPERTS]
    for block0 in range(0, max_blocks, FILL):
        blocks = block0 + fill  # [FILL]
        first_rows = blocks * BLOCK_M
        expert = tl.sum((real_end[None, :] <= first_rows[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_rows < total, expert, -1)  # [FILL]
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < max_blocks)
    return padded_start


@triton.jit
def _chunk_ranks(ids, local, EXPERTS: tl.constexpr):
    """(one-hot [n, EXPERTS] int32, rank of each pair among the chunk's earlier pairs of its
    expert [n]) for a chunk's expert ids [n] (-1 = no pair)."""
    experts = tl.arange(0, EXPERTS)  # [EXPERTS]
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [n, EXPERTS]
    earlier_same = (ids[None, :] == ids[:, None]) & (local[None, :] < local[:, None])
    return onehot, tl.sum(earlier_same.to(tl.int32), axis=1)


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_blocks"])
def align_single_kernel(
    topk_ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    max_rows,
    max_blocks,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
    EXPERTS: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program aligns all pairs: one-hot [PAIRS, EXPERTS] histogram, and each pair's rank
    within its expert from a [PAIRS, PAIRS] comparison with the earlier pairs (stable)."""
    pairs = tl.arange(0, PAIRS)  # [PAIRS]
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1).to(tl.int32)  # [PAIRS]
    onehot, rank = _chunk_ranks(ids, pairs, EXPERTS)
    counts = tl.sum(onehot, axis=0)  # [EXPERTS]
    padded_start = _write_layout(
        counts, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
        max_rows, max_blocks, BLOCK_M, EXPERTS, FILL,
    )  # fmt: skip
    pair_start = tl.sum(onehot * padded_start[None, :], axis=1)  # [PAIRS]
    tl.store(sorted_ptr + pair_start + rank, pairs, mask=valid & (ids >= 0))


@triton.jit(do_not_specialize=["num_pairs"])
def align_count_kernel(
    topk_ids_ptr, hist_ptr, num_pairs, CHUNK: tl.constexpr, EXPERTS: tl.constexpr
):
    """Program g: histogram of the experts of pairs [g * CHUNK, (g + 1) * CHUNK)."""
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    experts = tl.arange(0, EXPERTS)  # [EXPERTS]
    hist = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)  # [EXPERTS]
    tl.store(hist_ptr + chunk * EXPERTS + experts, hist)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_rows", "max_blocks"])
def align_scan_kernel(
    hist_ptr,
    expert_start_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    num_chunks,
    max_rows,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,
    SCAN_ROWS: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program: the chunks' histograms become, in place, each chunk's count of earlier
    pairs per expert; then the layout (`_write_layout`) and each expert's first row."""
    experts = tl.arange(0, EXPERTS)  # [EXPERTS]
    scan_rows = tl.arange(0, SCAN_ROWS)  # [SCAN_ROWS]
    running = tl.zeros([EXPERTS], dtype=tl.int32)
    for chunk0 in range(0, num_chunks, SCAN_ROWS):
        chunks = chunk0 + scan_rows  # [SCAN_ROWS]
        ptrs = hist_ptr + chunks[:, None] * EXPERTS + experts[None, :]  # [SCAN_ROWS, EXPERTS]
        in_range = (chunks < num_chunks)[:, None]
        hist = tl.load(ptrs, mask=in_range, other=0)
        before = tl.cumsum(hist, axis=0) - hist + running[None, :]
        tl.store(ptrs, before, mask=in_range)
        running += tl.sum(hist, axis=0)
    padded_start = _write_layout(
        running, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
        max_rows, max_blocks, BLOCK_M, EXPERTS, FILL,
    )  # fmt: skip
    tl.store(expert_start_ptr + experts, padded_start)


@triton.jit(do_not_specialize=["num_pairs"])
def align_place_kernel(
    topk_ids_ptr,
    hist_ptr,
    expert_start_ptr,
    sorted_ptr,
    num_pairs,
    CHUNK: tl.constexpr,
    EXPERTS: tl.constexpr,
):
    """Program g: row of each pair of chunk g = its expert's first row + earlier chunks' pairs
    of that expert + the pair's rank within the chunk."""
    chunk = tl.program_id(0)
    local = tl.arange(0, CHUNK)  # [CHUNK]
    pairs = chunk * CHUNK + local
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1).to(tl.int32)  # [CHUNK]
    onehot, rank = _chunk_ranks(ids, local, EXPERTS)
    experts = tl.arange(0, EXPERTS)  # [EXPERTS]
    base = tl.load(expert_start_ptr + experts) + tl.load(hist_ptr + chunk * EXPERTS + experts)
    rows = tl.sum(onehot * base[None, :], axis=1) + rank  # [CHUNK]
    tl.store(sorted_ptr + rows, pairs, mask=valid & (ids >= 0))


def _align_torch(
    flat_ids: Tensor, num_experts: int, block_m: int, sorted_ids: Tensor, block_experts: Tensor
) -> Tensor:
    """PyTorch device ops (no host sync): fills sorted_ids and block_experts, returns the [1]
    int32 padded row count."""
    device = flat_ids.device
    num_pairs = flat_ids.shape[0]
    routed = flat_ids >= 0  # [num_pairs]; id -1: no expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat_ids.clamp(min=0), routed.long())  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    shift = (padded_end - padded) - (torch.cumsum(counts, 0) - counts)  # [E] padding before
    keys = torch.where(routed, flat_ids, num_experts)  # unrouted pairs sort last
    order = torch.argsort(keys, stable=True)  # [num_pairs] pair ids grouped by expert
    num_routed = routed.sum()  # [] stays on the device
    ranks = torch.arange(num_pairs, device=device)  # [num_pairs]
    rows = ranks + shift[keys[order].clamp(max=num_experts - 1)]  # [num_pairs]
    rows = torch.where(ranks < num_routed, rows, sorted_ids.shape[0])  # unrouted: dropped
    sorted_ids.fill_(num_pairs)
    spill = torch.empty(sorted_ids.shape[0] + 1, dtype=torch.int32, device=device)
    spill[:-1] = sorted_ids
    spill.scatter_(0, rows, order.to(torch.int32))
    sorted_ids.copy_(spill[:-1])
    first_rows = torch.arange(block_experts.shape[0], device=device) * block_m  # [blocks]
    expert = torch.searchsorted(padded_end, first_rows, right=True)  # [blocks]
    total = padded_end[-1:]  # [1]
    block_experts.copy_(torch.where(first_rows < total, expert, -1))
    return total.to(torch.int32)


def align_pairs_to_experts(
    topk_ids: Tensor, num_experts: int, block_m: int, method: str | None = None
) -> ExpertAlignment:
    """Sort a step's pairs by expert, padded per expert to block_m rows (see module docstring).

    Args:
        topk_ids: [num_tokens, top_k] int32/int64 expert ids in [0, num_experts), or -1 for a
            pair that goes to no expert (a padding token's).
        num_experts: experts of the layer (E).
        block_m: rows per GEMM block, a power of two (>= 16 for the GEMM kernels).
        method: "single" (one Triton program: small steps), "chunked" (three Triton launches:
            per-chunk histograms, one scan program, per-chunk placement) or "torch" (PyTorch
            device ops, the reference); None picks "single" when pairs x max(pairs, experts)
            (powers of two, at least 16) <= 32768, else "chunked". All give equal tensors.

    Returns:
        An `ExpertAlignment` on topk_ids' device.

    Raises:
        ValueError: block_m is not a power of two, or an unknown method.
    """
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1)  # [num_pairs]
    num_pairs = flat_ids.shape[0]
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    max_blocks = cdiv(max_rows, block_m) if max_rows else 0
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)  # written by the kernels
    pairs_p2 = max(16, next_power_of_2(num_pairs))  # >= 16: no degenerate 1-wide tiles
    experts_p2 = max(16, next_power_of_2(num_experts))
    num_elements = pairs_p2 * max(pairs_p2, experts_p2)
    if method is None:
        method = "single" if num_elements <= MAX_SINGLE_PROGRAM_ELEMENTS else "chunked"
    layout = (num_pairs, num_experts, max_rows, max_blocks)
    if num_pairs == 0:
        num_padded.zero_()
    elif method == "single":
        align_single_kernel[(1,)](
            flat_ids, sorted_ids, block_experts, num_padded, *layout,
            BLOCK_M=block_m,
            PAIRS=pairs_p2,
            EXPERTS=experts_p2,
            FILL=128,
            num_warps=8 if num_elements > 4096 else 4,
        )  # fmt: skip
    elif method == "chunked":
        _align_chunked(flat_ids, sorted_ids, block_experts, num_padded, layout, block_m, experts_p2)
    elif method == "torch":
        num_padded = _align_torch(flat_ids.long(), num_experts, block_m, sorted_ids, block_experts)
    else:
        raise ValueError(f"unknown alignment method {method!r}")
    return ExpertAlignment(sorted_ids, block_experts, num_padded, block_m, num_pairs)


def _align_chunked(
    flat_ids: Tensor,
    sorted_ids: Tensor,
    block_experts: Tensor,
    num_padded: Tensor,
    layout: tuple[int, int, int, int],
    block_m: int,
    experts_p2: int,
) -> None:
    """The three-launch Triton alignment (count, scan, place) of large steps."""
    num_pairs = layout[0]
    chunk = max(16, min(128, CHUNK_ELEMENTS // experts_p2))  # pairs per program
    num_chunks = cdiv(num_pairs, chunk)
    hist = torch.empty(num_chunks, experts_p2, dtype=torch.int32, device=flat_ids.device)
    expert_start = torch.empty(experts_p2, dtype=torch.int32, device=flat_ids.device)
    align_count_kernel[(num_chunks,)](flat_ids, hist, num_pairs, CHUNK=chunk, EXPERTS=experts_p2)
    align_scan_kernel[(1,)](
        hist, expert_start, sorted_ids, block_experts, num_padded,
        layout[0], layout[1], num_chunks, layout[2], layout[3],
        BLOCK_M=block_m,
        EXPERTS=experts_p2,
        SCAN_ROWS=max(1, min(64, 4096 // experts_p2)),
        FILL=128,  # the block-expert search is [FILL, EXPERTS] in one program: keep it small
        num_warps=8,
    )  # fmt: skip
    align_place_kernel[(num_chunks,)](
        flat_ids, hist, expert_start, sorted_ids, num_pairs, CHUNK=chunk, EXPERTS=experts_p2
    )
