"""`sits bench serve`: the online serving benchmark against any OpenAI-compatible server.

`add_serve_bench_args(parser)` declares the flags (vLLM's `benchmark_serving` names where
they exist), `config_from_args` turns them into a `ServeBenchConfig`, and `run_serve_bench`
runs, prints the report and writes `--result-json`. The API key falls back to
$OPENAI_API_KEY, read at run time. Exit code: 0 when at least one request completed, 1 when
none did, 2 (from the CLI) for bad flags or an unreachable server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

from sits.bench.client import COMPLETIONS, ENDPOINTS, quiet_http_logs
from sits.bench.mix import load_tenants_mix
from sits.bench.probe import PROMPT_FORMATS
from sits.bench.report import build_result, command_line, format_report, machine_info
from sits.bench.runner import ServeBenchConfig, run_serve_benchmark
from sits.bench.workload import DEFAULT_TENANT, TenantLoad
from sits.config import OPENAI_API_KEY_ENV, env_values
from sits.core.errors import SitsError

DESCRIPTION = (
    "Send Poisson-timed streamed requests to an OpenAI-compatible server and report "
    "TTFT/TPOT/ITL/E2E percentiles, throughput, SLO attainment and goodput."
)


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    """Add the `sits bench serve` flags to a parser."""
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)",
    )
    add_workload_args(p)


def add_workload_args(p: argparse.ArgumentParser, include_model: bool = True) -> None:
    """Add every `sits bench serve` flag but --base-url (shared with `sits bench qos`, which
    has its own --model and passes `include_model=False`)."""
    p.add_argument("--endpoint", default=COMPLETIONS, choices=ENDPOINTS)
    if include_model:
        p.add_argument(
            "--model", default=None, help="model name to send (default: the first listed)"
        )
    p.add_argument("--api-key", default=None, help=f"bearer key (default ${OPENAI_API_KEY_ENV})")
    p.add_argument(
        "--dataset",
        default="random",
        choices=["random"],
        help="prompt source: random tokens or words (see --prompt-format)",
    )
    p.add_argument(
        "--prompt-format",
        default="auto",
        choices=PROMPT_FORMATS,
        help="token-ids: exact-length id prompts via /tokenize (completions only); "
        "text: random words sized by probing the server; auto: ids when possible",
    )
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean requests/s of the Poisson arrivals; inf sends all at once",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps (1 = Poisson, < 1 burstier)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes the requests are spread over (default 1): one Python process "
        "parses every streamed event, and past a few thousand events per second its own lag "
        "(the report's 'Client loop lag') shows up in the latencies it measures",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals and prompts")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send vLLM's ignore_eos so each request makes exactly --output-len tokens",
    )
    p.add_argument(
        "--no-stream-usage",
        dest="stream_usage",
        action="store_false",
        help="do not send stream_options.include_usage (count chunks as tokens)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    p.add_argument(
        "--tenants-mix",
        default=None,
        metavar="FILE",
        help="TOML list of client tenants (keys, rates, lengths, SLOs); the flags "
        "above are the defaults of fields a tenant leaves out",
    )
    p.add_argument("--request-timeout-s", type=float, default=3600.0)
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="untimed copies of the first request sent first; a failure stops the "
        "run before timing (default 1, 0 = none)",
    )
    p.add_argument("--result-json", default=None, metavar="PATH", help="write the JSON result")
    p.add_argument("--no-gpu-info", dest="gpu_info", action="store_false",
                   help="do not import torch to name the GPU in the report")  # fmt: skip


def fallback_tenant(args: argparse.Namespace, api_key: str | None) -> TenantLoad:
    """The one tenant of a plain run, and the defaults of a tenants mix, from the flags."""
    return TenantLoad(
        name=DEFAULT_TENANT,
        api_key=api_key,
        request_rate=args.request_rate,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        ttft_ms=args.slo_ttft_ms,
        tpot_ms=args.slo_tpot_ms,
        burstiness=args.burstiness,
    )


def config_from_args(
    args: argparse.Namespace, environ: dict[str, str], base_url: str | None = None
) -> ServeBenchConfig:
    """The run's configuration from parsed flags (`base_url` overrides --base-url).

    Raises:
        InvalidParameterError: a flag or the tenants-mix file is invalid.
    """
    api_key = args.api_key if args.api_key is not None else environ.get(OPENAI_API_KEY_ENV) or None
    fallback = fallback_tenant(args, api_key)
    tenants = (
        [fallback] if args.tenants_mix is None else load_tenants_mix(args.tenants_mix, fallback)
    )
    return ServeBenchConfig(
        base_url=args.base_url if base_url is None else base_url,
        tenants=tuple(tenants),
        endpoint=args.endpoint,
        model=args.model,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        prompt_format=args.prompt_format,
        stream_usage=args.stream_usage,
        request_timeout_s=args.request_timeout_s,
        tenants_mix=args.tenants_mix,
        warmup_requests=args.warmup_requests,
        client_procs=args.client_procs,
    )


def run_config(config: ServeBenchConfig, command: str, gpu_info: bool = True) -> dict[str, Any]:
    """Run one benchmark and return its JSON document (nothing printed)."""
    result = asyncio.run(run_serve_benchmark(config))
    return build_result(result, command, machine_info(include_gpu=gpu_info))


def write_json(doc: dict[str, Any], path: str) -> None:
    """Write a result document (indented, keys in schema order)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run `sits bench serve` with parsed flags; returns the exit code (see module)."""
    quiet_http_logs()  # the server's health polls too
    config = config_from_args(args, env_values(OPENAI_API_KEY_ENV))
    command = getattr(args, "command_line", None) or command_line()
    doc = run_config(config, command, gpu_info=args.gpu_info)
    print(format_report(doc))
    if args.result_json:
        write_json(doc, args.result_json)
        print(f"result written to {args.result_json}")
    return 0 if doc["totals"]["completed"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m sits.bench.serve ...` (the flags of `sits bench serve`)."""
    parser = argparse.ArgumentParser(prog="sits bench serve", description=DESCRIPTION)
    add_serve_bench_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve_bench(args)
    except SitsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
