"""`sits bench perplexity`: perplexity of held-out Python text under bf16, fp8 and int4 weights.

One responsibility: score the demo model's held-out standard library files (issue 25) with the
engine's prompt logprobs, once per weight precision, and say whether the quantized weights stay
within their targets (fp8 within 2 %, int4 within 10 % of the unquantized perplexity).

Algorithm:
- Files: the `.py` files of the running interpreter's standard library
  (`sysconfig.get_paths()["stdlib"]`, or `--stdlib-dir`) outside the directories of
  `STDLIB_EXCLUDED_DIRS`, kept when `is_held_out(relative posix path)`; this is the rule that
  split the demo model's corpus (`is_held_out` and `read_stdlib` of tools/demo_corpus.py,
  re-implemented here because tools/ is not part of the installed package). A path held out
  there was never trained on, whatever the Python version.
- Tokens: a file's text is tokenized without special tokens and framed as in training, where
  every file follows the previous file's `<|endoftext|>` and ends with one:
  `seq = [eos] + ids + [eos]`. Its targets are `seq[1:]` (`--max-tokens-per-file N` keeps the
  first N targets), each predicted from all the tokens before it within its window.
- Windows (`score_windows`): `seq` is cut into windows of at most `window_tokens` tokens that
  overlap by exactly one token, so each window's first token is the context of its first target
  and every target is scored exactly once. `window_tokens` = max_model_len - 1, because a
  request also needs room for its one generated token.
- Scoring: each window is a request `SamplingParams(max_tokens=1, prompt_logprobs=0)` (vLLM
  semantics: position i >= 1 of `prompt_logprobs` holds the log-probability of prompt token i
  given tokens 0..i-1; position 0 is None). NLL = -logprob.
- Figures: token-weighted perplexity = exp(mean NLL over every target of every file); the
  relative difference of a precision = its perplexity / the unquantized one - 1; a target
  holds when that difference is at most the target (a lower perplexity holds too).
- Precisions: "bf16" = the checkpoint's weights unquantized, "fp8" / "int4" = the engine's
  online quantization of them (`EngineConfig.quantization`); all run in the checkpoint's dtype
  (`--dtype` to change it). One engine per precision, built and freed in turn.

JSON (`--output-json`, schema "sits.bench.perplexity/1"): "command", "date", "machine",
"model" {"model_dir", "dtype", "device", "max_model_len", "window_tokens"}, "stdlib_dir",
"max_tokens_per_file", "files" [{"path", "num_tokens", "num_scored_tokens"}], "results"
[{"precision", "quantization", "num_scored_tokens", "mean_nll", "perplexity",
"relative_diff_vs_bf16", "target", "met", "elapsed_s"}].
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import sysconfig
import time
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sits.bench.offline_common import markdown_table, write_json
from sits.bench.report import command_line, machine_info
from sits.core.errors import InvalidParameterError
from sits.core.outputs import RequestOutput
from sits.core.sampling_params import SamplingParams

SCHEMA = "sits.bench.perplexity/1"
DESCRIPTION = (
    "Perplexity of the held-out standard library files (the demo model's held-out rule) under "
    "bf16, fp8 and int4 weights, scored with prompt logprobs in windows of max_model_len - 1 "
    "tokens, with the relative difference to bf16 and the issue-25 targets."
)
HELD_OUT_PERCENT = 3
STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
# Precision name -> EngineConfig.quantization.
PRECISIONS: dict[str, str | None] = {"bf16": None, "fp8": "fp8", "int4": "int4"}
BASELINE = "bf16"
# Largest relative perplexity increase vs bf16 that meets issue 25's target.
TARGETS = {"fp8": 0.02, "int4": 0.10}


def is_held_out(rel_path: str, held_out_percent: int = HELD_OUT_PERCENT) -> bool:
    """The demo corpus' split (tools/demo_corpus.py `is_held_out`): True when
    int(sha256(rel_path utf-8).hexdigest(), 16) % 100 < held_out_percent."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % 100 < held_out_percent


@dataclass(frozen=True, slots=True)
class HeldOutFile:
    """One held-out source file.

    Attributes:
        rel_path: posix path relative to the stdlib directory ("functools.py").
        text: its source, decoded with its PEP 263 coding cookie.
    """

    rel_path: str
    text: str


