"""`TritonPagedAttention`: the GPU `AttentionBackend`, Triton twin of `TorchPagedAttention`.

Each forward writes the step's K/V into the paged cache (`kv_write_triton`), then attends:
- every sequence with exactly one new token goes to the decode kernel (GQA heads of a kv head
  together, split-K over long contexts, `attention_decode_triton`);
- every sequence with more goes to the prefill kernel (variable lengths, chunked prefill over
  a cached prefix, causal, `attention_prefill_triton`).
A pure decode batch launches only the decode kernel (and its combine kernel when split); a
mixed batch launches both, each skipping the other's sequences on the device.
The cache is a tensor in the query dtype or a `QuantizedKVCache` (fp8 / int8, as for
`TorchPagedAttention`): the write kernel quantizes (fp8: after a calibration kernel that
returns at once once the heads are calibrated), the attention kernels dequantize on load.

Invariants:
- Same contract as `attention_ref.TorchPagedAttention`: all K/V of the step are written before
  any attention reads the cache; output [num_tokens, num_heads, head_dim] in the query dtype;
  rows outside every sequence's new tokens (padding) are zero.
- Only the metadata's CPU fields and tensor shapes drive host control flow: no device syncs,
  so a decode step can be captured in a CUDA graph (fix `decode_num_splits` for capture, since
  the heuristic reads max_seq_len).
- Launch parameters live in one frozen `TritonAttentionConfig`; defaults aim at an H200 in
  bfloat16 with head_dim 64/128 and block_size 16 (to be tuned by bench/kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sits.core.errors import InvalidParameterError
from sits.kernels.attention_decode_triton import triton_decode_attention
from sits.kernels.attention_prefill_triton import triton_prefill_attention
from sits.kernels.kv_quant_ref import QuantizedKVCache
from sits.kernels.kv_write_triton import triton_write_kv, triton_write_kv_quantized
from sits.kernels.triton_utils import cdiv, triton_runs_on

if TYPE_CHECKING:
    from sits.kernels.attention_metadata import AttentionMetadata

H200_NUM_SMS = 132  # streaming multiprocessors of an H200 SXM (and an H100 SXM)


@dataclass(frozen=True, slots=True)
class TritonAttentionConfig:
    """Launch parameters of the paged attention kernels.

    Attributes:
        prefill_block_m: rows per prefill tile (new tokens x padded GQA group heads).
        prefill_block_n: key positions per prefill tile.
        prefill_num_warps, prefill_num_stages: prefill launch parameters.
        decode_block_n: key positions per decode tile.
        decode_block_n_quantized: key positions per decode tile over an fp8/int8 cache (1-byte
            tiles; on an H200 128 was 1.2-1.4x faster than 64, bench/kernels/
            attention_quant_bench.py).
        decode_num_warps, decode_num_stages: decode launch parameters.
        decode_num_splits: fixed split count of each decode context; None = `choose_num_splits`.
        decode_target_programs: the heuristic splits until (seqs x kv heads x splits) reaches
            this (about two programs per SM).
        decode_min_split_tokens: the heuristic never makes a split shorter than this.
        decode_max_splits: the heuristic's ceiling.
        kv_write_num_warps: warps per token of the KV write kernel.
        fixed_max_query_len: graph mode for mixed steps: when set, every call zero-fills the
            output and launches the decode kernel (with `decode_num_splits`, which must be set)
            and the prefill kernel (grid sized for this many new tokens per sequence) over all
            the metadata's sequences, whatever its CPU fields say; sequences without new
            tokens and rows outside every sequence (token padding) are left zero. The launches
            then depend on tensor shapes only, so a CUDA graph can capture them. None: plan
            each call from the CPU fields (eager).

    Raises:
        InvalidParameterError: a block size that is not a power of two >= 16, or a count < 1.
    """

    prefill_block_m: int = 64
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2
    decode_block_n: int = 64
    decode_block_n_quantized: int = 128
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    decode_num_splits: int | None = None
    decode_target_programs: int = 2 * H200_NUM_SMS
    decode_min_split_tokens: int = 256
    decode_max_splits: int = 32
    kv_write_num_warps: int = 4
    fixed_max_query_len: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "prefill_block_m",
            "prefill_block_n",
            "decode_block_n",
            "decode_block_n_quantized",
        ):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise InvalidParameterError(name, f"{name} must be a power of two >= 16")
        for name in (
            "prefill_num_warps",
            "prefill_num_stages",
            "decode_num_warps",
            "decode_num_stages",
            "decode_target_programs",
            "decode_min_split_tokens",
            "decode_max_splits",
            "kv_write_num_warps",
        ):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"{name} must be >= 1")
        if self.decode_num_splits is not None and self.decode_num_splits < 1:
            raise InvalidParameterError("decode_num_splits", "decode_num_splits must be >= 1")
        if self.fixed_max_query_len is not None and (
            self.fixed_max_query_len < 1 or self.decode_num_splits is None
        ):
            raise InvalidParameterError(
                "fixed_max_query_len",
                "fixed_max_query_len must be >= 1 and needs decode_num_splits",
            )

    @classmethod
    def for_head_dim(cls, head_dim: int, **overrides: object) -> TritonAttentionConfig:
        """H200 defaults for a head size. The class defaults' prefill launch (64 x 64 tiles, 4
        warps, 2 stages) was the fastest, or within 5 % of it, on each case of the 2026-11-30
        sweep at head_dim 128 (llama and qwen3 shapes, bench/RESULTS.md); smaller heads keep
        the former 128-row tiles and 3 stages (not swept)."""
        defaults: dict[str, object] = {}
        if head_dim <= 64:
            defaults = {"prefill_block_m": 128, "prefill_num_stages": 3}
        defaults.update(overrides)
        return cls(**defaults)  # type: ignore[arg-type]


def _uninitialized(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An output buffer every row of which the kernels write (`torch.empty`; tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, config: TritonAttentionConfig
) -> int:
    """Splits per decode context: enough programs to fill the GPU, none shorter than the minimum.

    Returns config.decode_num_splits when set; otherwise
    min(max_splits, ceil(target_programs / (num_seqs * num_kv_heads)),
    ceil(max_seq_len / min_split_tokens)), at least 1.
    """
    if config.decode_num_splits is not None:
        return config.decode_num_splits
    num_programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = cdiv(config.decode_target_programs, num_programs)
    by_length = cdiv(max(1, max_seq_len), config.decode_min_split_tokens)
    return max(1, min(config.decode_max_splits, by_occupancy, by_length))


def count_single_token_seqs(metadata: AttentionMetadata) -> int:
    """Sequences of the step with exactly one new token (decodes), from the CPU fields."""
    starts = metadata.query_start_loc_cpu
    return sum(1 for begin, end in zip(starts, starts[1:]) if end - begin == 1)


class TritonPagedAttention:
    """The GPU `AttentionBackend`: Triton KV write, then Triton decode and/or prefill attention.

    Args:
        config: launch parameters; None = `TritonAttentionConfig()` (H200 defaults).
    """

    supports_quantized_kv = True  # reads and writes `QuantizedKVCache` (fp8, int8)

    def __init__(self, config: TritonAttentionConfig | None = None) -> None:
        self.config = config or TritonAttentionConfig()
        self._checked_devices: set[torch.device] = set()
        self._plan_metadata: AttentionMetadata | None = None  # last metadata seen
        self._plan_num_single = 0  # its count of one-token sequences

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor | QuantizedKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """Write key/value at metadata.slot_mapping (quantized for a quantized cache), then attend.

        Args:
            query: [num_tokens, num_heads, head_dim], contiguous last dimension.
            key, value: [num_tokens, num_kv_heads, head_dim]; cast to the cache dtype (or
                quantized).
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] in the query dtype,
                or a `QuantizedKVCache` (fp8/int8 data of that shape with a contiguous last
                dimension, contiguous float32 scales); written in place.
            metadata: the step's layout (device tensors on the query's device).
            scale: softmax scale.

        Returns:
            [num_tokens, num_heads, head_dim], query dtype.

        Raises:
            RuntimeError: the kernels cannot run on the query's device (CPU without the
                Triton interpreter, or CUDA under the interpreter).
        """
        self._check_device(query.device)
        num_warps = self.config.kv_write_num_warps
        if isinstance(kv_cache, QuantizedKVCache):
            triton_write_kv_quantized(kv_cache, key, value, metadata.slot_mapping, num_warps)
        else:
            triton_write_kv(kv_cache, key, value, metadata.slot_mapping, num_warps=num_warps)
        return self.attend(query, kv_cache, metadata, scale)

    def attend(
        self,
        query: Tensor,
        kv_cache: Tensor | QuantizedKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """Attention only (the cache already holds the step's K/V); see `forward`."""
        quantized = isinstance(kv_cache, QuantizedKVCache)
        data = kv_cache.data if quantized else kv_cache  # [2, blocks, block_size, kv_heads, dim]
        num_heads, num_kv_heads = query.shape[1], data.shape[3]
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
        assert quantized or query.dtype == data.dtype, "a plain cache must have the query dtype"
        assert metadata.block_size == data.shape[2], "metadata/cache block size mismatch"
        config = self.config
        fixed = config.fixed_max_query_len
        if fixed is not None:  # graph mode: the same launches whatever the step holds
            output = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
            num_single, max_query_len = 1, fixed
        else:
            # Every row belongs to a sequence whose kernel writes it: no zero fill (a memset
            # per layer per step); rows outside every sequence (padding) must read zero.
            covered = metadata.max_query_len > 0 and metadata.query_start_loc_cpu[-1] == len(query)
            new_output = _uninitialized if covered else torch.zeros
            output = new_output(query.shape, dtype=query.dtype, device=query.device)
            if metadata.num_seqs == 0 or metadata.max_query_len == 0:
                return output
            num_single, max_query_len = self._num_single(metadata), metadata.max_query_len
        if num_single > 0:
            num_splits = choose_num_splits(
                metadata.num_seqs, num_kv_heads, metadata.max_seq_len, config
            )
            triton_decode_attention(
                output, query, kv_cache, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, scale, num_splits,
                block_n=config.decode_block_n_quantized if quantized else config.decode_block_n,
                num_warps=config.decode_num_warps,
                num_stages=config.decode_num_stages,
            )  # fmt: skip
        if max_query_len > 1:
            triton_prefill_attention(
                output, query, kv_cache, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, scale, max_query_len,
                skip_single=num_single > 0,
                block_m=config.prefill_block_m,
                block_n=config.prefill_block_n,
                num_warps=config.prefill_num_warps,
                num_stages=config.prefill_num_stages,
            )  # fmt: skip
        return output

    def _num_single(self, metadata: AttentionMetadata) -> int:
        """One-token sequences of the step, counted once per metadata (layers share it)."""
        if metadata is not self._plan_metadata:
            self._plan_metadata = metadata
            self._plan_num_single = count_single_token_seqs(metadata)
        return self._plan_num_single

    def _check_device(self, device: torch.device) -> None:
        if device in self._checked_devices:
            return
        if not triton_runs_on(device):
            raise RuntimeError(
                f"the Triton attention kernels cannot run on {device}: they need a CUDA "
                "device, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)"
            )
        self._checked_devices.add(device)
