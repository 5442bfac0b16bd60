"""`sits bench qos`: the side-by-side comparison math, and the driver's plumbing against real
`sits serve` subprocesses on the tiny model (QoS off; QoS on once `sits serve --tenants` exists)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from sits.bench.qos_compare import (
    compare,
    format_comparison,
    make_modes,
    output_throughput_while_offered,
)
from sits.cli.bench import add_bench_parser
from sits.core.errors import InvalidParameterError

SERVE_ARGS = (
    "--dtype float32 --max-model-len 512 --kv-cache-memory-bytes 8388608 --log-level warning"
)
MIX = """
[defaults]
input_len = 16
output_len = 4

[[tenants]]
name = "gold"
api_key = "sk-gold-test"
request_rate = 40
num_prompts = 3
ttft_ms = 600000
tpot_ms = 600000

[[tenants]]
name = "bulk"
api_key = "sk-bulk-test"
request_rate = "inf"
num_prompts = 2
"""


def _summary(ttft: float, tpot: float, both: float, goodput: float, tok_s: float) -> dict:
    return {
        "ttft_attainment_pct": ttft, "tpot_attainment_pct": tpot, "slo_attainment_pct": both,
        "goodput": goodput, "output_throughput": tok_s, "failed_429": 1, "failed_503": 2,
        "failed_other": 0, "completed": 5,
    }  # fmt: skip


def _doc(gold: dict, bulk: dict, total: dict) -> dict:
    return {"tenants": [{"name": "gold", "summary": gold}, {"name": "bulk", "summary": bulk}],
            "totals": total}  # fmt: skip


def test_compare_puts_modes_side_by_side_with_the_throughput_ratio() -> None:
    qos = _doc(_summary(100, 99.5, 99.5, 2, 300), _summary(40, 50, 30, 1, 600),
               _summary(60, 70, 50, 3, 900))  # fmt: skip
    fcfs = _doc(_summary(20, 30, 10, 0.5, 250), _summary(90, 90, 90, 4, 750),
                _summary(70, 75, 60, 4.5, 1000))  # fmt: skip
    result = compare({"qos": qos, "fcfs": fcfs})
    assert result["output_throughput_ratio"] == 0.9
    gold = result["tenants"][0]
    assert gold["name"] == "gold"
    assert (gold["qos"]["slo_attainment_pct"], gold["fcfs"]["slo_attainment_pct"]) == (99.5, 10)
    assert result["totals"]["fcfs"]["output_throughput"] == 1000
    table = format_comparison(result, ["qos", "fcfs"])
    assert "QoS / FCFS: 0.900" in table
    gold_line = next(line for line in table.splitlines() if line.startswith("gold"))
    assert gold_line.split()[1:] == [
        "100.0/20.0", "99.5/30.0", "99.5/10.0", "2.00/0.50", "300.0/250.0", "1/1", "2/2"
    ]  # fmt: skip
    assert compare({"qos": qos})["output_throughput_ratio"] is None
    assert result["output_throughput_ratio_while_offered"] is None  # no per-request records
    assert "while the load was offered" not in table


def _request(arrival_ms: float, ok: bool, ttft_ms: float | None, itl_ms: list, tokens: int):
    return {"arrival_ms": arrival_ms, "start_ms": arrival_ms, "ok": ok, "ttft_ms": ttft_ms,
            "itl_ms": itl_ms, "num_chunks": len(itl_ms) + 1 if ttft_ms is not None else 0,
            "output_tokens": tokens}  # fmt: skip


def test_throughput_while_the_load_was_offered_counts_chunks_before_the_last_arrival() -> None:
    total = _summary(60, 70, 50, 3, 900)
    qos = _doc(total, total, total)
    qos["requests"] = [
        _request(0.0, True, 100.0, [200.0, 300.0, 500.0], 8),  # chunks at 100, 300, 600, 1100 ms
        _request(1000.0, True, 50.0, [], 1),  # its chunk at 1050 ms: after the window
        _request(500.0, False, 10.0, [10.0], 2),  # failed: not counted
    ]
    fcfs = _doc(total, total, total)
    fcfs["requests"] = [
        _request(0.0, True, 100.0, [100.0], 2),
        _request(1000.0, False, None, [], 0),
    ]
    # Window 1 s: QoS 3 chunks x (8 / 4) tokens = 6 tok/s; FCFS 2 chunks x 1 token = 2 tok/s.
    assert output_throughput_while_offered(qos) == 6.0
    assert output_throughput_while_offered(fcfs) == 2.0
    assert output_throughput_while_offered({"requests": []}) is None
    result = compare({"qos": qos, "fcfs": fcfs})
    assert result["output_throughput_ratio"] == 1.0
    assert result["output_throughput_ratio_while_offered"] == 3.0
    table = format_comparison(result, ["qos", "fcfs"])
    assert "while the load was offered QoS / FCFS: 3.000 (6.0 / 2.0 tok/s)" in table


def test_modes_and_their_serve_flags() -> None:
    qos, fcfs = make_modes(["qos", "fcfs"], "t.toml")
    assert (qos.name, qos.serve_args, fcfs.name, fcfs.serve_args) == (
        "qos", ("--tenants", "t.toml"), "fcfs", ()
    )  # fmt: skip
    assert make_modes(["fcfs"], None, "flat.toml")[0].serve_args == ("--tenants", "flat.toml")
    with pytest.raises(InvalidParameterError, match="needs --tenants"):
        make_modes(["qos"], None)
    with pytest.raises(InvalidParameterError, match="unknown mode"):
        make_modes(["edf"], "t.toml")


def _run_qos(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sits")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "qos", *argv, "--no-gpu-info"])
    return args.func(args)


def _serve_has_tenants_flag() -> bool:
    from sits.cli.serve import add_serve_parser

    parser = argparse.ArgumentParser()
    serve = add_serve_parser(parser.add_subparsers())
    return any("--tenants" in action.option_strings for action in serve._actions)


def test_driver_runs_the_mix_against_sits_serve(tiny_model_factory, tmp_path: Path) -> None:
    """Both modes when `sits serve --tenants` exists, else the FCFS mode alone."""
    from sits.tenancy.keys import hash_api_key

    modes = "qos,fcfs" if _serve_has_tenants_flag() else "fcfs"
    (tmp_path / "mix.toml").write_text(MIX)
    (tmp_path / "tenants.toml").write_text(
        f'[[tenants]]\nid = "gold"\napi_key_sha256 = ["{hash_api_key("sk-gold-test")}"]\n'
        'tier = "guaranteed"\nreserved_kv_fraction = 0.5\nttft_ms = 600000\ntpot_ms = 600000\n\n'
        f'[[tenants]]\nid = "bulk"\napi_key_sha256 = ["{hash_api_key("sk-bulk-test")}"]\n'
        'tier = "best_effort"\n'
    )  # fmt: skip
    out = tmp_path / "qos.json"
    rc = _run_qos([
        "--model", str(tiny_model_factory("qwen3_moe")), "--modes", modes,
        "--tenants", str(tmp_path / "tenants.toml"), "--tenants-mix", str(tmp_path / "mix.toml"),
        "--serve-args", SERVE_ARGS, "--ignore-eos", "--log-dir", str(tmp_path / "logs"),
        "--result-json", str(out),
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    names = modes.split(",")
    assert doc["schema"] == "sits.bench.qos/1" and list(doc["runs"]) == names
    for name in names:
        run = doc["runs"][name]
        assert run["mode"]["name"] == name
        gold, bulk = (t["summary"] for t in run["tenants"])
        assert (gold["completed"], bulk["completed"]) == (3, 2)
        assert run["totals"]["total_output_tokens"] == 5 * 4
        assert gold["slo_attainment_pct"] == 100.0
        assert (tmp_path / "logs" / f"serve-{name}.log").is_file()
        assert (tmp_path / "logs" / f"metrics-{name}.txt").is_file()
        view = run["server_view"]  # the server's own TTFT count per tenant: every request,
        counts = {tenant: t["ttft_count"] for tenant, t in view["tenants"].items()}
        assert sum(counts.values()) == 6 and view["queue_mean_s"] >= 0  # and the warm-up one
        if name == "qos":  # the warm-up request is a copy of the first (gold's)
            assert counts == {"bulk": 2, "gold": 4}
            assert view["tenants"]["gold"]["ttft_met_pct"] == 100.0
    assert [t["name"] for t in doc["tenants"]] == ["gold", "bulk"]
    ratio = doc["output_throughput_ratio"]
    assert (ratio is None) if modes == "fcfs" else (ratio > 0)
