"""`sits generate` prints a completion for a prompt."""

from __future__ import annotations

import json
import subprocess
import sys


def test_sits_generate_prints_text(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    cmd = [sys.executable, "-m", "sits.cli.main", "generate", "--model", str(model_dir)]
    cmd += ["--prompt", "hi", "--max-tokens", "8", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["prompt"] == "hi"
    assert 1 <= len(record["token_ids"]) <= 8
    assert record["finish_reason"] in ("stop", "length")
    assert isinstance(record["text"], str)
