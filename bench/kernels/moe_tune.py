"""Tuner of the fused MoE kernels: launch configs per token count, written as the JSON that
`sits.kernels.moe_config` reads.

For each token count (1, 2, 4, ..., 8192 by default) it draws random top-k routing, then for
each candidate BLOCK_M (chosen from the mean rows per expert) times GEMM1 and GEMM2 alone over
a bounded list of tile shapes, keeps the fastest of each, and picks the BLOCK_M with the least
GEMM1 + GEMM2 time. The winner is checked against `moe_ref.moe_forward` (relative error
< 1e-2) before it is kept; a failing candidate falls back to the next best.
`--dtype fp8_w8a8` tunes the FP8 experts' kernels (`moe_fp8_triton`, 128 x 128 block scales,
bf16 activations quantized per token group; BLOCK_K at most 128) against
`moe_forward_fp8_w8a8_reference` and writes the `fp8_w8a8` file.

Timing: CUDA graph replay between CUDA events, the launch repeated over enough copies of the
expert weights that one call's weights have left L2 before they are read again (as in serving,
where 48 layers' experts pass through L2 between two reads of one layer).
Compilation: every candidate kernel is compiled first in a pool of processes (filling Triton's
on-disk cache), so the sweep itself compiles nothing.

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 bench/kernels/moe_tune.py --shape qwen3 [--out-dir DIR]
    PYTHONPATH=src python3 bench/kernels/moe_tune.py --shape qwen3 --dtype fp8_w8a8
    PYTHONPATH=src python3 bench/kernels/moe_tune.py --num-experts 8 --hidden-size 4096 \
        --intermediate-size 14336 --top-k 2 --time-budget-s 120
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from timing import elapsed_us, graph_or_eager

SHAPES = {  # name: (num_experts, hidden_size, intermediate_size, top_k)
    "qwen3": (128, 2048, 768, 8),  # Qwen3-30B-A3B
    "mixtral": (8, 4096, 14336, 2),  # Mixtral-8x7B
    "tiny": (8, 64, 32, 2),  # plumbing check on the CPU (--device cpu, Triton interpreter)
}
TOKEN_COUNTS = [2**i for i in range(14)]  # 1 ... 8192
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP8_W8A8 = "fp8_w8a8"  # --dtype of the FP8 experts (bf16 activations)
FP8_BLOCK = (128, 128)  # weight scale blocks of the tuned FP8 experts


@dataclass(frozen=True, slots=True)
class Shape:
    """One MoE layer: E experts of width I over hidden size H, top_k per token; activations
    in dtype, weights too unless fp8 (float8_e4m3fn with FP8_BLOCK scales, W8A8 kernels)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    dtype: torch.dtype
    fp8: bool = False

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's w13 and w2 (scales not counted)."""
        itemsize = 1 if self.fp8 else self.dtype.itemsize
        return 3 * self.hidden_size * self.intermediate_size * itemsize


def small_m_candidates():
    """Tile shapes for few rows per expert (memory-bound: stream the weights)."""
    from sits.kernels.moe_config import GemmConfig

    shapes = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (32, 128, 4, 6),
              (64, 128, 4, 4), (64, 256, 4, 3), (64, 64, 4, 5), (128, 128, 8, 3)]  # fmt: skip
    return [GemmConfig(n, k, 1, warps, stages) for n, k, warps, stages in shapes]


def large_m_candidates():
    """Tile shapes for many rows per expert (tensor-core bound)."""
    from sits.kernels.moe_config import GemmConfig

    shapes = [(64, 64, 8, 4, 4), (128, 64, 8, 4, 4), (128, 64, 8, 8, 3), (128, 64, 8, 8, 4),
              (256, 64, 8, 8, 3), (128, 128, 8, 8, 3), (64, 128, 8, 4, 3),
              (128, 64, 16, 8, 4)]  # fmt: skip
    return [GemmConfig(n, k, g, warps, stages) for n, k, g, warps, stages in shapes]


def block_m_candidates(num_tokens: int, shape: Shape) -> list[int]:
    """BLOCK_M values worth trying for the mean rows per expert."""
    rows = num_tokens * shape.top_k / shape.num_experts
    if rows < 4:
        return [16]
    if rows < 16:
        return [16, 32]
    if rows < 48:
        return [32, 64]
    if rows < 160:
        return [64, 128]
    return [128]


def gemm_candidates(block_m: int, fp8: bool = False):
    """The tile shapes for block_m; fp8: BLOCK_K capped at 128 (it must divide the scale
    blocks), duplicates dropped."""
    candidates = small_m_candidates() if block_m <= 32 else large_m_candidates()
    if not fp8:
        return candidates
    capped = [dataclasses.replace(gemm, block_k=min(gemm.block_k, 128)) for gemm in candidates]
    return list(dict.fromkeys(capped))


