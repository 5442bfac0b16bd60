"""Micro-benchmark: the INT4 weight-only MoE GEMV kernels (`int4_gemv_triton`) at decode sizes
vs the grouped w4a16 MoE they replace and vs bf16, with a launch-config sweep.

Qwen3-30B-A3B's experts (symmetric, group 128, as `--quantization int4` makes) at 1-8 tokens:
`fused_moe_int4_gemv` (the sweep's best at the first count, and the shipped configs) vs the
grouped `fused_moe_int4` vs bf16 `fused_moe`. (A dense INT4 GEMV built the same way was
measured at 0.7-1.2x the tiled w4a16 GEMM at one token, 2026-12-02, and not kept.)

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
from fp8_gemv_bench import per_call_us
from moe_tune import SHAPES as MOE_SHAPES
from moe_tune import Shape, copies_needed, random_routing, touched_experts
from timing import machine_line

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
    parser.add_argument("--moe-tokens", default="1,2,4,8")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line('cuda')}")
    bench_moe([int(t) for t in args.moe_tokens.split(",")])


if __name__ == "__main__":
    main(sys.argv[1:])
