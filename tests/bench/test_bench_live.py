"""`sits bench serve` end to end against a live sits server (tiny Qwen3-MoE on loopback)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sits.cli.bench import add_bench_parser
from sits.config import EngineConfig

INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS = 24, 5, 8


@pytest.fixture(scope="module")
def live(tiny_model_factory) -> Iterator:
    from tests.server.live import LiveServer

    model_dir = tiny_model_factory("qwen3_moe")

    def make_engine():
        from sits.engine.async_llm import AsyncLLM

        return AsyncLLM(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=512,
                                     kv_cache_memory_bytes=8 << 20))  # fmt: skip

    with LiveServer(make_engine) as server:
        yield server


def _bench(argv: list[str]) -> tuple[int, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="sits")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "serve", *argv, "--no-gpu-info"])
    return args.func(args), args


@pytest.mark.parametrize("client_procs", [1, 2])
def test_serve_benchmark_counts_and_timings(live, tmp_path: Path, capsys, client_procs) -> None:
    """The same exact counts whether one client process sends everything or two share it."""
    out = tmp_path / "result.json"
    rc, _ = _bench([
        "--base-url", live.base_url, "--num-prompts", str(NUM_PROMPTS), "--request-rate", "50",
        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--ignore-eos",
        "--seed", "3", "--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000",
        "--client-procs", str(client_procs), "--result-json", str(out),
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "sits.bench.serve/1"
    assert doc["server"]["model"] == doc["server"]["model_card"]["id"]  # the first listed
    assert doc["prompts"]["mode"] == "token_ids"
    totals = doc["totals"]
    assert (totals["num_requests"], totals["completed"], totals["failed"]) == (8, 8, 0)
    assert totals["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert totals["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN  # token-id prompts: exact
    assert totals["ttft_ms"]["count"] == 8 and totals["tpot_ms"]["count"] == 8
    assert (totals["slo_attainment_pct"], totals["num_met_slo"]) == (100.0, 8)
    assert totals["goodput"] == pytest.approx(8 / doc["duration_s"])
    assert [r["index"] for r in doc["requests"]] == list(range(8))
    for r in doc["requests"]:
        assert (r["ok"], r["status"], r["output_tokens"]) == (True, 200, OUTPUT_LEN)
        assert r["prompt_tokens"] == INPUT_LEN
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert len(r["itl_ms"]) == r["num_chunks"] - 1
        assert r["start_ms"] >= r["arrival_ms"]  # sent at (not before) its time from t = 0
        assert 0 < r["connect_ms"] <= r["sent_ms"] <= r["ttft_ms"]  # one new connection each
        # the server receives after the client's connect stamp and answers before its first
        # token stamp (the header is whole ms, rounded down; the stamps are rounded to 1 us)
        assert 0 <= r["processing_ms"] <= r["ttft_ms"] - r["connect_ms"] + 0.002
    assert [t["name"] for t in doc["tenants"]] == ["default"]
    connect = doc["client_connect_ms"]
    assert connect["max"] == pytest.approx(max(r["connect_ms"] for r in doc["requests"]), abs=1e-3)
    lag = doc["client_loop_lag_ms"]  # sampled every 10 ms through the run
    assert set(lag) == {"p50", "p99", "max"} and 0 <= lag["p50"] <= lag["p99"] <= lag["max"]
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Goodput (req/s)" in printed
    assert "Client loop lag p50/p99/max (ms)" in printed
    assert "Client connect p50/p99/max (ms)" in printed
    outside = doc["ttft_outside_server_ms"]
    assert outside["max"] == pytest.approx(
        max(r["ttft_ms"] - r["processing_ms"] for r in doc["requests"]), abs=2e-3
    )
    assert "TTFT outside server p50/p99/max (ms)" in printed


def test_tenants_mix_on_chat_with_text_prompts(live, tmp_path: Path) -> None:
    mix = tmp_path / "mix.toml"
    mix.write_text(
        '[defaults]\ninput_len = 40\noutput_len = 3\n\n'
        '[[tenants]]\nname = "gold"\napi_key = "sk-gold"\nrequest_rate = 20\nnum_prompts = 3\n'
        'ttft_ms = 600000\ntpot_ms = 600000\n\n'
        '[[tenants]]\nname = "bulk"\napi_key = "sk-bulk"\nrequest_rate = "inf"\nnum_prompts = 2\n'
        'ttft_ms = 0.001\n'
    )  # fmt: skip
    out = tmp_path / "mix.json"
    rc, _ = _bench([
        "--base-url", f"{live.base_url}/v1", "--endpoint", "/v1/chat/completions",
        "--tenants-mix", str(mix), "--ignore-eos", "--result-json", str(out),
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["prompts"]["mode"] == "text" and doc["prompts"]["calibrated"] is True
    gold, bulk = doc["tenants"]
    assert (gold["name"], gold["summary"]["completed"], gold["summary"]["slo_attainment_pct"]) == (
        "gold", 3, 100.0
    )  # fmt: skip
    # bulk's 1-microsecond TTFT SLO cannot be met; it has no TPOT SLO.
    assert (bulk["summary"]["completed"], bulk["summary"]["ttft_attainment_pct"]) == (2, 0.0)
    assert (bulk["summary"]["tpot_attainment_pct"], bulk["summary"]["goodput"]) == (None, 0.0)
    assert doc["totals"]["num_met_slo"] == 3 and doc["totals"]["total_output_tokens"] == 15
    for r in doc["requests"]:
        assert 30 <= r["prompt_tokens"] <= 50  # calibrated text: about 40 tokens
        assert r["ttft_ms"] <= r["e2e_ms"]
    assert "sk-gold" not in out.read_text()  # keys are never written


def test_unreachable_server_is_a_named_error(tmp_path: Path) -> None:
    from sits.bench.errors import BenchmarkError
    from sits.bench.server_proc import free_port

    with pytest.raises(BenchmarkError, match="cannot reach"):
        _bench(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"])


def test_a_failing_initial_request_stops_the_run_before_timing(live) -> None:
    from sits.bench.errors import BenchmarkError

    # max_tokens beyond the 512-token context: the server answers 400 to the warm-up request.
    with pytest.raises(BenchmarkError, match=r"initial test request .* failed \(HTTP 400\)"):
        _bench(["--base-url", live.base_url, "--num-prompts", "2", "--input-len", "8",
                "--output-len", "100000"])  # fmt: skip