def random_routing(num_tokens: int, shape: Shape, seed: int, device: str):
    """(hidden [T, H], topk_weights [T, k] float32, topk_ids [T, k] int64): softmax top-k of
    random logits (about uniform load over experts)."""
    from sits.kernels.moe_ref import select_experts

    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(num_tokens, shape.hidden_size, generator=gen, device=device)
    logits = torch.randn(num_tokens, shape.num_experts, generator=gen, device=device)
    weights, ids = select_experts(logits, shape.top_k, renormalize=True)
    return hidden.to(shape.dtype), weights, ids


def make_weights(shape: Shape, num_copies: int, device: str, seed: int = 0):
    """num_copies independent (w13 [E, 2I, H], w2 [E, H, I]), scaled for O(1) activations;
    for an fp8 shape (w13, w13_scale, w2, w2_scale) quantized with FP8_BLOCK scales."""
    from sits.kernels.fp8_ref import quantize_fp8_block

    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    copies = []
    for _ in range(num_copies):
        w13 = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=shape.dtype)
        w2 = torch.randn(e, h, i, generator=gen, device=device, dtype=shape.dtype)
        w13, w2 = w13.mul_(h**-0.5), w2.mul_(i**-0.5)
        if shape.fp8:
            copies.append((*quantize_fp8_block(w13, FP8_BLOCK), *quantize_fp8_block(w2, FP8_BLOCK)))
        else:
            copies.append((w13, w2))
    return copies


def gemm_operands(shape: Shape, hidden: torch.Tensor, align) -> dict:
    """The GEMMs' inputs and outputs for one alignment: hidden, a random intermediate and
    pair_out; for an fp8 shape also hidden and the intermediate quantized per 128 group."""
    from sits.kernels.moe_align import max_padded_rows

    rows = max_padded_rows(align.num_pairs, shape.num_experts, align.block_m)
    inter = torch.randn(rows, shape.intermediate_size, device=hidden.device).to(shape.dtype)
    operands = {
        "hidden": hidden,
        "inter": inter,
        "pair_out": hidden.new_empty(align.num_pairs, shape.hidden_size),
    }
    if shape.fp8:
        from sits.kernels.fp8_gemm_triton import triton_quant_fp8_group

        operands["hidden_fp8"] = triton_quant_fp8_group(hidden, FP8_BLOCK[1])
        operands["inter_fp8"] = triton_quant_fp8_group(inter, FP8_BLOCK[1])
    return operands


def launch(kind: str, shape: Shape, operands: dict, weights: tuple, align, gemm) -> None:
    """One GEMM launch ("gemm1" or "gemm2") of the bf16 or (fp8 shape) the W8A8 kernels."""
    from sits.kernels.moe_fp8_triton import launch_fp8_gemm1, launch_fp8_gemm2
    from sits.kernels.moe_triton import launch_gemm1, launch_gemm2

    inter, pair_out = operands["inter"], operands["pair_out"]
    if not shape.fp8:
        w13, w2 = weights
        if kind == "gemm1":
            launch_gemm1(operands["hidden"], w13, inter, align, shape.top_k, gemm)
        else:
            launch_gemm2(inter, w2, pair_out, align, gemm)
        return
    w13, s13, w2, s2 = weights
    if kind == "gemm1":
        q, scale = operands["hidden_fp8"]
        launch_fp8_gemm1(q, scale, w13, s13, FP8_BLOCK, inter, align, shape.top_k, gemm)
    else:
        q, scale = operands["inter_fp8"]
        launch_fp8_gemm2(q, scale, w2, s2, FP8_BLOCK, pair_out, align, gemm)


def touched_experts(topk_ids: torch.Tensor, num_experts: int) -> int:
    return int((torch.bincount(topk_ids.flatten(), minlength=num_experts) > 0).sum())


def copies_needed(touched_bytes: int, available: int, device: str) -> int:
    """Weight copies to cycle so that one copy's bytes leave L2 (4x L2) before reuse."""
    if device == "cpu":
        return 1
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(1, min(available, math.ceil(4 * l2_bytes / max(1, touched_bytes))))


def graph_time_us(fn: Callable[[], object], num_calls: int, device: str) -> float:
    """Median over 3 batches of the mean time of one replay of a CUDA graph of fn, / num_calls;
    each batch lasts about 2 ms. Falls back to eager timing when capture fails (printing why);
    on the CPU, the wall-clock time of one call.
    """
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6 / num_calls
    run = graph_or_eager(fn)
    reps = max(2, min(50, int(2000 / max(1.0, elapsed_us(run, 1)))))
    times = [elapsed_us(run, reps) for _ in range(3)]
    return sorted(times)[1] / num_calls


