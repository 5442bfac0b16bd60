"""`sits bench throughput`: offline throughput of `LLM.generate` on random token-id prompts.

Workload: `--num-prompts` prompts of `--input-len` random token ids (seeded by `--seed`), each
generating exactly `--output-len` tokens (greedy, `ignore_eos`), all queued at once. A warm-up
of a few other prompts runs first and is not timed. Reported: requests/s, output tok/s and
total (prompt + output) tok/s over the wall time of the timed `generate` call, the exact token
counts, and the roofline of the steps the engine ran (`sits.bench.roofline`). The timed call
shows `LLM.generate`'s progress bar on stderr.

`--peer transformers` first runs transformers' `generate_batch` on the same prompts and weights
(`sits.bench.peer`), frees it, then runs sits, and prints the ratio of output tok/s sits/peer
and the fraction of prompts whose first generated token is the same in both (a sanity check of
the shared weights; bf16 rounding may change some).
JSON (`--output-json`, schema "sits.bench.throughput/1"): the `base_doc` head plus "workload",
"sits" (with "phase_s": seconds of each engine phase, `phase_counters`), "roofline", "peer"
(or null), "ratio" and "first_token_match" (or null).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from sits.bench.offline_common import (
    OfflineSetup,
    add_offline_args,
    base_doc,
    fraction_text,
    header_lines,
    markdown_table,
    offline_setup,
    random_prompts,
    roofline_lines,
    step_roofline,
    write_json,
)
from sits.bench.report import command_line
from sits.bench.steps import StepRecorder, phase_counters, phases_text
from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import SamplingParams

SCHEMA = "sits.bench.throughput/1"
DESCRIPTION = (
    "Offline throughput: LLM.generate over random token-id prompts (greedy, ignore_eos, exactly "
    "--output-len tokens each); prints requests/s, output and total tok/s, the roofline, and "
    "with --peer transformers the same workload on transformers' generate_batch."
)
_WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from the timed ones


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    """Add the `sits bench throughput` flags."""
    add_offline_args(p, input_len=512, output_len=128)
    p.add_argument("--num-prompts", type=int, default=256, help="prompts to generate for")
    p.add_argument(
        "--num-warmup-prompts", type=int, default=4, help="untimed prompts run first (4)"
    )
    p.add_argument(
        "--peer",
        choices=["transformers"],
        default=None,
        help="also run transformers' continuous batching (generate_batch) on the same "
        "weights and prompts, and print the ratio",
    )
    p.add_argument(
        "--peer-attn-implementation",
        default=None,
        help="transformers attn_implementation (default: paged|sdpa before 5.23, else sdpa)",
    )
    p.add_argument(
        "--peer-num-blocks",
        type=int,
        default=None,
        help="transformers KV blocks (default: its automatic sizing on GPU)",
    )


def _greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_sits(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Time one `generate` over `prompts`; returns the figures and each prompt's first token.

    Returns:
        {"elapsed_s", "num_prompt_tokens", "num_output_tokens", "requests_per_s",
         "output_tokens_per_s", "total_tokens_per_s", "first_token_ids"}.
    """
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start_s = time.perf_counter()
    outputs = llm.generate(inputs, _greedy(output_len))
    elapsed_s = time.perf_counter() - start_s
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "elapsed_s": elapsed_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "requests_per_s": len(outputs) / elapsed_s,
        "output_tokens_per_s": num_output / elapsed_s,
        "total_tokens_per_s": (num_prompt + num_output) / elapsed_s,
        "first_token_ids": [o.outputs[0].token_ids[0] for o in outputs],
    }


def _run_peer(
    args: argparse.Namespace, setup: OfflineSetup, prompts: list[list[int]]
) -> dict[str, Any]:
    """The transformers peer on the same workload (see `sits.bench.peer`)."""
    from sits.bench.peer import run_transformers_peer
    from sits.runner.model_info import read_model_info

    info = read_model_info(setup.config, setup.model_dir)
    dummy_seed = setup.config.seed if setup.config.load_format == "dummy" else None
    result = run_transformers_peer(
        setup.model_dir,
        prompts,
        args.output_len,
        info.dtype,
        info.device,
        dummy_seed,
        attn_implementation=args.peer_attn_implementation,
        num_blocks=args.peer_num_blocks,
    )
    num_prompt = sum(len(p) for p in prompts)
    return {
        "name": result.name,
        "version": result.version,
        "attn_implementation": result.attn_implementation,
        "elapsed_s": result.elapsed_s,
        "wall_s": result.wall_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": result.num_output_tokens,
        "requests_per_s": len(prompts) / result.elapsed_s,
        "output_tokens_per_s": result.num_output_tokens / result.elapsed_s,
        "total_tokens_per_s": (num_prompt + result.num_output_tokens) / result.elapsed_s,
        "first_token_ids": [t[0] if t else None for t in result.output_token_ids],
    }


