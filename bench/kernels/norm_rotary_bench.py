"""Micro-benchmark: RMSNorm (+ residual), q/k norm + RoPE and SiLU-and-mul, PyTorch vs Triton.

Prints the exact command, the machine, then a markdown table (ready for bench/RESULTS.md) per
operation and token count: microseconds, bytes moved / time (GB/s) and kernels launched, for
the PyTorch reference (`RMSNorm.forward_reference`, `RotaryEmbedding.forward_reference`,
`silu_and_mul_reference`: the code the layers ran before) and the Triton kernel (what the
layers run on CUDA), plus the largest difference between the two.

Shapes default to one Qwen3-30B-A3B layer: hidden 2048, 32 query heads, 4 kv heads, head_dim
128, q/k norm, rope theta 1e6 over 40960 positions; SiLU-and-mul to a Llama-3.1-8B MLP
(intermediate 14,336).

Timing: CUDA graph replay between CUDA events (launch overhead excluded, as in the engine's
decode graphs; an eager decode step would add about 8 us per kernel launched); inputs are
cycled over several copies so that one call's data is not still in L2 from the previous one.
Bytes: norm reads x (+ residual) and writes out (+ residual_out); RoPE reads and writes q and k
and reads one cos and one sin row per token (the torch path's cos/sin temporaries not counted);
SiLU-and-mul reads [gate | up] and writes the product (the torch path's temporary not counted).

Usage (GPU machine, from the repository root):
    PYTHONPATH=src python3 bench/kernels/norm_rotary_bench.py [--tokens 1,64,2048]
    PYTHONPATH=src python3 bench/kernels/norm_rotary_bench.py --device cpu   # plumbing check
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable

import torch
from timing import machine_line, num_copies, time_us

PEAK_TBPS = 4.2  # measured device-to-device copy bandwidth of an H200 (shared/notes)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", default="1,64,2048")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-positions", type=int, default=40960)
    parser.add_argument("--intermediate-size", type=int, default=14336)
    parser.add_argument("--no-qk-norm", action="store_true", help="RoPE only (Llama-style)")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    if args.device == "cpu":  # interpreter: tiny shapes, wall-clock timing
        args.tokens, args.hidden_size, args.num_heads, args.num_kv_heads = "1,3", 64, 4, 2
        args.head_dim, args.max_positions, args.reps = 16, 64, 1
        args.intermediate_size = 40
    return args


def count_kernels(fn: Callable[[], object], device: str) -> int | None:
    """CUDA kernels one call of fn launches (torch profiler); None on the CPU or on failure."""
    if device == "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - counting is informative only
        return None
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def make_norm(size: int, dtype: torch.dtype, device: str, seed: int):
    from sits.layers.norm import RMSNorm

    norm = RMSNorm(size, 1e-6)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = 1.0 + 0.1 * torch.randn(size, generator=gen)
    return norm.to(device, dtype).requires_grad_(False)


def norm_case(args, num_tokens: int, dtype: torch.dtype) -> dict[str, float]:
    """Time RMSNorm with a residual on [num_tokens, hidden]: torch vs Triton."""
    from sits.kernels.norm_triton import triton_rms_norm

    norm = make_norm(args.hidden_size, dtype, args.device, seed=0)
    shape = (num_tokens, args.hidden_size)
    nbytes = 4 * num_tokens * args.hidden_size * dtype.itemsize  # 2 reads + 2 writes
    copies = num_copies(nbytes, args.device, max_copies=64)
    inputs = [
        (torch.randn(shape, device=args.device).to(dtype), torch.randn(shape, device=args.device))
        for _ in range(copies)
    ]
    inputs = [(x, r.to(dtype)) for x, r in inputs]
    expected = norm.forward_reference(*inputs[0])[0]
    actual = triton_rms_norm(inputs[0][0], norm.weight, norm.eps, inputs[0][1])[0]

    def torch_run() -> None:
        for x, residual in inputs:
            norm.forward_reference(x, residual)

    def triton_run() -> None:
        for x, residual in inputs:
            triton_rms_norm(x, norm.weight, norm.eps, residual)

    return {
        "bytes": nbytes,
        "torch_us": time_us(torch_run, args.device, args.reps) / copies,
        "triton_us": time_us(triton_run, args.device, args.reps) / copies,
        "torch_kernels": count_kernels(lambda: norm.forward_reference(*inputs[0]), args.device),
        "triton_kernels": count_kernels(
            lambda: triton_rms_norm(inputs[0][0], norm.weight, norm.eps, inputs[0][1]),
            args.device,
        ),
        "error": float((actual.float() - expected.float()).abs().max()),
    }


def rope_case(args, num_tokens: int, dtype: torch.dtype) -> dict[str, float]:
    """Time q/k norm + RoPE on views of a fused QKV output: torch vs Triton (in place)."""
    from sits.layers.rotary import RopeConfig, RotaryEmbedding

    heads, kv_heads, dim = args.num_heads, args.num_kv_heads, args.head_dim
    rope = RopeConfig(head_dim=dim, theta=1e6, max_position_embeddings=args.max_positions)
    emb = RotaryEmbedding(rope)
    norms = None
    if not args.no_qk_norm:
        norms = (make_norm(dim, dtype, args.device, 1), make_norm(dim, dtype, args.device, 2))
    width = (heads + 2 * kv_heads) * dim
    nbytes = 2 * num_tokens * (heads + kv_heads) * dim * dtype.itemsize + num_tokens * dim * 2
    copies = num_copies(nbytes, args.device, max_copies=64)
    sets = []
    for _ in range(copies):
        qkv = torch.randn(num_tokens, width, device=args.device).to(dtype)
        q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        positions = torch.randint(0, args.max_positions, (num_tokens,), device=args.device)
        sets.append((positions, q.view(num_tokens, heads, dim), k.view(num_tokens, kv_heads, dim)))
    expected = emb.forward_reference(*sets[0], norms)[0]
    cos, sin = emb.cos_sin_cache(torch.device(args.device), dtype)  # built once, not timed
    from sits.kernels.rotary_triton import triton_qk_norm_rope

    weights = (norms[0].weight, norms[1].weight) if norms else (None, None)
    eps = (1e-6, 1e-6)

    def triton_one(positions, q, k, in_place: bool = True):
        return triton_qk_norm_rope(q, k, positions, cos, sin, *weights, *eps, in_place=in_place)

    actual = triton_one(*sets[0], in_place=False)[0]

    def torch_run() -> None:
        for positions, q, k in sets:
            emb.forward_reference(positions, q, k, norms)

    def triton_run() -> None:
        for positions, q, k in sets:
            triton_one(positions, q, k)

    return {
        "bytes": nbytes,
        "torch_us": time_us(torch_run, args.device, args.reps) / copies,
        "triton_us": time_us(triton_run, args.device, args.reps) / copies,
        "torch_kernels": count_kernels(lambda: emb.forward_reference(*sets[0], norms), args.device),
        "triton_kernels": count_kernels(lambda: triton_one(*sets[0]), args.device),
        "error": float((actual.float() - expected.float()).abs().max()),
    }


def act_case(args, num_tokens: int, dtype: torch.dtype) -> dict[str, float]:
    """Time SiLU(gate) * up on [num_tokens, 2 * intermediate]: torch vs Triton."""
    from sits.kernels.activation_triton import triton_silu_and_mul
    from sits.layers.activation import silu_and_mul_reference

    width = args.intermediate_size
    nbytes = 3 * num_tokens * width * dtype.itemsize  # reads gate and up, writes the product
    copies = num_copies(nbytes, args.device, max_copies=64)
    inputs = [
        torch.randn(num_tokens, 2 * width, device=args.device).to(dtype) for _ in range(copies)
    ]
    expected = silu_and_mul_reference(inputs[0])
    actual = triton_silu_and_mul(inputs[0])

    def torch_run() -> None:
        for x in inputs:
            silu_and_mul_reference(x)

    def triton_run() -> None:
        for x in inputs:
            triton_silu_and_mul(x)

    return {
        "bytes": nbytes,
        "torch_us": time_us(torch_run, args.device, args.reps) / copies,
        "triton_us": time_us(triton_run, args.device, args.reps) / copies,
        "torch_kernels": count_kernels(lambda: silu_and_mul_reference(inputs[0]), args.device),
        "triton_kernels": count_kernels(lambda: triton_silu_and_mul(inputs[0]), args.device),
        "error": float((actual.float() - expected.float()).abs().max()),
    }


def report(title: str, case: Callable, args, dtype: torch.dtype) -> None:
    print(f"\n## {title}\n")
    print("| tokens | MB | torch us | torch GB/s | torch kernels | Triton us | Triton GB/s "
          "| % of 4.2 TB/s | Triton kernels | speed-up | max diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for num_tokens in map(int, args.tokens.split(",")):
        row = case(args, num_tokens, dtype)
        torch_gbps = row["bytes"] / row["torch_us"] / 1e3
        triton_gbps = row["bytes"] / row["triton_us"] / 1e3
        print(
            f"| {num_tokens} | {row['bytes'] / 1e6:.3f} | {row['torch_us']:.1f} "
            f"| {torch_gbps:.0f} | {row['torch_kernels']} | {row['triton_us']:.1f} "
            f"| {triton_gbps:.0f} | {100 * triton_gbps / (PEAK_TBPS * 1e3):.0f} "
            f"| {row['triton_kernels']} | {row['torch_us'] / row['triton_us']:.1f}x "
            f"| {row['error']:.1e} |",
            flush=True,
        )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.device == "cpu":  # the interpreter, set before the kernels are imported
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu for a plumbing check")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {machine_line(args.device)}")
    print(
        f"shape: hidden {args.hidden_size}, heads {args.num_heads}/{args.num_kv_heads}, "
        f"head_dim {args.head_dim}, qk_norm {not args.no_qk_norm}, {dtype}"
    )
    report(f"RMSNorm + residual add (hidden {args.hidden_size})", norm_case, args, dtype)
    norm_title = "" if args.no_qk_norm else "q/k RMSNorm + "
    report(f"{norm_title}RoPE on q/k views of the fused QKV output", rope_case, args, dtype)
    report(f"SiLU-and-mul (intermediate {args.intermediate_size})", act_case, args, dtype)


if __name__ == "__main__":
    main(sys.argv[1:])
