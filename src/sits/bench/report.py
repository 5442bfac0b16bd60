"""The serving benchmark's result: a JSON document and the tables printed from it.

The printed report is rendered from the JSON document, so both always agree. Schema
`sits.bench.serve/1` (times in ms, rates per second, attainment in %):
```
{"schema": "sits.bench.serve/1", "command": str, "date": ISO-8601 UTC,
 "machine": {"hostname", "platform", "python", "cpu", "num_cpus", "torch", "gpus": [str]},
 "server": {"base_url", "endpoint", "model", "model_card": {...}},
 "config": {"seed", "max_concurrency", "ignore_eos", "prompt_format", "stream_usage",
            "request_timeout_s", "tenants_mix", "warmup_requests"},
 "prompts": {"mode": "token_ids" | "text", ...},
 "duration_s": float,
 "tenants": [{"name", "request_rate" (number or "inf"), "num_prompts", "duration_s",
              "input_len", "output_len", "ttft_ms", "tpot_ms", "burstiness",
              "summary": Summary}],
 "totals": Summary,
 "client_loop_lag_ms": {"p50", "p99", "max"} or null (the client's own event-loop lag),
 "client_connect_ms": {"p50", "p99", "max"} or null (send -> TCP connection up),
 "ttft_outside_server_ms": {"p50", "p99", "max"} or null (TTFT - the server's
     `openai-processing-ms`: connect, listen queue, network and client),
 "requests": [RequestRecord.to_json()]}
```
`Summary` is `sits.bench.metrics.Summary.to_json()`. API keys are never written.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import os
import platform
import shlex
import socket
import sys
from typing import Any

from sits.bench.metrics import summarize, summarize_by_tenant
from sits.bench.runner import RunResult
from sits.bench.sender import lag_summary
from sits.bench.workload import TenantLoad

SCHEMA = "sits.bench.serve/1"
_LAT_KEYS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(include_gpu: bool = True) -> dict[str, Any]:
    """Where the benchmark client ran: host, OS, Python, CPU, and the GPUs torch sees.

    torch is imported only here and only when installed and `include_gpu`; a missing or
    CPU-only torch gives `"gpus": []`.
    """
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "num_cpus": os.cpu_count(),
        "torch": None,
        "gpus": [],
    }
    if include_gpu and importlib.util.find_spec("torch") is not None:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _rate(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def tenant_json(tenant: TenantLoad) -> dict[str, Any]:
    """A tenant's workload as JSON (without its API key)."""
    return {
        "name": tenant.name,
        "request_rate": _rate(tenant.request_rate),
        "num_prompts": tenant.num_prompts if tenant.duration_s is None else None,
        "duration_s": tenant.duration_s,
        "input_len": tenant.input_len,
        "output_len": tenant.output_len,
        "ttft_ms": tenant.ttft_ms,
        "tpot_ms": tenant.tpot_ms,
        "burstiness": tenant.burstiness,
    }


