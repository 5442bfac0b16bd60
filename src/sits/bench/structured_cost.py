"""The throughput cost of structured outputs: one engine, the same prompts, run with 0 % and
with `--constrained-fraction` (10 %) of the requests under a JSON schema.

Workload: `--num-prompts` prompts of `--input-len` random token ids, each generating up to
`--output-len` tokens (greedy, `ignore_eos`), all queued at once; in the constrained pass every
k-th request (k = 1 / fraction) carries the `--schema` JSON schema (default: an object holding
an array of records, long enough that a random model rarely ends it early). A warm-up runs
first (up to 32 requests, a quarter of them constrained), so the grammar's compile (cached by
schema) and the first masks are not timed. The passes alternate `--repeats` times; each row
is one pass. Reported per pass: output tokens (a constrained request may end before
output_len when its grammar does), wall seconds, output tok/s, and the ratio to the mean of
the 0 % passes.

Where the cost comes from: each step, each constrained row's matcher fills its token bitmask
on the host and the mask is applied to its logits row (`sits.sampling.structured`), and a
step holding a constrained row is not launched ahead under `--async-scheduling`.

Tokenizer: the mask covers the tokenizer's vocabulary, so the cost depends on it. A model
directory's own tokenizer is used (or `--tokenizer`); a `--random-weights` shape has none, so
a synthetic byte-level vocabulary of the shape's full size is written (seeded random words of
2-10 characters, the shape's EOS ids as special tokens) and used instead.

Examples:
```
# CPU, the built-in demo model
python bench/structured_cost.py --model src/sits/demo_model --num-prompts 40 --input-len 64 \
    --output-len 32
# H200, the qwen3-30b-a3b shape with random weights
python bench/structured_cost.py --random-weights qwen3-30b-a3b --num-prompts 512 \
    --input-len 512 --output-len 256 --repeats 2
```
JSON (`--output-json`, schema "sits.bench.structured_cost/1"): the `base_doc` head plus
"workload" and "passes" (one object per row).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import string
import time
from typing import Any

from sits.bench.offline_common import (
    add_offline_args,
    base_doc,
    header_lines,
    markdown_table,
    offline_setup,
    random_prompts,
    write_json,
)
from sits.bench.report import command_line
from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import SamplingParams
from sits.core.structured_outputs import StructuredOutputsParams

SCHEMA_NAME = "sits.bench.structured_cost/1"
DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "score": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["id", "name", "score", "tags"],
            },
        }
    },
    "required": ["records"],
}
_WARMUP_SEED_OFFSET = 1_000_003
_WORD_CHARS = string.ascii_letters + string.digits + "_.,:;(){}[]\"'-+=*/#"


def build_parser() -> argparse.ArgumentParser:
    """The flags: the offline benchmarks' (engine, --random-weights, lengths) and these."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_args(p, input_len=256, output_len=128)
    p.add_argument("--num-prompts", type=int, default=256, help="requests per pass (256)")
    p.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.1,
        help="share of the requests under the schema in the constrained pass (0.1)",
    )
    p.add_argument("--repeats", type=int, default=1, help="times each pass runs, alternating")
    p.add_argument(
        "--schema", default=None, metavar="FILE", help="JSON schema file (default: built in)"
    )
    return p


def synthetic_tokenizer(vocab_size: int, eos_token_ids: list[int], seed: int = 0) -> str:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids saved under the sits cache (made
    once per size and EOS ids); returns its directory. The EOS ids are special tokens, the
    other ids the 256 byte symbols first, then distinct random words (some with a leading
    space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sits.config import sits_cache_dir

    eos_key = "-".join(map(str, eos_token_ids))
    out_dir = os.path.join(sits_cache_dir(), "tokenizers", f"bytes-{vocab_size}-eos-{eos_key}")
    if os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        return out_dir
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), reverse=True)
    specials = {i: f"<|eos_{i}|>" for i in eos_token_ids}
    rng = random.Random(seed)
    vocab: dict[str, int] = {}
    for token_id in range(vocab_size):
        if token_id in specials:
            vocab[specials[token_id]] = token_id
            continue
        word = byte_chars.pop() if byte_chars else ""
        while not word or word in vocab:
            word = "".join(rng.choices(_WORD_CHARS, k=rng.randint(2, 10)))
            word = ("Ġ" + word) if rng.random() < 0.4 else word
        vocab[word] = token_id
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(specials.values()))
    first_eos = specials[eos_token_ids[0]] if eos_token_ids else None
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=first_eos).save_pretrained(out_dir)
    return out_dir


