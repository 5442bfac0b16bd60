"""Micro-benchmark: the FP8 weight-only GEMV kernels (`fp8_gemv_triton`) at decode sizes, vs
the tiled FP8 kernels they replace and vs bf16, with a launch-config sweep.

Dense: the projections of Qwen3-30B-A3B's attention (qkv 5120 x 2048, o 2048 x 4096) and of
Llama-3.1-8B at 1-16 tokens, per-row scales (what `--quantization fp8` makes) and 128 x 128
block scales (the Qwen3-*-FP8 format): `triton_fp8_gemv` with the best config of a sweep at
M = 1 (and the shipped `DENSE_CONFIG`), `triton_fp8_linear` in its "w8a16" tiled mode, and
`F.linear` on bf16 weights (cuBLAS).

MoE: Qwen3-30B-A3B's experts (E=128, H=2048, I=768, top-8) at 1-8 tokens: `fused_moe_fp8_gemv`
(sweep of the up and down GEMVs' configs at one token, then the shipped ones), the grouped
W8A8 `fused_moe_fp8`, and the bf16 `fused_moe` on the dequantized weights.

Timing: CUDA graph replay between CUDA events, over enough copies of the weights that a
call's weights have left L2 before they are read again (`timing`, `moe_tune`). TB/s: the
weight bytes read (1 per fp8 element, 2 per bf16) over the time.

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 bench/kernels/fp8_gemv_bench.py
"""

# ruff: noqa: B023  (each lambda is captured in a CUDA graph at once, in its loop turn)
from __future__ import annotations

import argparse
import itertools
import shlex
import sys

import torch
import torch.nn.functional as F
from moe_tune import SHAPES as MOE_SHAPES
from moe_tune import Shape, copies_needed, random_routing, touched_experts
from timing import machine_line, num_copies, time_us

DENSE = {  # name: (N, K)
    "qwen3_30b_qkv": (5120, 2048),
    "qwen3_30b_o": (2048, 4096),
    "llama8b_qkv": (6144, 4096),
    "llama8b_o": (4096, 4096),
    "llama8b_gate_up": (28672, 4096),
    "llama8b_down": (4096, 14336),
}
BLOCK = (128, 128)


def dense_sweep():
    from sits.kernels.fp8_gemv_triton import GemvConfig

    for bn, bk, warps, stages in itertools.product((8, 16, 32), (256, 512), (4, 8), (2, 3)):
        yield GemvConfig(bn, bk, warps, stages)


def moe_sweep():
    from sits.kernels.fp8_gemv_triton import GemvConfig

    for bn, bk, stages in itertools.product((4, 8, 16, 32), (256, 512), (2, 3)):
        yield GemvConfig(bn, bk, 4, stages)


def quantize(w: torch.Tensor, scales: str):
    from sits.kernels.fp8_ref import quantize_fp8_block, quantize_fp8_per_row

    if scales == "block":
        return (*quantize_fp8_block(w, BLOCK), BLOCK)
    return (*quantize_fp8_per_row(w), None)


def per_call_us(fn, copies: list) -> float:
    """Microseconds of one fn call: a CUDA graph of fn over every copy in turn (so each
    call's weights have left L2 before they are read again), replayed, / the copies."""

    def over_copies() -> None:
        for copy in copies:
            fn(*copy)

    return time_us(over_copies, "cuda", 20) / len(copies)


