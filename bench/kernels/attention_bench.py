"""Micro-benchmark of the Triton paged attention and KV write kernels against their rooflines.

Prints the exact command, the machine, then markdown tables (ready for bench/RESULTS.md):
- decode (one new token per sequence, equal contexts): KV bytes read / time, against the
  measured 4.2 TB/s copy bandwidth, beside PyTorch SDPA on a dense (unpaged) KV of the same
  shape measured in the same run;
- prefill (causal, optionally over a cached prefix): FLOPs / time against the measured
  790 TFLOP/s bf16 matrix rate, beside SDPA (flash, kv heads expanded) where there is no prefix;
- KV write: bytes read + written / time;
- with --sections sweep: launch parameters (block sizes, warps, stages, splits) tried on a
  few cases, best first, with the `TritonAttentionConfig` fields to paste.

Timing: CUDA graph replay between CUDA events (launch overhead excluded, as in the engine's
decode graphs); small problems are repeated over several copies of their inputs inside the
graph so the data of one call is not still in L2 from the previous one.
FLOPs of causal attention: 4 * head_dim * num_heads * (query, key) pairs at or before the query.

Usage (GPU machine, from the repository root):
    PYTHONPATH=src python3 bench/kernels/attention_bench.py [--sections decode,prefill,write]
    PYTHONPATH=src python3 bench/kernels/attention_bench.py --sections sweep
    PYTHONPATH=src python3 bench/kernels/attention_bench.py --device cpu   # plumbing check
    PYTHONPATH=src python3 bench/kernels/attention_bench.py --device cpu --sections compile
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, replace

import torch
from timing import machine_line, num_copies, time_us

PEAK_TBPS = 4.2  # measured device-to-device copy bandwidth of an H200 (shared/notes)
PEAK_TFLOPS = 790.0  # measured bf16 8192^3 matmul rate of an H200


@dataclass(frozen=True, slots=True)
class Shape:
    """Attention shape of one layer: heads, head size, KV block size, dtype, device."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: str


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--context-lens", default="1024,2048,4096,8192")
    parser.add_argument(
        "--prefill-cases",
        default="1x0+2048,1x0+8192,4x0+2048,1x4096+2048",
        help="comma list of BATCHxCACHED+NEW",
    )
    parser.add_argument("--write-tokens", default="64,2048,8192")
    parser.add_argument(
        "--sections",
        default="decode,prefill,write",
        help="comma list of decode, prefill, write, sweep (try launch parameters), compile "
        "(alone with --device cpu: compile for sm_90 offline, real shape)",
    )
    parser.add_argument(
        "--sweep-decode-cases",
        default="1x8192,8x4096,64x2048",
        help="sweep: comma list of BATCHxCONTEXT decode cases",
    )
    parser.add_argument(
        "--sweep-prefill-cases",
        default="1x0+2048,1x4096+2048",
        help="sweep: comma list of BATCHxCACHED+NEW prefill cases ('' = none)",
    )
    parser.add_argument(
        "--sweep-splits",
        default="",
        help="sweep: comma list of decode split counts, each tried with every block size, "
        "warp and stage count ('' = the grid as is, splits alone with the defaults)",
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-peer", action="store_true", help="skip the SDPA peer")
    args = parser.parse_args(argv)
    if args.device == "cpu":  # interpreter: tiny shapes, wall-clock timing
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 32
        args.batch_sizes, args.context_lens = "1,2", "40,100"
        args.prefill_cases, args.write_tokens, args.reps = "1x0+40,2x24+16", "8", 1
    return args


def make_step(shape: Shape, chunks: list[tuple[int, int]], seed: int):
    """(query, key, value, kv_cache, metadata) of one step; chunks = (cached, new) per seq."""
    from sits.kernels.attention_metadata import AttentionMetadata

    gen = torch.Generator(device=shape.device).manual_seed(seed)
    bs, dev = shape.block_size, shape.device
    counts = [-(-(cached + new) // bs) for cached, new in chunks]
    order = torch.randperm(sum(counts), generator=gen, device=dev)  # [num_blocks] shuffled ids
    cache = torch.randn(
        2, sum(counts), bs, shape.num_kv_heads, shape.head_dim, generator=gen, device=dev
    ).to(shape.dtype)  # [2, num_blocks, block_size, kv_heads, head_dim]
    table = torch.zeros(len(chunks), max(counts), dtype=torch.int32, device=dev)
    starts, lens, slots, used = [0], [], [], 0
    for row, ((cached, new), count) in enumerate(zip(chunks, counts)):
        blocks = order[used : used + count]
        used += count
        table[row, :count] = blocks.int()
        pos = torch.arange(cached, cached + new, device=dev)
        slots.append(blocks[pos // bs] * bs + pos % bs)
        starts.append(starts[-1] + new)
        lens.append(cached + new)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(starts[-1], heads, shape.head_dim, generator=gen, device=dev).to(
            shape.dtype
        )

    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=table,
        slot_mapping=torch.cat(slots).long(),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        max_query_len=max(new for _, new in chunks),
        max_seq_len=max(lens),
        block_size=bs,
    )
    return (
        rand(shape.num_heads),
        rand(shape.num_kv_heads),
        rand(shape.num_kv_heads),
        cache,
        metadata,
    )


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


def decode_inputs(shape: Shape, batch: int, context: int) -> tuple[list, torch.Tensor, int]:
    """(steps, reference output of steps[0], KV bytes of one step): `batch` equal contexts."""
    from sits.kernels.attention_ref import paged_attention

    kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    copies = num_copies(kv_bytes, shape.device)
    steps = [make_step(shape, [(context - 1, 1)] * batch, seed=i) for i in range(copies)]
    query, _, _, cache, metadata = steps[0]
    return steps, paged_attention(query, cache, metadata, shape.head_dim**-0.5), kv_bytes


def time_decode(shape: Shape, inputs: tuple, config, reps: int) -> dict[str, object]:
    """Time `attend` over the steps (one after another in one graph); error vs the reference."""
    from sits.kernels.attention_triton import TritonPagedAttention, choose_num_splits

    steps, expected, kv_bytes = inputs
    backend = TritonPagedAttention(config)
    scale = shape.head_dim**-0.5
    query, _, _, cache, metadata = steps[0]
    error = max_error(backend.attend(query, cache, metadata, scale), expected)
    elapsed = time_us(
        lambda: [backend.attend(s[0], s[3], s[4], scale) for s in steps], shape.device, reps
    )
    splits = choose_num_splits(metadata.num_seqs, shape.num_kv_heads, metadata.max_seq_len, config)
    return {"splits": splits, "us": elapsed / len(steps), "bytes": kv_bytes, "error": error}


def sdpa_decode_us(shape: Shape, batch: int, context: int, copies: int, reps: int) -> float:
    """PyTorch SDPA over a dense KV [batch, kv_heads, context, head_dim], GQA without expansion."""
    import torch.nn.functional as F

    def dense(heads: int, length: int) -> torch.Tensor:
        return torch.randn(batch, heads, length, shape.head_dim, device="cuda", dtype=shape.dtype)

    sets = [
        (dense(shape.num_heads, 1), dense(shape.num_kv_heads, context)) for _ in range(copies)
    ]  # [(query, key)]; the value is the key (the same bytes are read)

    def run() -> None:
        for q, kv in sets:
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)

    return time_us(run, "cuda", reps) / copies


def prefill_flops(shape: Shape, batch: int, cached: int, new: int) -> int:
    """4 * head_dim * heads * causal (query, key) pairs of `batch` sequences."""
    pairs = new * cached + new * (new + 1) // 2
    return 4 * shape.head_dim * shape.num_heads * pairs * batch


def prefill_inputs(shape: Shape, batch: int, cached: int, new: int) -> tuple:
    """(step, reference output): `batch` sequences of `new` tokens over `cached` tokens."""
    from sits.kernels.attention_ref import paged_attention

    step = make_step(shape, [(cached, new)] * batch, seed=1)
    query, _, _, cache, metadata = step
    return step, paged_attention(query, cache, metadata, shape.head_dim**-0.5)


def time_prefill(shape: Shape, inputs: tuple, config, reps: int) -> dict[str, object]:
    """Time `attend` of the step; error vs the reference."""
    from sits.kernels.attention_triton import TritonPagedAttention

    (query, _, _, cache, metadata), expected = inputs
    backend = TritonPagedAttention(config)
    scale = shape.head_dim**-0.5
    error = max_error(backend.attend(query, cache, metadata, scale), expected)
    elapsed = time_us(lambda: backend.attend(query, cache, metadata, scale), shape.device, reps)
    return {"us": elapsed, "error": error}


def sdpa_prefill_us(shape: Shape, batch: int, new: int, reps: int) -> float:
    """PyTorch SDPA, causal, dense [batch, heads, new, head_dim] with kv heads expanded."""
    import torch.nn.functional as F

    q = torch.randn(batch, shape.num_heads, new, shape.head_dim, device="cuda", dtype=shape.dtype)
    k, v = torch.randn_like(q), torch.randn_like(q)
    return time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), "cuda", reps)


def write_case(shape: Shape, num_tokens: int, args) -> dict:
    """Time the KV write of `num_tokens` new tokens (bytes read + written)."""
    from sits.kernels.attention_ref import write_kv
    from sits.kernels.kv_write_triton import triton_write_kv

    _, key, value, cache, metadata = make_step(shape, [(0, num_tokens)], seed=2)
    expected = cache.clone()
    write_kv(expected, key, value, metadata.slot_mapping)
    triton_write_kv(cache, key, value, metadata.slot_mapping)
    error = max_error(cache, expected)
    nbytes = 2 * 2 * key.numel() * shape.dtype.itemsize
    elapsed = time_us(
        lambda: triton_write_kv(cache, key, value, metadata.slot_mapping), shape.device, args.reps
    )
    return {"us": elapsed, "bytes": nbytes, "error": error}


def fmt_peer(row: dict, amount: float, unit_scale: float) -> str:
    if "peer_us" not in row:
        return "| - | - | -"
    peer = row["peer_us"]
    return f"| {peer:.1f} | {amount / peer / unit_scale:.2f} | {peer / row['us']:.2f}x"


def report_decode(shape: Shape, config, args) -> None:
    print("\n## Decode (one new token per sequence; KV bytes read / time)\n")
    print("| batch | context | splits | us | KV MB | TB/s | % of 4.2 | max err "
          "| SDPA us | SDPA TB/s | SDPA/ours |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in map(int, args.batch_sizes.split(",")):
        for context in map(int, args.context_lens.split(",")):
            inputs = decode_inputs(shape, batch, context)
            row = time_decode(shape, inputs, config, args.reps)
            if not args.no_peer and shape.device == "cuda":
                copies = len(inputs[0])
                del inputs  # free the paged copies before the dense ones
                row["peer_us"] = sdpa_decode_us(shape, batch, context, copies, args.reps)
            tbps = row["bytes"] / row["us"] / 1e6
            print(
                f"| {batch} | {context} | {row['splits']} | {row['us']:.1f} "
                f"| {row['bytes'] / 1e6:.1f} | {tbps:.2f} | {100 * tbps / PEAK_TBPS:.0f} "
                f"| {row['error']:.1e} {fmt_peer(row, row['bytes'], 1e6)} |",
                flush=True,
            )


def parse_prefill_cases(text: str) -> list[tuple[int, int, int]]:
    """ "1x0+2048,4x512+1024" -> [(1, 0, 2048), (4, 512, 1024)] as (batch, cached, new)."""
    cases = []
    for item in text.split(","):
        batch, rest = item.split("x")
        cached, new = rest.split("+")
        cases.append((int(batch), int(cached), int(new)))
    return cases


def report_prefill(shape: Shape, config, args) -> None:
    print("\n## Prefill (causal; FLOPs = 4 * d * heads * pairs)\n")
    print("| batch | cached | new | us | TFLOP/s | % of 790 | max err "
          "| SDPA us | SDPA TFLOP/s | SDPA/ours |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, cached, new in parse_prefill_cases(args.prefill_cases):
        row = time_prefill(shape, prefill_inputs(shape, batch, cached, new), config, args.reps)
        if not args.no_peer and shape.device == "cuda" and cached == 0:
            row["peer_us"] = sdpa_prefill_us(shape, batch, new, args.reps)
        flops = prefill_flops(shape, batch, cached, new)
        tflops = flops / row["us"] / 1e6
        print(
            f"| {batch} | {cached} | {new} | {row['us']:.1f} | {tflops:.1f} "
            f"| {100 * tflops / PEAK_TFLOPS:.0f} | {row['error']:.1e} "
            f"{fmt_peer(row, flops, 1e6)} |",
            flush=True,
        )


def report_write(shape: Shape, args) -> None:
    print("\n## KV write (bytes read + written / time)\n")
    print("| tokens | us | MB | TB/s | % of 4.2 | max err |")
    print("|---|---|---|---|---|---|")
    for tokens in map(int, args.write_tokens.split(",")):
        row = write_case(shape, tokens, args)
        tbps = row["bytes"] / row["us"] / 1e6
        print(
            f"| {tokens} | {row['us']:.1f} | {row['bytes'] / 1e6:.2f} | {tbps:.2f} "
            f"| {100 * tbps / PEAK_TBPS:.0f} | {row['error']:.1e} |",
            flush=True,
        )


DECODE_GRID = [
    {"decode_block_n": n, "decode_num_warps": w, "decode_num_stages": s}
    for n in (32, 64, 128)
    for w in (2, 4, 8)
    for s in (2, 3, 4)
] + [{"decode_num_splits": k} for k in (1, 2, 4, 8, 16, 32, 64)]
PREFILL_GRID = [
    {"prefill_block_m": m, "prefill_block_n": n, "prefill_num_warps": w, "prefill_num_stages": s}
    for m in (64, 128)
    for n in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3, 4)
]


def sweep(shape: Shape, base, args) -> None:
    """Try launch parameters on representative cases; print them best first."""
    small = shape.device == "cpu"
    decode_cases = [_pair(c, "x") for c in args.sweep_decode_cases.split(",") if c]
    prefill_cases = (
        parse_prefill_cases(args.sweep_prefill_cases) if args.sweep_prefill_cases else []
    )
    if small:
        decode_cases, prefill_cases = [(1, 64), (2, 100)], [(1, 0, 40)]
    decode_grid = DECODE_GRID
    if args.sweep_splits:
        decode_grid = [
            {"decode_block_n": n, "decode_num_warps": w, "decode_num_stages": s,
             "decode_num_splits": int(k)}
            for n in (32, 64, 128)
            for w in (2, 4)
            for s in (2, 3)
            for k in args.sweep_splits.split(",")
        ]  # fmt: skip
    grids = (decode_grid[:2], PREFILL_GRID[:2]) if small else (decode_grid, PREFILL_GRID)
    for batch, context in decode_cases:
        inputs = decode_inputs(shape, batch, context)
        results = []
        for fields in grids[0]:
            try:
                row = time_decode(shape, inputs, replace(base, **fields), args.reps)
            except Exception as error:  # noqa: BLE001 - e.g. out of shared memory
                print(f"  decode {fields}: failed ({type(error).__name__})")
                continue
            results.append((row["bytes"] / row["us"] / 1e6, row["us"], row["error"], fields))
        default = time_decode(shape, inputs, base, args.reps)
        del inputs
        print_sweep(f"decode batch {batch} context {context}", results, "TB/s")
        print(
            f"default ({default['splits']} splits, heuristic on the context): "
            f"{default['us']:.1f} us, {default['bytes'] / default['us'] / 1e6:.2f} TB/s"
        )
    for batch, cached, new in prefill_cases:
        inputs = prefill_inputs(shape, batch, cached, new)
        flops = prefill_flops(shape, batch, cached, new)
        results = []
        for fields in grids[1]:
            try:
                row = time_prefill(shape, inputs, replace(base, **fields), args.reps)
            except Exception as error:  # noqa: BLE001
                print(f"  prefill {fields}: failed ({type(error).__name__})")
                continue
            results.append((flops / row["us"] / 1e6, row["us"], row["error"], fields))
        print_sweep(f"prefill batch {batch} cached {cached} new {new}", results, "TFLOP/s")


def _pair(text: str, sep: str) -> tuple[int, int]:
    """ "AxB" -> (A, B) for the sweep's case lists."""
    first, second = text.split(sep)
    return int(first), int(second)


def print_sweep(title: str, results: list, unit: str) -> None:
    print(f"\n### Sweep: {title} (best first)\n")
    print(f"| {unit} | us | max err | config fields |")
    print("|---|---|---|---|")
    for rate, elapsed, error, fields in sorted(results, key=lambda r: -r[0])[:8]:
        print(f"| {rate:.2f} | {elapsed:.1f} | {error:.1e} | {fields} |", flush=True)


def compile_report(shape: Shape, config) -> None:
    """Compile the attention kernels for sm_90 on this machine (no GPU needed) and print what
    the compiler made of them: shared memory, Hopper wgmma vs mma.sync, cp.async pipelining.

    Uses `triton.compile(ASTSource(...))` with 16-divisible pointers and strides, as the JIT
    specialises them at run time; needs the kernels compiled, not interpreted (run the section
    alone: `--device cpu --sections compile` leaves TRITON_INTERPRET unset).
    """
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sits.kernels.attention_decode_triton import decode_attention_kernel
    from sits.kernels.attention_prefill_triton import prefill_attention_kernel, prefill_block_q
    from sits.kernels.triton_utils import next_power_of_2

    group = shape.num_heads // shape.num_kv_heads
    common = {
        "BLOCK_SIZE": shape.block_size,
        "HEAD_DIM": shape.head_dim,
        "BLOCK_DIM": next_power_of_2(shape.head_dim),
        "DOT_PRECISION": "tf32",
        "KV_QUANT": "none",  # the bf16 cache (attention_quant_bench times fp8/int8)
    }
    block_q = prefill_block_q(config.prefill_block_m, group)
    kernels = [
        (decode_attention_kernel, config.decode_num_warps, config.decode_num_stages,
         {**common, "GROUP": group, "BLOCK_M": max(16, next_power_of_2(group)),
          "BLOCK_N": config.decode_block_n, "SPLIT": True}),
        (prefill_attention_kernel, config.prefill_num_warps, config.prefill_num_stages,
         {**common, "GROUP": group, "GROUP_P2": next_power_of_2(group), "BLOCK_Q": block_q,
          "BLOCK_M": block_q * next_power_of_2(group), "BLOCK_N": config.prefill_block_n,
          "SKIP_SINGLE": True}),
    ]  # fmt: skip
    print("\n## sm_90 compile (offline)\n")
    print("| kernel | warps | stages | shared KB | wgmma | mma.sync | cp.async |")
    print("|---|---|---|---|---|---|---|")
    for kernel, num_warps, num_stages, constexprs in kernels:
        signature, attrs = {}, {}
        for index, name in enumerate(kernel.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                is_int = name.startswith(("block_tables", "seq_lens", "query_start"))
                is_part = name.startswith("part_")
                signature[name] = "*i32" if is_int else "*fp32" if is_part else "*bf16"
                attrs[(index,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "fp32" if name == "qk_scale" else "i32"
                if name.startswith("stride"):
                    attrs[(index,)] = [["tt.divisibility", 16]]
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": num_warps, "num_stages": num_stages}
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        counts = [
            len(re.findall(p, ptx)) for p in (r"wgmma\.mma_async", r"mma\.sync", r"cp\.async\.")
        ]
        print(
            f"| {kernel.__name__} | {num_warps} | {num_stages} "
            f"| {compiled.metadata.shared / 1024:.0f} | {counts[0]} | {counts[1]} | {counts[2]} |"
        )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    sections = args.sections.split(",")
    if args.device == "cpu":
        if sections != ["compile"]:  # the interpreter, set before the kernels are imported
            os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu for a plumbing check")
    from sits.kernels.attention_triton import TritonAttentionConfig

    dtype = torch.float16 if args.device == "cpu" else torch.bfloat16
    shape = Shape(
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, dtype, args.device
    )
    config = TritonAttentionConfig.for_head_dim(args.head_dim)
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line(args.device)}")
    print(f"shape: {shape}")
    print(f"config: {config}")
    print(f"ceilings: {PEAK_TBPS} TB/s copy, {PEAK_TFLOPS} TFLOP/s bf16 (measured on an H200)")
    if "compile" in sections:
        real = Shape(32, 8, 128, 16, torch.bfloat16, "cuda") if args.device == "cpu" else shape
        compile_report(real, TritonAttentionConfig.for_head_dim(real.head_dim))
    if "decode" in sections:
        report_decode(shape, config, args)
    if "prefill" in sections:
        report_prefill(shape, config, args)
    if "write" in sections:
        report_write(shape, args)
    if "sweep" in sections:
        sweep(shape, config, args)


if __name__ == "__main__":
    main(sys.argv[1:])