def _eos_ids(model_dir: str) -> list[int]:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _params(num: int, fraction: float, output_len: int, spec: StructuredOutputsParams):
    """`num` params, every round(1 / fraction)-th constrained (none for fraction 0)."""
    every = round(1 / fraction) if fraction > 0 else 0
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=output_len,
            ignore_eos=True,
            structured_outputs=spec if every and i % every == every - 1 else None,
        )
        for i in range(num)
    ]


def _run_pass(llm: Any, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start_s = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start_s
    constrained = [p.structured_outputs is not None for p in params]
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    return {
        "num_constrained": sum(constrained),
        "num_output_tokens": sum(counts),
        "num_constrained_tokens": sum(c for c, k in zip(counts, constrained) if k),
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": sum(counts) / elapsed_s,
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the passes of the parsed flags; returns the result document.

    Raises:
        InvalidParameterError: bad flags.
    """
    from sits.engine.llm import LLM

    if args.num_prompts < 1 or args.repeats < 1 or not 0 < args.constrained_fraction <= 1:
        raise InvalidParameterError(
            "constrained_fraction",
            "--num-prompts and --repeats must be >= 1, --constrained-fraction in (0, 1]",
        )
    setup = offline_setup(args)
    config = setup.config
    if config.tokenizer is None and not os.path.isfile(
        os.path.join(setup.model_dir, "tokenizer.json")
    ):
        tokenizer = synthetic_tokenizer(setup.vocab_size, _eos_ids(setup.model_dir), args.seed)
        config = dataclasses.replace(config, tokenizer=tokenizer)
    schema = DEFAULT_SCHEMA
    if args.schema is not None:
        with open(args.schema, encoding="utf-8") as f:
            schema = json.load(f)
    spec = StructuredOutputsParams(json=schema)
    llm = LLM(**dataclasses.asdict(config))
    num_warmup = min(args.num_prompts, 32)
    warmup = random_prompts(
        num_warmup, args.input_len, setup.vocab_size, args.seed + _WARMUP_SEED_OFFSET
    )
    llm.generate(
        [{"prompt_token_ids": p} for p in warmup],
        _params(num_warmup, 0.25, min(args.output_len, 8), spec),
        use_tqdm=False,
    )
    prompts = random_prompts(args.num_prompts, args.input_len, setup.vocab_size, args.seed)
    passes = []
    for repeat in range(args.repeats):
        for fraction in (0.0, args.constrained_fraction):
            params = _params(args.num_prompts, fraction, args.output_len, spec)
            passes.append(
                {"repeat": repeat, "fraction": fraction} | _run_pass(llm, prompts, params)
            )
    doc = base_doc(SCHEMA_NAME, dataclasses.replace(setup, config=config), llm)
    doc["workload"] = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "constrained_fraction": args.constrained_fraction,
        "repeats": args.repeats,
        "async_scheduling": config.async_scheduling,
        "tokenizer": config.tokenizer or setup.model_dir,
        "schema": schema,
        "seed": args.seed,
    }
    doc["passes"] = passes
    return doc


def format_report(doc: dict[str, Any]) -> str:
    """The printed report (the command was printed first): machine, model, workload, table."""
    w = doc["workload"]
    lines = header_lines(doc, with_command=False)
    lines.append(
        f"Workload: {w['num_prompts']} prompts x {w['input_len']} in / up to {w['output_len']} "
        f"out (greedy, ignore_eos), {100 * w['constrained_fraction']:.0f} % under a JSON schema "
        f"in the constrained passes; async scheduling {'on' if w['async_scheduling'] else 'off'}; "
        f"tokenizer {w['tokenizer']}"
    )
    base = [p["output_tokens_per_s"] for p in doc["passes"] if p["fraction"] == 0.0]
    base_tok_s = sum(base) / len(base)
    rows = [
        [
            f"{100 * p['fraction']:.0f} %",
            str(p["repeat"]),
            f"{p['num_constrained']}",
            f"{p['num_output_tokens']} ({p['num_constrained_tokens']} constrained)",
            f"{p['elapsed_s']:.2f}",
            f"{p['output_tokens_per_s']:.1f}",
            f"{p['output_tokens_per_s'] / base_tok_s:.3f}",
        ]
        for p in doc["passes"]
    ]
    headers = ["constrained", "repeat", "requests", "output tokens", "s", "output tok/s",
               "vs 0 %"]  # fmt: skip
    return "\n".join(lines + [""] + markdown_table(headers, rows))


def main(argv: list[str] | None = None) -> int:
    """`python bench/structured_cost.py [flags]`: run, print, write --output-json."""
    args = build_parser().parse_args(argv)
    print(f"Command: {command_line()}", flush=True)
    doc = run_benchmark(args)
    print(format_report(doc))
    write_json(args.output_json, doc)
    return 0