def bench_dense(name: str, num_cols: int, num_inner: int, scales: str, tokens: list[int]) -> None:
    from sits.kernels.fp8_gemm_triton import triton_fp8_linear
    from sits.kernels.fp8_gemv_triton import DENSE_CONFIG, gemv_fits, triton_fp8_gemv

    def weight() -> torch.Tensor:
        return torch.randn(num_cols, num_inner, device="cuda") * 0.02

    fp8 = [quantize(weight(), scales) for _ in range(num_copies(num_cols * num_inner, "cuda"))]
    bf16 = [(weight().bfloat16(),) for _ in range(num_copies(2 * num_cols * num_inner, "cuda"))]
    block = fp8[0][2]
    mb = num_cols * num_inner / 1e6
    x1 = torch.randn(1, num_inner, device="cuda", dtype=torch.bfloat16)

    def gemv_us(x: torch.Tensor, config) -> float:
        return per_call_us(lambda q, s, b: triton_fp8_gemv(x, q, s, None, b, config), fp8)

    best = min((c for c in dense_sweep() if gemv_fits(c, block)), key=lambda c: gemv_us(x1, c))
    print(f"\n#### {name} (N={num_cols}, K={num_inner}), {scales} scales; sweep best at M=1: "
          f"{best}\n")  # fmt: skip
    print("| M | gemv best us | TB/s | gemv shipped us | tiled w8a16 us | bf16 cuBLAS us "
          "| best vs tiled | best vs bf16 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for m in tokens:
        x = torch.randn(m, num_inner, device="cuda", dtype=torch.bfloat16)
        best_us, shipped_us = gemv_us(x, best), gemv_us(x, DENSE_CONFIG)
        tiled_us = per_call_us(
            lambda q, s, b: triton_fp8_linear(x, q, s, None, b, mode="w8a16"), fp8
        )
        bf16_us = per_call_us(lambda w: F.linear(x, w), bf16)
        print(f"| {m} | {best_us:.1f} | {mb / best_us:.2f} | {shipped_us:.1f} | {tiled_us:.1f} "
              f"| {bf16_us:.1f} | {tiled_us / best_us:.2f}x | {bf16_us / best_us:.2f}x |",
              flush=True)  # fmt: skip


def bench_moe(scales: str, tokens: list[int]) -> None:
    from sits.kernels import fp8_gemv_triton as gemv
    from sits.kernels.fp8_ref import FP8_DTYPE, dequantize_fp8
    from sits.kernels.moe_fp8_triton import fused_moe_fp8
    from sits.kernels.moe_triton import TritonMoe, fused_moe

    num_experts, hidden_size, inter_size, top_k = MOE_SHAPES["qwen3"]
    shape = Shape(num_experts, hidden_size, inter_size, top_k, torch.bfloat16)
    touched_one = touched_experts(random_routing(1, shape, 0, "cuda")[2], num_experts)
    copies = []
    for _ in range(copies_needed(touched_one * shape.expert_bytes // 2, 8, "cuda")):
        w13 = torch.randn(num_experts, 2 * inter_size, hidden_size, device="cuda")
        w2 = torch.randn(num_experts, hidden_size, inter_size, device="cuda")
        q13, s13, block = quantize(w13.mul_(hidden_size**-0.5), scales)
        q2, s2, _ = quantize(w2.mul_(inter_size**-0.5), scales)
        del w13, w2
        copies.append((q13, s13, q2, s2, block))
    deq = [(dequantize_fp8(q13, s13, b, torch.bfloat16), dequantize_fp8(q2, s2, b, torch.bfloat16))
           for q13, s13, q2, s2, b in copies[:2]]  # fmt: skip
    backend = TritonMoe()
    routing = {count: random_routing(count, shape, count, "cuda") for count in tokens}

    def gemv_us(count: int, up, down) -> float:
        hidden, weights, ids = routing[count]
        return per_call_us(
            lambda q13, s13, q2, s2, b: gemv.fused_moe_fp8_gemv(
                hidden, q13, s13, q2, s2, b, weights, ids, None, up, down
            ),
            copies,
        )

    up_best = min(
        (c for c in moe_sweep() if gemv.gemv_fits(c, block, inter_size)),
        key=lambda c: gemv_us(tokens[0], c, gemv.moe_configs(block, inter_size)[1]),
    )
    down_best = min(
        (c for c in moe_sweep() if gemv.gemv_fits(c, block)),
        key=lambda c: gemv_us(tokens[0], up_best, c),
    )
    print(f"\n#### MoE E={num_experts} H={hidden_size} I={inter_size} top-{top_k}, {scales} "
          f"scales; sweep best at T={tokens[0]}: up {up_best}, down {down_best}\n")  # fmt: skip
    print(
        "| tokens | experts | fp8 MB | gemv best us | TB/s | gemv shipped us "
        "| grouped w8a8 us | bf16 us | best vs grouped | best vs bf16 | err vs bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for count in tokens:
        hidden, weights, ids = routing[count]
        experts = touched_experts(ids, num_experts)
        mb = experts * shape.expert_bytes / 2 / 1e6
        best_us = gemv_us(count, up_best, down_best)
        shipped_us = gemv_us(count, *gemv.moe_configs(block, inter_size))
        config = backend.launch_config(hidden, copies[0][2], top_k, FP8_DTYPE)
        grouped_us = per_call_us(
            lambda q13, s13, q2, s2, b: fused_moe_fp8(
                hidden, q13, s13, q2, s2, b, weights, ids, config
            ),
            copies,
        )
        bf16_config = backend.launch_config(hidden, deq[0][1], top_k)
        bf16_us = per_call_us(
            lambda w13, w2: fused_moe(hidden, w13, w2, weights, ids, bf16_config), deq
        )
        out = gemv.fused_moe_fp8_gemv(hidden, *copies[0], weights, ids)
        ref = fused_moe(hidden, *deq[0], weights, ids, bf16_config)
        err = float((out.double() - ref.double()).norm() / ref.double().norm())
        print(f"| {count} | {experts} | {mb:.1f} | {best_us:.1f} | {mb / best_us:.2f} "
              f"| {shipped_us:.1f} | {grouped_us:.1f} | {bf16_us:.1f} "
              f"| {grouped_us / best_us:.2f}x | {bf16_us / best_us:.2f}x | {err:.1e} |",
              flush=True)  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--moe-tokens", default="1,2,4,8")
    parser.add_argument("--shapes", default=",".join(DENSE))
    parser.add_argument("--scales", default="channel,block")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line('cuda')}")
    tokens = [int(t) for t in args.tokens.split(",")]
    for scales in args.scales.split(","):
        bench_moe(scales, [int(t) for t in args.moe_tokens.split(",")])
        for name in args.shapes.split(","):
            bench_dense(name, *DENSE[name], scales, tokens)


if __name__ == "__main__":
    main(sys.argv[1:])
