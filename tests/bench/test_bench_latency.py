"""`sits bench latency` end to end on the CPU, and the prefill/decode split of its steps."""

from __future__ import annotations

import json

import pytest

from sits import LLM
from sits.bench.latency import run_iteration
from sits.bench.roofline import StepShape
from sits.bench.shapes import write_shape_dir
from sits.bench.steps import StepRecorder
from sits.cli.main import main
from tests.bench.offline_checks import check_gpu_only_roofline


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))


def _main(monkeypatch, argv: list[str]) -> int:
    """`sits ARGV` as the shell would run it (the report prints sys.argv)."""
    monkeypatch.setattr("sys.argv", ["sits", *argv])
    return main(argv)


def test_latency_counts_every_request_and_step(tmp_path, capsys, monkeypatch) -> None:
    out_json = tmp_path / "l.json"
    argv = ["bench", "latency", "--random-weights", "tiny-llama", "--batch-size", "2"]
    argv += ["--input-len", "5", "--output-len", "4", "--num-iters", "2"]
    argv += ["--num-iters-warmup", "1", "--dtype", "float32", "--output-json", str(out_json)]
    assert _main(monkeypatch, argv) == 0
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "sits.bench.latency/1"
    assert doc["num_output_tokens"] == [2 * 4, 2 * 4]
    assert doc["ttft_ms"]["count"] == 2 * 2
    assert doc["tpot_ms"]["count"] == 2 * 2
    assert doc["latency_ms"]["count"] == 2
    assert doc["prefill_step_ms"]["count"] == 2  # one prefill step per iteration
    assert doc["decode_step_ms"]["count"] == 2 * 3
    assert doc["rooflines"]["prefill"]["num_steps"] == 2
    assert doc["rooflines"]["decode"]["num_steps"] == 6
    # Where a decode step goes: the phases are parts of the steps, so they sum to the mean step.
    phases = doc["decode_step_phases_ms"]
    assert set(phases) == {"schedule", "runner", "update", "launch", "shadow", "sync", "other"}
    assert all(value >= 0 for value in phases.values())
    parts = phases["schedule"] + phases["runner"] + phases["update"] + phases["other"]
    assert parts == pytest.approx(doc["decode_step_ms"]["mean"], rel=1e-6)
    inner = phases["launch"] + phases["shadow"] + phases["sync"]
    assert inner <= phases["runner"] * (1 + 1e-6)
    for key in ("ttft_ms", "tpot_ms", "decode_step_ms"):
        stats = doc[key]
        assert 0 < stats["p50"] <= stats["p99"]
    captured = capsys.readouterr()
    printed = captured.out
    last_bar = captured.err.split("\r")[-1]
    assert last_bar.startswith("Iterations: 100%") and " 3/3 " in last_bar  # warm-up + timed
    assert printed.startswith("Command: ")
    assert "| (ms) | mean | p50 | p99 | count |" in printed
    assert "| TTFT |" in printed and "| TPOT |" in printed
    assert printed.count("Command: ") == 1
    assert "Decode step phases (ms per step): schedule " in printed
    for roofline in doc["rooflines"].values():
        check_gpu_only_roofline(doc["model"]["device"], roofline, printed)


def test_chunked_prefill_steps_count_until_every_first_token() -> None:
    llm = LLM(
        write_shape_dir("tiny-llama"),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        max_num_batched_tokens=4,
    )
    recorder = StepRecorder().attach(llm.engine_core)
    timing = run_iteration(llm, recorder, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], 4, "x")
    # Budget 4: [r0 4 tokens], [r0 1 + r1 3], [r0 decode + r1 2]: both have a first token.
    assert [shape for _, shape in timing.prefill_steps] == [
        StepShape(4, 1, 0, 4, 10),
        StepShape(4, 2, 1, 5 + 3, 5 + 6),
        StepShape(3, 2, 2, 6 + 5, 6 + 9),
    ]
    # r0 needs 2 more tokens, r1 3 more.
    assert [shape.num_seqs for _, shape in timing.decode_steps] == [2, 2, 1]
    assert timing.num_output_tokens == 8
    assert len(timing.ttft_s) == 2 and timing.ttft_s[0] < timing.ttft_s[1]
    assert len(timing.tpot_s) == 2
