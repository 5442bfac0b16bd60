"""`sits bench qos`: one tenant mix against sits with QoS on and off (plain FCFS), side by side.

For each mode in order it starts `sits serve` on the model (`sits.bench.server_proc`), runs the
same `--tenants-mix` workload (same seed: same arrivals and prompts) with `sits bench serve`'s
runner, reads the server's /metrics (saved as `metrics-MODE.txt` in the log directory and
summarized as its "server view", `sits.bench.server_view`), stops the server, and finally
prints per-tenant SLO attainment of both modes and the total output throughput ratio QoS /
FCFS (issue 6's target: the guaranteed tenant >= 99 % TTFT and TPOT attainment, and a ratio
>= 0.95).

Modes:
- `qos`: `sits serve --tenants FILE` (the server's tenants.toml: key hashes, tiers, SLOs).
- `fcfs`: `sits serve` without `--tenants` and without `--api-key`: one default tenant, no
  auth (every key the clients send is accepted), no admission limits, the scheduler's plain
  first-come-first-served order. `--fcfs-tenants FILE` runs FCFS with a tenants file instead
  (e.g. every tenant best_effort with weight 1), when keys must be checked.
Run: `sits bench qos --model M --tenants tenants.toml --tenants-mix mix.toml`, or
`python -m sits.bench.qos_compare ...`, or `python bench/qos_compare.py ...` from a checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sits.bench.report import command_line, format_report, machine_info
from sits.bench.serve import add_workload_args, config_from_args, run_config, write_json
from sits.bench.server_proc import SitsServer
from sits.bench.server_view import ServerView, format_view, scrape, summarize
from sits.config import OPENAI_API_KEY_ENV, env_values
from sits.core.errors import InvalidParameterError, SitsError

SCHEMA = "sits.bench.qos/1"
MODE_NAMES = ("qos", "fcfs")
_KEYS = ("ttft_attainment_pct", "tpot_attainment_pct", "slo_attainment_pct", "goodput",
         "output_throughput", "failed_429", "failed_503", "failed_other")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ServerMode:
    """One server configuration of the comparison.

    Attributes:
        name: "qos" or "fcfs" (the labels of the comparison).
        serve_args: `sits serve` flags of this mode only (e.g. `("--tenants", FILE)`).
    """

    name: str
    serve_args: tuple[str, ...]


def make_modes(
    names: Sequence[str], tenants_path: str | None, fcfs_tenants_path: str | None = None
) -> list[ServerMode]:
    """The modes to run, in order (see the module docstring for each).

    Raises:
        InvalidParameterError: an unknown mode, or `qos` without a tenants file.
    """
    modes = []
    for name in names:
        if name == "qos":
            if not tenants_path:
                raise InvalidParameterError("tenants", "the qos mode needs --tenants FILE")
            modes.append(ServerMode("qos", ("--tenants", tenants_path)))
        elif name == "fcfs":
            extra = ("--tenants", fcfs_tenants_path) if fcfs_tenants_path else ()
            modes.append(ServerMode("fcfs", extra))
        else:
            raise InvalidParameterError("modes", f"unknown mode {name!r}; use {MODE_NAMES}")
    return modes


def _pick(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: summary[key] for key in _KEYS}


def output_throughput_while_offered(doc: dict[str, Any]) -> float | None:
    """Output tokens per second received while the load was offered: from the run's start to
    the last request's scheduled arrival.

    The whole-run figure (`output_throughput`) divides by each run's own duration, which
    includes draining its backlog: an FCFS run that queued a minute of work runs twice as long
    as a QoS run that shed it, so the ramp-up and the final drain weigh differently in the two.
    This figure compares both over the same window. Each content chunk of a successful request
    counts output_tokens / num_chunks tokens at the time it arrived.

    Returns:
        tok/s, or None without per-request records or with every arrival at 0.
    """
    requests = doc.get("requests") or []
    end_ms = max((r["arrival_ms"] for r in requests), default=0.0)
    if end_ms <= 0:
        return None
    num_tokens = 0.0
    for r in requests:
        if not r["ok"] or r["ttft_ms"] is None or not r["num_chunks"]:
            continue
        per_chunk = r["output_tokens"] / r["num_chunks"]
        at_ms = r["start_ms"] + r["ttft_ms"]
        for gap_ms in (0.0, *r["itl_ms"]):
            at_ms += gap_ms
            if at_ms > end_ms:
                break
            num_tokens += per_chunk
    return num_tokens / (end_ms / 1000.0)


def _ratio(totals: dict[str, dict[str, Any]], key: str) -> float | None:
    if "qos" not in totals or "fcfs" not in totals:
        return None
    qos, fcfs = totals["qos"][key], totals["fcfs"][key]
    return None if qos is None or not fcfs else qos / fcfs


def compare(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per-tenant and total figures of every mode, and the QoS / FCFS output throughput ratio.

    Args:
        docs: mode name -> that run's `sits.bench.serve/1` document (same tenants in each).

    Returns:
        {"tenants": [{"name", <mode>: {attainments, goodput, throughput, failures}}],
         "totals": {<mode>: {..., "output_throughput_while_offered"}},
         "output_throughput_ratio": float | None, "output_throughput_ratio_while_offered":
         float | None} where the ratios are qos / fcfs output tok/s over each whole run (the
         issue's figure) and over the window the load was offered
         (`output_throughput_while_offered`); None unless both ran and FCFS produced tokens.
    """
    first = next(iter(docs.values()))
    tenants = []
    for index, tenant in enumerate(first["tenants"]):
        row: dict[str, Any] = {"name": tenant["name"]}
        for mode, doc in docs.items():
            row[mode] = _pick(doc["tenants"][index]["summary"])
        tenants.append(row)
    totals = {
        mode: {
            **_pick(doc["totals"]),
            "output_throughput_while_offered": output_throughput_while_offered(doc),
        }
        for mode, doc in docs.items()
    }
    return {
        "tenants": tenants,
        "totals": totals,
        "output_throughput_ratio": _ratio(totals, "output_throughput"),
        "output_throughput_ratio_while_offered": _ratio(totals, "output_throughput_while_offered"),
    }


