"""sits.bench.qos_sim: the modelled device pads steps as the H200's runner does and sleeps
base + per-row time; a short run of both modes prints the table and the ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sits.bench import qos_sim as module
from sits.core.plan import ScheduledRequest, StepPlan

ROOT = Path(__file__).resolve().parents[2]


def _plan(*num_tokens: int) -> StepPlan:
    return StepPlan([ScheduledRequest(f"r{i}", [1] * n, 0, [1], sample=n == 1)
                     for i, n in enumerate(num_tokens)])  # fmt: skip


def test_steps_are_padded_like_the_runner_and_cost_base_plus_rows(monkeypatch) -> None:
    slept = []
    monkeypatch.setattr(module.time, "sleep", slept.append)
    runner = module._ModelledRunner(None, 0.02, 1e-5, [64, 128, 256, 512, 640], [1, 2, 4, 8])
    result = runner.run(_plan(1, 1, 1))  # a decode step of 3 runs the batch-4 graph
    assert sorted(result.sampled_token_ids) == ["r0", "r1", "r2"]
    runner.run(_plan(1, 300, 300))  # 601 prompt and decode tokens run the 640-token bucket
    assert [round(s, 6) for s in slept] == [0.02 + 4e-5, 0.02 + 640e-5]
    assert runner.rows == 644


def test_a_short_run_of_both_modes_prints_the_ratio(capsys) -> None:
    args = ["--model", str(ROOT / "src/sits/demo_model"), "--tenants",
            str(ROOT / "bench/qos/tenants.toml"), "--duration-s", "1.5", "--gold-rate", "4",
            "--burst-rate", "8", "--input-len", "16", "--output-len", "4",
            "--step-base-ms", "2", "--per-row-us", "1"]  # fmt: skip
    assert module.main(args) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line[:7] in
            ("| qos |", "| fcfs ")}  # fmt: skip
    assert set(rows) == {"qos", "fcfs"}
    assert all(int(line.split("|")[2]) > 0 for line in rows.values())  # steps ran
    assert "output throughput QoS / FCFS (modelled device): " in out


def test_a_measured_cost_curve_is_interpolated_piecewise(monkeypatch) -> None:
    curve = module.parse_curve("1280:40.0,256:20.0,2048:48.0")  # any order
    assert curve == [(256, 0.02), (1280, 0.04), (2048, 0.048)]
    assert [round(module.curve_s(curve, r), 6) for r in (256, 768, 1664, 128, 2304)] == [
        0.02, 0.03, 0.044, 0.0175, 0.050667,  # inside, and extended along the end segments
    ]  # fmt: skip
    slept = []
    monkeypatch.setattr(module.time, "sleep", slept.append)
    runner = module._ModelledRunner(None, 1.0, 1.0, [768, 1280], [256], curve)
    runner.run(_plan(*([1] * 200), 500))  # 700 tokens run the 768-token bucket
    assert [round(s, 6) for s in slept] == [0.03]
    for bad in ("1280:40", "x:1,2:3"):
        with pytest.raises(ValueError):
            module.parse_curve(bad)


def test_the_virtual_clock_gives_the_same_figures_twice(capsys) -> None:
    args = ["--model", str(ROOT / "src/sits/demo_model"), "--tenants",
            str(ROOT / "bench/qos/tenants.toml"), "--duration-s", "3", "--host-ms", "5",
            "--gold-rate", "4", "--burst-rate", "8", "--input-len", "16", "--output-len", "4",
            "--min-prefill-tokens", "32"]  # fmt: skip
    outs = []
    for _ in range(2):
        assert module.main(args) == 0
        outs.append(capsys.readouterr().out.split("\n", 1)[1])  # after the command line
    assert outs[0] == outs[1] and "output throughput QoS / FCFS" in outs[0]


def test_a_cost_curve_from_recorded_steps_takes_medians_by_padded_rows(tmp_path) -> None:
    steps = tmp_path / "steps.jsonl"
    lines = [
        *[{"runner_ms": ms, "reqs": [[512, 1]] * 3} for ms in (4.0, 5.0, 9.0)],  # batch 4
        *[{"runner_ms": ms, "reqs": [[512, 1], [0, 500]]} for ms in (30.0, 31.0, 33.0)],  # 512
        *[{"runner_ms": ms, "reqs": [[0, 600]]} for ms in (40.0, 41.0)],  # 640: too few steps
    ]
    steps.write_text("".join(json.dumps(line) + "\n" for line in lines))
    curve = module.curve_from_steps(str(steps), [64, 512, 640], [1, 2, 4, 8], min_steps=3)
    assert curve == [(4, 0.005), (512, 0.031)]
    with pytest.raises(ValueError, match="fewer than two row counts"):
        module.curve_from_steps(str(steps), [64, 512, 640], [1, 2, 4, 8], min_steps=4)
