"""Micro-benchmark of the fused MoE (`TritonMoe`) against its rooflines and two peers.

For the Qwen3-30B-A3B shape (E=128, H=2048, I=768, top-8) and the Mixtral-8x7B shape (E=8,
H=4096, I=14336, top-2) in bf16, at 1 ... 8192 tokens with random softmax top-k routing, it
prints the exact command, the machine, then a markdown table per shape (ready for
bench/RESULTS.md):
- our time for one layer's experts (`TritonMoe.experts`, the engine's call: alignment, both
  GEMMs, the top-k sum and the non-finite check), the bytes of the touched experts' weights
  over that time against the measured 4.21 TB/s copy bandwidth, and the FLOPs
  (2 * T * k * 3 * H * I) against the measured 792 TFLOP/s bf16 matrix rate;
- the peer `torch._grouped_mm` (both GEMMs, where this torch has it) measured in the same run;
- the reference `moe_ref.moe_forward` (eager: it reads counts back to the host) and our
  relative error against it; the alignment's own time.

Timing: CUDA graph replay between CUDA events (launch overhead excluded, as in the engine's
decode graphs), the call repeated over enough copies of the expert weights that one call's
weights have left L2 before the next read (see moe_tune.py).

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 bench/kernels/moe_bench.py [--shapes qwen3,mixtral] [--config-dir D]
    PYTHONPATH=src python3 bench/kernels/moe_bench.py --device cpu --shapes tiny  # plumbing
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F
from moe_tune import (
    DTYPES,
    SHAPES,
    TOKEN_COUNTS,
    Shape,
    copies_needed,
    graph_time_us,
    make_weights,
    random_routing,
    touched_experts,
)
from timing import machine_line

PEAK_TBPS = 4.21  # measured device-to-device copy bandwidth of an H200 (shared/notes)
PEAK_TFLOPS = 792.0  # measured bf16 8192^3 matmul rate of an H200


def grouped_mm_moe(hidden, w13, w2, topk_weights, topk_ids):
    """The peer: pairs sorted by expert, both projections as one `torch._grouped_mm` each,
    weighted scatter-add in float32. [T, H] in hidden's dtype."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()  # [T * k]
    order = torch.argsort(flat, stable=True)  # [T * k]
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=hidden.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] group ends
    tokens = order // top_k  # [T * k]
    gate_up = torch._grouped_mm(hidden[tokens], w13.transpose(1, 2), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)  # [T * k, I] each
    expert_out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)
    weighted = expert_out.float() * topk_weights.flatten()[order, None]  # [T * k, H]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, tokens, weighted).to(hidden.dtype)


def eager_time_us(fn, device: str, reps: int = 3) -> float:
    """Mean wall time of fn (synchronised); for code that reads the device from the host."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def bench_token_count(shape: Shape, weights: list, count: int, args) -> str:
    """One table row for `count` tokens."""
    from sits.kernels.moe_align import align_pairs_to_experts
    from sits.kernels.moe_ref import moe_forward
    from sits.kernels.moe_triton import TritonMoe

    device = args.device
    backend = TritonMoe(config_dir=args.config_dir)
    hidden, topk_weights, topk_ids = random_routing(count, shape, count, device)
    num_touched = touched_experts(topk_ids, shape.num_experts)
    touched_bytes = num_touched * shape.expert_bytes
    copies = weights[: copies_needed(touched_bytes, len(weights), device)]
    flags = torch.zeros(shape.num_experts, dtype=torch.bool, device=device)
    config = backend.launch_config(hidden, copies[0][1], shape.top_k)

    def ours() -> None:
        for w13, w2 in copies:
            backend.experts(hidden, w13, w2, topk_weights, topk_ids, flags)

    ours_us = graph_time_us(ours, len(copies), device)
    align_us = graph_time_us(
        lambda: align_pairs_to_experts(topk_ids, shape.num_experts, config.block_m), 1, device
    )
    peer = "n/a"
    if device == "cuda" and hasattr(torch, "_grouped_mm") and not args.no_peer:

        def grouped() -> None:
            for w13, w2 in copies:
                grouped_mm_moe(hidden, w13, w2, topk_weights, topk_ids)

        peer_us = graph_time_us(grouped, len(copies), device)
        peer = f"{peer_us:.1f} | {peer_us / ours_us:.2f}x"
    else:
        peer = "n/a | n/a"
    w13, w2 = copies[0]
    out = backend.experts(hidden, w13, w2, topk_weights, topk_ids)
    if args.no_ref:
        ref_us, error = float("nan"), float("nan")
    else:
        ref_call = lambda: moe_forward(hidden, w13, w2, topk_weights, topk_ids)  # noqa: E731
        ref_us = eager_time_us(ref_call, device)
        error = relative_error(out, ref_call())
    flops = 2 * count * shape.top_k * 3 * shape.hidden_size * shape.intermediate_size
    tbps = touched_bytes / ours_us / 1e6
    tflops = flops / ours_us / 1e6
    return (
        f"| {count} | {num_touched} | {touched_bytes / 1e6:.1f} | {config.block_m} "
        f"| {ours_us:.1f} | {tbps:.2f} | {100 * tbps / PEAK_TBPS:.0f}% | {tflops:.1f} "
        f"| {100 * tflops / PEAK_TFLOPS:.1f}% | {peer} | {ref_us:.0f} | {error:.1e} "
        f"| {align_us:.1f} |"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shapes", default="qwen3,mixtral", help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--token-counts", default=",".join(map(str, TOKEN_COUNTS)))
    parser.add_argument("--config-dir", default=None, help="tuned JSON files (default: package)")
    parser.add_argument("--no-peer", action="store_true", help="skip torch._grouped_mm")
    parser.add_argument("--no-ref", action="store_true", help="skip moe_ref (eager, slow)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.token_counts = "1,4"
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.device == "cpu":  # the interpreter, set before the kernels are imported
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu --shapes tiny for a plumbing check")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line(args.device)}")
    print(f"ceilings: {PEAK_TBPS} TB/s copy, {PEAK_TFLOPS} TFLOP/s bf16 (measured on an H200)")
    counts = [int(c) for c in args.token_counts.split(",")]
    for name in args.shapes.split(","):
        num_experts, hidden_size, inter_size, top_k = SHAPES[name]
        dtype = torch.float32 if args.device == "cpu" else DTYPES[args.dtype]
        shape = Shape(num_experts, hidden_size, inter_size, top_k, dtype)
        one_token = random_routing(1, shape, 0, args.device)[2]
        one_token_bytes = shape.expert_bytes * touched_experts(one_token, num_experts)
        weights = make_weights(shape, copies_needed(one_token_bytes, 8, args.device), args.device)
        print(f"\n### {name}: E={num_experts} H={hidden_size} I={inter_size} top-{top_k} {dtype}\n")
        print(
            "| tokens | experts | MB touched | BLOCK_M | us | TB/s | % of 4.21 | TFLOP/s "
            "| % of 792 | grouped_mm us | speed-up | moe_ref us | rel err | align us |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for count in counts:
            print(bench_token_count(shape, weights, count, args), flush=True)
        del weights
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