def _cell(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_comparison(comparison: dict[str, Any], modes: Sequence[str]) -> str:
    """The side-by-side table: per tenant, one column per figure holding every mode's value
    separated by "/" in `modes` order (e.g. "99.8/41.0" for qos/fcfs)."""
    metrics = (("TTFT %", "ttft_attainment_pct", 1), ("TPOT %", "tpot_attainment_pct", 1),
               ("both %", "slo_attainment_pct", 1), ("goodput r/s", "goodput", 2),
               ("out tok/s", "output_throughput", 1), ("429", "failed_429", None),
               ("503", "failed_503", None))  # fmt: skip
    width = 4 + 6 * len(modes)
    header = f"{'tenant':<14}" + "".join(f"{label:>{width}}" for label, _, _ in metrics)
    title = f" QoS comparison: {' / '.join(modes)} (same tenant mix and seed) "
    lines = [title.center(len(header), "="), header]
    rows = [(t["name"], t) for t in comparison["tenants"]]
    rows.append(("TOTAL", comparison["totals"]))
    for name, row in rows:
        cells = []
        for _, key, digits in metrics:
            values = [row[m][key] for m in modes]
            text = "/".join(str(v) if digits is None else _cell(v, digits) for v in values)
            cells.append(f"{text:>{width}}")
        lines.append(f"{name:<14}" + "".join(cells))
    ratio = comparison["output_throughput_ratio"]
    if ratio is not None:
        lines.append(f"total output throughput QoS / FCFS: {ratio:.3f}")
    ratio = comparison.get("output_throughput_ratio_while_offered")
    if ratio is not None:
        totals = comparison["totals"]
        lines.append(
            f"output throughput while the load was offered QoS / FCFS: {ratio:.3f} "
            f"({totals['qos']['output_throughput_while_offered']:.1f} / "
            f"{totals['fcfs']['output_throughput_while_offered']:.1f} tok/s)"
        )
    return "\n".join(lines)


def run_modes(
    args: argparse.Namespace, modes: Sequence[ServerMode], log_dir: Path, command: str
) -> dict[str, dict[str, Any]]:
    """Start the server of each mode, run the workload against it, stop it; mode -> document."""
    common = shlex.split(args.serve_args or "")
    docs: dict[str, dict[str, Any]] = {}
    for mode in modes:
        log_path = log_dir / f"serve-{mode.name}.log"
        print(f"[{mode.name}] starting sits serve {shlex.join([*common, *mode.serve_args])} "
              f"(log {log_path})", flush=True)  # fmt: skip
        server = SitsServer(args.server_model, [*common, *mode.serve_args], log_path,
                            startup_timeout_s=args.startup_timeout_s)  # fmt: skip
        with server:
            config = config_from_args(
                args, env_values(OPENAI_API_KEY_ENV), base_url=server.base_url
            )
            doc = run_config(config, f"{command}  # mode {mode.name}", gpu_info=False)
            view = _server_view(server.base_url, log_dir / f"metrics-{mode.name}.txt")
        doc["mode"] = {"name": mode.name, "serve_args": [*common, *mode.serve_args]}
        print(format_report(doc), flush=True)
        if view is not None:
            doc["server_view"] = dataclasses.asdict(view)
            print(format_view(view, mode.name), flush=True)
        docs[mode.name] = doc
    return docs


def _server_view(base_url: str, path: Path) -> ServerView | None:
    """The server's /metrics after the load, saved to `path` and summarized; None (with a
    note) when the server did not answer."""
    try:
        text = scrape(base_url)
    except httpx.HTTPError as exc:
        print(f"could not read {base_url}/metrics: {exc}", flush=True)
        return None
    path.write_text(text)
    return summarize(text)


def run_qos(args: argparse.Namespace) -> int:
    """Run `sits bench qos` with parsed flags; 0 when every mode completed some request."""
    if not args.tenants_mix:
        raise InvalidParameterError("tenants_mix", "sits bench qos needs --tenants-mix FILE")
    names = [n.strip() for n in args.modes.split(",") if n.strip()]
    modes = make_modes(names, args.tenants, args.fcfs_tenants)
    command = getattr(args, "command_line", None) or command_line()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sits-bench-qos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    docs = run_modes(args, modes, log_dir, command)
    comparison = compare(docs)
    print(format_comparison(comparison, [m.name for m in modes]))
    if args.result_json:
        date = datetime.datetime.fromtimestamp(started, datetime.UTC)
        write_json(
            {
                "schema": SCHEMA,
                "command": command,
                "date": date.isoformat(timespec="seconds"),
                "machine": machine_info(include_gpu=args.gpu_info),
                "model": args.server_model,
                **comparison,
                "runs": docs,
            },
            args.result_json,
        )
        print(f"result written to {args.result_json}")
    return 0 if all(doc["totals"]["completed"] > 0 for doc in docs.values()) else 1


def add_qos_args(p: argparse.ArgumentParser) -> None:
    """Add the `sits bench qos` flags (the workload flags of `sits bench serve` included)."""
    p.add_argument(
        "--model",
        dest="server_model",
        required=True,
        help="checkpoint or model id for `sits serve`",
    )
    p.add_argument(
        "--tenants", default=None, metavar="FILE", help="the server's tenants.toml for the qos mode"
    )
    p.add_argument(
        "--fcfs-tenants",
        default=None,
        metavar="FILE",
        help="run the fcfs mode with this tenants file (default: no --tenants, no auth)",
    )
    p.add_argument("--modes", default="qos,fcfs", help="modes to run, in order (qos,fcfs)")
    p.add_argument(
        "--serve-args",
        default="",
        help="extra `sits serve` flags for both modes, one string (e.g. "
        '"--dtype bfloat16 --max-num-seqs 64")',
    )
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--log-dir", default=None, help="server logs (default: a new temp dir)")
    add_workload_args(p, include_model=False)  # fmt: skip
    p.set_defaults(model=None)  # the benchmark sends the name the server lists


def main(argv: list[str] | None = None) -> int:
    """`python -m sits.bench.qos_compare ...` (the flags of `sits bench qos`)."""
    parser = argparse.ArgumentParser(
        prog="sits bench qos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_qos_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_qos(args)
    except SitsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
