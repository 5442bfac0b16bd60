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

Tensor parallelism: `AXES` says where N and K lie in each tensor and how many of them one
index holds (8 for packed codes, G for groups), so `int4_cut` cuts a column-parallel rank's
rows (N) or a row-parallel rank's columns (K, on group boundaries) out of any format before
the converter sees the rank's part; `weight_shape` is checked against the checkpoint's whole
(N, K) and stored as the rank's, a row-parallel GPTQ `g_idx` against its columns' groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sits.core.errors import UnsupportedModelError
from sits.kernels.int4_ref import PACK, pack_int4, unpack_int4
from sits.layers.linear import Shard
from sits.layers.quant.sharding import Convert, tensor_shard

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8)

# Our parameter's local suffix per (format, checkpoint kind); formats: "ct", "gptq", "awq".
LOCAL_OF: dict[str, dict[str, str]] = {
    "ct": {"weight_packed": "", "weight_scale": "_scale", "weight_shape": "_shape"},
    "gptq": {"qweight": "", "scales": "_scale", "qzeros": "_zero", "g_idx": "_g_idx"},
    "awq": {"qweight": "", "scales": "_scale", "qzeros": "_zero"},
}


# Per (format, kind): (dim of N, Ns per index, dim of K, Ks per index), None where the tensor
# does not run along it; GROUP stands for the group size G.
GROUP = -1
AXES: dict[str, dict[str, tuple[int | None, int, int | None, int]]] = {
    "ct": {
        "weight_packed": (0, 1, 1, PACK), "weight_scale": (0, 1, 1, GROUP),
        "weight_shape": (None, 1, None, 1),
    },
    "gptq": {
        "qweight": (1, 1, 0, PACK), "qzeros": (1, PACK, 0, GROUP), "scales": (1, 1, 0, GROUP),
        "g_idx": (None, 1, 0, 1),
    },
    "awq": {"qweight": (1, PACK, 0, 1), "qzeros": (1, PACK, 0, GROUP), "scales": (1, 1, 0, GROUP)},
}  # fmt: skip


def int4_cut(
    fmt: str, kind: str, row_shard: Shard, col_shard: Shard, group_size: int
) -> tuple[int, Shard] | None:
    """This rank's cut of one checkpoint tensor of an [N, K] weight: (dim, shard in that
    dim's units) of its rows `row_shard` or its columns `col_shard`, None when it keeps all.

    Raises:
        UnsupportedModelError: the shard cuts through a packed word or a group
            (`sharding.check_aligned`; the layers refuse such shards at build).
    """
    n_dim, n_unit, k_dim, k_unit = AXES[fmt][kind]
    k_unit = group_size if k_unit == GROUP else k_unit
    rows = None if n_dim is None else (n_dim, row_shard, n_unit)
    cols = None if k_dim is None else (k_dim, col_shard, k_unit)
    return tensor_shard(rows, cols)


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
    fmt: str,
    kind: str,
    num_rows: int,
    num_cols: int,
    group_size: int,
    desc_act: bool = False,
    whole: tuple[int, int] | None = None,
    first_col: int = 0,
) -> Convert | None:
    """Check-and-convert of one checkpoint tensor of an [num_rows, num_cols] weight (this
    rank's part of it: the tensor comes cut by `int4_cut`).

    Args:
        fmt: "ct", "gptq" or "awq".
        kind: the checkpoint tensor kind (`LOCAL_OF[fmt]` keys).
        num_rows, num_cols: N and K of this part's (or expert's) weight on this rank.
        group_size: G.
        desc_act: GPTQ `g_idx` may be any grouping (else it must be k // G).
        whole: the checkpoint's (N, K) of the weight (default: (num_rows, num_cols)), which
            `weight_shape` must hold.
        first_col: the checkpoint column of this rank's column 0 (a multiple of G; not 0
            only for a row-parallel rank, never with desc_act): its `g_idx` must hold
            (first_col + k) // G and is stored as this rank's groups, from 0.

    Returns:
        `convert(tensor, name)` giving our layout (packed [N, K / 8] int32, scale [N, K / G]
        float32, zero [N, K / G] uint8, g_idx [K] int32, shape [2] int64: this rank's N and
        K), or None when the format has no such tensor.
    """
    rows, cols, groups = num_rows, num_cols, num_cols // group_size
    whole = whole if whole is not None else (rows, cols)
    assert first_col % group_size == 0 and not (desc_act and first_col), "cut on groups only"
    label = f"{fmt} {kind}"

    def convert(tensor: Tensor, name: str) -> Tensor:
        if kind == "weight_packed":
            _check(tensor, name, (torch.int32,), (rows, cols // PACK), label)
            return tensor
        if kind == "weight_shape":
            _check(tensor, name, INT_DTYPES, (2,), label)
            if tensor.tolist() != list(whole):
                raise UnsupportedModelError(
                    f"checkpoint tensor {name} is {tensor.tolist()}, expected {list(whole)}"
                )
            return torch.tensor([rows, cols], dtype=torch.int64, device=tensor.device)
        if kind in ("weight_scale", "scales"):
            shape = (rows, groups) if fmt == "ct" else (groups, rows)
            _check(tensor, name, SCALE_DTYPES, shape, label)
            return tensor.float() if fmt == "ct" else tensor.float().T
        if kind == "g_idx":
            _check(tensor, name, INT_DTYPES, (cols,), label)
            sequential = (torch.arange(cols, device=tensor.device) + first_col) // group_size
            if not desc_act and not torch.equal(tensor.long(), sequential):
                raise UnsupportedModelError(
                    f"checkpoint tensor {name} is not k // {group_size} but desc_act is false"
                )
            local = tensor.long() - first_col // group_size  # this rank's groups
            if int(local.min()) < 0 or int(local.max()) >= groups:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name} holds groups outside 0 .. {groups - 1}"
                )
            return local.to(torch.int32)
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
