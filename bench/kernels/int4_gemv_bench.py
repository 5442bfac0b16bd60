"""Micro-benchmark: the INT4 weight-only GEMV kernels (`int4_gemv_triton`) at decode sizes vs
the tiled w4a16 kernels they replace and vs bf16, with a launch-config sweep.

Dense: Qwen3-30B-A3B's attention projections and Llama-3.1-8B's qkv / down, group 128 with
zero points (AWQ-like) at 1-4 tokens: `triton_int4_gemv` (the sweep's best at M = 1, and the
shipped `DENSE_CONFIG`), `triton_w4a16_linear` (tiled / split-K), `F.linear` on bf16 (cuBLAS).
MoE: Qwen3-30B-A3B's experts (symmetric, group 128, as `--quantization int4` makes) at 1-8
tokens: `fused_moe_int4_gemv` vs the grouped `fused_moe_int4` vs bf16 `fused_moe`.

Timing as `fp8_gemv_bench` (CUDA graph of one call per weight copy, copies cycled out of L2).
TB/s: packed weight bytes (half a byte per weight, plus scales) over the time.

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 bench/kernels/int4_gemv_bench.py
"""

# ruff: noqa: B023  (each lambda is captured in a CUDA graph at once, in its loop turn)
from __future__ import annotations

import argparse
import itertools
import shlex
import sys

import torch
import torch.nn.functional as F
from fp8_gemv_bench import DENSE, per_call_us
from moe_tune import SHAPES as MOE_SHAPES
from moe_tune import Shape, copies_needed, random_routing, touched_experts
from timing import machine_line, num_copies

GROUP = 128


def sweep():
    from sits.kernels.int4_gemv_triton import Int4GemvConfig

    for bn, groups, stages in itertools.product((8, 16, 32), (1, 2, 4), (2, 3)):
        yield Int4GemvConfig(bn, groups, 4, stages)