def build_result(result: RunResult, command: str, machine: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a run (schema in the module docstring)."""
    config = result.config
    names = [t.name for t in config.tenants]
    per_tenant = summarize_by_tenant(result.records, result.duration_s, names)
    requests = [r.to_json() for r in result.records]
    date = datetime.datetime.fromtimestamp(result.started_at_unix_s, datetime.UTC)
    return {
        "schema": SCHEMA,
        "command": command,
        "date": date.isoformat(timespec="seconds"),
        "machine": machine,
        "server": {
            "base_url": config.base_url,
            "endpoint": config.endpoint,
            "model": result.model,
            "model_card": result.model_card,
        },
        "config": {
            "seed": config.seed,
            "max_concurrency": config.max_concurrency,
            "ignore_eos": config.ignore_eos,
            "prompt_format": config.prompt_format,
            "stream_usage": config.stream_usage,
            "request_timeout_s": config.request_timeout_s,
            "tenants_mix": config.tenants_mix,
            "warmup_requests": config.warmup_requests,
        },
        "prompts": result.prompts,
        "duration_s": result.duration_s,
        "tenants": [
            {**tenant_json(t), "summary": per_tenant[t.name].to_json()} for t in config.tenants
        ],
        "totals": summarize(result.records, result.duration_s).to_json(),
        "client_loop_lag_ms": result.client_loop_lag_ms,
        "client_connect_ms": lag_summary(
            [r["connect_ms"] for r in requests if r["connect_ms"] is not None]
        ),
        "ttft_outside_server_ms": outside_server_ms(requests),
        "requests": requests,
    }


def command_line() -> str:
    """The exact command that is running, shell-quoted (`python -m MODULE ...` when run as a
    module, where argv[0] would be the module's file)."""
    argv = _redact_secrets(list(sys.argv))
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and argv:
        argv = ["python", "-m", spec.name.removesuffix(".__main__"), *argv[1:]]
    return shlex.join(argv)


def fmt(value: float | None, digits: int = 2) -> str:
    """A number with `digits` decimals, or "-" for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def _machine_line(machine: dict[str, Any]) -> str:
    gpus = machine.get("gpus") or []
    if gpus:
        gpu = f"{len(gpus)}x {gpus[0]}"
    else:  # torch None: GPUs were not looked up (e.g. each mode of `sits bench qos`)
        gpu = "no GPU" if machine.get("torch") else "GPUs not queried"
    return f"{machine.get('cpu')} ({machine.get('num_cpus')} CPUs), {gpu}"


def _lag_cell(lag: dict[str, float] | None) -> str:
    if lag is None:
        return "-"
    return f"{fmt(lag['p50'], 1)} / {fmt(lag['p99'], 1)} / {fmt(lag['max'], 1)}"


def format_totals(doc: dict[str, Any]) -> list[str]:
    """The headline block and latency table of a run's JSON document."""
    t = doc["totals"]
    rows = [
        ("Command", doc["command"]),
        ("Machine", _machine_line(doc["machine"])),
        ("Server / model", f"{doc['server']['base_url']}{doc['server']['endpoint']}  "
                           f"{doc['server']['model']}"),
        ("Prompts", ", ".join(f"{k}={v}" for k, v in doc["prompts"].items())),
        ("Requests sent / completed", f"{t['num_requests']} / {t['completed']}"),
        ("Failed (429 / 503 / other)", f"{t['failed_429']} / {t['failed_503']} / "
                                       f"{t['failed_other']}"),
        ("Benchmark duration (s)", fmt(doc["duration_s"])),
        ("Total input / output tokens", f"{t['total_input_tokens']} / {t['total_output_tokens']}"),
        ("Request throughput (req/s)", fmt(t["request_throughput"])),
        ("Output token throughput (tok/s)", fmt(t["output_throughput"])),
        ("Total token throughput (tok/s)", fmt(t["total_token_throughput"])),
        ("SLO attainment TTFT/TPOT/both (%)", f"{fmt(t['ttft_attainment_pct'], 1)} / "
         f"{fmt(t['tpot_attainment_pct'], 1)} / {fmt(t['slo_attainment_pct'], 1)}"),
        ("Goodput (req/s)", fmt(t["goodput"])),
        ("Client loop lag p50/p99/max (ms)", _lag_cell(doc.get("client_loop_lag_ms"))),
        ("Client connect p50/p99/max (ms)", _lag_cell(doc.get("client_connect_ms"))),
        ("TTFT outside server p50/p99/max (ms)", _lag_cell(doc.get("ttft_outside_server_ms"))),
    ]  # fmt: skip
    lines = [" Serving Benchmark Result ".center(72, "=")]
    lines += [f"{label + ':':<40}{value}" for label, value in rows]
    lines.append(f"{'(ms)':<10}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for label, key in _LAT_KEYS:
        d = t[key]
        lines.append(
            f"{label:<10}{fmt(d['mean']):>12}{fmt(d['p50']):>12}{fmt(d['p90']):>12}"
            f"{fmt(d['p99']):>12}"
        )
    return lines


_TENANT_COLUMNS = (
    ("tenant", 14), ("sent", 6), ("ok", 6), ("429", 5), ("503", 5), ("other", 6),
    ("TTFT%", 7), ("TPOT%", 7), ("both%", 7), ("goodput", 8), ("out tok/s", 10),
    ("TTFT p50", 9), ("TTFT p99", 9), ("TPOT p50", 9), ("TPOT p99", 9), ("out p99", 9),
)  # fmt: skip


def outside_server_ms(requests: list[dict[str, Any]]) -> dict[str, float] | None:
    """p50, p99 and max (nearest rank) of TTFT minus the server's `openai-processing-ms` over
    `requests` (JSON records): what the request and its first bytes spent outside the server's
    app (connect, the accept queue, the network, the client). None when no record has both."""
    known = [
        r for r in requests if r.get("ttft_ms") is not None and r.get("processing_ms") is not None
    ]
    return lag_summary([r["ttft_ms"] - r["processing_ms"] for r in known])


def outside_server_p99_ms(requests: list[dict[str, Any]]) -> float | None:
    """The p99 of `outside_server_ms`, None when it is None."""
    summary = outside_server_ms(requests)
    return None if summary is None else summary["p99"]


def tenant_row(name: str, s: dict[str, Any], out_p99_ms: float | None = None) -> list[str]:
    """One per-tenant table row from a Summary's JSON, and the p99 of its requests' TTFT
    outside the server (`outside_server_p99_ms`)."""
    return [
        name, str(s["num_requests"]), str(s["completed"]), str(s["failed_429"]),
        str(s["failed_503"]), str(s["failed_other"]), fmt(s["ttft_attainment_pct"], 1),
        fmt(s["tpot_attainment_pct"], 1), fmt(s["slo_attainment_pct"], 1), fmt(s["goodput"]),
        fmt(s["output_throughput"], 1), fmt(s["ttft_ms"]["p50"], 1), fmt(s["ttft_ms"]["p99"], 1),
        fmt(s["tpot_ms"]["p50"], 1), fmt(s["tpot_ms"]["p99"], 1), fmt(out_p99_ms, 1),
    ]  # fmt: skip


def format_tenants(doc: dict[str, Any]) -> list[str]:
    """The per-tenant table (one row per tenant, then the totals)."""
    widths = [w for _, w in _TENANT_COLUMNS]
    header = "".join(f"{name:<{w}}" if i == 0 else f"{name:>{w}}"
                     for i, (name, w) in enumerate(_TENANT_COLUMNS))  # fmt: skip
    lines = [
        " Per tenant (attainment % of requests sent; latencies in ms; out: TTFT outside "
        "the server) ".center(72, "-"),
        header,
    ]
    requests = doc.get("requests", [])
    rows = [
        tenant_row(t["name"], t["summary"],
                   outside_server_p99_ms([r for r in requests if r["tenant"] == t["name"]]))
        for t in doc["tenants"]
    ]  # fmt: skip
    rows.append(tenant_row("TOTAL", doc["totals"], outside_server_p99_ms(requests)))
    for row in rows:
        cells = [f"{row[0]:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(row[1:], widths[1:])]
        lines.append("".join(cells))
    return lines


def format_report(doc: dict[str, Any]) -> str:
    """The whole printed report of a run's JSON document."""
    lines = format_totals(doc)
    if doc["config"]["tenants_mix"] is not None or len(doc["tenants"]) > 1:
        lines += format_tenants(doc)
    lines.append("=" * 72)
    return "\n".join(lines)


_SECRET_FLAGS = ("--api-key",)


def _redact_secrets(argv: list[str]) -> list[str]:
    """argv with the values of secret flags (API keys) replaced by "***"."""
    out = []
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append("***")
            redact_next = False
        elif arg in _SECRET_FLAGS:
            out.append(arg)
            redact_next = True
        elif arg.startswith(tuple(f"{flag}=" for flag in _SECRET_FLAGS)):
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
    return out
