"""`sits bench serve | qos`: benchmarks from the command line (code in `sits.bench`).

- `serve`: online serving benchmark against any OpenAI-compatible server (Poisson arrivals,
  TTFT/TPOT/ITL/E2E percentiles, throughput, goodput, per-tenant SLO attainment with
  `--tenants-mix`); see `sits.bench.serve`.
- `qos`: starts `sits serve` with and without tenant QoS and runs the same tenant mix against
  both; see `sits.bench.qos_compare`.
- `throughput`: offline throughput of `LLM.generate` (optionally beside transformers'
  `generate_batch` on the same weights); see `sits.bench.offline`.
- `latency`: TTFT and TPOT of one fixed batch, timed on the engine's steps; see
  `sits.bench.latency`.
- `perplexity`: perplexity of the held-out stdlib files under bf16, fp8 and int4 weights;
  see `sits.bench.perplexity`.
- `precision-switch`: the runtime precision switch under load through `AsyncLLM`: each
  switch's delay to its first step and output tok/s per precision; see
  `sits.bench.precision_switch`.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` with its subcommands to an argparse subparsers object; returns its parser."""
    from sits.bench import latency, offline, perplexity, precision_switch
    from sits.bench.qos_compare import add_qos_args, run_qos
    from sits.bench.serve import DESCRIPTION, add_serve_bench_args, run_serve_bench

    p = subparsers.add_parser(
        "bench",
        help="benchmarks (online serving, QoS comparison, offline throughput, latency, perplexity)",
    )
    sub = p.add_subparsers(
        dest="bench_command",
        required=True,
        metavar="{serve,qos,throughput,latency,perplexity,precision-switch}",
    )
    serve = sub.add_parser(
        "serve",
        help="online serving benchmark against an OpenAI-compatible server",
        description=DESCRIPTION,
    )
    add_serve_bench_args(serve)
    serve.set_defaults(func=run_serve_bench)
    qos = sub.add_parser(
        "qos",
        help="the same tenant mix against sits with QoS (--tenants) and plain FCFS",
        description="Start `sits serve` with --tenants and without, run one --tenants-mix "
        "workload against each, and print per-tenant SLO attainment side by side with the "
        "output throughput ratio QoS/FCFS.",
    )
    add_qos_args(qos)
    qos.set_defaults(func=run_qos)
    throughput = sub.add_parser(
        "throughput", help="offline throughput (LLM.generate)", description=offline.DESCRIPTION
    )
    offline.add_throughput_args(throughput)
    throughput.set_defaults(func=offline.run_throughput)
    latency_parser = sub.add_parser(
        "latency", help="fixed-batch TTFT and TPOT", description=latency.DESCRIPTION
    )
    latency.add_latency_args(latency_parser)
    latency_parser.set_defaults(func=latency.run_latency)
    ppl = sub.add_parser(
        "perplexity",
        help="held-out perplexity of bf16, fp8 and int4 weights",
        description=perplexity.DESCRIPTION,
    )
    perplexity.add_perplexity_args(ppl)
    ppl.set_defaults(func=perplexity.run_perplexity)
    switch = sub.add_parser(
        "precision-switch",
        help="the precision switch under load (delay, throughput per precision)",
        description=precision_switch.DESCRIPTION,
    )
    precision_switch.add_precision_switch_args(switch)
    switch.set_defaults(func=precision_switch.run_precision_switch)
    return p