def int4_weight(*shape: int, zeros: bool):
    """(packed, scale, zero or None) of random codes, the `int4_ref` layout, on the GPU."""
    *lead, num_cols, num_inner = shape
    packed = torch.randint(-(2**31), 2**31 - 1, (*lead, num_cols, num_inner // 8),
                           dtype=torch.int32, device="cuda")  # fmt: skip
    groups = (*lead, num_cols, num_inner // GROUP)
    scale = torch.rand(groups, device="cuda") * 1e-3
    zero = torch.randint(0, 16, groups, device="cuda", dtype=torch.uint8) if zeros else None
    return packed, scale, zero


def bench_dense(name: str, num_cols: int, num_inner: int, tokens: list[int]) -> None:
    from sits.kernels.int4_gemv_triton import DENSE_CONFIG, int4_gemv_fits, triton_int4_gemv
    from sits.kernels.w4a16_gemm_triton import triton_w4a16_linear

    weights = [(int4_weight(num_cols, num_inner, zeros=True),)
               for _ in range(num_copies(num_cols * num_inner // 2, "cuda"))]  # fmt: skip
    bf16 = [(torch.randn(num_cols, num_inner, device="cuda", dtype=torch.bfloat16),)
            for _ in range(num_copies(2 * num_cols * num_inner, "cuda"))]  # fmt: skip
    mb = num_cols * num_inner * (0.5 + 5 / GROUP) / 1e6
    x1 = torch.randn(1, num_inner, device="cuda", dtype=torch.bfloat16)

    def gemv_us(x, config) -> float:
        return per_call_us(lambda w: triton_int4_gemv(x, w, GROUP, None, config), weights)

    fits = [c for c in sweep() if int4_gemv_fits(GROUP, num_inner, c)]
    best = min(fits, key=lambda c: gemv_us(x1, c))
    print(f"\n#### int4 {name} (N={num_cols}, K={num_inner}), group {GROUP} with zero points; "
          f"sweep best at M=1: {best}\n")  # fmt: skip
    print("| M | gemv best us | TB/s | gemv shipped us | tiled w4a16 us | bf16 us "
          "| best vs tiled | best vs bf16 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for m in tokens:
        x = torch.randn(m, num_inner, device="cuda", dtype=torch.bfloat16)
        best_us, shipped_us = gemv_us(x, best), gemv_us(x, DENSE_CONFIG)
        tiled_us = per_call_us(lambda w: triton_w4a16_linear(x, *w, GROUP, None), weights)
        bf16_us = per_call_us(lambda w: F.linear(x, w), bf16)
        print(f"| {m} | {best_us:.1f} | {mb / best_us:.2f} | {shipped_us:.1f} | {tiled_us:.1f} "
              f"| {bf16_us:.1f} | {tiled_us / best_us:.2f}x | {bf16_us / best_us:.2f}x |",
              flush=True)  # fmt: skip


def bench_moe(tokens: list[int]) -> None:
    from sits.kernels import int4_gemv_triton as gemv
    from sits.kernels.moe_int4_triton import fused_moe_int4
    from sits.kernels.moe_triton import TritonMoe, fused_moe

    num_experts, hidden_size, inter_size, top_k = MOE_SHAPES["qwen3"]
    shape = Shape(num_experts, hidden_size, inter_size, top_k, torch.bfloat16)
    touched_one = touched_experts(random_routing(1, shape, 0, "cuda")[2], num_experts)
    copies = [
        (int4_weight(num_experts, 2 * inter_size, hidden_size, zeros=False),
         int4_weight(num_experts, hidden_size, inter_size, zeros=False))
        for _ in range(copies_needed(touched_one * shape.expert_bytes // 4, 8, "cuda"))
    ]  # fmt: skip
    bf16 = [(torch.randn(num_experts, 2 * inter_size, hidden_size, device="cuda",
                         dtype=torch.bfloat16) * 0.02,
             torch.randn(num_experts, hidden_size, inter_size, device="cuda",
                         dtype=torch.bfloat16) * 0.02) for _ in range(2)]  # fmt: skip
    routing = {count: random_routing(count, shape, count, "cuda") for count in tokens}

    def gemv_us(count: int, up, down) -> float:
        hidden, weights, ids = routing[count]
        return per_call_us(
            lambda w13, w2: gemv.fused_moe_int4_gemv(
                hidden, w13, w2, GROUP, weights, ids, None, up, down
            ),
            copies,
        )

    up_best = min(sweep(), key=lambda c: gemv_us(tokens[0], c, gemv.MOE_DOWN_CONFIG))
    down_best = min(
        (c for c in sweep() if gemv.int4_gemv_fits(GROUP, inter_size, c)),
        key=lambda c: gemv_us(tokens[0], up_best, c),
    )
    print(
        f"\n#### int4 MoE E={num_experts} H={hidden_size} I={inter_size} top-{top_k}, group "
        f"{GROUP} symmetric; sweep best at T={tokens[0]}: up {up_best}, down {down_best}\n"
    )
    print("| tokens | experts | int4 MB | gemv best us | TB/s | gemv shipped us | grouped us "
          "| bf16 us | best vs grouped | best vs bf16 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    backend = TritonMoe()
    for count in tokens:
        hidden, weights, ids = routing[count]
        experts = touched_experts(ids, num_experts)
        mb = experts * shape.expert_bytes / 4 / 1e6
        best_us = gemv_us(count, up_best, down_best)
        shipped_us = gemv_us(count, gemv.MOE_UP_CONFIG, gemv.MOE_DOWN_CONFIG)
        grouped_us = per_call_us(
            lambda w13, w2: fused_moe_int4(hidden, w13, w2, GROUP, weights, ids), copies
        )
        bf16_config = backend.launch_config(hidden, bf16[0][1], top_k)
        bf16_us = per_call_us(
            lambda w13, w2: fused_moe(hidden, w13, w2, weights, ids, bf16_config), bf16
        )
        print(f"| {count} | {experts} | {mb:.1f} | {best_us:.1f} | {mb / best_us:.2f} "
              f"| {shipped_us:.1f} | {grouped_us:.1f} | {bf16_us:.1f} "
              f"| {grouped_us / best_us:.2f}x | {bf16_us / best_us:.2f}x |",
              flush=True)  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4")
    parser.add_argument("--moe-tokens", default="1,2,4,8")
    parser.add_argument("--shapes", default="qwen3_30b_qkv,qwen3_30b_o,llama8b_qkv,llama8b_down")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line('cuda')}")
    bench_moe([int(t) for t in args.moe_tokens.split(",")])
    for name in args.shapes.split(","):
        bench_dense(name, *DENSE[name], [int(t) for t in args.tokens.split(",")])


if __name__ == "__main__":
    main(sys.argv[1:])
