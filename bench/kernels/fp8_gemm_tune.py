"""Tuner of the Triton W8A8 FP8 GEMM: launch configs per token count M, written as the JSON that
`sits.kernels.fp8_gemm_triton.select_config` reads (`fp8_gemm_N{N}_K{K}_{gpu}.json`).

For each projection shape (N, K) and each M it times every candidate tile shape (bounded by M:
16-row tiles for decode, 64/128-row tiles for prefill) of `triton_fp8_linear` with 128 x 128
block scales, keeps the fastest whose output matches the default config's (relative error
< 1e-3), and prints the default's time beside the winner's.

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


def candidates(num_rows: int) -> list[dict]:
    """Tile shapes worth timing at M = num_rows (as the JSON entries of a tuned file)."""
    if num_rows <= 16:
        block_ms = [16]
    elif num_rows <= 64:
        block_ms = [16, 32, 64]
    elif num_rows <= 256:
        block_ms = [32, 64, 128]
    else:
        block_ms = [64, 128]
    out = []
    for block_m in block_ms:
        for block_n in (32, 64, 128, 256):
            for num_warps in (4, 8):
                for num_stages in (3, 4, 5):
                    if block_m * block_n >= 128 * 256 and num_stages > 3:
                        continue  # shared memory
                    out.append(
                        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128,
                         "GROUP_M": 1 if num_rows <= 64 else 8,
                         "num_warps": num_warps, "num_stages": num_stages}
                    )  # fmt: skip
    return out


def _problem(num_cols: int, num_inner: int, num_rows: int, copies: int):
    from sits.kernels.fp8_ref import quantize_fp8_block

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(num_cols, num_inner, generator=gen, device="cuda") * 0.02
    weights = [quantize_fp8_block(w, BLOCK) for _ in range(copies)]
    xs = [
        torch.randn(num_rows, num_inner, generator=gen, device="cuda").bfloat16()
        for _ in range(copies)
    ]
    return weights, xs


def _compile(job: tuple[int, int, int, dict]) -> str:
    """Run one candidate once (fills Triton's cache); '' or the error."""
    from sits.kernels.fp8_gemm_triton import Fp8GemmConfig, triton_fp8_linear

    num_cols, num_inner, num_rows, entry = job
    try:
        weights, xs = _problem(num_cols, num_inner, num_rows, 1)
        triton_fp8_linear(xs[0], *weights[0], None, BLOCK, Fp8GemmConfig.from_json(entry))
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - a failing candidate is skipped
        return repr(error)[:200]


def tune_shape(num_cols: int, num_inner: int, tokens: list[int], reps: int) -> dict[str, dict]:
    from sits.kernels.fp8_gemm_triton import Fp8GemmConfig, default_config, triton_fp8_linear

    result = {}
    copies = num_copies(num_cols * num_inner, "cuda")
    for num_rows in tokens:
        weights, xs = _problem(num_cols, num_inner, num_rows, copies)
        state = {"i": 0}

        def call(config):
            def run():
                i = state["i"] = (state["i"] + 1) % copies
                return triton_fp8_linear(xs[i], *weights[i], None, BLOCK, config)

            return run

        default = default_config(num_rows, num_cols)
        want = triton_fp8_linear(xs[0], *weights[0], None, BLOCK, default).float()
        default_us = time_us(call(default), "cuda", reps)
        best_us, best = default_us, None
        for entry in candidates(num_rows):
            config = Fp8GemmConfig.from_json(entry)
            try:
                got = triton_fp8_linear(xs[0], *weights[0], None, BLOCK, config).float()
            except Exception:  # noqa: BLE001 - failed to compile or launch
                continue
            if ((got - want).norm() / want.norm().clamp_min(1e-30)).item() > 1e-3:
                continue
            us = time_us(call(config), "cuda", reps)
            if us < best_us:
                best_us, best = us, entry
        if best is None:
            d = default
            best = {"BLOCK_M": d.block_m, "BLOCK_N": d.block_n, "BLOCK_K": d.block_k,
                    "GROUP_M": d.group_m, "num_warps": d.num_warps, "num_stages": d.num_stages}  # fmt: skip
        result[str(num_rows)] = best
        print(
            f"| {num_cols} | {num_inner} | {num_rows} | {default_us:.1f} | {best_us:.1f} | "
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
    args = parser.parse_args(argv)
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(machine_line("cuda"))
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = {SHAPES[name] for name in args.shapes.split(",")}
    jobs = [(n, k, m, e) for n, k in shapes for m in tokens for e in candidates(m)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        failures = sum(bool(err) for err in pool.map(_compile, jobs))
    print(f"compiled {len(jobs)} candidates ({failures} failed)")
    print("\n| N | K | M | default us | tuned us | speedup | config |\n|---|---|---|---|---|---|---|")
    name = torch.cuda.get_device_name(0)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for num_cols, num_inner in sorted(shapes):
        entries = tune_shape(num_cols, num_inner, tokens, args.reps)
        path = out_dir / config_file_name(num_cols, num_inner, name)
        path.write_text(json.dumps(entries, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
