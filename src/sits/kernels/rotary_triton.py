"""Triton kernel: optional per-head q/k RMSNorm (Qwen3) then rotary embedding, in one launch.

Twin of `Attention`'s torch path (`RMSNorm.normalize` per head, then
`RotaryEmbedding.forward`, rotate-half / NeoX layout: dims [0, D/2) pair with [D/2, D)), with
the same rounding steps, so that results match it bit for bit up to the order of the float32
sum of squares of the norm:
    n = dtype(weight * dtype(float32(x) * rsqrt(mean(float32(x)^2) + eps)))   # if normed
    out[:D/2] = dtype(dtype(n1 * cos) - dtype(n2 * sin))
    out[D/2:] = dtype(dtype(n2 * cos) + dtype(n1 * sin))
cos and sin come from a per-position cache [max_positions, D/2] in the query dtype, built by
`RotaryEmbedding.cos_sin_cache` (every rope scaling and attention_scaling folded in there).

Invariants:
- Grid (num_tokens, query head blocks + key head blocks): a program rotates BLOCK_HEADS heads
  of q or of k for one token, so decode steps still spread over many SMs.
- q and k may be strided views into a fused QKV output (head_dim contiguous); outputs may be
  the inputs themselves (in place: each element is read before it is written, by the same
  program) or new tensors.
- Positions are clamped to the cache (an out-of-range position never reads outside it).
- Compiled with `enable_fp_fusion=False`: the compiler would otherwise contract a bfloat16
  product and the following add into one fma (one rounding instead of the reference's two).
- No host synchronisation: capturable in a CUDA graph.

Algorithms: RoPE (Su et al. 2021, "RoFormer"); RMSNorm (Zhang & Sennrich 2019); per-head q/k
norm as in Qwen3 (Hugging Face `Qwen3Attention`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import cdiv, next_power_of_2

MAX_HEADS_PER_PROGRAM = 8
TARGET_PROGRAMS = 1024  # enough programs to fill an H200 (132 SMs) several times over


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (as a torch op in that dtype rounds), back in float32."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _norm_rope_heads(
    src_ptr,
    dst_ptr,
    weight_ptr,
    stride_src_head,
    stride_dst_head,
    num_heads,
    head_block,
    eps,
    cos,
    sin,
    HALF_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    APPLY_NORM: tl.constexpr,
):
    """Norm (optional) and rotate heads [head_block * BLOCK_HEADS, +BLOCK_HEADS) of one token.

    src_ptr/dst_ptr point at the token's first head; cos/sin are [1, BLOCK_HALF] float32.
    """
    heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (dims < HALF_DIM)  # [BLOCK_HEADS, BLOCK_HALF]
    src = src_ptr + heads * stride_src_head + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_HALF]
    x2 = tl.load(src + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    if APPLY_NORM:
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * (0.5 / HALF_DIM)
        rstd = tl.rsqrt(mean_square + eps)[:, None]  # [BLOCK_HEADS, 1]
        w1 = tl.load(weight_ptr + dims, mask=dims < HALF_DIM, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF_DIM + dims, mask=dims < HALF_DIM, other=0.0)
        x1 = _round(_round(x1 * rstd, dtype) * w1, dtype)  # [BLOCK_HEADS, BLOCK_HALF]
        x2 = _round(_round(x2 * rstd, dtype) * w2.to(tl.float32), dtype)
    out1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)  # x * cos + rotate_half(x) * sin
    out2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    dst = dst_ptr + heads * stride_dst_head + dims
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + HALF_DIM, out2.to(dtype), mask=mask)


@triton.jit
def qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_q_out_token,
    stride_q_out_head,
    stride_k_out_token,
    stride_k_out_head,
    stride_cache_position,
    num_q_heads,
    num_k_heads,
    num_positions,
    q_eps,
    k_eps,
    HALF_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    APPLY_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, b): head block b of q (b < q blocks) or of k (the rest) for token t."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    position = tl.minimum(tl.maximum(position, 0), num_positions - 1)
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    cache = position * stride_cache_position + dims
    cos = tl.load(cos_ptr + cache, mask=dims < HALF_DIM, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cache, mask=dims < HALF_DIM, other=0.0).to(tl.float32)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_HEADS)
    if head_block < num_q_blocks:
        _norm_rope_heads(
            q_ptr + token * stride_q_token,
            q_out_ptr + token * stride_q_out_token,
            q_weight_ptr,
            stride_q_head,
            stride_q_out_head,
            num_q_heads,
            head_block,
            q_eps,
            cos,
            sin,
            HALF_DIM,
            BLOCK_HALF,
            BLOCK_HEADS,
            APPLY_NORM,
        )
    else:
        _norm_rope_heads(
            k_ptr + token * stride_k_token,
            k_out_ptr + token * stride_k_out_token,
            k_weight_ptr,
            stride_k_head,
            stride_k_out_head,
            num_k_heads,
            head_block - num_q_blocks,
            k_eps,
            cos,
            sin,
            HALF_DIM,
            BLOCK_HALF,
            BLOCK_HEADS,
            APPLY_NORM,
        )


def heads_per_program(num_tokens: int, num_heads: int) -> int:
    """Heads one program handles: 1 for small steps (more programs in flight), up to
    MAX_HEADS_PER_PROGRAM once num_tokens * head blocks exceeds TARGET_PROGRAMS."""
    block = 1
    while (
        block < MAX_HEADS_PER_PROGRAM
        and block < num_heads
        and num_tokens * cdiv(num_heads, 2 * block) >= TARGET_PROGRAMS
    ):
        block *= 2
    return block


def _check_heads(x: Tensor, name: str, num_tokens: int, head_dim: int) -> None:
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[2] != head_dim or x.stride(2) != 1:
        raise ValueError(f"{name} must be [num_tokens, heads, {head_dim}], last dim contiguous")


def _check_inputs(
    query: Tensor,
    key: Tensor,
    positions: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
) -> bool:
    """Raise ValueError unless the kernel takes these inputs; True when the norm applies."""
    num_tokens, _, head_dim = query.shape
    _check_heads(query, "query", num_tokens, head_dim)
    _check_heads(key, "key", num_tokens, head_dim)
    half_dim = head_dim // 2
    if head_dim % 2 or key.dtype != query.dtype or positions.shape != (num_tokens,):
        raise ValueError("need an even head_dim, q/k of one dtype and [num_tokens] positions")
    if positions.device != query.device or positions.is_floating_point():
        raise ValueError("positions must be integers on the query's device")
    for cache in (cos_cache, sin_cache):
        if cache.dim() != 2 or cache.shape[1] != half_dim or cache.dtype != query.dtype:
            raise ValueError(f"cos/sin caches must be [max_positions, {half_dim}] {query.dtype}")
    if cos_cache.shape[0] == 0:
        raise ValueError("the cos/sin caches hold no position")
    if cos_cache.stride() != sin_cache.stride() or cos_cache.stride(1) != 1:
        raise ValueError("cos and sin caches must share strides with a contiguous last dim")
    apply_norm = q_norm_weight is not None
    if apply_norm != (k_norm_weight is not None):
        raise ValueError("give both q and k norm weights or neither")
    for weight in (q_norm_weight, k_norm_weight) if apply_norm else ():
        if weight.shape != (head_dim,) or weight.dtype != query.dtype or weight.stride(0) != 1:
            raise ValueError(f"norm weights must be [{head_dim}] contiguous {query.dtype}")
    return apply_norm


def triton_qk_norm_rope(
    query: Tensor,
    key: Tensor,
    positions: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    q_eps: float = 1e-6,
    k_eps: float = 1e-6,
    in_place: bool = False,
    block_heads: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-head RMSNorm (when weights are given) then RoPE of q and k in one kernel.

    Args:
        query: [num_tokens, num_heads, head_dim], float32/float16/bfloat16, any strides with a
            contiguous last dimension (e.g. a view of a fused QKV output).
        key: [num_tokens, num_kv_heads, head_dim], query's dtype, same layout rules.
        positions: [num_tokens] int64 (or int32), each token's position.
        cos_cache, sin_cache: [max_positions, head_dim // 2] in query's dtype, last dimension
            contiguous (`RotaryEmbedding.cos_sin_cache`).
        q_norm_weight, k_norm_weight: [head_dim] in query's dtype, or both None (no norm).
        q_eps, k_eps: eps of the q and k norms.
        in_place: write the results into query and key (returned); else into new contiguous
            tensors.
        block_heads: heads per program (a power of two); None = `heads_per_program`.
        num_warps: warps per program; None = one warp per 256 elements, 1 to 4.

    Returns:
        (query, key) normalised and rotated, shapes and dtype of the inputs.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take (callers fall back to
            the PyTorch reference).
    """
    apply_norm = _check_inputs(
        query, key, positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight
    )
    num_tokens, num_heads, head_dim = query.shape
    half_dim = head_dim // 2
    q_out = query if in_place else torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = key if in_place else torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    num_kv_heads = key.shape[1]
    if block_heads is None:
        block_heads = heads_per_program(num_tokens, max(num_heads, num_kv_heads))
    assert block_heads == next_power_of_2(block_heads), "block_heads must be a power of two"
    num_blocks = cdiv(num_heads, block_heads) + cdiv(num_kv_heads, block_heads)
    block_half = next_power_of_2(half_dim)
    if num_warps is None:
        num_warps = max(1, min(4, block_heads * 2 * block_half // 256))
    qk_norm_rope_kernel[(num_tokens, num_blocks)](
        query, key, q_out, k_out, positions, cos_cache, sin_cache,
        q_norm_weight if apply_norm else query,  # unused without the norm
        k_norm_weight if apply_norm else key,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_cache.stride(0),
        num_heads, num_kv_heads, cos_cache.shape[0], q_eps, k_eps,
        HALF_DIM=half_dim,
        BLOCK_HALF=block_half,
        BLOCK_HEADS=block_heads,
        APPLY_NORM=apply_norm,
        num_warps=num_warps,
        enable_fp_fusion=False,  # no fma: round each product as torch does
        **pdl_args(q_out),
    )  # fmt: skip
    return q_out, k_out
