"""Pieces shared by the offline benchmarks (`sits bench throughput` and `sits bench latency`).

- flags: the engine flags of `sits.engine.arg_utils` plus `--random-weights SHAPE`,
  `--input-len`, `--output-len` and `--output-json`;
- `OfflineSetup`: the `EngineConfig` those flags give (always token ids in and out:
  `skip_tokenizer_init`; `--random-weights` = a shape directory with dummy weights);
- seeded random token-id prompts; the roofline of recorded steps (its fraction only for a run on
  a CUDA device: the ceilings are the GPU's); the printed header, markdown tables and the JSON
  file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
from dataclasses import dataclass
from typing import Any

from sits.bench.report import command_line, machine_info
from sits.bench.roofline import H200, ModelShape, StepShape, roofline_json, step_cost
from sits.bench.shapes import shape_names, write_shape_dir
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.engine.arg_utils import add_engine_args, engine_kwargs

_KV_ELEM_BYTES = {"fp8": 1, "int8": 1}


def add_offline_args(p: argparse.ArgumentParser, *, input_len: int, output_len: int) -> None:
    """Add the engine flags and the flags every offline benchmark shares."""
    add_engine_args(p, model_required=False)
    p.add_argument(
        "--random-weights",
        metavar="SHAPE",
        choices=shape_names(),
        default=None,
        help=f"benchmark a named real shape with seeded random weights made on the device "
        f"(no download, no tokenizer): one of {', '.join(shape_names())}",
    )
    p.add_argument("--input-len", type=int, default=input_len, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=output_len, help="generated tokens")
    p.add_argument(
        "--output-json",
        "--result-json",
        dest="output_json",
        default=None,
        metavar="FILE",
        help="write the figures as JSON",
    )


@dataclass(frozen=True, slots=True)
class OfflineSetup:
    """The engine to benchmark.

    Attributes:
        config: the engine configuration (token ids in and out).
        model_dir: the resolved checkpoint or shape directory.
        label: what the report calls the model ("qwen3-30b-a3b (random weights)", a path...).
        vocab_size: prompts draw token ids from [0, vocab_size).
    """

    config: EngineConfig
    model_dir: str
    label: str
    vocab_size: int


def offline_setup(args: argparse.Namespace) -> OfflineSetup:
    """The engine configuration of the parsed flags.

    Raises:
        InvalidParameterError: neither or both of --model and --random-weights, or a length
            below 1.
        ModelNotFoundError: --model cannot be resolved.
    """
    if (args.model is None) == (args.random_weights is None):
        raise InvalidParameterError("model", "give exactly one of --model M, --random-weights S")
    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            raise InvalidParameterError(name, f"--{name.replace('_', '-')} must be >= 1")
    kwargs = engine_kwargs(args)
    kwargs["skip_tokenizer_init"] = True
    if args.random_weights is not None:
        kwargs["model"] = write_shape_dir(args.random_weights)
        kwargs["load_format"] = "dummy"
        label = f"{args.random_weights} (random weights, seed {args.seed})"
    else:
        label = args.model
        if kwargs["load_format"] == "dummy":
            label += f" (random weights, seed {args.seed})"
    from sits.models.loader import resolve_model_path  # torch: imported on use

    config = EngineConfig(**kwargs)
    model_dir = resolve_model_path(config.model)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        vocab_size = int(json.load(f)["vocab_size"])
    return OfflineSetup(config, model_dir, label, vocab_size)


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num_prompts` lists of `input_len` token ids drawn uniformly from [0, vocab_size)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def step_roofline(
    llm: Any, label: str, shapes: list[StepShape], measured_s: float
) -> dict[str, Any]:
    """The roofline (`sits.bench.roofline.roofline_json`) of `shapes` run by `llm`'s engine in
    `measured_s` seconds, against the H200's ceilings.

    Adds "on_gpu" (the engine ran on a CUDA device); when it did not, "fraction" is None: the
    GPU's ceilings say nothing about a CPU run.
    """
    runner = llm.engine_core.runner
    model = ModelShape.from_decoder_config(runner.model.config)
    weight_bytes = runner.dtype.itemsize
    kv_bytes = _KV_ELEM_BYTES.get(runner.kv_cache_dtype, weight_bytes)
    costs = [step_cost(model, s, H200, weight_bytes, kv_bytes) for s in shapes]
    doc = roofline_json(label, costs, measured_s, H200)
    doc["on_gpu"] = runner.device.type == "cuda"
    if not doc["on_gpu"]:
        doc["fraction"] = None
    return doc


def base_doc(schema: str, setup: OfflineSetup, llm: Any | None) -> dict[str, Any]:
    """The common head of a result document: schema, command, date, machine, model."""
    config = setup.config
    model: dict[str, Any] = {
        "label": setup.label,
        "model_dir": setup.model_dir,
        "load_format": config.load_format,
        "kv_cache_dtype": config.kv_cache_dtype,
    }
    if llm is not None:
        runner = llm.engine_core.runner
        model["dtype"] = str(runner.dtype).removeprefix("torch.")
        model["device"] = str(runner.device)
        model["total_params"] = ModelShape.from_decoder_config(runner.model.config).total_params
    return {
        "schema": schema,
        "command": command_line(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": model,
        "engine": {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "block_size": config.block_size,
            "enable_prefix_caching": config.enable_prefix_caching,
            "enforce_eager": config.enforce_eager,
            "seed": config.seed,
        },
    }


def header_lines(doc: dict[str, Any], with_command: bool = True) -> list[str]:
    """The report's first lines: the exact command (unless already printed: `with_command`
    False), the machine and the model."""
    machine = doc["machine"]
    gpus = machine.get("gpus") or []
    model = doc["model"]
    command = [f"Command: {doc['command']}"] if with_command else []
    return command + [
        f"Machine: {machine.get('cpu')} ({machine.get('num_cpus')} CPUs), "
        f"{f'{len(gpus)}x {gpus[0]}' if gpus else 'no GPU'}; torch {machine.get('torch')}",
        f"Model: {model['label']} ({model.get('dtype', '?')} on {model.get('device', '?')}, "
        f"KV {model['kv_cache_dtype']})",
    ]


def roofline_lines(roofline: dict[str, Any]) -> list[str]:
    """Readable lines of one roofline summary (without the ideal-vs-measured line when the
    run was not on a GPU: "on_gpu" False)."""
    hw = roofline["hardware"]
    fraction = roofline["fraction"]
    achieved_bw = roofline["achieved_bytes_s"] or 0.0
    achieved_flops = roofline["achieved_flops_s"] or 0.0
    if not roofline.get("on_gpu", True):
        return [
            f"Roofline ({roofline['label']}, {roofline['num_steps']} steps): not computed on "
            f"a CPU; it compares GPU runs with the {hw['name']}'s bandwidth and matmul rate.",
            f"  per step: {roofline['bytes_per_step'] / 1e9:.3f} GB read, "
            f"{roofline['flops_per_step'] / 1e9:.2f} GFLOP",
        ]
    return [
        f"Roofline ({roofline['label']}, {roofline['num_steps']} steps) against "
        f"{hw['bandwidth_bytes_s'] / 1e12:.1f} TB/s and {hw['matmul_flops_s'] / 1e12:.0f} "
        f"TFLOP/s ({hw['name']}):",
        f"  per step: {roofline['bytes_per_step'] / 1e9:.3f} GB read "
        f"(weights {roofline['weight_bytes'] / 1e9:.2f} GB, experts "
        f"{roofline['expert_bytes'] / 1e9:.2f} GB, KV {roofline['kv_bytes'] / 1e9:.2f} GB "
        f"in all), {roofline['flops_per_step'] / 1e9:.2f} GFLOP; {roofline['bound']}-bound",
        f"  ideal {roofline['ideal_s'] * 1e3:.2f} ms vs measured "
        f"{roofline['measured_s'] * 1e3:.2f} ms: "
        f"{'-' if fraction is None else f'{100 * fraction:.1f} %'} of the roofline "
        f"(achieved {achieved_bw / 1e12:.3f} TB/s, {achieved_flops / 1e12:.2f} TFLOP/s)",
    ]


def fraction_text(roofline: dict[str, Any]) -> str:
    """The roofline fraction as printed: "12.3 %", "-" when unknown, or "n/a (no GPU)"."""
    if not roofline.get("on_gpu", True):
        return "n/a (no GPU)"
    fraction = roofline["fraction"]
    return "-" if fraction is None else f"{100 * fraction:.1f} %"


def markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    """Write `doc` to `path` (nothing when None)."""
    if path is None:
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
