"""Triton kernels: the FP8 GEMM y = x @ dequant(W)^T, weight-only or on FP8 tensor cores.

Twin of `sits.kernels.fp8_ref` (`fp8_linear_weight_only_reference`,
`fp8_linear_w8a8_reference`), in two modes (`fp8_gemm_mode`, by the number of tokens M):
- "w8a16" (decode-sized M <= W8A16_MAX_ROWS, bound by the weight bytes): one launch;
  `fp8_gemm_kernel` loads the activations in the model dtype and widens each fp8 weight tile
  to it (exact) for the tl.dot; weight scales apply per K step (block) or once after the loop.
- "w8a8" (larger M, bound by the tensor cores): two launches.
  1. `quant_fp8_group_kernel` quantizes x [M, K] dynamically: per token and 128-wide K group
     for block-scaled weights, per token (one group of K) for per-row weight scales; scale =
     amax(|group|) / 448 (1 for an all-zero group), q = float8_e4m3fn(x / scale), rounded to
     nearest even and saturated.
  2. `fp8_gemm_kernel` walks K in BLOCK_K steps of tl.dot on float8_e4m3fn operands (Hopper
     FP8 tensor cores): with block scales acc += dot * x_scale[:, None] * w_scale[None, :] per
     step; with per-row scales the tensor cores accumulate the whole K and both scales apply
     once after the loop.
  The bias is added in float32 and the tile is cast to the activation dtype once.

Invariants:
- Weight W [N, K] float8_e4m3fn, contiguous; scales float32: block [ceil(N / bn), ceil(K / bk)]
  (`weight_scale_inv` of the Qwen3-*-FP8 checkpoints), per row [N], or one element
  (per-tensor). A BLOCK_K tile never crosses an activation group or a weight scale block:
  BLOCK_K divides `group_size` and bk (checked at launch).
- Ragged M, N and K are masked (loads of fp8 outside the edges read zeros).
- No host synchronisation: both kernels are capturable in a CUDA graph.
- In Triton's CPU interpreter (tests), float32 -> float8 casts do not round to nearest even
  (triton 3.9's interpreter truncates and loses carries into the exponent), so the
  quantization kernel rounds to the e4m3 grid in float32 arithmetic first when
  `EXACT_ROUND` (set only when interpreted); the cast then only re-encodes exact values. The
  fp8 tl.dot itself runs in the interpreter as is.

Algorithm: fine-grained (1 x 128 activation, 128 x 128 weight) FP8 quantization of DeepSeek-V3
(DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 3.3), as vLLM's w8a8 block FP8 linear
applies it; FP8 formats of Micikevicius et al. 2022; grouped tile order for L2 reuse as in
Triton's matmul tutorial.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.fp8_ref import FP8_DTYPE, FP8_MAX
from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import cdiv, kernels_interpreted, next_power_of_2
from sits.kernels.tuned_table import load_table, pick

GROUP_SIZE = 128  # activation quantization group along K (DeepSeek-V3 / Qwen3-FP8)
W8A16_MAX_ROWS = 64  # up to this M the GEMM keeps activations in the model dtype
CONFIG_DIR = Path(__file__).parent / "configs"


@triton.jit
def scale_to_fp8(x, scale, FP8_MAX: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """x / scale (float32, broadcast) clamped to +-FP8_MAX, ready to cast to float8_e4m3fn;
    when EXACT_ROUND (interpreter only), rounded to the e4m3 grid (nearest even) first. NaN
    stays NaN (as torch's clamp), so a non-finite activation shows in the output."""
    v = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if EXACT_ROUND:
        exponent = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
        step_exponent = tl.maximum(exponent, 127 - 6) - 3  # 3 mantissa bits; subnormals 2^-9
        step = (step_exponent << 23).to(tl.float32, bitcast=True)
        v = ((v / step + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: round half to even
    return v


@triton.jit
def quant_fp8_group_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_q,
    stride_scale,
    GROUP_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (row, group): q[row, cols] = fp8(x[row, cols] / s), s = amax / FP8_MAX."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP_SIZE + tl.arange(0, BLOCK)  # [BLOCK]
    mask = (tl.arange(0, BLOCK) < GROUP_SIZE) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)  # torch's rounding
    v = scale_to_fp8(x, scale, FP8_MAX, EXACT_ROUND)
    tl.store(q_ptr + row * stride_q + cols, v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_scale + group, scale)


@triton.jit
def fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_bsk,
    stride_cm,
    GROUP_K: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    A_FP8: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program pid: the [BLOCK_M, BLOCK_N] tile of c = (a * a_scale) @ (b * b_scale)^T.

    A_FP8 (W8A8): a [M, K] fp8 with a_scale [M, ceil(K / GROUP_K)], or one scale per row
    applied after the loop when PER_TOKEN (per-row weight scales only). Else (W8A16): a in
    the model dtype, no a_scale; b's fp8 values are widened to a's dtype (exact) for the dot.
    b [N, K] fp8 with b_scale [ceil(N / SCALE_BLOCK_N), ceil(K / SCALE_BLOCK_K)] when
    BLOCK_SCALES (applied per K step), else per row after the loop (b_scale + n * stride_bsn;
    stride 0 for one per-tensor scale). DOT_IEEE: float32 a multiplied in full precision.
    """
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
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
    rows_n = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = k_step * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < K
        a = tl.load(
            a_ptr + rows_m[:, None] * stride_am + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K] fp8 (W8A8) or the model dtype (W8A16)
        b = tl.load(
            b_ptr + rows_n[None, :] * stride_bn + offs_k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N] fp8 (W^T)
        if not A_FP8:
            b = b.to(a.dtype)  # exact: every e4m3 value is a float16 / bfloat16 value
        if BLOCK_SCALES or (A_FP8 and not PER_TOKEN):
            if DOT_IEEE:
                partial = tl.dot(a, b, input_precision="ieee")
            else:
                partial = tl.dot(a, b)  # [BLOCK_M, BLOCK_N] float32
            if A_FP8:
                a_scale = tl.load(
                    a_scale_ptr + rows_m * stride_asm + k0 // GROUP_K, mask=mask_m, other=0.0
                )
                partial = partial * a_scale[:, None]
            if BLOCK_SCALES:
                b_scale = tl.load(
                    b_scale_ptr
                    + (offs_n // SCALE_BLOCK_N) * stride_bsn
                    + (k0 // SCALE_BLOCK_K) * stride_bsk,
                    mask=mask_n,
                    other=0.0,
                )  # [BLOCK_N]
                partial = partial * b_scale[None, :]
            acc += partial
        elif DOT_IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)  # scales after the loop: the tensor cores accumulate
    if A_FP8 and PER_TOKEN:
        token_scale = tl.load(a_scale_ptr + rows_m * stride_asm, mask=mask_m, other=0.0)
        acc = acc * token_scale[:, None]
    if not BLOCK_SCALES:
        row_scale = tl.load(b_scale_ptr + rows_n * stride_bsn, mask=mask_n, other=0.0)
        acc = acc * row_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True, slots=True)
class Fp8GemmConfig:
    """Launch shape of the FP8 GEMM.

    Attributes:
        block_m, block_n, block_k: tile (powers of two >= 16; block_k divides the activation
            group and the weight's K scale block).
        group_m: row tiles swept together for L2 reuse of weight tiles (>= 1).
        num_warps, num_stages: Triton launch parameters.
    """

    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("group_m", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_json(cls, entry: dict) -> Fp8GemmConfig:
        """Parse {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
        (all but BLOCK_M and BLOCK_N optional)."""
        return cls(
            block_m=int(entry["BLOCK_M"]),
            block_n=int(entry["BLOCK_N"]),
            block_k=int(entry.get("BLOCK_K", 128)),
            group_m=int(entry.get("GROUP_M", 8)),
            num_warps=int(entry.get("num_warps", 4)),
            num_stages=int(entry.get("num_stages", 3)),
        )


def fp8_gemm_mode(num_rows: int) -> str:
    """The kernel's mode at M = num_rows: "w8a16" (decode-sized M: the weight bytes bound the
    time, so the activations stay in the model dtype and no quantization launch is spent) or
    "w8a8" (activations quantized to FP8: the FP8 tensor cores' throughput)."""
    return "w8a16" if num_rows <= W8A16_MAX_ROWS else "w8a8"


def default_config(num_rows: int, num_cols: int) -> Fp8GemmConfig:
    """Untuned launch shape by M (rows) and N (columns); `bench/kernels/fp8_gemm_tune.py`
    writes tuned ones.

    Decode (M <= 64) is bound by the weight bytes: small row tiles, narrow column tiles so
    that enough programs cover the SMs (H200 tuning: 16 x 32 tiles, 4-5 stages). Prefill is
    bound by the tensor cores: 64-128 x 128 tiles.
    """
    if num_rows <= 16:
        return Fp8GemmConfig(16, 32, 128, group_m=1, num_warps=4, num_stages=5)
    if num_rows <= 64:
        return Fp8GemmConfig(64, 32, 128, group_m=1, num_warps=4, num_stages=5)
    if num_rows <= 256 or num_cols < 2048:
        return Fp8GemmConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=3)
    return Fp8GemmConfig(128, 128, 128, group_m=8, num_warps=8, num_stages=3)


def config_file_name(num_cols: int, num_inner: int, device_name: str, scales: str = "block") -> str:
    """`fp8_gemm_N{N}_K{K}_{gpu}.json` (128 x 128 block scales) or
    `fp8_gemm_channel_N{N}_K{K}_{gpu}.json` (per-row scales): tuned configs keyed by M."""
    kind = "" if scales == "block" else f"{scales}_"
    return f"fp8_gemm_{kind}N{num_cols}_K{num_inner}_{device_name.replace(' ', '_')}.json"


def select_config(
    num_rows: int,
    num_cols: int,
    num_inner: int,
    device_name: str,
    config_dir: Path = CONFIG_DIR,
    scales: str = "block",
) -> Fp8GemmConfig:
    """The tuned entry of the smallest key >= M (the largest key past all), else the default.

    scales: "block" or "channel" (per-row and per-tensor weight scales)."""
    name = config_file_name(num_cols, num_inner, device_name, scales)
    tuned = pick(load_table(config_dir / name, Fp8GemmConfig.from_json), num_rows)
    return tuned if tuned is not None else default_config(num_rows, num_cols)


@functools.lru_cache(maxsize=16)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.lru_cache(maxsize=16)
def fp8_gemm_supported(device: torch.device) -> bool:
    """True when the kernels run on `device`: FP8 tensor cores (sm_89+) or the interpreter."""
    if device.type != "cuda":
        return device.type == "cpu" and kernels_interpreted()
    return torch.cuda.get_device_capability(device) >= (8, 9)


def triton_quant_fp8_group(x: Tensor, group_size: int = GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """Dynamic per-token, per-group FP8 quantization of activations.

    Args:
        x: [M, K] float32/float16/bfloat16, contiguous last dimension.
        group_size: K elements per scale.

    Returns:
        (q [M, K] float8_e4m3fn, scale [M, ceil(K / group_size)] float32), x ~= q * scale.
    """
    num_rows, num_inner = x.shape
    q = torch.empty(num_rows, num_inner, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, cdiv(num_inner, group_size), dtype=torch.float32, device=x.device)
    if num_rows == 0 or num_inner == 0:
        return q, scale
    quant_fp8_group_kernel[(num_rows, scale.shape[1])](
        x, q, scale, num_inner, x.stride(0), q.stride(0), scale.stride(0),
        GROUP_SIZE=group_size, BLOCK=next_power_of_2(group_size), FP8_MAX=FP8_MAX,
        EXACT_ROUND=kernels_interpreted(), num_warps=4, **pdl_args(q),
    )  # fmt: skip
    return q, scale


def triton_fp8_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    block: tuple[int, int] | None = None,
    config: Fp8GemmConfig | None = None,
    group_size: int = GROUP_SIZE,
    mode: str | None = None,
) -> Tensor:
    """y = x @ dequantize(weight).T (+ bias) on FP8 weights.

    Modes (`fp8_gemm_mode` picks one by M when None):
    - "w8a16": x stays in its dtype; the fp8 weight tile is widened in the kernel (the
      reference is `fp8_ref.fp8_linear_weight_only_reference`).
    - "w8a8": x is quantized to FP8 first, per token and `group_size`-wide K group for block
      scales, per token (one scale per row) for per-row / per-tensor weight scales, whose
      scales then apply once after the K loop (`fp8_ref.fp8_linear_w8a8_reference` with
      group_size K).

    Args:
        x: [..., K] float32/float16/bfloat16 (contiguous last dimension).
        weight: [N, K] float8_e4m3fn, contiguous.
        weight_scale: float32, [ceil(N / bn), ceil(K / bk)] when `block`, else [N] or one
            element (per-tensor).
        bias: [N] or None.
        block: (bn, bk) of a block-scaled weight, None for per-row / per-tensor scales.
        config: launch shape; None picks a tuned or default one by shape.
        group_size: activation quantization group along K (block scales, "w8a8").
        mode: "w8a16", "w8a8" or None.

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: shapes, dtypes or modes the kernel does not compute.
    """
    num_cols, num_inner = weight.shape
    if weight.dtype != FP8_DTYPE or not weight.is_contiguous():
        raise ValueError(f"expected a contiguous {FP8_DTYPE} weight, got {weight.dtype}")
    if x.shape[-1] != num_inner:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {num_inner}")
    x2 = x.reshape(-1, num_inner)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    mode = mode or fp8_gemm_mode(num_rows)
    if mode not in ("w8a16", "w8a8"):
        raise ValueError(f"unknown FP8 GEMM mode {mode!r} (w8a16 or w8a8)")
    scale = weight_scale.float()
    if block is not None:
        expected = (cdiv(num_cols, block[0]), cdiv(num_inner, block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(f"block scales of shape {tuple(scale.shape)}, expected {expected}")
        stride_bsn, stride_bsk = scale.stride(0), scale.stride(1)
    elif scale.numel() == 1:
        scale, stride_bsn, stride_bsk = scale.reshape(1), 0, 0
    elif tuple(scale.shape) == (num_cols,):
        stride_bsn, stride_bsk = scale.stride(0), 0
    else:
        raise ValueError(f"per-row scales of shape {tuple(scale.shape)}, expected ({num_cols},)")
    per_token = mode == "w8a8" and block is None
    if config is None:
        scales = "block" if block is not None else "channel"
        config = select_config(num_rows, num_cols, num_inner, _device_name(x.device), scales=scales)
    grouped = mode == "w8a8" and block is not None
    if (grouped and group_size % config.block_k) or (
        block is not None and block[1] % config.block_k
    ):
        raise ValueError(
            f"BLOCK_K {config.block_k} must divide the activation group {group_size} and the "
            f"weight's K scale block {block}"
        )
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out.reshape(*x.shape[:-1], num_cols)
    if num_inner == 0:
        out.zero_() if bias is None else out.copy_(bias.to(x.dtype).expand_as(out))
        return out.reshape(*x.shape[:-1], num_cols)
    if mode == "w8a8":
        q, x_scale = triton_quant_fp8_group(x2, num_inner if per_token else group_size)
    else:
        q, x_scale = x2, scale  # x_scale unused: no activation scales in W8A16
    grid = (cdiv(num_rows, config.block_m) * cdiv(num_cols, config.block_n),)
    fp8_gemm_kernel[grid](
        q, x_scale, weight, scale, bias if bias is not None else out, out,
        num_rows, num_cols, num_inner,
        q.stride(0), x_scale.stride(0) if mode == "w8a8" else 0, weight.stride(0),
        stride_bsn, stride_bsk, out.stride(0),
        GROUP_K=num_inner if per_token else group_size,
        SCALE_BLOCK_N=block[0] if block is not None else 1,
        SCALE_BLOCK_K=block[1] if block is not None else 1,
        BLOCK_SCALES=block is not None, A_FP8=mode == "w8a8", PER_TOKEN=per_token,
        DOT_IEEE=mode == "w8a16" and x.dtype == torch.float32, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_args(out),
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], num_cols)
