"""GPTQ and AWQ checkpoint tensors -> our INT4 layout (`layers.quant.int4_formats`): packing
round trips against packers written here from each format's documented layout (GPTQ packed
along K with zeros minus one, AWQ packed along N in the order 0 2 4 6 1 3 5 7)."""

from __future__ import annotations

import pytest
import torch

from sits.core.errors import UnsupportedModelError
from sits.kernels.int4_ref import pack_int4
from sits.layers.quant.int4_formats import awq_pack, int4_converter
from tests.kernels.test_int4_ref import _codes, _words

SEQUENTIAL = list(range(8))
AWQ = [0, 2, 4, 6, 1, 3, 5, 7]


def test_gptq_tensors_convert_to_our_layout() -> None:
    n, k, group = 16, 32, 8
    codes, zeros = _codes(n, k), _codes(n, k // group, seed=1)
    zeros[0, 0] = 0  # stored as -1 & 15 = 15: the v1 offset wraps
    qweight = _words(codes, SEQUENTIAL).T.contiguous()  # [K / 8, N], packed along K
    qzeros = _words((zeros.T - 1) & 0xF, SEQUENTIAL)  # [K / G, N / 8], packed along N
    convert = lambda kind: int4_converter("gptq", kind, n, k, group)  # noqa: E731
    assert torch.equal(convert("qweight")(qweight, "q"), pack_int4(codes))
    assert torch.equal(convert("qzeros")(qzeros, "z").long(), zeros)
    scales = torch.rand(k // group, n).half()
    assert torch.equal(convert("scales")(scales, "s"), scales.float().T)


def test_awq_tensors_convert_to_our_layout() -> None:
    n, k, group = 16, 32, 8
    codes, zeros = _codes(k, n), _codes(k // group, n, seed=2)  # AWQ: [K, N] along N
    qweight, qzeros = _words(codes, AWQ), _words(zeros, AWQ)
    assert torch.equal(awq_pack(codes), qweight)
    convert = lambda kind: int4_converter("awq", kind, n, k, group)  # noqa: E731
    assert torch.equal(convert("qweight")(qweight, "q"), pack_int4(codes.T))
    assert torch.equal(convert("qzeros")(qzeros, "z").long(), zeros.T)


def test_a_wrong_shape_is_refused_with_both_shapes() -> None:
    convert = int4_converter("gptq", "qweight", 16, 32, 8)
    with pytest.raises(UnsupportedModelError, match=r"has shape \(16, 4\), expected \(4, 16\)"):
        convert(torch.zeros(16, 4, dtype=torch.int32), "x.qweight")
