"""Fused FP8 MoE (`fused_moe_fp8`, `TritonMoe.experts_fp8`) vs its references, both scale
layouts (block and per-row), in Triton's CPU interpreter (or compiled, on a GPU machine).

Two references: `moe_forward_fp8_w8a8_reference` quantizes the activations as the kernels do,
so the kernels equal it up to float32 summation order (relative error < 1e-5 in float32;
measured ~3e-7); `moe_ref.moe_forward_fp8` keeps the activations unquantized, so the two
differ by the FP8 rounding of hidden and of the intermediate (3 mantissa bits: measured
3-5% relative, bound 8e-2). Block (32, 32) scales give tiny shapes several activation groups
and weight scale blocks, ragged H (80) a partial last one; BLOCK_K 32 (fp8 tensor cores need
K >= 32 when compiled).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels import moe_triton  # noqa: E402
from sits.kernels.fp8_gemv_triton import MOE_GEMV_MAX_TOKENS  # noqa: E402
from sits.kernels.fp8_ref import FP8_DTYPE, quantize_fp8_block, quantize_fp8_per_row  # noqa: E402
from sits.kernels.moe_config import (  # noqa: E402
    GemmConfig,
    MoeConfigStore,
    MoeLaunchConfig,
    config_file_name,
    default_config,
    device_name_of,
)
from sits.kernels.moe_fp8_triton import (  # noqa: E402
    fused_moe_fp8,
    moe_forward_fp8_w8a8_reference,
)
from sits.kernels.moe_ref import moe_forward_fp8, select_experts  # noqa: E402
from sits.kernels.moe_triton import TritonMoe  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
SMALL = MoeLaunchConfig(16, GemmConfig(32, 32, 1), GemmConfig(16, 32, 2))
WIDE = MoeLaunchConfig(32, GemmConfig(32, 32, 4), GemmConfig(32, 32, 1))
BLOCK = (32, 32)
TIGHT = 1e-5  # vs the w8a8 reference (same activation quantization), float32
LOOSE = 8e-2  # vs moe_forward_fp8 (unquantized activations)


def make_inputs(num_tokens, num_experts, top_k, hidden, inter, block, seed):
    """(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids) on DEVICE: float32
    activations, FP8 experts with block scales (block) or per-row scales (None)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    quantize = quantize_fp8_per_row if block is None else lambda w: quantize_fp8_block(w, block)
    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return tuple(t.to(DEVICE) for t in (x, q13, s13, q2, s2, weights, ids))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def assert_matches_references(out, x, q13, s13, q2, s2, block, weights, ids) -> None:
    assert out.shape == x.shape and out.dtype == x.dtype
    tight = moe_forward_fp8_w8a8_reference(x, q13, s13, q2, s2, block, weights, ids)
    assert relative_error(out, tight) < TIGHT
    assert relative_error(out, moe_forward_fp8(x, q13, s13, q2, s2, block, weights, ids)) < LOOSE


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter", "config"),
    [
        (1, 8, 2, 64, 64, SMALL),  # one token: a block per pair, no alignment launch
        (5, 16, 2, 80, 64, SMALL),  # ragged H: a partial last K step and scale block
        (17, 6, 3, 96, 32, WIDE),  # several row blocks per expert, GROUP_M 4
        (40, 8, 4, 64, 32, SMALL),  # 160 pairs: the chunked alignment
    ],
)
def test_fused_moe_fp8_matches_references(
    block, num_tokens, num_experts, top_k, hidden, inter, config
) -> None:
    inputs = make_inputs(num_tokens, num_experts, top_k, hidden, inter, block, seed=3)
    x, q13, s13, q2, s2, weights, ids = inputs
    flags = torch.zeros(num_experts, dtype=torch.bool, device=DEVICE)
    out = fused_moe_fp8(x, q13, s13, q2, s2, block, weights, ids, config, flags)
    assert_matches_references(out, x, q13, s13, q2, s2, block, weights, ids)
    assert not flags.any()


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_padding_tokens_get_zero_rows(block) -> None:
    x, q13, s13, q2, s2, weights, ids = make_inputs(10, 8, 2, 64, 32, block, seed=8)
    padding = torch.tensor([False] * 7 + [True] * 3, device=DEVICE)  # decode 7 padded to 10
    ids[padding], weights[padding] = -1, 0.0
    flags = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    out = fused_moe_fp8(x, q13, s13, q2, s2, block, weights, ids, SMALL, flags)
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    real = fused_moe_fp8(x[:7], q13, s13, q2, s2, block, weights[:7], ids[:7], SMALL)
    assert torch.equal(out[:7], real)  # per-token quantization: padding rows change nothing
    assert_matches_references(out[:7], x[:7], q13, s13, q2, s2, block, weights[:7], ids[:7])
    one_padding = fused_moe_fp8(
        x[:1], q13, s13, q2, s2, block, weights[:1] * 0, torch.full_like(ids[:1], -1), SMALL, flags
    )  # a one-token step of padding (a warm-up)
    assert torch.equal(one_padding, torch.zeros_like(one_padding)) and not flags.any()