def _compile_one(task: tuple) -> tuple[str, float, str]:
    """Worker: compile (and run once) one GEMM variant on a tiny problem of the real shape."""
    shape, device, kind, block_m, gemm = task
    from sits.kernels.moe_align import align_pairs_to_experts

    start = time.perf_counter()
    try:
        small = dataclasses.replace(shape, num_experts=shape.top_k)
        hidden, _, ids = random_routing(1, small, 0, device)
        (weights,) = make_weights(small, 1, device)
        align = align_pairs_to_experts(ids, small.num_experts, block_m)
        launch(kind, small, gemm_operands(small, hidden, align), weights, align, gemm)
        if device == "cuda":
            torch.cuda.synchronize()
        return kind, time.perf_counter() - start, ""
    except Exception as error:  # noqa: BLE001 - reported, the sweep skips it
        return kind, time.perf_counter() - start, f"{type(error).__name__}: {error}"[:200]


def precompile(shape: Shape, device: str, tasks: list[tuple], num_workers: int) -> None:
    """Compile every (kind, block_m, gemm) variant in a process pool (Triton's disk cache)."""
    start = time.perf_counter()
    if num_workers <= 1:
        results = [_compile_one((shape, device, *task)) for task in tasks]
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(num_workers, mp_context=context) as pool:
            results = list(pool.map(_compile_one, [(shape, device, *task) for task in tasks]))
    failed = [(task, error) for task, (_, _, error) in zip(tasks, results) if error]
    print(
        f"precompiled {len(tasks)} variants in {time.perf_counter() - start:.1f} s "
        f"({num_workers} workers, {len(failed)} failed)",
        flush=True,
    )
    for (kind, block_m, gemm), error in failed[:8]:
        print(f"  {kind} BLOCK_M={block_m} {gemm.to_json()}: {error}")


@dataclass(slots=True)
class Sweep:
    """The state of one token count's sweep (inputs shared by all candidates)."""

    shape: Shape
    weights: list
    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    num_copies: int
    device: str


def time_gemm(sweep: Sweep, kind: str, block_m: int, gemm) -> float:
    """Microseconds of one GEMM launch (inf when it fails to compile or launch)."""
    from sits.kernels.moe_align import align_pairs_to_experts

    shape = sweep.shape
    align = align_pairs_to_experts(sweep.topk_ids, shape.num_experts, block_m)
    operands = gemm_operands(shape, sweep.hidden, align)
    copies = sweep.weights[: sweep.num_copies]

    def run() -> None:
        for weights in copies:
            launch(kind, shape, operands, weights, align, gemm)

    try:
        return graph_time_us(run, len(copies), sweep.device)
    except Exception as error:  # noqa: BLE001 - a config that cannot run is skipped
        print(f"  skip {kind} BLOCK_M={block_m} {gemm.to_json()}: {type(error).__name__}")
        return math.inf


def check_config(sweep: Sweep, config) -> float:
    """Relative error of the fused call with config vs moe_forward on copy 0 (fp8 shape:
    fused_moe_fp8 vs moe_forward_fp8_w8a8_reference)."""
    from sits.kernels.moe_fp8_triton import fused_moe_fp8, moe_forward_fp8_w8a8_reference
    from sits.kernels.moe_ref import moe_forward
    from sits.kernels.moe_triton import fused_moe

    routing = (sweep.topk_weights, sweep.topk_ids)
    if sweep.shape.fp8:
        w13, s13, w2, s2 = sweep.weights[0]
        args = (sweep.hidden, w13, s13, w2, s2, FP8_BLOCK, *routing)
        out = fused_moe_fp8(*args, config).double()
        expected = moe_forward_fp8_w8a8_reference(*args).double()
    else:
        w13, w2 = sweep.weights[0]
        out = fused_moe(sweep.hidden, w13, w2, *routing, config).double()
        expected = moe_forward(sweep.hidden, w13, w2, *routing).double()
    return float((out - expected).norm() / expected.norm())


def tune_token_count(sweep: Sweep, num_tokens: int) -> tuple[object, list[str]]:
    """(best MoeLaunchConfig, table rows) for one token count."""
    from sits.kernels.moe_config import MoeLaunchConfig

    ranked, rows = [], []
    for block_m in block_m_candidates(num_tokens, sweep.shape):
        timed = {
            kind: sorted(
                ((time_gemm(sweep, kind, block_m, gemm), i, gemm) for i, gemm in
                 enumerate(gemm_candidates(block_m, sweep.shape.fp8))),
                key=lambda item: item[:2],
            )
            for kind in ("gemm1", "gemm2")
        }  # fmt: skip
        for rank in range(min(3, len(timed["gemm1"]))):
            (t1, _, g1), (t2, _, g2) = timed["gemm1"][rank], timed["gemm2"][rank]
            ranked.append((t1 + t2, block_m, MoeLaunchConfig(block_m, g1, g2)))
        (t1, _, g1), (t2, _, g2) = timed["gemm1"][0], timed["gemm2"][0]
        rows.append(
            f"| {num_tokens} | {block_m} | {t1:.1f} | {t2:.1f} | {t1 + t2:.1f} "
            f"| {json.dumps(g1.to_json())} | {json.dumps(g2.to_json())} |"
        )
    for total_us, _, config in sorted(ranked, key=lambda item: (item[0], item[1])):
        if not math.isfinite(total_us):
            break
        error = check_config(sweep, config)
        if error < 1e-2:
            return config, rows
        print(f"  rejected (relative error {error:.2e}): {config.to_json()}")
    raise RuntimeError(f"no candidate config ran correctly for {num_tokens} tokens")


