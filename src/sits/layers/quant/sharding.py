"""How a tensor-parallel rank's quantized layers cut checkpoint tensors: its `Shard` of an
output or input dimension counted in the units a tensor stores it in (scale blocks, INT4
groups, eight packed 4-bit codes), and the refusal, with the numbers, of a shard that does not
fall on those units' boundaries.

Invariants:
- Column-parallel layers (q/k/v, gate/up, the experts' w13 rows) cut their weight and
  per-row or block scales by output rows; row-parallel ones (o_proj, down_proj, the experts'
  w2) by input columns, their block scales and group scales by whole blocks / groups, while
  a per-row scale stays the full row's on every rank (the partial sums of all ranks then add
  up to one rank's result).
- A shard in units is exact: its start is a whole number of units and its stop too, or the
  end of a ragged last unit (the dimension's end).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from sits.core.errors import UnsupportedModelError
from sits.layers.linear import RowParallelLinear, Shard
from sits.parallel import SINGLE, TensorParallel

Convert = Callable[[Tensor, str], Tensor]
# Where one checkpoint tensor of a quantized module goes: (our parameter's local name, index
# into it, check/convert or None, this rank's cut of the tensor: (dim, shard in that dim's
# units), or None to keep it whole).
Target = tuple[str, tuple[int | slice, ...], Convert | None, tuple[int, Shard] | None]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_aligned(shard: Shard, unit: int, what: str, units: str) -> None:
    """Refuse a rank's shard that cuts through a unit of `unit` elements.

    Args:
        shard: this rank's indices of one checkpoint dimension.
        unit: the elements of one unit (e.g. 128 columns of an FP8 scale block).
        what: the dimension in the message ("input columns", "output rows of part 1").
        units: the units in the message ("FP8 scale blocks (fp8 block [128, 128] ...)").

    Raises:
        UnsupportedModelError: shard.start is not a multiple of `unit`, or shard.stop is
            neither a multiple of it nor the dimension's end; the message gives the shard,
            the dimension's size and the unit.
    """
    if shard.start % unit == 0 and (shard.stop % unit == 0 or shard.stop == shard.full):
        return
    raise UnsupportedModelError(
        f"tensor parallelism gives a rank {what} [{shard.start}, {shard.stop}) of {shard.full}, "
        f"which do not fall on the boundaries of {unit}-wide {units}"
    )


def in_units(shard: Shard, unit: int) -> Shard:
    """`shard` counted in units of `unit` elements (a ragged last unit counts whole).

    Raises:
        UnsupportedModelError: the shard cuts through a unit (`check_aligned`).
    """
    if unit == 1:
        return shard
    check_aligned(shard, unit, "indices", "units")
    return Shard(_cdiv(shard.full, unit), shard.start // unit, _cdiv(shard.stop, unit))


def tensor_shard(
    rows: tuple[int, Shard, int] | None, cols: tuple[int, Shard, int] | None
) -> tuple[int, Shard] | None:
    """The one cut of a checkpoint tensor: (dim, shard in that dim's units) of its output
    rows or of its input columns, each given as (dim, shard in elements, elements per index)
    or None when the tensor does not hold that dimension; None when the rank keeps all of it.

    A layer is column-parallel or row-parallel, never both: at most one of the two shards
    is partial.
    """
    given = [axis for axis in (rows, cols) if axis is not None]
    cuts = [(dim, in_units(shard, unit)) for dim, shard, unit in given if not shard.is_whole]
    assert len(cuts) <= 1, "a layer is cut along its rows or its columns, not both"
    return cuts[0] if cuts else None


def input_columns(module: nn.Linear) -> tuple[Shard | None, TensorParallel]:
    """(input columns, ranks) of a `RowParallelLinear`; (None, SINGLE) for any other linear:
    what a quantized twin of `module` takes to hold the same slice."""
    if isinstance(module, RowParallelLinear):
        return module.col_shard, module.tp
    return None, SINGLE