def held_out_files(stdlib_dir: str | os.PathLike[str] | None = None) -> list[HeldOutFile]:
    """The held-out `.py` files under `stdlib_dir` (default: this interpreter's stdlib), sorted
    by path, as tools/demo_corpus.py `read_stdlib` picks them: files under an excluded directory,
    undecodable ones and blank ones are left out."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"]).resolve()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in STDLIB_EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if not is_held_out(rel.as_posix()):
            continue
        try:
            with tokenize.open(path) as f:
                text = f.read()
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        if text.strip():
            files.append(HeldOutFile(rel.as_posix(), text))
    return files


def framed_tokens(ids: Sequence[int], eos_token_id: int, max_targets: int | None) -> list[int]:
    """`[eos] + ids + [eos]`, cut to `max_targets + 1` tokens (all when None): the file as the
    model saw files in training; every token after the first is a target."""
    seq = [eos_token_id, *ids, eos_token_id]
    return seq if max_targets is None else seq[: max_targets + 1]


def score_windows(num_tokens: int, window_tokens: int) -> list[tuple[int, int]]:
    """Windows [start, end) over a sequence of `num_tokens` tokens whose targets are tokens
    1..num_tokens-1: at most `window_tokens` tokens each, consecutive windows sharing one token,
    so each target is scored exactly once (the window's tokens start..end-1 score targets
    start+1..end-1).

    Raises:
        ValueError: `window_tokens` < 2 (a window must hold a context and a target).
    """
    if window_tokens < 2:
        raise ValueError(f"window_tokens must be >= 2, got {window_tokens}")
    step = window_tokens - 1
    return [(s, min(s + window_tokens, num_tokens)) for s in range(0, num_tokens - 1, step)]


def window_nlls(output: RequestOutput, window_ids: Sequence[int]) -> list[float]:
    """Per-target NLL (nats) of one window's request: -logprob of tokens 1.. of `window_ids`
    from `output.prompt_logprobs` (vLLM layout: entry 0 is None)."""
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(window_ids), "prompt_logprobs missing"
    return [-entries[i][window_ids[i]].logprob for i in range(1, len(window_ids))]


def score_sequences(
    llm: Any, sequences: Sequence[Sequence[int]], window_tokens: int
) -> list[list[float]]:
    """NLL of every target of every sequence under `llm` (an `LLM`), one request per window,
    all windows in one `generate` call.

    Returns:
        Per sequence, [len(seq) - 1] NLLs in nats, in target order.
    """
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    owners, prompts = [], []
    for seq_index, seq in enumerate(sequences):
        for start, end in score_windows(len(seq), window_tokens):
            owners.append(seq_index)
            prompts.append(list(seq[start:end]))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    nlls: list[list[float]] = [[] for _ in sequences]
    for seq_index, prompt, output in zip(owners, prompts, outputs):
        nlls[seq_index].extend(window_nlls(output, prompt))
    return nlls


def perplexity(nlls: Sequence[float]) -> float:
    """Token-weighted perplexity exp(mean NLL) of NLLs in nats.

    Raises:
        ValueError: no NLLs.
    """
    if not nlls:
        raise ValueError("perplexity of no tokens")
    return math.exp(math.fsum(nlls) / len(nlls))


def compare(results: list[dict[str, Any]]) -> None:
    """Fill each result's "relative_diff_vs_bf16", "target" and "met" in place (None where no
    bf16 result or no target)."""
    base = next((r["perplexity"] for r in results if r["precision"] == BASELINE), None)
    for r in results:
        diff = None if base is None else r["perplexity"] / base - 1.0
        target = TARGETS.get(r["precision"])
        r["relative_diff_vs_bf16"] = diff
        r["target"] = target
        r["met"] = None if diff is None or target is None else diff <= target


def parse_precisions(text: str) -> list[str]:
    """ "bf16,fp8,int4" -> ["bf16", "fp8", "int4"].

    Raises:
        InvalidParameterError: an unknown, repeated or empty name.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PRECISIONS]
    if not names or bad or len(set(names)) != len(names):
        raise InvalidParameterError(
            "quantization", f"give distinct names among {', '.join(PRECISIONS)}, got {text!r}"
        )
    return names


