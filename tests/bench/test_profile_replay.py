"""sits.bench.profile_step --replay: steps recorded by an engine (`SITS_STEP_SHAPES_FILE`) are
rebuilt and run again; on the CPU the per-op table stands in for the GPU's kernel table."""

from __future__ import annotations

import random
from pathlib import Path

from sits import LLM, SamplingParams
from sits.bench import profile_step
from sits.bench.shapes import write_shape_dir
from sits.engine.step_shapes import STEP_SHAPES_ENV, read_step_shapes


def test_recorded_steps_with_prompt_chunks_are_replayed(tmp_path: Path, monkeypatch, capsys):
    shapes = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_SHAPES_ENV, str(shapes))
    model = write_shape_dir("tiny-qwen3-moe")
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              max_num_batched_tokens=64, max_model_len=256)  # fmt: skip
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100) for _ in range(40)]} for _ in range(6)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    monkeypatch.delenv(STEP_SHAPES_ENV)
    mixed = [s for s in read_step_shapes(str(shapes)) if any(n > 1 for _, n in s["reqs"])]
    assert len(mixed) == 4  # 6 prompts x 40 tokens through a 64-token budget

    argv = ["--random-weights", "tiny-qwen3-moe", "--max-model-len", "256", "--dtype",
            "float32", "--replay", str(shapes), "--replay-steps", "10", "--top", "3"]  # fmt: skip
    assert profile_step.main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"| {shapes} |"))
    cells = [c.strip() for c in row.split("|")[2:-1]]
    tokens = sum(sum(n for _, n in s["reqs"]) for s in mixed) / len(mixed)
    assert cells[0] == "4" and cells[1] == f"{tokens:.1f}"  # every mixed step, their mean size
    assert f"| kernel | 1: {shapes} |" in out
