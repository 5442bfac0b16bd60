"""INT4 checkpoint tensors -> our w4a16 layout (`kernels.int4_ref`): one converter per format
and tensor kind, checked for dtype and shape, shared by the INT4 linear layers and experts.

Checkpoint layouts, for one quantized weight of N output rows, K input columns, group G:
- compressed-tensors `pack-quantized` (and online `--quantization int4`): `weight_packed`
  [N, K / 8] int32, sequential nibbles along K, codes = signed value + 8 (our layout);
  `weight_scale` [N, K / G]; `weight_shape` [2] = (N, K). Symmetric only.
- GPTQ (AutoGPTQ, checkpoint_format "gptq"): `qweight` [K / 8, N] int32 packed along K,
  sequential nibbles; `qzeros` [K / G, N / 8] int32 packed along N, holding zero - 1 (the
  "v1" offset, so a zero of 0 is stored as 15 and read back as (15 + 1) & 15 = 0);
  `scales` [K / G, N]; `g_idx` [K] int32, the group of each input column (k // G without
  `desc_act`; a permutation's groups with it).
- AWQ GEMM: `qweight` [K, N / 8] int32 packed along N, `qzeros` [K / G, N / 8] int32 packed
  along N, both in AWQ's interleaved nibble order: nibble j of a word holds column
  8 * word + AWQ_ORDER[j] with AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7); zeros without offset;
  `scales` [K / G, N].
In every format w[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)].

Invariants: a converter returns exactly the slice of our parameter its tensor fills (rows of
one fused part, or one expert's), so the loader's once-per-element check still holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sits.core.errors import UnsupportedModelError
from sits.kernels.int4_ref import PACK, pack_int4, unpack_int4

Convert = Callable[[Tensor, str], Tensor]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8)

# Our parameter's local suffix per (format, checkpoint kind); formats: "ct", "gptq", "awq".
LOCAL_OF: dict[str, dict[str, str]] = {
    "ct": {"weight_packed": "", "weight_scale": "_scale", "weight_shape": "_shape"},
    "gptq": {"qweight": "", "scales": "_scale", "qzeros": "_zero", "g_idx": "_g_idx"},
    "awq": {"qweight": "", "scales": "_scale", "qzeros": "_zero"},
}


def checkpoint_kind(fmt: str, suffix: str) -> str:
    """The checkpoint tensor kind of our parameter suffix ("" = the packed weight)."""
    return next(kind for kind, local in LOCAL_OF[fmt].items() if local == suffix)


def _check(tensor: Tensor, name: str, dtypes: tuple, shape: tuple[int, ...], what: str) -> None:
    if tensor.dtype not in dtypes:
        raise UnsupportedModelError(
            f"checkpoint tensor {name} has dtype {tensor.dtype}, expected "
            f"{' or '.join(str(d) for d in dtypes)} ({what})"
        )
    if tuple(tensor.shape) != shape:
        raise UnsupportedModelError(
            f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {shape} ({what})"
        )


def _awq_unpack(packed: Tensor) -> Tensor:
    """AWQ words [R, C / 8] -> codes [R, C] in column order (undoing AWQ_ORDER)."""
    nibbles = unpack_int4(packed)  # [R, C] in nibble order
    words = nibbles.reshape(packed.shape[0], -1, PACK)
    columns = torch.empty_like(words)
    columns[..., list(AWQ_ORDER)] = words
    return columns.reshape(nibbles.shape)


def awq_pack(codes: Tensor) -> Tensor:
    """Codes [R, C] -> AWQ words [R, C / 8] (the inverse of the AWQ unpack; tests use it)."""
    words = codes.reshape(codes.shape[0], -1, PACK)[..., list(AWQ_ORDER)]
    return pack_int4(words.reshape(codes.shape))


def int4_converter(
    fmt: str, kind: str, num_rows: int, num_cols: int, group_size: int, desc_act: bool = False
) -> Convert | None:
    """Check-and-convert of one checkpoint tensor of an [num_rows, num_cols] weight.

    Args:
        fmt: "ct", "gptq" or "awq".
        kind: the checkpoint tensor kind (`LOCAL_OF[fmt]` keys).
        num_rows, num_cols: N and K of this part's (or expert's) weight.
        group_size: G.
        desc_act: GPTQ `g_idx` may be any grouping (else it must be k // G).

    Returns:
        `convert(tensor, name)` giving our layout (packed [N, K / 8] int32, scale [N, K / G]
        float32, zero [N, K / G] uint8, g_idx [K] int32, shape [2] int64), or None when the
        format has no such tensor.
    """
    rows, cols, groups = num_rows, num_cols, num_cols // group_size
    label = f"{fmt} {kind}"

    def convert(tensor: Tensor, name: str) -> Tensor:
        if kind == "weight_packed":
            _check(tensor, name, (torch.int32,), (rows, cols // PACK), label)
            return tensor
        if kind == "weight_shape":
            _check(tensor, name, INT_DTYPES, (2,), label)
            if tensor.tolist() != [rows, cols]:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name} is {tensor.tolist()}, expected {[rows, cols]}"
                )
            return tensor.to(torch.int64)
        if kind in ("weight_scale", "scales"):
            shape = (rows, groups) if fmt == "ct" else (groups, rows)
            _check(tensor, name, SCALE_DTYPES, shape, label)
            return tensor.float() if fmt == "ct" else tensor.float().T
        if kind == "g_idx":
            _check(tensor, name, INT_DTYPES, (cols,), label)
            sequential = torch.arange(cols, device=tensor.device) // group_size
            if not desc_act and not torch.equal(tensor.long(), sequential):
                raise UnsupportedModelError(
                    f"checkpoint tensor {name} is not k // {group_size} but desc_act is false"
                )
            if int(tensor.min()) < 0 or int(tensor.max()) >= groups:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name} holds groups outside 0 .. {groups - 1}"
                )
            return tensor.to(torch.int32)
        if kind == "qweight" and fmt == "gptq":
            _check(tensor, name, (torch.int32,), (cols // PACK, rows), label)
            return pack_int4(unpack_int4(tensor, dim=0).T)
        if kind == "qweight":
            _check(tensor, name, (torch.int32,), (cols, rows // PACK), label)
            return pack_int4(_awq_unpack(tensor).T)
        _check(tensor, name, (torch.int32,), (groups, rows // PACK), label)  # qzeros
        if fmt == "gptq":
            return ((unpack_int4(tensor).T.to(torch.int32) + 1) & 0xF).to(torch.uint8)
        return _awq_unpack(tensor).T.contiguous()

    return convert if kind in LOCAL_OF[fmt] else None


def format_of(method: str) -> str:
    """The converter format of a `QuantConfig.method` (online int4 streams CT tensors)."""
    return {"gptq": "gptq", "awq": "awq"}.get(method, "ct")