def add_perplexity_args(p: argparse.ArgumentParser) -> None:
    """Add the `sits bench perplexity` flags."""
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument(
        "--quantization",
        default="bf16,fp8,int4",
        help="comma-separated precisions to score: bf16 (unquantized), fp8, int4 (all three)",
    )
    p.add_argument(
        "--max-tokens-per-file",
        type=int,
        default=None,
        metavar="N",
        help="score only the first N targets of each file (default: all)",
    )
    p.add_argument(
        "--max-files", type=int, default=None, metavar="N", help="first N held-out files only"
    )
    p.add_argument(
        "--stdlib-dir", default=None, help="standard library to read (default: this Python's)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="run dtype (default: the checkpoint's)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None, help="context (default: the model's)")
    p.add_argument(
        "--output-json",
        "--result-json",
        dest="output_json",
        default=None,
        metavar="FILE",
        help="write the figures as JSON",
    )


def checkpoint_dtype(model_dir: str) -> str:
    """The checkpoint's dtype from config.json ("dtype", else "torch_dtype", else float32)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def run_perplexity_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark of the parsed flags; returns the result document (module docstring).

    Raises:
        InvalidParameterError: bad flags, or no held-out file found.
        ModelNotFoundError: --model cannot be resolved.
    """
    from sits.demo import ensure_demo_model
    from sits.engine.llm import LLM
    from sits.engine.tokenizer import Tokenizer
    from sits.models.loader import resolve_model_path

    precisions = parse_precisions(args.quantization)
    for name in ("max_tokens_per_file", "max_files"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidParameterError(name, f"--{name.replace('_', '-')} must be >= 1")
    model_dir = resolve_model_path(args.model or ensure_demo_model())
    stdlib_dir = str(Path(args.stdlib_dir or sysconfig.get_paths()["stdlib"]).resolve())
    files = held_out_files(stdlib_dir)[: args.max_files]
    if not files:
        raise InvalidParameterError("stdlib_dir", f"no held-out .py file under {stdlib_dir}")
    tokenizer = Tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    assert eos is not None, "the model's tokenizer has no EOS token"
    ids = [tokenizer.encode(f.text, add_special_tokens=False) for f in files]
    sequences = [framed_tokens(i, eos, args.max_tokens_per_file) for i in ids]
    dtype = args.dtype or checkpoint_dtype(model_dir)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command_line(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": {"model_dir": model_dir, "dtype": dtype},
        "stdlib_dir": stdlib_dir,
        "max_tokens_per_file": args.max_tokens_per_file,
        "files": [
            {"path": f.rel_path, "num_tokens": len(i) + 2, "num_scored_tokens": len(s) - 1}
            for f, i, s in zip(files, ids, sequences)
        ],
        "results": [],
    }
    for name in precisions:
        start_s = time.perf_counter()
        llm = LLM(
            model_dir,
            dtype=dtype,
            device=args.device,
            quantization=PRECISIONS[name],
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,
        )
        window_tokens = llm.max_model_len - 1
        nlls = [v for seq in score_sequences(llm, sequences, window_tokens) for v in seq]
        doc["model"].update(
            device=str(llm.engine_core.runner.device),
            max_model_len=llm.max_model_len,
            window_tokens=window_tokens,
        )
        doc["results"].append(
            {
                "precision": name,
                "quantization": PRECISIONS[name],
                "num_scored_tokens": len(nlls),
                "mean_nll": math.fsum(nlls) / len(nlls),
                "perplexity": perplexity(nlls),
                "elapsed_s": time.perf_counter() - start_s,
            }
        )
        del llm
        gc.collect()
    compare(doc["results"])
    return doc


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f} %"


def format_perplexity(doc: dict[str, Any], with_command: bool = True) -> str:
    """The printed report: command (unless printed already), machine, model, files, then a
    markdown table of one row per precision."""
    machine, model = doc["machine"], doc["model"]
    gpus = machine.get("gpus") or []
    lines = [f"Command: {doc['command']}"] if with_command else []
    files = doc["files"]
    num_scored = sum(f["num_scored_tokens"] for f in files)
    cap = doc["max_tokens_per_file"]
    lines += [
        f"Machine: {machine.get('cpu')} ({machine.get('num_cpus')} CPUs), "
        f"{f'{len(gpus)}x {gpus[0]}' if gpus else 'no GPU'}; torch {machine.get('torch')}, "
        f"Python {machine.get('python')}",
        f"Model: {model['model_dir']} ({model['dtype']} on {model.get('device', '?')}, "
        f"windows of {model.get('window_tokens', '?')} tokens)",
        f"Held-out files under {doc['stdlib_dir']}: {len(files)} files, {num_scored} scored "
        f"tokens ({'all tokens' if cap is None else f'at most {cap} per file'}):",
    ]
    lines += [f"  {f['path']}: {f['num_scored_tokens']} of {f['num_tokens']}" for f in files]
    rows = []
    for r in doc["results"]:
        target = r["target"]
        met = {None: "-", True: "yes", False: "**no**"}[r["met"]]
        rows.append(
            [
                r["precision"],
                str(r["num_scored_tokens"]),
                f"{r['mean_nll']:.4f}",
                f"{r['perplexity']:.3f}",
                _pct(r["relative_diff_vs_bf16"]),
                "-" if target is None else f"<= +{100 * target:.0f} %",
                met,
                f"{r['elapsed_s']:.1f}",
            ]
        )
    lines.append("")
    headers = ["precision", "tokens", "mean NLL (nats)", "perplexity", "vs bf16", "target"]
    lines += markdown_table([*headers, "met", "time (s)"], rows)
    return "\n".join(lines)


def run_perplexity(args: argparse.Namespace) -> int:
    """`sits bench perplexity`: run, print the report, write --output-json; exit code 0."""
    print(f"Command: {command_line()}", flush=True)
    doc = run_perplexity_benchmark(args)
    print(format_perplexity(doc, with_command=False))
    write_json(args.output_json, doc)
    return 0