def run_throughput_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark of the parsed flags; returns the result document (module docstring).

    Raises:
        InvalidParameterError: bad flags.
    """
    from sits.engine.llm import LLM

    if args.num_prompts < 1 or args.num_warmup_prompts < 0:
        raise InvalidParameterError("num_prompts", "--num-prompts must be >= 1, warm-up >= 0")
    setup = offline_setup(args)
    prompts = random_prompts(args.num_prompts, args.input_len, setup.vocab_size, args.seed)
    peer = _run_peer(args, setup, prompts) if args.peer == "transformers" else None
    llm = LLM(**dataclasses.asdict(setup.config))
    if args.num_warmup_prompts:
        warmup = random_prompts(
            args.num_warmup_prompts,
            args.input_len,
            setup.vocab_size,
            args.seed + _WARMUP_SEED_OFFSET,
        )
        llm.generate(
            [{"prompt_token_ids": p} for p in warmup],
            _greedy(min(args.output_len, 4)),
            use_tqdm=False,
        )
    recorder = StepRecorder().attach(llm.engine_core)
    phases_before = phase_counters(llm.engine_core)
    sits = run_sits(llm, prompts, args.output_len)
    shapes = recorder.take()
    sits["num_steps"] = len(shapes)
    sits["phase_s"] = {
        name: total_s - phases_before.get(name, 0.0)
        for name, total_s in phase_counters(llm.engine_core).items()
    }
    doc = base_doc(SCHEMA, setup, llm)
    doc["workload"] = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_warmup_prompts": args.num_warmup_prompts,
        "sampling": "greedy, ignore_eos",
        "seed": args.seed,
    }
    first_ids = sits.pop("first_token_ids")
    doc["sits"] = sits
    doc["roofline"] = step_roofline(llm, "whole run", shapes, sits["elapsed_s"])
    doc["peer"] = None
    doc["ratio"] = None
    doc["first_token_match"] = None
    if peer is not None:
        peer_first = peer.pop("first_token_ids")
        doc["peer"] = peer
        doc["ratio"] = sits["output_tokens_per_s"] / peer["output_tokens_per_s"]
        matches = sum(a == b for a, b in zip(first_ids, peer_first))
        doc["first_token_match"] = matches / len(first_ids)
    return doc


def format_throughput(doc: dict[str, Any], with_command: bool = True) -> str:
    """The printed report: command (unless `with_command` is False: printed already), machine
    and model first, a markdown table last."""
    w, s = doc["workload"], doc["sits"]
    expected = w["num_prompts"] * w["output_len"]
    lines = header_lines(doc, with_command)
    lines.append(
        f"Workload: {w['num_prompts']} prompts x {w['input_len']} in / {w['output_len']} out "
        f"({w['sampling']}, seed {w['seed']})"
    )
    lines.append(
        f"sits: {s['elapsed_s']:.2f} s, {s['num_steps']} steps, {s['num_prompt_tokens']} prompt + "
        f"{s['num_output_tokens']} output tokens"
        + ("" if s["num_output_tokens"] == expected else f" (EXPECTED {expected})")
    )
    lines += roofline_lines(doc["roofline"])
    if s.get("phase_s"):
        lines.append(_phases_line(s["phase_s"], s["elapsed_s"]))
    peer = doc["peer"]
    if peer is not None:
        lines.append(
            f"peer: transformers {peer['version']} generate_batch "
            f"({peer['attn_implementation']}): {peer['elapsed_s']:.2f} s "
            f"(call {peer['wall_s']:.2f} s), {peer['num_output_tokens']} output tokens; "
            f"first output token identical for {100 * doc['first_token_match']:.1f} % of prompts"
        )
    headers = ["engine", "workload", "requests/s", "output tok/s", "total tok/s", "roofline"]
    shape = f"{w['num_prompts']} x {w['input_len']} in / {w['output_len']} out"
    rows = [
        [
            "sits",
            shape,
            f"{s['requests_per_s']:.2f}",
            f"{s['output_tokens_per_s']:.1f}",
            f"{s['total_tokens_per_s']:.1f}",
            fraction_text(doc["roofline"]),
        ]
    ]
    if peer is not None:
        rows.append(
            [
                f"transformers {peer['version']} generate_batch",
                shape,
                f"{peer['requests_per_s']:.2f}",
                f"{peer['output_tokens_per_s']:.1f}",
                f"{peer['total_tokens_per_s']:.1f}",
                "",
            ]
        )
    lines.append("")
    lines += markdown_table(headers, rows)
    if doc["ratio"] is not None:
        lines.append("")
        lines.append(f"sits / transformers output tok/s: {doc['ratio']:.2f}x")
    return "\n".join(lines)


def _phases_line(phase_s: dict[str, float], elapsed_s: float) -> str:
    """`Engine phases (s in all): schedule 1.20, runner 95.00 (launch 3.10, shadow 0.20, sync
    91.70), update 2.00, outside the steps 1.80` (sync: the host waiting for the device)."""
    outside = elapsed_s - sum(phase_s[n] for n in ("schedule", "runner", "update"))
    return "Engine phases (s in all): " + phases_text(phase_s, "outside the steps", outside)


def run_throughput(args: argparse.Namespace) -> int:
    """`sits bench throughput`: run, print the report, write --output-json; exit code 0."""
    print(f"Command: {command_line()}", flush=True)
    doc = run_throughput_benchmark(args)
    print(format_throughput(doc, with_command=False))  # the command was printed first
    write_json(args.output_json, doc)
    return 0
