"""Micro-benchmark: the Triton FP8 GEMM vs the bf16 torch matmul at the same shapes.

Prints the exact command, the machine, then a markdown table (ready for bench/RESULTS.md) per
projection and token count: microseconds, TFLOP/s (2 * M * N * K / time) and TB/s (bytes read
and written / time) of `triton_fp8_linear` (in the mode it picks by M: W8A16 for decode, else
activation quantization + W8A8 GEMM; 128 x 128 block scales and per-row scales, `--scales`;
what `fp8_linear` runs on CUDA) and of `F.linear` on bf16 weights (cuBLAS),
the speedup, the FP8 result's error relative to the bf16 one, and for per-row scales cuBLAS's
FP8 GEMM (`torch._scaled_mm`, activations pre-quantized) as the library's ceiling.

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
    parser.add_argument("--scales", default="block,channel", help="block, channel or both")
    args = parser.parse_args(argv)
    if args.device == "cpu":  # interpreter: one tiny shape, wall-clock timing
        args.tokens, args.reps = "1,5", 1
    return args


def scaled_mm_us(w, num_rows: int, num_inner: int, copies: int, reps: int) -> float | None:
    """cuBLAS's FP8 GEMM (`torch._scaled_mm`, per-row scales, activations already quantized
    per token): the library ceiling beside ours; None where this torch lacks it."""
    from sits.kernels.fp8_ref import quantize_fp8_per_row

    try:
        weights = [quantize_fp8_per_row(w) for _ in range(copies)]
        xs = [
            quantize_fp8_per_row(torch.randn(num_rows, num_inner, device="cuda"))
            for _ in range(copies)
        ]
        state = {"i": 0}

        def call() -> object:
            i = state["i"] = (state["i"] + 1) % copies
            (xq, xs_), (wq, ws) = xs[i], weights[i]
            return torch._scaled_mm(
                xq, wq.t(), scale_a=xs_[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16
            )

        call()
        return time_us(call, "cuda", reps)
    except (RuntimeError, TypeError, AttributeError) as error:
        print(f"  (torch._scaled_mm unavailable: {error!r:.120})")
        return None


def bench_shape(name: str, num_cols: int, num_inner: int, num_rows: int, args, scales: str) -> str:
    from sits.kernels.fp8_gemm_triton import fp8_gemm_mode, triton_fp8_linear
    from sits.kernels.fp8_ref import quantize_fp8_block, quantize_fp8_per_row

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # interpreter: no bf16
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(num_cols, num_inner, generator=gen, device=device) * 0.02
    weight_bytes = num_cols * num_inner * 2
    copies = num_copies(weight_bytes, device)
    w_bf16 = [w.to(dtype) for _ in range(copies)]
    block = BLOCK if scales == "block" else None
    if block is not None:
        w_fp8 = [quantize_fp8_block(w, BLOCK) for _ in range(copies)]
    else:
        w_fp8 = [quantize_fp8_per_row(w) for _ in range(copies)]
    x = [
        torch.randn(num_rows, num_inner, generator=gen, device=device).to(dtype)
        for _ in range(copies)
    ]
    state = {"i": 0}

    def fp8_call() -> object:
        i = state["i"] = (state["i"] + 1) % copies
        return triton_fp8_linear(x[i], *w_fp8[i], None, block)

    def bf16_call() -> object:
        i = state["i"] = (state["i"] + 1) % copies
        return F.linear(x[i], w_bf16[i])

    fp8_us = time_us(fp8_call, device, args.reps)
    bf16_us = time_us(bf16_call, device, args.reps)
    out = triton_fp8_linear(x[0], *w_fp8[0], None, block).float()
    ref = F.linear(x[0], w_bf16[0]).float()
    error = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    flops = 2 * num_rows * num_cols * num_inner
    io = num_rows * (num_inner + num_cols) * 2  # x and y in bf16
    scale_bytes = w_fp8[0][1].numel() * 4 + num_rows * -(-num_inner // 128) * 4 * 2
    fp8_bytes = num_cols * num_inner + io + 2 * num_rows * num_inner + scale_bytes
    bf16_bytes = weight_bytes + io
    cublas = None
    if device == "cuda" and block is None:
        cublas = scaled_mm_us(w, num_rows, num_inner, copies, args.reps)
    cublas_text = f"{cublas:.1f}" if cublas is not None else "-"
    return (
        f"| {name} | {scales} | {fp8_gemm_mode(num_rows)} | {num_rows} | {num_cols} | "
        f"{num_inner} | {fp8_us:.1f} | "
        f"{flops / fp8_us / 1e6:.1f} | {fp8_bytes / fp8_us / 1e6:.2f} | {bf16_us:.1f} | "
        f"{flops / bf16_us / 1e6:.1f} | {bf16_bytes / bf16_us / 1e6:.2f} | "
        f"{bf16_us / fp8_us:.2f}x | {error:.1e} | {cublas_text} |"
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
        "| shape | scales | mode | M | N | K | fp8 us | fp8 TFLOP/s | fp8 TB/s | bf16 us "
        "| bf16 TFLOP/s | bf16 TB/s | speedup | rel. error | cuBLAS fp8 us |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for scales in args.scales.split(","):
        for name, (num_cols, num_inner) in shapes.items():
            for num_rows in (int(t) for t in args.tokens.split(",")):
                line = bench_shape(name, num_cols, num_inner, num_rows, args, scales)
                print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
