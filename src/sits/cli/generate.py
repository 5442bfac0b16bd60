"""`sits generate`: run one prompt through the offline engine and print the completion."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sits.cli.tp_check import check_tensor_parallel_fit
from sits.engine.arg_utils import add_engine_args, engine_kwargs


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sits generate`."""
    p = subparsers.add_parser(
        "generate",
        help="generate a completion for a prompt offline",
        description="Generate completions for prompts offline (no server), printing the text. "
        "With no --model, use the built-in demo model 'sits-demo' (shipped with sits, no "
        "download).",
    )
    add_engine_args(p, model_required=False)
    p.add_argument("--prompt", required=True, action="append", help="prompt text (repeatable)")
    p.add_argument(
        "--max-tokens",
        metavar="N",
        type=int,
        default=32,
        help="most tokens to generate per sample (default %(default)s)",
    )
    p.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        default=0.0,
        help="divides the logits before sampling; 0 = greedy, always the most likely token "
        "(default %(default)s)",
    )
    p.add_argument(
        "--top-p",
        metavar="P",
        type=float,
        default=1.0,
        help="nucleus sampling: sample among the most likely tokens whose probabilities add "
        "up to P, in (0, 1] (default %(default)s = all tokens)",
    )
    p.add_argument(
        "--top-k",
        metavar="K",
        type=int,
        default=0,
        help="sample among the K most likely tokens; 0 or -1 = all (default %(default)s)",
    )
    p.add_argument(
        "--n", type=int, default=1, help="samples per prompt, 1-128 (default %(default)s)"
    )
    p.add_argument(
        "--sampling-seed",
        metavar="SEED",
        type=int,
        default=None,
        help="seed of the request's own random generator: the same samples alone or batched "
        "(default: unseeded)",
    )
    p.add_argument(
        "--stop",
        metavar="TEXT",
        action="append",
        default=[],
        help="stop string, left out of the text (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print JSON with token ids")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Load the model, generate for each prompt, print the text (or JSON), then shut the
    engine down (with `--tensor-parallel-size` > 1: join its worker processes).

    Raises:
        SitsError: a refused flag, model or tensor-parallel size (`check_tensor_parallel_fit`,
            before any worker starts).
    """
    from sits import LLM
    from sits.config import EngineConfig
    from sits.demo import DEMO_MODEL_NAME, ensure_demo_model

    kwargs = engine_kwargs(args)
    if kwargs["model"] in (None, DEMO_MODEL_NAME):  # no model: the built-in demo model
        kwargs["model"] = ensure_demo_model()
    check_tensor_parallel_fit(EngineConfig(**kwargs))
    llm = LLM(**kwargs)
    try:
        _generate(llm, args)
    finally:
        llm.shutdown()
    return 0


def _generate(llm: Any, args: argparse.Namespace) -> None:
    """Print each prompt's samples (text and finish reason, or one JSON line each)."""
    from sits import SamplingParams

    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
    )
    for out in llm.generate(args.prompt, params):
        for sample in out.outputs:
            if args.json:
                record = {
                    "prompt": out.prompt,
                    "index": sample.index,
                    "text": sample.text,
                    "token_ids": sample.token_ids,
                    "finish_reason": sample.finish_reason,
                }
                print(json.dumps(record))
            else:
                print(f"{out.prompt}{sample.text}")
                print(f"[finish_reason={sample.finish_reason}, tokens={len(sample.token_ids)}]")