def fill_missing(table: dict, token_counts: list[int]) -> dict:
    """Buckets the budget left untuned take the config of the nearest tuned count (log2)."""
    tuned = sorted(table)
    for count in token_counts:
        if count not in table:
            table[count] = table[min(tuned, key=lambda t: abs(math.log2(t) - math.log2(count)))]
    return dict(sorted(table.items()))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="preset (else give the sizes)")
    parser.add_argument("--num-experts", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--intermediate-size", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--dtype", choices=[*sorted(DTYPES), FP8_W8A8], default="bf16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--token-counts", default=",".join(map(str, TOKEN_COUNTS)))
    parser.add_argument("--out-dir", default="src/sits/kernels/configs")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--time-budget-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    sizes = (args.num_experts, args.hidden_size, args.intermediate_size, args.top_k)
    if args.shape is not None:
        preset = SHAPES[args.shape]
        sizes = tuple(given or default for given, default in zip(sizes, preset))
    if None in sizes:
        parser.error(
            "give --shape or all of --num-experts/--hidden-size/--intermediate-size/--top-k"
        )
    args.sizes = sizes
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    device = args.device
    if device == "cpu":  # the interpreter, set before the kernels are imported
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu --shape tiny for a plumbing check")
    from sits.kernels.moe_config import config_file_name, device_name_of

    print("command: " + shlex.join([sys.executable, *sys.argv]), flush=True)
    start = time.perf_counter()
    fp8 = args.dtype == FP8_W8A8
    dtype = torch.float32 if device == "cpu" else DTYPES.get(args.dtype, torch.bfloat16)
    shape = Shape(*args.sizes, dtype, fp8)
    counts = [int(c) for c in args.token_counts.split(",")]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; shape: {shape}")
    tasks = sorted(
        {(kind, bm, gemm) for count in counts for bm in block_m_candidates(count, shape)
         for gemm in gemm_candidates(bm, fp8) for kind in ("gemm1", "gemm2")},
        key=lambda task: (task[0], task[1], tuple(task[2].to_json().values())),
    )  # fmt: skip
    if args.workers > 0:
        try:
            precompile(shape, device, tasks, args.workers)
        except Exception as error:  # noqa: BLE001 - the sweep then compiles as it goes
            print(f"precompile failed ({type(error).__name__}: {error}); compiling serially")
    one_token = random_routing(1, shape, 0, device)[2]
    one_token_bytes = shape.expert_bytes * touched_experts(one_token, shape.num_experts)
    available = copies_needed(one_token_bytes, 8, device)
    weights = make_weights(shape, available, device)
    table, rows = {}, []
    for count in counts:
        if time.perf_counter() - start > args.time_budget_s:
            print(f"time budget spent: {count} tokens and up take the nearest tuned config")
            break
        hidden, topk_weights, topk_ids = random_routing(count, shape, count, device)
        touched = touched_experts(topk_ids, shape.num_experts) * shape.expert_bytes
        num_copies = copies_needed(touched, available, device)
        sweep = Sweep(shape, weights, hidden, topk_weights, topk_ids, num_copies, device)
        table[count], new_rows = tune_token_count(sweep, count)
        rows += new_rows
        print(f"{count} tokens: {json.dumps(table[count].to_json())}", flush=True)
    table = fill_missing(table, counts)
    gpu = device_name_of(torch.device(device))
    key_dtype = torch.float8_e4m3fn if fp8 else shape.dtype  # the fp8_w8a8 file
    file_name = config_file_name(shape.num_experts, shape.intermediate_size, key_dtype, gpu)
    path = Path(args.out_dir) / file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = [f' "{count}": {json.dumps(config.to_json())}' for count, config in table.items()]
    path.write_text("{\n" + ",\n".join(entries) + "\n}\n")  # one line per token count
    print(f"\nwrote {path} in {time.perf_counter() - start:.0f} s\n")
    print("| tokens | BLOCK_M | GEMM1 us | GEMM2 us | sum us | GEMM1 config | GEMM2 config |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
