"""Tuner of the Triton W8A8 FP8 GEMM: launch configs per token count M, written as the JSON that
`sits.kernels.fp8_gemm_triton.select_config` reads (`fp8_gemm_N{N}_K{K}_{gpu}.json`).

For each projection shape (N, K) and each M it times every candidate tile shape (bounded by M:
16-row tiles for decode, 64/128-row tiles for prefill) of `triton_fp8_linear` with 128 x 128
block scales and with per-row scales (`--scales`), keeps the fastest whose output matches the
default config's (relative error < 1e-3), and prints the default's time beside the winner's.
The mode (w8a16 up to `W8A16_MAX_ROWS` tokens, w8a8 past it) is the one the engine runs.

Timing: CUDA graph replay between CUDA events over enough copies of the weight that one call's
weight has left L2 (`timing.num_copies`), as in the engine's decode graphs.
Compilation: every candidate is compiled first in a pool of processes (filling Triton's on-disk
cache), so the sweep itself compiles nothing.

Usage (GPU machine, repository root):
    PYTHONPATH=src python3 bench/kernels/fp8_gemm_tune.py [--shapes llama8b_qkv,...] \
        [--tokens 1,16,...] [--out-dir src/sits/kernels/configs]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from fp8_gemm_bench import SHAPES
from timing import machine_line, num_copies, time_us

TOKENS = [1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
BLOCK = (128, 128)


def candidates(num_rows: int, scales: str = "block") -> list[dict]:
    """Tile shapes worth timing at M = num_rows (as the JSON entries of a tuned file); per-row
    scales also try K tiles of 256 (and 512 at M <= 16: no 128-wide scale block to stay
    inside)."""
    if num_rows <= 16:
        block_ms = [16]
    elif num_rows <= 64:
        block_ms = [16, 32, 64]
    elif num_rows <= 256:
        block_ms = [32, 64, 128]
    else:
        block_ms = [64, 128]
    block_ks = (128,) if scales == "block" else (128, 256)
    block_ns, warps = (32, 64, 128, 256), (4, 8)
    if num_rows <= 16:  # weight-bound: narrow tiles give more programs, small ones fewer warps
        block_ns, warps = (16, 32, 64, 128), (2, 4)
        block_ks = (128,) if scales == "block" else (128, 256, 512)
    out = []
    for block_m in block_ms:
        for block_n in block_ns:
            for block_k in block_ks:
                for num_warps in warps:
                    for num_stages in (3, 4, 5):
                        if block_m * block_n * block_k >= 128 * 256 * 128 and num_stages > 3:
                            continue  # shared memory
                        out.append(
                            {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                             "GROUP_M": 1 if num_rows <= 64 else 8,
                             "num_warps": num_warps, "num_stages": num_stages}
                        )  # fmt: skip
    return out


def _problem(num_cols: int, num_inner: int, num_rows: int, copies: int, scales: str):
    from sits.kernels.fp8_ref import quantize_fp8_block, quantize_fp8_per_row

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(num_cols, num_inner, generator=gen, device="cuda") * 0.02
    if scales == "block":
        weights = [quantize_fp8_block(w, BLOCK) for _ in range(copies)]
    else:
        weights = [quantize_fp8_per_row(w) for _ in range(copies)]
    xs = [
        torch.randn(num_rows, num_inner, generator=gen, device="cuda").bfloat16()
        for _ in range(copies)
    ]
    return weights, xs


def _compile(job: tuple[int, int, int, dict, str]) -> str:
    """Run one candidate once (fills Triton's cache); '' or the error."""
    from sits.kernels.fp8_gemm_triton import Fp8GemmConfig, triton_fp8_linear

    num_cols, num_inner, num_rows, entry, scales = job
    block = BLOCK if scales == "block" else None
    try:
        weights, xs = _problem(num_cols, num_inner, num_rows, 1, scales)
        triton_fp8_linear(xs[0], *weights[0], None, block, Fp8GemmConfig.from_json(entry))
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - a failing candidate is skipped
        return repr(error)[:200]


def _cycling_call(xs: list, weights: list, block: tuple[int, int] | None):
    """call(config) -> a no-argument launch that cycles through the problem's copies."""
    from sits.kernels.fp8_gemm_triton import triton_fp8_linear

    state = {"i": 0}

    def call(config):
        def run():
            i = state["i"] = (state["i"] + 1) % len(xs)
            return triton_fp8_linear(xs[i], *weights[i], None, block, config)

        return run

    return call


def _entry_of(config) -> dict:
    """A config as its JSON entry."""
    return {
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
        "GROUP_M": config.group_m, "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }  # fmt: skip


def tune_shape(
    num_cols: int, num_inner: int, tokens: list[int], reps: int, scales: str
) -> dict[str, dict]:
    from sits.kernels.fp8_gemm_triton import (
        Fp8GemmConfig,
        default_config,
        fp8_gemm_mode,
        triton_fp8_linear,
    )

    result = {}
    block = BLOCK if scales == "block" else None
    copies = num_copies(num_cols * num_inner, "cuda")
    for num_rows in tokens:
        weights, xs = _problem(num_cols, num_inner, num_rows, copies, scales)
        call = _cycling_call(xs, weights, block)
        default = default_config(num_rows, num_cols)
        want = triton_fp8_linear(xs[0], *weights[0], None, block, default).float()
        default_us = time_us(call(default), "cuda", reps)
        best_us, best = default_us, None
        for entry in candidates(num_rows, scales):
            config = Fp8GemmConfig.from_json(entry)
            try:
                got = triton_fp8_linear(xs[0], *weights[0], None, block, config).float()
            except Exception:  # noqa: BLE001 - failed to compile or launch
                continue
            if ((got - want).norm() / want.norm().clamp_min(1e-30)).item() > 1e-3:
                continue
            us = time_us(call(config), "cuda", reps)
            if us < best_us:
                best_us, best = us, entry
        if best is None:
            best = _entry_of(default)
        result[str(num_rows)] = best
        print(
            f"| {scales} | {fp8_gemm_mode(num_rows)} | {num_cols} | {num_inner} | {num_rows} | "
            f"{default_us:.1f} | {best_us:.1f} | "
            f"{default_us / best_us:.2f}x | {json.dumps(best)} |",
            flush=True,
        )
    return result


def main(argv: list[str]) -> None:
    from sits.kernels.fp8_gemm_triton import config_file_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out-dir", default="src/sits/kernels/configs")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--scales", default="block,channel", help="block, channel or both")
    args = parser.parse_args(argv)
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(machine_line("cuda"))
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = {SHAPES[name] for name in args.shapes.split(",")}
    kinds = args.scales.split(",")
    jobs = [
        (n, k, m, e, kind)
        for kind in kinds
        for n, k in shapes
        for m in tokens
        for e in candidates(m, kind)
    ]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        failures = sum(bool(err) for err in pool.map(_compile, jobs))
    print(f"compiled {len(jobs)} candidates ({failures} failed)")
    print(
        "\n| scales | mode | N | K | M | default us | tuned us | speedup | config |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    name = torch.cuda.get_device_name(0)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        for num_cols, num_inner in sorted(shapes):
            entries = tune_shape(num_cols, num_inner, tokens, args.reps, kind)
            path = out_dir / config_file_name(num_cols, num_inner, name, kind)
            path.write_text(json.dumps(entries, indent=1) + "\n")
            print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
