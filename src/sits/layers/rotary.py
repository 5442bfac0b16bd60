"""Rotary position embedding (RoPE) with the scaling kinds of Llama/Qwen/Mixtral checkpoints.

Supported `rope_type`s: "default", "linear", "llama3", "yarn". Anything else (e.g. "dynamic",
"longrope", a partial rotary factor) raises UnsupportedModelError naming it.

Invariants:
- Inverse frequencies and cos/sin are computed in float32 from the positions of each token, so
  a token's rotation depends only on its own position (never on the batch).
- cos/sin are cast to the query dtype before rotating (as Hugging Face transformers do).
- The rotation is "rotate half": dims [0, D/2) pair with [D/2, D).
- inv_freq is a plain float32 attribute, not a buffer: `module.to(dtype)` never rounds it,
  and a model built on the meta device still gets real frequencies.
- On CUDA with Triton installed, `forward` (and `Attention`'s fused q/k norm + RoPE) runs one
  Triton kernel (`sits.kernels.rotary_triton`, imported only then) that reads cos/sin from a
  per-position cache: [max_position_embeddings, D/2] per (device, dtype), built once by
  `cos_sin_cache` with the same torch code as `cos_sin` (so every rope type and
  attention_scaling is handled here), lazily at the first forward on a device, which the
  runner's eager warm-up does before any CUDA graph capture. Elsewhere (the CPU, no Triton,
  no known max_position_embeddings) the torch code below computes cos/sin from the positions.

Algorithms: RoPE (Su et al. 2021, "RoFormer"); linear position interpolation (Chen et al.
2023); Llama 3.1 frequency smoothing (Meta, llama3 `apply_scaling`); YaRN (Peng et al. 2023,
"YaRN: Efficient Context Window Extension of Large Language Models").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from sits.core.errors import UnsupportedModelError
from sits.kernels.triton_utils import has_triton

if TYPE_CHECKING:
    from sits.layers.norm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE parameters of a checkpoint.

    Attributes:
        head_dim: rotated dimensions per head (the whole head).
        rope_type: one of SUPPORTED_ROPE_TYPES.
        theta: base wavelength (`rope_theta`).
        factor: context scaling factor (linear, llama3, yarn).
        original_max_position_embeddings: pretraining context (llama3, yarn).
        low_freq_factor, high_freq_factor: llama3 smoothing bounds.
        beta_fast, beta_slow: yarn ramp bounds (rotations).
        attention_factor: yarn cos/sin scale; None = derived from factor/mscale.
        mscale, mscale_all_dim: yarn attention-factor parameters (DeepSeek style).
        truncate: yarn: round the correction range to whole dimensions.
        max_position_embeddings: positions the model may see (sizes the cos/sin cache of the
            Triton path; None = unknown, the torch path is used). Not compared: it changes no
            rotation.
    """

    head_dim: int
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    max_position_embeddings: int | None = field(default=None, compare=False)

    @staticmethod
    def from_dict(
        params: dict[str, Any], head_dim: int, max_position_embeddings: int
    ) -> RopeConfig:
        """Build from a Hugging Face `rope_parameters` dict (or legacy `rope_scaling` + theta).

        Args:
            params: keys rope_type (or legacy "type"), rope_theta, factor, ...
            head_dim: attention head size.
            max_position_embeddings: the config's context length (default for the original
                context of llama3/yarn).

        Raises:
            UnsupportedModelError: an unsupported rope_type or partial rotary factor.
        """
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        partial = params.get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported")
        original_max = params.get("original_max_position_embeddings")
        if original_max is None and rope_type in ("llama3", "yarn"):
            original_max = max_position_embeddings
        factor = params.get("factor")
        if factor is None:
            needs_factor = rope_type in ("linear", "llama3")
            if needs_factor:
                raise UnsupportedModelError(f"rope_type {rope_type!r} needs a 'factor'")
            factor = max_position_embeddings / original_max if rope_type == "yarn" else 1.0
        return RopeConfig(
            head_dim=head_dim,
            rope_type=rope_type,
            theta=float(params.get("rope_theta", 10000.0)),
            factor=float(factor),
            original_max_position_embeddings=original_max,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            max_position_embeddings=max_position_embeddings,
        )


def _base_inv_freq(rope: RopeConfig) -> Tensor:
    """theta^(-2i/D) for i in [0, D/2): [head_dim // 2] float32."""
    exponents = torch.arange(0, rope.head_dim, 2, dtype=torch.int64, device="cpu").float()
    return 1.0 / (rope.theta ** (exponents / rope.head_dim))


