"""What a decode graph's padding rows cost the fused MoE: routed (as before) vs routed nowhere.

A decode batch of B sequences replays the CUDA graph captured for the next size up (1, 2, 4,
8, then steps of 8), so P = size - B padding rows run through every layer. They share one input
(the padding token), so they all pick the same k experts. Routed like real tokens, they send
up to k more experts' weights through the GEMMs per layer. `fused_route` now gives them expert
id -1 and weight 0, and `fused_moe` skips them.

For each batch, the table gives the time of one layer's `TritonMoe.experts` call over the
padded batch in both ways, the experts touched, and the saving. Qwen3-30B-A3B shape (E=128,
H=2048, I=768, top-8), bf16, random softmax routing for the real rows. Timing as in
moe_bench.py: CUDA graph replays over enough weight copies that L2 holds none of a call's
weights.

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 bench/kernels/moe_padding_bench.py [--batches 3,5,10,12,20,33]
    PYTHONPATH=src python3 bench/kernels/moe_padding_bench.py --device cpu --batches 3  # plumbing
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
from moe_tune import SHAPES, Shape, copies_needed, graph_time_us, make_weights, random_routing
from timing import machine_line


def graph_size(batch: int) -> int:
    """The captured decode size a batch replays (the runner's default capture list)."""
    if batch <= 8:
        return 1 << (batch - 1).bit_length()
    return -(-batch // 8) * 8


def padded_routing(batch: int, size: int, shape, device: str, drop: bool):
    """(hidden [size, H], weights [size, k], ids [size, k]): `batch` real rows, then padding
    rows that repeat one input's routing (drop=False) or go to expert -1 (drop=True)."""
    hidden, weights, ids = random_routing(size, shape, batch, device)
    hidden[batch:] = hidden[batch]  # one padding token's input
    weights[batch:], ids[batch:] = weights[batch], ids[batch]
    if drop:
        weights[batch:], ids[batch:] = 0.0, -1
    return hidden, weights, ids


def touched(ids: torch.Tensor, num_experts: int) -> int:
    return int((torch.bincount(ids[ids >= 0], minlength=num_experts) > 0).sum())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--batches", default="3,5,10,12,20,33")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before sits' kernels are imported
    from sits.kernels.moe_triton import TritonMoe

    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line(args.device)}")
    on_gpu = args.device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = Shape(*SHAPES["qwen3" if on_gpu else "tiny"], dtype)
    expert_bytes = shape.expert_bytes
    weights = make_weights(shape, 8 if args.device == "cuda" else 1, args.device)
    backend = TritonMoe()
    flags = torch.zeros(shape.num_experts, dtype=torch.bool, device=args.device)
    print("\n| batch | graph size | experts routed / dropped | us routed | us dropped | saving |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        size = graph_size(batch)
        row = []
        for drop in (False, True):
            hidden, topk_weights, topk_ids = padded_routing(batch, size, shape, args.device, drop)
            num_bytes = touched(topk_ids, shape.num_experts) * expert_bytes
            copies = weights[: copies_needed(num_bytes, len(weights), args.device)]

            def call(hidden=hidden, topk_weights=topk_weights, topk_ids=topk_ids, copies=copies):
                for w13, w2 in copies:
                    backend.experts(hidden, w13, w2, topk_weights, topk_ids, flags)

            row.append(
                (
                    touched(topk_ids, shape.num_experts),
                    graph_time_us(call, len(copies), args.device),
                )
            )
        (routed_n, routed_us), (dropped_n, dropped_us) = row
        print(
            f"| {batch} | {size} | {routed_n} / {dropped_n} | {routed_us:.1f} | "
            f"{dropped_us:.1f} | {100 * (1 - dropped_us / routed_us):.1f} % |",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
