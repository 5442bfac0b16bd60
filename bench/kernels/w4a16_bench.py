"""Micro-benchmark: the Triton w4a16 GEMM vs bf16 F.linear, and the fused INT4 MoE vs the bf16
fused MoE, at the same shapes in the same run.

Prints the exact command, the machine, then two markdown tables (ready for bench/RESULTS.md):
1. GEMM, per projection and token count: microseconds and TB/s (bytes read and written / time)
   of `triton_w4a16_linear` (symmetric INT4, group 128, what `Int4Weights.forward` runs on
   CUDA) and of `F.linear` on bf16 weights (cuBLAS), the speedup and the INT4 result's error
   relative to `int4_ref.w4a16_linear` (the same weights dequantized, cuBLAS in bf16).
   Shapes: Llama-3.1-8B (qkv, o, gate_up, down) and Qwen3-30B-A3B's attention (qkv, o) at
   1, 16, 256 and 4,096 tokens.
2. MoE, Qwen3-30B-A3B experts (E=128, H=2048, I=768, top-8) at 1, 10, 64 and 256 tokens with
   random softmax routing: `fused_moe_int4` (group 128) and `moe_triton.fused_moe` on bf16
   experts (the engine's tuned configs), microseconds, TB/s over the touched experts' bytes,
   the speedup and the INT4 result's error relative to `moe_ref.moe_forward_int4`.
`--sweep` also times a few GEMM launch shapes per row (the best one and its time are printed),
as input to the default heuristic or a tuned file (`w4a16_gemm_triton.config_file_name`).

Timing: CUDA graph replay between CUDA events (launch overhead excluded, as in the engine's
decode graphs); weights cycled over enough copies that one call's weights have left L2 before
they are read again. Bytes: INT4 reads x, the packed weight (K / 2 bytes a row) and the
float32 scales and writes y; bf16 reads x and W (2 bytes an element) and writes y.

Usage (GPU machine, from the repository root):
    PYTHONPATH=src python3 bench/kernels/w4a16_bench.py [--tokens 1,16,256,4096] [--sweep]
    PYTHONPATH=src python3 bench/kernels/w4a16_bench.py --device cpu  # plumbing (interpreter)
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import sys

import torch
import torch.nn.functional as F
from moe_tune import Shape, copies_needed, graph_time_us, random_routing, touched_experts
from timing import machine_line, num_copies, time_us

SHAPES = {  # name: (N, K)
    "llama8b_qkv": (6144, 4096),
    "llama8b_o": (4096, 4096),
    "llama8b_gate_up": (28672, 4096),
    "llama8b_down": (4096, 14336),
    "qwen3_30b_qkv": (5120, 2048),
    "qwen3_30b_o": (2048, 4096),
}
MOE_SHAPE = (128, 2048, 768, 8)  # Qwen3-30B-A3B: E, H, I, top_k
GROUP = 128
SWEEP = [  # (block_m, block_n, block_k, split_k, num_warps, num_stages, dequantize_first)
    (16, 32, 128, 1, 4, 4, False), (16, 64, 128, 1, 4, 4, False), (16, 64, 128, 4, 4, 4, False),
    (16, 128, 128, 4, 4, 3, False), (16, 32, 256, 4, 4, 3, False), (16, 64, 256, 2, 4, 3, False),
    (16, 32, 128, 8, 4, 4, False), (32, 64, 128, 1, 4, 4, False), (64, 64, 128, 1, 4, 3, False),
    (64, 128, 128, 1, 4, 3, False), (128, 128, 128, 1, 8, 3, False),
    (64, 64, 128, 1, 4, 3, True),
]  # fmt: skip
MOE_SWEEP = [  # (block_n, block_k, group_m, num_warps, num_stages) of both GEMMs
    (32, 128, 1, 4, 4), (64, 128, 1, 4, 4), (32, 256, 1, 4, 3), (128, 128, 8, 8, 3),
    (64, 128, 8, 4, 3), (64, 256, 8, 4, 3),
]  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--moe-tokens", default="1,10,64,256")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="names of " + ", ".join(SHAPES))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time GEMM launch shapes")
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE table")
    args = parser.parse_args(argv)
    if args.device == "cpu":  # interpreter: tiny shapes, wall-clock timing
        args.tokens, args.moe_tokens, args.reps = "1,5", "1,4", 1
    return args


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def sweep_gemm(x, weight, num_rows: int, device: str, reps: int) -> str:
    """'best config: us' over the SWEEP launch shapes for one (shape, M)."""
    from sits.kernels.w4a16_gemm_triton import W4a16Config, triton_w4a16_linear

    best = (float("inf"), None)
    for block_m, block_n, block_k, split_k, warps, stages, dequant in SWEEP:
        if block_m > 16 and num_rows <= 16 or block_m < 64 and num_rows > 256:
            continue
        config = W4a16Config(block_m, block_n, block_k, split_k, 8, warps, stages, dequant)
        try:
            call = functools.partial(triton_w4a16_linear, x, *weight, GROUP, None, config)
            us = time_us(call, device, reps)
        except Exception as error:  # noqa: BLE001 - a launch shape that does not compile
            print(f"  ({config} failed: {type(error).__name__})")
            continue
        best = min(best, (us, config), key=lambda item: item[0])
    return f"{best[1]}: {best[0]:.1f} us"


def bench_gemm(name: str, num_cols: int, num_inner: int, num_rows: int, args) -> str:
    from sits.kernels.int4_ref import quantize_int4, w4a16_linear
    from sits.kernels.w4a16_gemm_triton import select_config, triton_w4a16_linear

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # interpreter: no bf16
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(num_cols, num_inner, generator=gen, device=device) * 0.02
    weight_bytes = num_cols * num_inner * 2
    copies = num_copies(weight_bytes, device)
    w_bf16 = [w.to(dtype) for _ in range(copies)]
    w_int4 = [(*quantize_int4(w, GROUP), None) for _ in range(copies)]
    x = [
        torch.randn(num_rows, num_inner, generator=gen, device=device).to(dtype)
        for _ in range(copies)
    ]
    state = {"i": 0}

    def int4_call() -> object:
        i = state["i"] = (state["i"] + 1) % copies
        return triton_w4a16_linear(x[i], *w_int4[i], GROUP)

    def bf16_call() -> object:
        i = state["i"] = (state["i"] + 1) % copies
        return F.linear(x[i], w_bf16[i])

    int4_us = time_us(int4_call, device, args.reps)
    bf16_us = time_us(bf16_call, device, args.reps)
    out = triton_w4a16_linear(x[0], *w_int4[0], GROUP)
    error = relative_error(out, w4a16_linear(x[0], *w_int4[0], GROUP))
    io = num_rows * (num_inner + num_cols) * 2  # x and y in bf16
    int4_bytes = num_cols * num_inner // 2 + w_int4[0][1].numel() * 4 + io
    config = select_config(num_rows, num_cols, num_inner, GROUP, x[0].device)
    row = (
        f"| {name} | {num_rows} | {num_cols} | {num_inner} | {int4_us:.1f} | "
        f"{int4_bytes / int4_us / 1e6:.2f} | {bf16_us:.1f} "
        f"| {(weight_bytes + io) / bf16_us / 1e6:.2f} "
        f"| {bf16_us / int4_us:.2f}x | {error:.1e} | {config.block_m}x{config.block_n}x"
        f"{config.block_k}/{config.split_k} |"
    )
    if args.sweep:
        row += f"\n  sweep: {sweep_gemm(x[0], w_int4[0], num_rows, device, args.reps)}"
    return row


def moe_weights(shape: Shape, count: int, device: str):
    """count copies of ((w13 bf16, w2 bf16), (w13 int4, w2 int4)) of the same experts."""
    from sits.kernels.int4_ref import quantize_int4

    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    copies = []
    for _ in range(count):
        w13 = torch.randn(e, 2 * i, h, generator=gen, device=device) * h**-0.5
        w2 = torch.randn(e, h, i, generator=gen, device=device) * i**-0.5
        int4 = ((*quantize_int4(w13, GROUP), None), (*quantize_int4(w2, GROUP), None))
        copies.append(((w13.to(shape.dtype), w2.to(shape.dtype)), int4))
        del w13, w2
    return copies


def bench_moe(shape: Shape, weights: list, count: int, device: str, sweep: bool) -> str:
    from sits.kernels.moe_int4_triton import fused_moe_int4
    from sits.kernels.moe_ref import moe_forward_int4
    from sits.kernels.moe_triton import TritonMoe

    backend = TritonMoe()
    hidden, topk_weights, topk_ids = random_routing(count, shape, count, device)
    num_touched = touched_experts(topk_ids, shape.num_experts)
    elements = 3 * shape.hidden_size * shape.intermediate_size * num_touched
    bf16_bytes, int4_bytes = elements * 2, elements // 2 + elements // GROUP * 4
    bf16_copies = weights[: copies_needed(bf16_bytes, len(weights), device)]
    int4_copies = weights[: copies_needed(int4_bytes, len(weights), device)]

    def bf16() -> None:
        for (w13, w2), _ in bf16_copies:
            backend.experts(hidden, w13, w2, topk_weights, topk_ids)

    def int4() -> None:
        for _, (w13, w2) in int4_copies:
            fused_moe_int4(hidden, w13, w2, GROUP, topk_weights, topk_ids)

    int4_us = graph_time_us(int4, len(int4_copies), device)
    bf16_us = graph_time_us(bf16, len(bf16_copies), device)
    w13, w2 = weights[0][1]
    out = fused_moe_int4(hidden, w13, w2, GROUP, topk_weights, topk_ids)
    error = relative_error(out, moe_forward_int4(hidden, w13, w2, GROUP, topk_weights, topk_ids))
    row = (
        f"| {count} | {num_touched} | {int4_us:.1f} | {int4_bytes / int4_us / 1e6:.2f} "
        f"| {bf16_us:.1f} | {bf16_bytes / bf16_us / 1e6:.2f} | {bf16_us / int4_us:.2f}x "
        f"| {error:.1e} |"
    )
    if sweep:
        row += "\n  sweep: " + sweep_moe(shape, int4_copies, hidden, topk_weights, topk_ids)
    return row


def sweep_moe(shape: Shape, copies: list, hidden, topk_weights, topk_ids) -> str:
    """'best config: us' over MOE_SWEEP tiles (both GEMMs alike) and BLOCK_M candidates."""
    from moe_tune import block_m_candidates

    from sits.kernels.moe_config import GemmConfig, MoeLaunchConfig
    from sits.kernels.moe_int4_triton import fused_moe_int4

    best = (float("inf"), None)
    for block_m in block_m_candidates(hidden.shape[0], shape):
        for block_n, block_k, group_m, warps, stages in MOE_SWEEP:
            gemm = GemmConfig(block_n, block_k, group_m, warps, stages)
            config = MoeLaunchConfig(block_m, gemm, gemm)

            def run(config=config) -> None:
                for _, (w13, w2) in copies:
                    fused_moe_int4(hidden, w13, w2, GROUP, topk_weights, topk_ids, config)

            us = graph_time_us(run, len(copies), "cuda")
            best = min(best, (us, config), key=lambda item: item[0])
    return f"{best[1]}: {best[0]:.1f} us"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.device == "cpu":  # the interpreter, set before the kernels are imported
        os.environ["TRITON_INTERPRET"] = "1"
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(machine_line(args.device))
    shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
    if args.device == "cpu":
        shapes = {"tiny": (200, 384)}
    print("\n### w4a16 GEMM (symmetric, group 128) vs bf16 F.linear\n")
    print(
        "| shape | M | N | K | int4 us | int4 TB/s | bf16 us | bf16 TB/s | speedup "
        "| rel. error | config (MxNxK/split) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (num_cols, num_inner) in shapes.items():
        for num_rows in (int(t) for t in args.tokens.split(",")):
            print(bench_gemm(name, num_cols, num_inner, num_rows, args), flush=True)
    if args.no_moe:
        return
    num_experts, hidden_size, inter_size, top_k = (
        (8, 256, 128, 2) if args.device == "cpu" else MOE_SHAPE
    )
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shape = Shape(num_experts, hidden_size, inter_size, top_k, dtype)
    print(
        f"\n### fused MoE E={num_experts} H={hidden_size} I={inter_size} top-{top_k}: "
        "int4 vs bf16\n"
    )
    print("| tokens | experts | int4 us | int4 TB/s | bf16 us | bf16 TB/s | speedup | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    weights = moe_weights(shape, 1 if args.device == "cpu" else 12, args.device)
    for count in (int(t) for t in args.moe_tokens.split(",")):
        print(bench_moe(shape, weights, count, args.device, args.sweep), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