def _llama3_inv_freq(rope: RopeConfig) -> Tensor:
    """Llama 3.1: long wavelengths divided by factor, short kept, the band between smoothed."""
    inv_freq = _base_inv_freq(rope)  # [D/2]
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, linear ramp between (by dimension)."""
    dim, base, factor = rope.head_dim, rope.theta, rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        context = rope.original_max_position_embeddings
        return (dim * math.log(context / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    dims = torch.arange(dim // 2, dtype=torch.float32, device="cpu")  # [D/2]
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)  # 0 below low, 1 above high
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)  # [D/2]
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = keep the original frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, attention_factor


def compute_inv_freq(rope: RopeConfig) -> tuple[Tensor, float]:
    """Inverse frequencies and the cos/sin scale of a RoPE config.

    Returns:
        (inv_freq [head_dim // 2] float32 on CPU, attention_scaling multiplying cos and sin).
    """
    if rope.rope_type == "default":
        return _base_inv_freq(rope), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rope) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope)
    raise UnsupportedModelError(f"rope_type {rope.rope_type!r} is not supported")


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys given each token's absolute position.

    One instance may serve every layer of a model (its state is per rope config, device and
    dtype, never per layer); sharing it shares the cos/sin cache of the Triton path.
    """

    def __init__(self, rope: RopeConfig) -> None:
        super().__init__()
        self.rope = rope
        inv_freq, self.attention_scaling = compute_inv_freq(rope)
        self._inv_freq_cpu = inv_freq  # [head_dim // 2] float32
        self._inv_freq_on: dict[torch.device, Tensor] = {}
        self._cos_sin_on: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def _inv_freq(self, device: torch.device) -> Tensor:
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = self._inv_freq_cpu.to(device)
        return self._inv_freq_on[device]

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of each position's angles.

        Args:
            positions: [num_tokens] int64.
            dtype: output dtype.

        Returns:
            (cos, sin), each [num_tokens, head_dim], both halves repeated.
        """
        freqs = positions.float()[:, None] * self._inv_freq(positions.device)  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def cos_sin_cache(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of every position below max_position_embeddings, built once per
        (device, dtype) by `cos_sin` (so the values are those the torch path computes).

        Returns:
            (cos, sin), each [max_position_embeddings, head_dim // 2] contiguous in `dtype`
            (one half: the two halves of `cos_sin` are equal).

        Raises:
            RuntimeError: the cache is missing while a CUDA graph is being captured (run an
                eager forward on the device first), or max_position_embeddings is unknown.
        """
        key = (torch.device(device), dtype)
        cached = self._cos_sin_on.get(key)
        if cached is not None:
            return cached
        if not self.rope.max_position_embeddings:
            raise RuntimeError("the cos/sin cache needs RopeConfig.max_position_embeddings")
        if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the cos/sin cache must be built by an eager forward before capture")
        half = self.rope.head_dim // 2
        with torch.no_grad():
            positions = torch.arange(self.rope.max_position_embeddings, device=key[0])
            cos, sin = self.cos_sin(positions, dtype)  # [max_positions, head_dim]
            cached = (cos[:, :half].contiguous(), sin[:, :half].contiguous())
        self._cos_sin_on[key] = cached
        return cached

    def forward(
        self,
        positions: Tensor,
        query: Tensor,
        key: Tensor,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
        in_place: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Normalise each query/key head (when qk_norm is given), then rotate query and key.

        On CUDA with Triton (and a known max_position_embeddings) one Triton kernel does both;
        otherwise `RMSNorm.normalize` per head, then the rotation from `cos_sin`.

        Args:
            positions: [num_tokens] int64.
            query: [num_tokens, num_heads, head_dim] (last dimension contiguous for Triton).
            key: [num_tokens, num_kv_heads, head_dim].
            qk_norm: (q_norm, k_norm) RMSNorms over head_dim (Qwen3), or None.
            in_place: the Triton path may write the results into query and key (then
                returned); the torch path always returns new tensors.

        Returns:
            (query, key) rotated, same shapes and dtypes.
        """
        if self._triton_applies(query, key, qk_norm):
            from sits.kernels.rotary_triton import triton_qk_norm_rope

            cos, sin = self.cos_sin_cache(query.device, query.dtype)  # [max_pos, D/2] each
            q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
            return triton_qk_norm_rope(
                query, key, positions, cos, sin,
                q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None,
                q_norm.eps if q_norm is not None else 0.0,
                k_norm.eps if k_norm is not None else 0.0,
                in_place=in_place,
            )  # fmt: skip
        return self.forward_reference(positions, query, key, qk_norm)

    def forward_reference(
        self,
        positions: Tensor,
        query: Tensor,
        key: Tensor,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`forward` in PyTorch (new tensors): the Triton kernel's reference and the CPU path."""
        if qk_norm is not None:
            query = qk_norm[0].normalize(query)
            key = qk_norm[1].normalize(key)
        cos, sin = self.cos_sin(positions, query.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [num_tokens, 1, head_dim]
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        return query, key

    def _triton_applies(
        self, query: Tensor, key: Tensor, qk_norm: tuple[RMSNorm, RMSNorm] | None
    ) -> bool:
        """True when the Triton kernel computes exactly what the torch path would: CUDA
        tensors of one dtype (norm weights too), contiguous head dims of even size, a sizable
        cache (`triton_qk_norm_rope` raises ValueError on anything else)."""
        if not query.is_cuda or not self.rope.max_position_embeddings:
            return False
        if query.shape[-1] % 2 or key.shape[-1] != query.shape[-1]:
            return False
        dtypes = {query.dtype, key.dtype}
        if qk_norm is not None:
            dtypes |= {qk_norm[0].weight.dtype, qk_norm[1].weight.dtype}
        if len(dtypes) != 1 or query.stride(-1) != 1 or key.stride(-1) != 1:
            return False
        return has_triton()

    def extra_repr(self) -> str:
        return f"{self.rope}"
