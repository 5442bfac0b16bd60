"""Micro-benchmark: the MoE router of a decode step, `gate_route` (the router GEMV and the
routing in one launch) vs the gate's `F.linear` (cuBLAS) then `fused_route`, and checks that
both route alike.

Shapes: Qwen3-30B-A3B (E=128, H=2048, top-8) and Mixtral-8x7B (E=8, H=4096, top-2), bf16, at
1-16 tokens, with a sweep of gate_route's launch parameters at one token. Timing: CUDA graph
replay between CUDA events over enough copies of the gate weights that a call's gate has left
L2 before it is read again (as in a model, where the experts' bytes evict it between layers).

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 bench/kernels/gate_route_bench.py
"""

# ruff: noqa: B023  (each lambda is captured in a CUDA graph at once, in its loop turn)
from __future__ import annotations

import argparse
import itertools
import shlex
import sys

import torch
import torch.nn.functional as F
from timing import machine_line, num_copies, time_us

SHAPES = {"qwen3": (128, 2048, 8), "mixtral": (8, 4096, 2)}  # (E, H, top_k)


def per_call_us(fn, copies: list) -> float:
    """Microseconds of one fn call over every copy in turn, in one CUDA graph."""

    def over_copies() -> None:
        for copy in copies:
            fn(copy)

    return time_us(over_copies, "cuda", 50) / len(copies)


def bench(name: str, tokens: list[int]) -> None:
    from sits.kernels.moe_routing_triton import (
        GATE_ROUTE_BLOCK_H,
        GATE_ROUTE_PROGRAMS,
        GATE_ROUTE_WARPS,
        fused_route,
        gate_route,
    )

    num_experts, hidden_size, top_k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    count = num_copies(num_experts * hidden_size * 2, "cuda")
    gates = [
        (torch.randn(num_experts, hidden_size, generator=gen, device="cuda") * 0.02).bfloat16()
        for _ in range(count)
    ]
    frozen = torch.zeros(num_experts, dtype=torch.bool, device="cuda")
    acc = torch.zeros(num_experts, dtype=torch.int64, device="cuda")
    checked = torch.zeros(num_experts, dtype=torch.bool, device="cuda")
    arrivals = torch.zeros(1, dtype=torch.int32, device="cuda")

    def one_us(hidden, launch) -> float:
        return per_call_us(
            lambda g: gate_route(
                hidden, g, arrivals, frozen, top_k, True, acc, checked, None, *launch
            ),
            gates,
        )

    hidden = torch.randn(1, hidden_size, generator=gen, device="cuda").bfloat16()
    sweep = list(itertools.product((16, 32, 64, 128), (256, 512, 1024), (1, 2, 4)))
    best = min(sweep, key=lambda launch: one_us(hidden, launch))
    print(f"\n#### {name}: E={num_experts} H={hidden_size} top-{top_k}, bf16, {count} gates; "
          f"sweep best at T=1 (programs, block_h, warps): {best}\n")  # fmt: skip
    print(
        "| tokens | gate GEMM + fused_route us | gate_route us (best) | speed-up "
        "| gate_route us (shipped) | same ids |"
    )
    print("|---|---|---|---|---|---|")
    for num_tokens in tokens:
        hidden = torch.randn(num_tokens, hidden_size, generator=gen, device="cuda").bfloat16()
        two_us = per_call_us(
            lambda g: fused_route(F.linear(hidden, g), frozen, top_k, True, acc, checked), gates
        )
        best_us = one_us(hidden, best)
        shipped_us = one_us(hidden, (GATE_ROUTE_PROGRAMS, GATE_ROUTE_BLOCK_H, GATE_ROUTE_WARPS))
        _, ref_ids = fused_route(F.linear(hidden, gates[0]), frozen, top_k, True, acc, checked)
        _, ids = gate_route(hidden, gates[0], arrivals, frozen, top_k, True, acc, checked)
        same = int((ids == ref_ids).all(dim=-1).sum())
        print(f"| {num_tokens} | {two_us:.1f} | {best_us:.1f} | {two_us / best_us:.2f}x "
              f"| {shipped_us:.1f} | {same}/{num_tokens} |", flush=True)  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line('cuda')}")
    for name in args.shapes.split(","):
        bench(name, [int(t) for t in args.tokens.split(",")])


if __name__ == "__main__":
    main(sys.argv[1:])
