"""Combine single-mode `sits bench qos --result-json` files into one QoS / FCFS comparison.

`bench/gpu_check.sh` runs the issue-6 mix's two halves in two lanes (one GPU each, same mix,
same seed): `qos` writes qos_qos.json, `qos_fcfs` writes qos_fcfs.json. This prints the same
side-by-side table and throughput ratio as a two-mode `sits bench qos` run.

Usage: python bench/qos/combine.py QOS_JSON FCFS_JSON [--result-json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

from sits.bench.qos_compare import compare, format_comparison


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="single-mode result files, in the table's order")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    docs = {}
    for path in args.runs:
        with open(path) as f:
            doc = json.load(f)
        docs.update(doc["runs"])
    comparison = compare(docs)
    print(format_comparison(comparison, list(docs)))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({**comparison, "runs": docs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
