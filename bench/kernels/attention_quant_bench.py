"""Micro-benchmark of Triton decode attention over bf16, fp8 and int8 paged KV caches.

Prints the exact command, the machine, then one markdown table (ready for bench/RESULTS.md):
per (batch, context, cache kind, key tile), the time of one decode step's attention of one
layer and the KV bytes it must read / time (data, plus int8's float32 scale per token and
head), against the measured 4.2 TB/s copy bandwidth, with the speedup over the fastest bf16
row of the case and the largest error against the PyTorch reference reading the same cache.

Cases: one new token per sequence, equal contexts; the fp8/int8 caches hold the bf16 cache's
values quantized by the reference write (`kv_quant_ref`). Shapes default to Qwen3-30B-A3B
attention (32 query heads, 4 kv heads, head_dim 128, block_size 16).
Timing and inputs come from `attention_bench` (CUDA graph replay between CUDA events, several
copies of small problems so one call's data is not in L2 from the previous one).

Usage (GPU machine, from the repository root):
    PYTHONPATH=src python3 bench/kernels/attention_quant_bench.py [--batch-sizes 64,256]
        [--context-lens 1024,2048] [--kinds bf16,fp8,int8] [--block-ns 64,128]
    PYTHONPATH=src python3 bench/kernels/attention_quant_bench.py --device cpu  # plumbing
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import replace

import torch
from attention_bench import PEAK_TBPS, Shape, make_step, max_error
from timing import machine_line, num_copies, time_us


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--context-lens", default="1024,2048")
    parser.add_argument("--kinds", default="bf16,fp8,int8")
    parser.add_argument(
        "--block-ns",
        default="",
        help="decode key tiles to try (comma list; default: the config's, 64 for bf16 and "
        "decode_block_n_quantized for fp8/int8)",
    )
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.device == "cpu":  # interpreter: tiny shapes, wall-clock timing
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 32
        args.batch_sizes, args.context_lens, args.reps = "2", "40", 1
        args.block_ns = args.block_ns or "16"
    return args


def kv_bytes_read(shape: Shape, batch: int, context: int, kind: str) -> int:
    """Bytes of K and V (and int8 scales) one decode step reads: 2 * tokens * heads * ..."""
    tokens_heads = 2 * batch * context * shape.num_kv_heads
    if kind == "bf16":
        return tokens_heads * shape.head_dim * shape.dtype.itemsize
    scale_bytes = 4 if kind == "int8" else 0  # fp8's per-head scales are 8 bytes per layer
    return tokens_heads * (shape.head_dim + scale_bytes)


def quantize_cache(cache: torch.Tensor, kind: str):
    """The whole plain cache quantized by the reference write (fp8 calibrated on all of it)."""
    from sits.kernels.kv_quant_ref import allocate_quantized_kv_cache, write_kv_quantized

    if kind == "bf16":
        return cache
    _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    quantized = allocate_quantized_kv_cache(
        kind, num_blocks, block_size, num_kv_heads, head_dim, cache.device
    )
    slots = cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, kv_heads, head_dim]
    all_slots = torch.arange(slots.shape[1], device=cache.device)
    write_kv_quantized(quantized, slots[0], slots[1], all_slots)
    return quantized


def prepare(shape: Shape, steps: list, kind: str) -> tuple[list, torch.Tensor]:
    """(the steps' caches as `kind`, reference output of steps[0] over its cache)."""
    from sits.kernels.attention_ref import paged_attention

    caches = [quantize_cache(step[3], kind) for step in steps]
    query, metadata = steps[0][0], steps[0][4]
    return caches, paged_attention(query, caches[0], metadata, shape.head_dim**-0.5)


def time_case(shape: Shape, steps: list, prepared: tuple, config, reps: int) -> dict:
    """Time `attend` over the steps with the prepared caches (one graph); error vs reference."""
    from sits.kernels.attention_triton import TritonPagedAttention, choose_num_splits

    caches, expected = prepared
    scale = shape.head_dim**-0.5
    query, metadata = steps[0][0], steps[0][4]
    backend = TritonPagedAttention(config)
    error = max_error(backend.attend(query, caches[0], metadata, scale), expected)
    elapsed = time_us(
        lambda: [backend.attend(s[0], c, s[4], scale) for s, c in zip(steps, caches)],
        shape.device,
        reps,
    )
    splits = choose_num_splits(metadata.num_seqs, shape.num_kv_heads, metadata.max_seq_len, config)
    return {"us": elapsed / len(steps), "error": error, "splits": splits}


def block_ns(text: str, config, kind: str) -> list[int]:
    """Key tiles to time: the comma list, or the one `config` uses for a cache of `kind`."""
    if text:
        return [int(item) for item in text.split(",")]
    return [config.decode_block_n if kind == "bf16" else config.decode_block_n_quantized]


def report(shape: Shape, args) -> None:
    from sits.kernels.attention_triton import TritonAttentionConfig

    base = TritonAttentionConfig.for_head_dim(shape.head_dim)
    print("\n## Decode over bf16 / fp8 / int8 KV (KV bytes read / time)\n")
    print("| batch | context | KV | block_n | splits | us | KV MB | TB/s | % of 4.2 "
          "| vs bf16 | max err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in map(int, args.batch_sizes.split(",")):
        for context in map(int, args.context_lens.split(",")):
            copies = num_copies(kv_bytes_read(shape, batch, context, "bf16"), shape.device)
            steps = [make_step(shape, [(context - 1, 1)] * batch, seed=i) for i in range(copies)]
            bf16_us: list[float] = []
            for kind in args.kinds.split(","):
                prepared = prepare(shape, steps, kind)
                nbytes = kv_bytes_read(shape, batch, context, kind)
                for block_n in block_ns(args.block_ns, base, kind):
                    config = replace(base, decode_block_n=block_n, decode_block_n_quantized=block_n)
                    row = time_case(shape, steps, prepared, config, args.reps)
                    if kind == "bf16":
                        bf16_us.append(row["us"])
                    speedup = f"{min(bf16_us) / row['us']:.2f}x" if bf16_us else "-"
                    tbps = nbytes / row["us"] / 1e6
                    print(
                        f"| {batch} | {context} | {kind} | {block_n} | {row['splits']} "
                        f"| {row['us']:.1f} | {nbytes / 1e6:.1f} | {tbps:.2f} "
                        f"| {100 * tbps / PEAK_TBPS:.0f} | {speedup} | {row['error']:.1e} |",
                        flush=True,
                    )
                del prepared
            del steps


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.device == "cpu":  # the interpreter, set before the kernels are imported
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu for a plumbing check")
    dtype = torch.float16 if args.device == "cpu" else torch.bfloat16
    shape = Shape(
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, dtype, args.device
    )
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line(args.device)}")
    print(f"shape: {shape}")
    print(f"ceiling: {PEAK_TBPS} TB/s copy (measured on an H200)")
    report(shape, args)


if __name__ == "__main__":
    main(sys.argv[1:])