def test_float16_activations() -> None:
    x, q13, s13, q2, s2, weights, ids = make_inputs(9, 8, 2, 64, 64, BLOCK, seed=4)
    x = x.half()
    out = fused_moe_fp8(x, q13, s13, q2, s2, BLOCK, weights, ids, SMALL)
    assert out.dtype == torch.float16
    tight = moe_forward_fp8_w8a8_reference(x, q13, s13, q2, s2, BLOCK, weights, ids)
    assert relative_error(out, tight) < 2e-3  # fp16 roundings of the intermediate may flip
    assert relative_error(out, moe_forward_fp8(x, q13, s13, q2, s2, BLOCK, weights, ids)) < LOOSE


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_nonfinite_flag_only_for_finite_input_rows(block) -> None:
    x, q13, s13, q2, s2, weights, ids = make_inputs(12, 8, 2, 64, 32, block, seed=5)
    bad = int(ids[0, 1])  # routed at least once
    s2[bad, 0] = float("nan")  # a scale: the interpreter reads fp8 NaN bytes as numbers
    x[1] = float("inf")  # a poisoned input row: its experts' outputs are not their fault
    assert bad not in set(ids[1].tolist())
    flags = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    ref_flags = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    out = TritonMoe(SMALL).experts_fp8(x, q13, s13, q2, s2, block, weights, ids, flags)
    expected = moe_forward_fp8(x, q13, s13, q2, s2, block, weights, ids, ref_flags)
    assert torch.equal(flags, ref_flags)
    assert flags.cpu().tolist() == [e == bad for e in range(8)]
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))
    already = torch.ones(8, dtype=torch.bool, device=DEVICE)  # flags are only ever set
    TritonMoe(SMALL).experts_fp8(x, q13, s13, q2, s2, block, weights, ids, already)
    assert already.all()


def test_bad_scales_and_block_k_are_refused() -> None:
    x, q13, s13, q2, s2, weights, ids = make_inputs(3, 4, 2, 64, 32, BLOCK, seed=6)
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe_fp8(x, q13, s13[:, :1], q2, s2, BLOCK, weights, ids, SMALL)
    with pytest.raises(ValueError, match="w2_scale"):  # block scales given as per-row
        fused_moe_fp8(x, q13, s13.new_ones(4, 64), q2, s2, None, weights, ids, SMALL)
    wide_k = MoeLaunchConfig(16, GemmConfig(32, 64), GemmConfig(32, 64))
    with pytest.raises(ValueError, match="BLOCK_K 64"):
        fused_moe_fp8(x, q13, s13, q2, s2, BLOCK, weights, ids, wide_k)
    empty = fused_moe_fp8(x[:0], q13, s13, q2, s2, BLOCK, weights[:0], ids[:0], SMALL)
    assert empty.shape == (0, 64)


