"""Micro-benchmark: the fused FP8 MoE (`TritonMoe.experts_fp8`, W8A8) vs the bf16 fused MoE.

For the Qwen3-30B-A3B shape (E=128, H=2048, I=768, top-8) at 1, 10, 64, 256 and 2048 tokens
with random softmax top-k routing, it prints the exact command, the machine, then a markdown
table (ready for bench/RESULTS.md): the FP8 call's time for one layer's experts (activation
quantization, alignment, both FP8 GEMMs, the intermediate's quantization, the top-k sum and
the non-finite check), the bytes of its touched experts' fp8 weights over that time, the
bf16 call (`TritonMoe.experts`, the peer, same run) on the dequantized weights, the speed-up,
the launch configs, and the FP8 result's error relative to the bf16 one (the activations'
FP8 rounding: both see the same weight values).

Timing: CUDA graph replay between CUDA events, the call repeated over enough copies of the
expert weights that one call's weights have left L2 before the next read (`moe_tune`).

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 bench/kernels/moe_fp8_bench.py [--scales block|channel]
    PYTHONPATH=src python3 bench/kernels/moe_fp8_bench.py --device cpu  # plumbing, tiny
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
from moe_tune import (
    SHAPES,
    Shape,
    copies_needed,
    graph_time_us,
    make_weights,
    random_routing,
    touched_experts,
)
from timing import machine_line

TOKEN_COUNTS = [1, 10, 64, 256, 2048]
BLOCK = (128, 128)


def quantized_copies(shape: Shape, num_copies: int, scales: str, device: str) -> list[tuple]:
    """num_copies of (fp8 (w13, w13_scale, w2, w2_scale), bf16 (w13, w2) dequantized)."""
    from sits.kernels.fp8_ref import dequantize_fp8, quantize_fp8_block, quantize_fp8_per_row

    block = BLOCK if scales == "block" else None
    copies = []
    for w13, w2 in make_weights(shape, num_copies, device):
        fp8 = []
        for w in (w13, w2):
            q, scale = quantize_fp8_block(w, block) if block else quantize_fp8_per_row(w)
            fp8.append((q, scale, dequantize_fp8(q, scale, block, shape.dtype)))
        (q13, s13, d13), (q2, s2, d2) = fp8
        copies.append(((q13, s13, q2, s2), (d13, d2)))
    return copies


def bench_token_count(shape: Shape, copies: list, count: int, args) -> str:
    """One table row for `count` tokens."""
    from sits.kernels.fp8_ref import FP8_DTYPE
    from sits.kernels.moe_triton import TritonMoe

    device = args.device
    block = BLOCK if args.scales == "block" else None
    backend = TritonMoe()
    hidden, topk_weights, topk_ids = random_routing(count, shape, count, device)
    num_touched = touched_experts(topk_ids, shape.num_experts)
    fp8_bytes = num_touched * shape.expert_bytes // shape.dtype.itemsize  # one byte a weight
    used = copies[: copies_needed(fp8_bytes, len(copies), device)]
    flags = torch.zeros(shape.num_experts, dtype=torch.bool, device=device)

    def fp8_call() -> None:
        for (w13, s13, w2, s2), _ in used:
            backend.experts_fp8(hidden, w13, s13, w2, s2, block, topk_weights, topk_ids, flags)

    def bf16_call() -> None:
        for _, (w13, w2) in used:
            backend.experts(hidden, w13, w2, topk_weights, topk_ids, flags)

    fp8_us = graph_time_us(fp8_call, len(used), device)
    bf16_us = graph_time_us(bf16_call, len(used), device)
    (w13, s13, w2, s2), (d13, d2) = used[0]
    out = backend.experts_fp8(hidden, w13, s13, w2, s2, block, topk_weights, topk_ids).double()
    ref = backend.experts(hidden, d13, d2, topk_weights, topk_ids).double()
    error = float((out - ref).norm() / ref.norm())
    fp8_config = backend.launch_config(hidden, w2, shape.top_k, FP8_DTYPE)
    bf16_config = backend.launch_config(hidden, d2, shape.top_k)
    return (
        f"| {count} | {num_touched} | {fp8_bytes / 1e6:.1f} | {fp8_us:.1f} "
        f"| {fp8_bytes / fp8_us / 1e6:.2f} | {bf16_us:.1f} | {bf16_us / fp8_us:.2f}x "
        f"| {fp8_config.block_m}/{fp8_config.gemm1.block_n}x{fp8_config.gemm1.block_k} "
        f"| {bf16_config.block_m}/{bf16_config.gemm1.block_n}x{bf16_config.gemm1.block_k} "
        f"| {error:.1e} |"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--scales", choices=("block", "channel"), default="block")
    parser.add_argument("--token-counts", default=",".join(map(str, TOKEN_COUNTS)))
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.token_counts = "1,4"
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.device == "cpu":  # the interpreter, set before the kernels are imported
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu for a plumbing check")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line(args.device)}")
    num_experts, hidden_size, inter_size, top_k = SHAPES["qwen3"]
    if args.device == "cpu":  # tiny, with whole 128 x 128 scale blocks
        num_experts, hidden_size, inter_size, top_k = 8, 128, 128, 2
    dtype = torch.float16 if args.device == "cpu" else torch.bfloat16  # interpreter: no bf16
    shape = Shape(num_experts, hidden_size, inter_size, top_k, dtype)
    one_token = random_routing(1, shape, 0, args.device)[2]
    one_token_bytes = shape.expert_bytes * touched_experts(one_token, num_experts) // 2
    copies = quantized_copies(
        shape, copies_needed(one_token_bytes, 8, args.device), args.scales, args.device
    )
    print(
        f"\n### E={num_experts} H={hidden_size} I={inter_size} top-{top_k}, {args.scales} "
        f"scales, activations {dtype}\n"
    )
    print(
        "| tokens | experts | fp8 MB touched | fp8 us | fp8 TB/s | bf16 us | speed-up "
        "| fp8 BLOCK_M/N x K | bf16 BLOCK_M/N x K | rel. err vs bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for count in (int(c) for c in args.token_counts.split(",")):
        print(bench_token_count(shape, copies, count, args), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
