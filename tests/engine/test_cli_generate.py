"""`sits generate` prints a completion for a prompt."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.waits import HANG_S


def test_sits_generate_prints_text(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    cmd = [sys.executable, "-m", "sits.cli.main", "generate", "--model", str(model_dir)]
    cmd += ["--prompt", "hi", "--max-tokens", "8", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["prompt"] == "hi"
    assert 1 <= len(record["token_ids"]) <= 8
    assert record["finish_reason"] in ("stop", "length")
    assert isinstance(record["text"], str)


def _help_entries(text: str) -> dict[str, str]:
    """`--help` output -> {option invocation: its help text} (argparse's layout: an entry
    starts at a line indented by two, its help follows two or more spaces or on more
    indented lines below)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, help_text = line.strip().partition("  ")
            current = invocation
            entries[current] = help_text.strip()
        elif current is not None and line.startswith("    "):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


def test_every_generate_option_has_help_text(monkeypatch, capsys) -> None:
    from sits.cli.main import build_parser

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "--help"])
    assert exit_info.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--n", "--stop"):
        assert any(invocation.split()[0].rstrip(",") == flag for invocation in entries), flag
    assert {invocation: text for invocation, text in entries.items() if not text} == {}
    assert entries["--temperature T"] == (
        "divides the logits before sampling; 0 = greedy, always the most likely token (default 0.0)"
    )
