"""Write a calibrated copy of a `--tenants-mix` file from a measured capacity (issue 6).

The capacity C (requests/s) is the FCFS run's request throughput in a `sits bench qos
--result-json` document of bench/qos/capacity.toml. The guaranteed tenant (first tenant of the
mix) gets G = --guaranteed-share x C, every other tenant an equal part of
--flood-factor x (C - G), the target's "3x the remaining capacity".

Usage: python bench/qos/calibrate.py CAPACITY_JSON MIX_TOML OUT_TOML
           [--guaranteed-share 0.3] [--flood-factor 3] [--duration-s S]
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib


def capacity_of(doc: dict) -> float:
    """Request throughput (req/s) of the capacity run's FCFS mode."""
    return float(doc["runs"]["fcfs"]["totals"]["request_throughput"])


def calibrated_rates(
    capacity: float, num_tenants: int, guaranteed_share: float, flood_factor: float
) -> list[float]:
    """[G, flood share, ...]: G = share x C, the others split flood x (C - G) equally."""
    guaranteed = guaranteed_share * capacity
    others = flood_factor * (capacity - guaranteed) / max(1, num_tenants - 1)
    return [guaranteed] + [others] * (num_tenants - 1)


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("capacity_json")
    p.add_argument("mix_toml")
    p.add_argument("out_toml")
    p.add_argument("--guaranteed-share", type=float, default=0.3)
    p.add_argument("--flood-factor", type=float, default=3.0)
    p.add_argument("--duration-s", type=float, default=None, help="send for S seconds")
    args = p.parse_args(argv)
    with open(args.capacity_json) as f:
        capacity = capacity_of(json.load(f))
    with open(args.mix_toml, "rb") as f:
        mix = tomllib.load(f)
    tenants = mix["tenants"]
    if args.duration_s is not None:
        mix["defaults"] = {**mix.get("defaults", {}), "duration_s": args.duration_s}
        tenants = [{k: v for k, v in t.items() if k not in ("duration_s", "num_prompts")}
                   for t in tenants]  # fmt: skip
    rates = calibrated_rates(capacity, len(tenants), args.guaranteed_share, args.flood_factor)
    lines = [f"# calibrated from {args.capacity_json}: capacity {capacity:.3f} req/s", ""]
    if "defaults" in mix:
        lines.append("[defaults]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in mix["defaults"].items()]
        lines.append("")
    for tenant, rate in zip(tenants, rates):
        lines.append("[[tenants]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in {**tenant, "request_rate": rate}.items()]
        lines.append("")
    with open(args.out_toml, "w") as f:
        f.write("\n".join(lines))
    print(f"capacity {capacity:.3f} req/s -> rates " + ", ".join(f"{r:.3f}" for r in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
