"""`sits generate`: run one prompt through the offline engine and print the completion."""

from __future__ import annotations

import argparse
import json

from sits.engine.arg_utils import add_engine_args, engine_kwargs


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sits generate`."""
    p = subparsers.add_parser("generate", help="generate a completion for a prompt offline")
    add_engine_args(p, model_required=False)
    p.add_argument("--prompt", required=True, action="append", help="prompt text (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of the request")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON with token ids")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Load the model, generate for each prompt, print the text (or JSON)."""
    from sits import LLM, SamplingParams
    from sits.demo import DEMO_MODEL_NAME, ensure_demo_model

    kwargs = engine_kwargs(args)
    if kwargs["model"] in (None, DEMO_MODEL_NAME):  # no model: the built-in demo model
        kwargs["model"] = ensure_demo_model()
    llm = LLM(**kwargs)
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
    return 0
