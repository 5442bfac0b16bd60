"""Triton kernels: the w4a16 GEMM y = x @ dequantize(W)^T with packed INT4 weights.

Twin of `sits.kernels.int4_ref.w4a16_linear` (dequantize, then matmul). Each program owns a
[BLOCK_M, BLOCK_N] output tile and walks its share of K in BLOCK_K steps; every step loads the
[BLOCK_K / 8, BLOCK_N] packed words of its weight rows once (`load_int4_words`) and runs eight
tl.dots accumulated in float32, one per nibble position j (`int4_plane`): the weights of
columns 8 * word + j, dequantized with the group zero point and scale in float32 and cast to
the activation dtype, times the activation columns 8 * word + j (a stride-8 load of x). A dot
product is a sum over K in any order, so no unpacked tile is ever reshaped or transposed.
Many rows (prefill) instead dequantize the weight once (`dequant_int4_kernel`) and multiply
with cuBLAS (`W4a16Config.dequantize_first`): the fused GEMM would dequantize each weight
tile once per row tile.
The bias is added in float32 and the tile is cast to the activation dtype once.

Decode (few rows) is bound by the weight bytes: a small BLOCK_N and split-K give enough
programs to keep every SM streaming. With SPLIT_K > 1 each split writes its float32 partial
tile to a [SPLIT_K, M, N] buffer and `splitk_reduce_kernel` sums the splits in a fixed order
(deterministic, no atomics), adds the bias and casts.

Invariants:
- The weight layout of `kernels.int4_ref`: packed [N, K / 8] int32, scale [N, K / G] float32,
  zero [N, K / G] uint8 or None (symmetric, 8); G a multiple of 8, so a word never crosses a
  group, and K a multiple of G. The dequantized tile is bit-identical to `dequantize_int4`
  (same float32 arithmetic, same cast), so the result differs from the reference only by the
  float32 summation order (and where the reference accumulates in bf16/fp16).
- GPTQ `desc_act` (`g_idx`) is not computed here: its layers stay on the reference.
- Ragged M, N and K tiles are masked (weight rows past N are clamped for loads, never stored).
- No host synchronisation: both kernels are capturable in a CUDA graph.

Algorithm: group-wise weight-only quantized GEMM with dequantization fused in the K loop, as
in GPTQ's Triton kernel (Frantar et al. 2022) and vLLM's AWQ Triton GEMM; split-K for skinny
GEMMs (as in CUTLASS's split-K reduction); grouped tile order for L2 reuse as in Triton's
matmul tutorial.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.int4_ref import PACK
from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import cdiv, kernels_interpreted
from sits.kernels.tuned_table import load_table, pick

CONFIG_DIR = Path(__file__).parent / "configs"
REDUCE_BLOCK_N = 256  # output columns per program of the split-K reduction
MIN_BLOCK_K = 128  # the eight per-nibble dots of a step span BLOCK_K / 8 >= 16 columns each
DEQUANT_BLOCK_N, DEQUANT_BLOCK_K = 32, 128  # weight tile per program of `dequant_int4_kernel`


@triton.jit
def dequant_int4_tile(
    packed_ptr,
    scale_ptr,
    zero_ptr,
    rows,
    k0,
    K,
    stride_p,
    stride_s,
    stride_z,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """The [BLOCK_K, BLOCK_N] transposed weight tile (u - zero) * scale of columns k0 + 0 ..
    BLOCK_K - 1, in DTYPE (for `dequant_int4_kernel`; no tl.dot reads it, so the 8-fold word
    loads are never staged in shared memory).

    rows [BLOCK_N] int64 weight rows (in bounds). Columns past K dequantize to 0 (scale 0).
    Each column loads its word k // 8 (the 8 columns of a word share its cache line) and
    shifts out nibble k % 8. When GROUP_SIZE is a multiple of BLOCK_K the whole step lies in
    one group (and K needs no mask: it is a multiple of G): one scale (zero) per row.
    Pointers may be offset to an expert already.
    """
    ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    k_ok = (ks < K)[:, None]  # [BLOCK_K, 1]
    packed = tl.load(packed_ptr + rows[None, :] * stride_p + (ks // 8)[:, None], mask=k_ok, other=0)
    codes = (packed >> ((ks % 8) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
    if GROUP_SIZE % BLOCK_K == 0:
        group = k0 // GROUP_SIZE
        scale = tl.load(scale_ptr + rows * stride_s + group)[None, :]  # [1, BLOCK_N]
        if HAS_ZERO:
            offset = tl.load(zero_ptr + rows * stride_z + group).to(tl.float32)[None, :]
        else:
            offset = 8.0
    else:
        groups = (ks // GROUP_SIZE)[:, None]  # [BLOCK_K, 1]
        scale = tl.load(scale_ptr + rows[None, :] * stride_s + groups, mask=k_ok, other=0.0)
        if HAS_ZERO:
            zero = tl.load(zero_ptr + rows[None, :] * stride_z + groups, mask=k_ok, other=0)
            offset = zero.to(tl.float32)
        else:
            offset = 8.0
    return ((codes.to(tl.float32) - offset) * scale).to(DTYPE)  # float32 as the reference


@triton.jit
def load_int4_words(
    packed_ptr,
    scale_ptr,
    zero_ptr,
    rows,
    word0,
    num_words,
    stride_p,
    stride_s,
    stride_z,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The packed words [BLOCK_K / 8, BLOCK_N] int32 of weight rows `rows` [BLOCK_N] (int64,
    in bounds) and word columns word0 + 0 .. BLOCK_K / 8 - 1, with their float32 scales and zero
    points (8 when symmetric), each [1, BLOCK_N] when the group spans the whole step (G a
    multiple of BLOCK_K; K is then a multiple of BLOCK_K too), else [BLOCK_K / 8, BLOCK_N].
    Words at or past num_words load as 0 with scale 0 (they dequantize to 0).
    """
    words = word0 + tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8]
    word_ok = (words < num_words)[:, None]  # [BLOCK_K / 8, 1]
    packed = tl.load(packed_ptr + rows[None, :] * stride_p + words[:, None], mask=word_ok, other=0)
    if GROUP_SIZE % BLOCK_K == 0:
        group = word0 // (GROUP_SIZE // 8)  # the step's one group
        scale = tl.load(scale_ptr + rows * stride_s + group)[None, :]
        if HAS_ZERO:
            offset = tl.load(zero_ptr + rows * stride_z + group).to(tl.float32)[None, :]
        else:
            offset = tl.zeros_like(scale) + 8.0
    else:
        groups = (words // (GROUP_SIZE // 8))[:, None]  # [BLOCK_K / 8, 1]
        scale = tl.load(scale_ptr + rows[None, :] * stride_s + groups, mask=word_ok, other=0.0)
        if HAS_ZERO:
            zero = tl.load(zero_ptr + rows[None, :] * stride_z + groups, mask=word_ok, other=0)
            offset = zero.to(tl.float32)
        else:
            offset = tl.zeros_like(scale) + 8.0
    return packed, scale, offset


@triton.jit
def int4_plane(packed, scale, offset, J: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble J of every word as weights (u - zero) * scale in DTYPE: [BLOCK_K / 8, BLOCK_N],
    the weight columns 8 * word + J (float32 arithmetic as `int4_ref.dequantize_int4`)."""
    codes = (packed >> (4 * J)) & 0xF
    return ((codes.to(tl.float32) - offset) * scale).to(DTYPE)


@triton.jit
def w4a16_gemm_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_zn,
    stride_om,
    stride_split,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (tile, split): the [BLOCK_M, BLOCK_N] tile of x @ W^T over the split's K steps.

    SPLIT_K == 1: bias, cast and store to out [M, N]; else the float32 partial is stored to
    out + split * stride_split (a [SPLIT_K, M, N] buffer, `splitk_reduce_kernel` finishes).
    """
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_rows = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_rows
    pid_n = (pid % num_pid_in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_m = offs_m.to(tl.int64)
    rows_n = (offs_n % N).to(tl.int64)  # clamped: loads stay in bounds, stores are masked
    num_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(num_steps, SPLIT_K)
    first_step = pid_k * steps_per_split
    last_step = min(first_step + steps_per_split, num_steps)
    word_ids = tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8]
    x_rows = x_ptr + rows_m[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first_step, last_step):
        word0 = step * (BLOCK_K // 8)
        words = word0 + word_ids  # [BLOCK_K / 8]
        packed, scale, offset = load_int4_words(
            packed_ptr, scale_ptr, zero_ptr, rows_n, word0, K // 8, stride_pn, stride_sn,
            stride_zn, GROUP_SIZE, HAS_ZERO, BLOCK_K,
        )  # fmt: skip
        a_ok = mask_m[:, None] & (words < K // 8)[None, :]  # [BLOCK_M, BLOCK_K / 8]
        for j in tl.static_range(8):  # columns 8 * word + j: one dot per nibble
            a = tl.load(x_rows + (words * 8 + j)[None, :], mask=a_ok, other=0.0)
            w = int4_plane(packed, scale, offset, j, x_ptr.dtype.element_ty)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c_ptrs = out_ptr + rows_m[:, None] * stride_om + offs_n[None, :]
        tl.store(c_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        c_ptrs = out_ptr + pid_k * stride_split + rows_m[:, None] * stride_om + offs_n[None, :]
        tl.store(c_ptrs, acc, mask=mask)


@triton.jit
def splitk_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    N,
    stride_split,
    stride_pm,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (row, column block): out = sum of the SPLIT_K partials in order (+ bias)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(
            partial_ptr + split * stride_split + row * stride_pm + cols, mask=col_ok, other=0.0
        )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def dequant_int4_kernel(
    packed_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    N,
    K,
    stride_pn,
    stride_sn,
    stride_zn,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (row block, column block): out[rows, cols] = dequantized weight, out's dtype."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k0 = tl.program_id(1) * BLOCK_K
    w = dequant_int4_tile(
        packed_ptr, scale_ptr, zero_ptr, (rows % N).to(tl.int64), k0, K, stride_pn, stride_sn,
        stride_zn, GROUP_SIZE, HAS_ZERO, BLOCK_K, out_ptr.dtype.element_ty,
    )  # fmt: skip  # [BLOCK_K, BLOCK_N]
    cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    o_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_on + cols[:, None]
    tl.store(o_ptrs, w, mask=(rows < N)[None, :] & (cols < K)[:, None])


@dataclass(frozen=True, slots=True)
class W4a16Config:
    """Launch shape of the w4a16 GEMM.

    Attributes:
        block_m, block_n, block_k: tile (powers of two, >= 16; block_k >= 128: each of its
            eight dots spans block_k / 8 >= 16 columns).
        split_k: K splits, each its own program (>= 1; > 1 adds the reduction launch).
        group_m: row tiles swept together for L2 reuse of weight tiles (>= 1).
        num_warps, num_stages: Triton launch parameters.
        dequantize_first: instead of the fused GEMM, dequantize the whole weight to the
            activation dtype (`dequant_int4_kernel`) and multiply with cuBLAS (`F.linear`):
            cheaper for many rows, where the fused GEMM dequantizes each weight tile once per
            row tile; the tile fields are then unused.
    """

    block_m: int
    block_n: int
    block_k: int = 128
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    dequantize_first: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.block_k < MIN_BLOCK_K:
            raise ValueError(
                f"block_k must be >= {MIN_BLOCK_K} (16 words a dot), got {self.block_k}"
            )
        for name in ("split_k", "group_m", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_json(cls, entry: dict) -> W4a16Config:
        """Parse {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M", "num_warps",
        "num_stages", "DEQUANTIZE_FIRST"} (all but BLOCK_M and BLOCK_N optional)."""
        return cls(
            block_m=int(entry["BLOCK_M"]),
            block_n=int(entry["BLOCK_N"]),
            block_k=int(entry.get("BLOCK_K", 128)),
            split_k=int(entry.get("SPLIT_K", 1)),
            group_m=int(entry.get("GROUP_M", 8)),
            num_warps=int(entry.get("num_warps", 4)),
            num_stages=int(entry.get("num_stages", 3)),
            dequantize_first=bool(entry.get("DEQUANTIZE_FIRST", False)),
        )


def default_config(num_rows: int, num_cols: int, num_inner: int, num_sms: int) -> W4a16Config:
    """Untuned launch shape by M (rows), N (columns), K and the device's SM count.

    Decode (M <= 16) streams the weight: 16-row tiles, 64-wide column tiles and split-K up to
    about four programs per SM (each split keeping at least four K steps); on an H200 this
    sweep's best shape within 10% at Llama-3.1-8B / Qwen3-30B-A3B projections. Up to 64 rows:
    the fused GEMM on 32-row tiles. Past that the weight is dequantized once for cuBLAS (the
    best measured shape at 256 and 4,096 rows: within 1.07x of bf16 at 4,096).
    """
    if num_rows <= 16:
        block_n, block_k = 64, 128
        tiles = cdiv(num_cols, block_n)
        split_k = max(1, min(cdiv(4 * num_sms, tiles), cdiv(num_inner, 4 * block_k), 16))
        return W4a16Config(16, block_n, block_k, split_k, 1, num_warps=4, num_stages=4)
    if num_rows <= 64:
        return W4a16Config(32, 64, 128, 1, group_m=8, num_warps=4, num_stages=4)
    return W4a16Config(64, 64, 128, dequantize_first=True)


def config_file_name(num_cols: int, num_inner: int, group_size: int, device_name: str) -> str:
    """`w4a16_gemm_N{N}_K{K}_G{G}_{gpu}.json`: tuned configs keyed by M (as the MoE's)."""
    gpu = device_name.replace(" ", "_")
    return f"w4a16_gemm_N{num_cols}_K{num_inner}_G{group_size}_{gpu}.json"


def select_config(
    num_rows: int,
    num_cols: int,
    num_inner: int,
    group_size: int,
    device: torch.device,
    config_dir: Path = CONFIG_DIR,
) -> W4a16Config:
    """The tuned entry of the smallest key >= M (the largest key past all), else the default."""
    name, num_sms = _device_info(device)
    path = config_dir / config_file_name(num_cols, num_inner, group_size, name)
    tuned = pick(load_table(path, W4a16Config.from_json), num_rows)
    return tuned if tuned is not None else default_config(num_rows, num_cols, num_inner, num_sms)


@functools.lru_cache(maxsize=16)
def _device_info(device: torch.device) -> tuple[str, int]:
    """(device name, SM count); ("cpu", 1) off CUDA."""
    if device.type != "cuda":
        return "cpu", 1
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count


@functools.lru_cache(maxsize=16)
def w4a16_gemm_supported(device: torch.device) -> bool:
    """True when the kernels run on `device`: a CUDA device (sm_80+, bf16 tensor cores) or the
    interpreter on the CPU."""
    if device.type != "cuda":
        return device.type == "cpu" and kernels_interpreted()
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def triton_dequantize_int4(
    packed: Tensor, scale: Tensor, zero: Tensor | None, group_size: int, dtype: torch.dtype
) -> Tensor:
    """`int4_ref.dequantize_int4` (no g_idx) in one launch: [N, K] in `dtype`, bit-identical.

    Args: packed [N, K / 8] int32, scale [N, K / G] float32, zero [N, K / G] uint8 or None,
    each with unit stride along its last dimension; group_size G.
    """
    num_cols, num_inner = packed.shape[0], packed.shape[1] * PACK
    out = torch.empty(num_cols, num_inner, dtype=dtype, device=packed.device)
    grid = (cdiv(num_cols, DEQUANT_BLOCK_N), cdiv(num_inner, DEQUANT_BLOCK_K))
    dequant_int4_kernel[grid](
        packed, scale, zero if zero is not None else packed, out, num_cols, num_inner,
        packed.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0,
        out.stride(0), GROUP_SIZE=group_size, HAS_ZERO=zero is not None,
        BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K, num_warps=4,
    )  # fmt: skip
    return out


def triton_w4a16_linear(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
    config: W4a16Config | None = None,
) -> Tensor:
    """y = x @ dequantize_int4(packed, scale, zero).T (+ bias), dequantized in the kernel.

    Args:
        x: [..., K] float32/float16/bfloat16.
        packed: [N, K / 8] int32 (layout of `kernels.int4_ref`), unit stride along K / 8.
        scale: [N, K / G] float32, unit stride along K / G.
        zero: [N, K / G] uint8 codes (unit stride along K / G), or None (symmetric: 8).
        group_size: G, a multiple of 8 dividing K.
        bias: [N] or None.
        config: launch shape; None picks a tuned or default one by shape.

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: shapes or dtypes the kernel does not compute.
    """
    num_cols, num_words = packed.shape
    num_inner = num_words * PACK
    if packed.dtype != torch.int32 or packed.stride(1) != 1:
        raise ValueError(f"expected packed int32 words with unit stride, got {packed.dtype}")
    if x.shape[-1] != num_inner:
        raise ValueError(f"x has {x.shape[-1]} columns, the packed weight {num_inner}")
    if group_size % PACK or num_inner % group_size:
        raise ValueError(f"group size {group_size} must be a multiple of 8 dividing {num_inner}")
    groups = (num_cols, num_inner // group_size)
    scale = scale.float()
    if tuple(scale.shape) != groups or (zero is not None and tuple(zero.shape) != groups):
        raise ValueError(f"scale / zero must be {groups}, got {tuple(scale.shape)}")
    if scale.stride(1) != 1:
        scale = scale.contiguous()
    if zero is not None and (zero.dtype != torch.uint8 or zero.stride(1) != 1):
        zero = zero.to(torch.uint8).contiguous()
    x2 = x.reshape(-1, num_inner)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out.reshape(*x.shape[:-1], num_cols)
    if config is None:
        config = select_config(num_rows, num_cols, num_inner, group_size, x.device)
    if config.dequantize_first:
        weight = triton_dequantize_int4(packed, scale, zero, group_size, x.dtype)  # [N, K]
        return F.linear(x, weight, bias)
    split_k = min(config.split_k, cdiv(num_inner, config.block_k))
    target = (
        out if split_k == 1 else out.new_empty(split_k, num_rows, num_cols, dtype=torch.float32)
    )
    bias_arg = bias if bias is not None else out
    grid = (cdiv(num_rows, config.block_m) * cdiv(num_cols, config.block_n), split_k)
    w4a16_gemm_kernel[grid](
        x2, packed, scale, zero if zero is not None else packed, bias_arg, target,
        num_rows, num_cols, num_inner,
        x2.stride(0), packed.stride(0), scale.stride(0),
        zero.stride(0) if zero is not None else 0, target.stride(-2),
        target.stride(0) if split_k > 1 else 0,
        GROUP_SIZE=group_size, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
        SPLIT_K=split_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m,
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(out),
    )  # fmt: skip
    if split_k > 1:
        splitk_reduce_kernel[(num_rows, cdiv(num_cols, REDUCE_BLOCK_N))](
            target, bias_arg, out, num_cols, target.stride(0), target.stride(1), out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK_N=REDUCE_BLOCK_N, num_warps=4,
            **pdl_args(out),
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], num_cols)
