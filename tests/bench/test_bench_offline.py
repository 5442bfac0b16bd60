"""`sits bench throughput` end to end on the CPU (tiny shapes, dummy weights), the step
recorder's exact step shapes, and the transformers peer on the same weights."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest
import torch

from sits import LLM, SamplingParams
from sits.bench.offline_common import random_prompts
from sits.bench.peer import default_attn_implementation, run_transformers_peer
from sits.bench.roofline import StepShape
from sits.bench.shapes import write_shape_dir
from sits.bench.steps import StepRecorder
from sits.cli.main import main
from tests.bench.offline_checks import check_gpu_only_roofline

# transformers < 5.23 sizes its continuous-batching cache on the CPU with psutil (without it:
# "available memory 0"); 5.24 does without.
needs_cpu_peer = pytest.mark.skipif(
    default_attn_implementation(importlib.metadata.version("transformers")) != "sdpa"
    and importlib.util.find_spec("psutil") is None,
    reason="transformers < 5.23 needs psutil to run generate_batch on the CPU",
)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))


def _main(monkeypatch, argv: list[str]) -> int:
    """`sits ARGV` as the shell would run it (the report prints sys.argv)."""
    monkeypatch.setattr("sys.argv", ["sits", *argv])
    return main(argv)


def _dummy_llm(shape: str, **kwargs) -> LLM:
    return LLM(
        write_shape_dir(shape),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        **kwargs,
    )


def test_throughput_reports_exact_token_counts(tmp_path, capsys, monkeypatch) -> None:
    out_json = tmp_path / "t.json"
    argv = ["bench", "throughput", "--random-weights", "tiny-qwen3-moe", "--input-len", "16"]
    argv += ["--output-len", "5", "--num-prompts", "4", "--num-warmup-prompts", "1"]
    assert _main(monkeypatch, [*argv, "--dtype", "float32", "--output-json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "sits.bench.throughput/1"
    assert doc["sits"]["num_output_tokens"] == 4 * 5
    assert doc["sits"]["num_prompt_tokens"] == 4 * 16
    assert doc["sits"]["num_steps"] == 5  # one prefill step, then 4 decode steps
    assert doc["roofline"]["num_steps"] == 5
    assert doc["roofline"]["measured_s"] == doc["sits"]["elapsed_s"]
    assert doc["model"]["load_format"] == "dummy"
    assert doc["model"]["total_params"] == 189824
    assert doc["peer"] is None and doc["ratio"] is None
    phases = doc["sits"]["phase_s"]
    assert set(phases) == {"schedule", "runner", "update", "launch", "shadow", "sync"}
    assert all(seconds >= 0.0 for seconds in phases.values())
    in_steps = phases["schedule"] + phases["runner"] + phases["update"]
    assert 0.0 < in_steps <= doc["sits"]["elapsed_s"]
    assert phases["launch"] + phases["shadow"] + phases["sync"] <= phases["runner"] + 1e-6
    captured = capsys.readouterr()
    printed = captured.out
    # one bar, the timed call's (not the warm-up's): 4 prompts, its last state at 100 %
    bars = [line for line in captured.err.split("\r") if line.startswith("Processed prompts")]
    assert bars and bars[-1].startswith("Processed prompts: 100%")
    assert {b.split("|")[2].split()[0] for b in bars} <= {"0/4", "1/4", "2/4", "3/4", "4/4"}
    assert "Engine phases (s in all): schedule " in printed
    assert printed.startswith("Command: ")
    assert "--random-weights tiny-qwen3-moe" in printed.splitlines()[0]
    assert "| engine | workload | requests/s | output tok/s | total tok/s | roofline |" in printed
    assert "| sits | 4 x 16 in / 5 out |" in printed
    assert printed.count("Command: ") == 1
    check_gpu_only_roofline(doc["model"]["device"], doc["roofline"], printed)


def test_step_recorder_sees_each_step_exactly() -> None:
    llm = _dummy_llm("tiny-llama")
    recorder = StepRecorder().attach(llm.engine_core)
    prompts = random_prompts(3, 10, 512, seed=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
    assert recorder.take() == [
        StepShape(num_tokens=30, num_seqs=3, num_sampled=3, num_kv_tokens=30, num_attn_pairs=165),
        StepShape(3, 3, 3, 3 * 11, 3 * 11),
        StepShape(3, 3, 3, 3 * 12, 3 * 12),
        StepShape(3, 3, 3, 3 * 13, 3 * 13),
    ]
    assert recorder.take() == []


def test_peer_attn_implementation_by_version() -> None:
    assert default_attn_implementation("5.17.0") == "paged|sdpa"
    assert default_attn_implementation("5.22.9") == "paged|sdpa"
    assert default_attn_implementation("5.23.0") == "sdpa"
    assert default_attn_implementation("5.24.0.dev0") == "sdpa"


@needs_cpu_peer
@pytest.mark.parametrize("shape", ["tiny-qwen3-moe", "tiny-llama"])
def test_peer_generates_the_same_tokens_on_the_same_dummy_weights(shape: str) -> None:
    prompts = random_prompts(3, 12, 512, seed=2)
    peer = run_transformers_peer(
        write_shape_dir(shape), prompts, 6, torch.float32, torch.device("cpu"), dummy_seed=7
    )
    assert peer.num_output_tokens == 3 * 6
    llm = _dummy_llm(shape, seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert peer.output_token_ids == ours
    other = run_transformers_peer(
        write_shape_dir(shape), prompts, 6, torch.float32, torch.device("cpu"), dummy_seed=8
    )
    assert other.output_token_ids != ours  # the seed reaches the peer's weights


@needs_cpu_peer
def test_peer_loads_a_real_checkpoint(tiny_model_factory) -> None:
    model_dir = str(tiny_model_factory("mixtral"))
    prompts = random_prompts(2, 9, 512, seed=3)
    peer = run_transformers_peer(
        model_dir, prompts, 5, torch.float32, torch.device("cpu"), dummy_seed=None
    )
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ours = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert peer.output_token_ids == ours


@needs_cpu_peer
def test_throughput_with_the_transformers_peer(tmp_path, capsys, monkeypatch) -> None:
    out_json = tmp_path / "t.json"
    argv = ["bench", "throughput", "--random-weights", "tiny-llama", "--input-len", "8"]
    argv += ["--output-len", "4", "--num-prompts", "3", "--peer", "transformers"]
    assert _main(monkeypatch, [*argv, "--dtype", "float32", "--output-json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    peer = doc["peer"]
    assert peer["num_output_tokens"] == 3 * 4
    assert peer["num_prompt_tokens"] == 3 * 8
    assert peer["attn_implementation"] == default_attn_implementation(peer["version"])
    assert doc["first_token_match"] == 1.0  # float32, same weights
    assert doc["ratio"] == pytest.approx(
        doc["sits"]["output_tokens_per_s"] / peer["output_tokens_per_s"]
    )
    printed = capsys.readouterr().out
    assert f"| transformers {peer['version']} generate_batch | 3 x 8 in / 4 out |" in printed
    assert "sits / transformers output tok/s: " in printed


def test_model_or_random_weights_is_required(capsys) -> None:
    assert main(["bench", "throughput", "--num-prompts", "1"]) == 2
    assert "exactly one of --model M, --random-weights S" in capsys.readouterr().err
