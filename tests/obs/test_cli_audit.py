"""`sits audit verify|show`: exit codes and messages (through the parser function)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sits.cli.audit import add_audit_parser
from sits.obs.audit import AuditLogError
from tests.obs.records import write_log


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sits")
    add_audit_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_verify_ok_prints_count(log_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(log_path, 5)
    assert _run(["audit", "verify", str(log_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 5 records in 1 file(s); last hash ")


def test_verify_names_first_broken_line(log_path: Path, capsys) -> None:
    write_log(log_path, 5)
    lines = log_path.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3].replace(b"answer number 3", b"answer number 4")
    log_path.write_bytes(b"".join(lines))
    assert _run(["audit", "verify", str(log_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED: {log_path} line 4 (request req-3): hash mismatch:" in out
    assert "3 records verified before it" in out


def test_verify_unparseable_line(log_path: Path, capsys) -> None:
    write_log(log_path, 3)
    lines = log_path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:20] + b"\n"
    log_path.write_bytes(b"".join(lines))
    assert _run(["audit", "verify", str(log_path)]) == 1
    assert f"FAILED: {log_path} line 2: unparseable line:" in capsys.readouterr().out


def test_verify_torn_tail_warns_and_exits_0(log_path: Path, capsys) -> None:
    write_log(log_path, 3)
    log_path.write_bytes(log_path.read_bytes()[:-30])
    assert _run(["audit", "verify", str(log_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("OK: 2 records")
    assert f"warning: {log_path} line 3: torn last line" in captured.err


def test_verify_missing_log_and_bad_anchor(log_path: Path) -> None:
    with pytest.raises(AuditLogError, match="no audit log"):
        _run(["audit", "verify", str(log_path)])
    write_log(log_path, 1)
    with pytest.raises(ValueError, match="prev-hash"):
        _run(["audit", "verify", str(log_path), "--prev-hash", "xyz"])


def test_show(log_path: Path, capsys) -> None:
    write_log(log_path, 3)
    assert _run(["audit", "show", "req-1", "--log", str(log_path)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["request_id"] == "req-1" and record["outputs"][0]["token_ids"] == [101, 102, 103]
    assert _run(["audit", "show", "req-9", "--log", str(log_path)]) == 1
    assert "no audit record for request req-9" in capsys.readouterr().err


def test_main_subprocess_when_wired(log_path: Path) -> None:
    from sits.cli.main import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if "audit" not in commands:
        pytest.skip("`sits audit` is not wired into sits.cli.main yet")
    write_log(log_path, 2)
    log_path.write_bytes(log_path.read_bytes().replace(b"answer", b"Answer", 1))
    proc = subprocess.run(
        [sys.executable, "-m", "sits.cli.main", "audit", "verify", str(log_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1 and "line 1 (request req-0): hash mismatch" in proc.stdout
