"""Micro-benchmark: the Triton W8A8 FP8 GEMM vs the bf16 torch matmul at the same shapes.

Prints the exact command, the machine, then a markdown table (ready for bench/RESULTS.md) per
projection and token count: microseconds, TFLOP/s (2 * M * N * K / time) and TB/s (bytes read
and written / time) of `triton_fp8_linear` (activation quantization + FP8 GEMM, 128 x 128
block scales, what `fp8_linear` runs on CUDA) and of `F.linear` on bf16 weights (cuBLAS),
the speedup, and the FP8 result's error relative to the bf16 one.

Shapes default to the projections of Llama-3.1-8B (qkv, o, gate_up, down) and Qwen3-30B-A3B's
attention (qkv, o) at 1, 16, 256 and 4,096 tokens.

Timing: CUDA graph replay between CUDA events (launch overhead excluded, as in the engine's
decode graphs); inputs and weights are cycled over several copies so that one call's weight is
not still in L2 from the previous one. Bytes: FP8 reads x (bf16), W (1 byte per element) and
the scales and writes y; the quantized activations' round trip is counted too (1 byte per
element each way); bf16 reads x and W (2 bytes) and writes y.

Usage (GPU machine, from the repository root):
    PYTHONPATH=src python3 bench/kernels/fp8_gemm_bench.py [--tokens 1,16,256,4096]
    PYTHONPATH=src TRITON_INTERPRET=1 python3 bench/kernels/fp8_gemm_bench.py --device cpu
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
import torch.nn.functional as F
from timing import machine_line, num_copies, time_us

SHAPES = {  # name: (N, K)
    "llama8b_qkv": (6144, 4096),
    "llama8b_o": (4096, 4096),
    "llama8b_gate_up": (28672, 4096),
    "llama8b_down": (4096, 14336),
    "qwen3_30b_qkv": (5120, 2048),
    "qwen3_30b_o": (2048, 4096),
}
BLOCK = (128, 128)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="names of " + ", ".join(SHAPES))
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    if args.device == "cpu":  # interpreter: one tiny shape, wall-clock timing
        args.tokens, args.reps = "1,5", 1
    return args


def bench_shape(name: str, num_cols: int, num_inner: int, num_rows: int, args) -> str:
    from sits.kernels.fp8_gemm_triton import triton_fp8_linear
    from sits.kernels.fp8_ref import quantize_fp8_block

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # interpreter: no bf16
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(num_cols, num_inner, generator=gen, device=device) * 0.02
    weight_bytes = num_cols * num_inner * 2
    copies = num_copies(weight_bytes, device)
    w_bf16 = [w.to(dtype) for _ in range(copies)]
    w_fp8 = [quantize_fp8_block(w, BLOCK) for _ in range(copies)]
    x = [
        torch.randn(num_rows, num_inner, generator=gen, device=device).to(dtype)
        for _ in range(copies)
    ]
    state = {"i": 0}

    def fp8_call() -> object:
        i = state["i"] = (state["i"] + 1) % copies
        return triton_fp8_linear(x[i], *w_fp8[i], None, BLOCK)

    def bf16_call() -> object:
        i = state["i"] = (state["i"] + 1) % copies
        return F.linear(x[i], w_bf16[i])

    fp8_us = time_us(fp8_call, device, args.reps)
    bf16_us = time_us(bf16_call, device, args.reps)
    out = triton_fp8_linear(x[0], *w_fp8[0], None, BLOCK).float()
    ref = F.linear(x[0], w_bf16[0]).float()
    error = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    flops = 2 * num_rows * num_cols * num_inner
    io = num_rows * (num_inner + num_cols) * 2  # x and y in bf16
    scale_bytes = w_fp8[0][1].numel() * 4 + num_rows * -(-num_inner // 128) * 4 * 2
    fp8_bytes = num_cols * num_inner + io + 2 * num_rows * num_inner + scale_bytes
    bf16_bytes = weight_bytes + io
    return (
        f"| {name} | {num_rows} | {num_cols} | {num_inner} | {fp8_us:.1f} | "
        f"{flops / fp8_us / 1e6:.1f} | {fp8_bytes / fp8_us / 1e6:.2f} | {bf16_us:.1f} | "
        f"{flops / bf16_us / 1e6:.1f} | {bf16_bytes / bf16_us / 1e6:.2f} | "
        f"{bf16_us / fp8_us:.2f}x | {error:.1e} |"
    )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(machine_line(args.device))
    shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
    if args.device == "cpu":
        shapes = {"tiny": (200, 328)}
    print()
    print(
        "| shape | M | N | K | fp8 us | fp8 TFLOP/s | fp8 TB/s | bf16 us | bf16 TFLOP/s "
        "| bf16 TB/s | speedup | rel. error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (num_cols, num_inner) in shapes.items():
        for num_rows in (int(t) for t in args.tokens.split(",")):
            print(bench_shape(name, num_cols, num_inner, num_rows, args), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