def test_fp8_configs_have_their_own_file_and_default(tmp_path) -> None:
    name = config_file_name(4, 32, FP8_DTYPE, "cpu")
    assert name == "moe_E4_N32_fp8_w8a8_cpu.json"
    (tmp_path / name).write_text(json.dumps({"64": WIDE.to_json()}))
    store = MoeConfigStore(tmp_path)
    cpu = torch.device("cpu")
    assert store.select(30, 2, 4, 32, FP8_DTYPE, cpu) == WIDE
    assert store.select(30, 2, 4, 32, torch.float32, cpu) == default_config(30, 2, 4)
    for num_tokens in (1, 512, 8192):  # BLOCK_K 128 divides the 128-wide groups and blocks
        config = default_config(num_tokens, 8, 128, FP8_DTYPE)
        assert config.gemm1.block_k == config.gemm2.block_k == 128
        assert config.block_m == default_config(num_tokens, 8, 128).block_m
    backend = TritonMoe(config_dir=tmp_path)
    x, q13, s13, q2, s2, weights, ids = make_inputs(30, 4, 2, 64, 32, BLOCK, seed=7)
    gpu = device_name_of(x.device)  # "cpu" in the interpreter, the GPU's name compiled
    (tmp_path / config_file_name(4, 32, FP8_DTYPE, gpu)).write_text(
        json.dumps({"64": WIDE.to_json()})
    )
    assert backend.launch_config(x, q2, 2, FP8_DTYPE) == WIDE
    out = backend.experts_fp8(x, q13, s13, q2, s2, BLOCK, weights, ids)  # the tuned entry
    assert_matches_references(out, x, q13, s13, q2, s2, BLOCK, weights, ids)


def test_gpus_without_fp8_tensor_cores_dequantize_for_the_bf16_kernel(monkeypatch) -> None:
    from sits.kernels import fp8_gemm_triton

    monkeypatch.setattr(fp8_gemm_triton, "fp8_gemm_supported", lambda device: False)
    x, q13, s13, q2, s2, weights, ids = make_inputs(6, 8, 2, 64, 32, None, seed=9)
    out = TritonMoe(MoeLaunchConfig(16, GemmConfig(16, 16), GemmConfig(16, 16))).experts_fp8(
        x, q13, s13, q2, s2, None, weights, ids
    )
    expected = moe_forward_fp8(x, q13, s13, q2, s2, None, weights, ids)  # weight-only too
    assert relative_error(out, expected) < 1e-5
    assert moe_triton.TritonMoe.cuda_graph_safe


def test_fp8_moe_block_keeps_the_triton_backend() -> None:
    from sits.layers.moe import MoeConfig
    from sits.layers.quant.config import QuantConfig
    from sits.layers.quant.fp8_moe import Fp8SparseMoeBlock
    from sits.runner.backends import graph_safe

    quant = QuantConfig("fp8", "block", (32, 32), "weight_scale_inv")
    block = Fp8SparseMoeBlock(64, MoeConfig(8, 2, 32, True), quant, moe_backend=TritonMoe(SMALL))
    assert isinstance(block.moe_backend, TritonMoe)
    triton_attention = type("TritonPagedAttention", (), {})()  # graph_safe reads its name
    assert graph_safe(torch.nn.Sequential(block), triton_attention)
    x, q13, s13, q2, s2, _, _ = make_inputs(5, 8, 2, 64, 32, BLOCK, seed=10)
    with torch.no_grad():
        for name, value in (("w13", q13), ("w13_scale", s13), ("w2", q2), ("w2_scale", s2)):
            getattr(block, name).data = value
        block.gate.weight.normal_(generator=torch.Generator().manual_seed(1))
    block.to(DEVICE)
    with torch.no_grad():
        out = block(x)
        weights, ids = select_experts(block.gate(x), 2, True)
    assert x.shape[0] <= MOE_GEMV_MAX_TOKENS  # 5 tokens: the weight-only GEMV
    expected = moe_forward_fp8(x, q13, s13, q2, s2, BLOCK, weights, ids)
    assert relative_error(out, expected) < TIGHT
