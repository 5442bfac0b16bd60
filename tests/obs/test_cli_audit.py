"""`sits audit verify|show`: exit codes and messages (through the parser function)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sits.cli.audit import add_audit_parser
from sits.obs.audit import AuditLogError
from sits.obs.audit_writer import AuditWriter, AuditWriterConfig
from tests.obs.records import make_record, write_log
from tests.waits import HANG_S


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sits")
    add_audit_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_verify_ok_prints_count(log_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(log_path, 5)
    assert _run(["audit", "verify", str(log_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "OK: 6 records in 1 file(s) (1 header(s), 5 request(s), 0 refused); last hash "
    )
    assert "\nunkeyed: a plain SHA-256 chain (no --key-file)" in out
    assert "cannot tell" in out  # it says what an unkeyed chain cannot detect
    assert "no --checkpoints: records cut from the end of the log cannot be detected" in out


def test_verify_names_first_broken_line(log_path: Path, capsys) -> None:
    write_log(log_path, 5)
    lines = log_path.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4].replace(b"answer number 3", b"answer number 4")
    log_path.write_bytes(b"".join(lines))
    assert _run(["audit", "verify", str(log_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED: {log_path} line 5 (request req-3): hash mismatch:" in out
    assert "4 records verified before it" in out


def test_verify_unparseable_line(log_path: Path, capsys) -> None:
    write_log(log_path, 3)
    lines = log_path.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2][:20] + b"\n"
    log_path.write_bytes(b"".join(lines))
    assert _run(["audit", "verify", str(log_path)]) == 1
    assert f"FAILED: {log_path} line 3: unparseable line:" in capsys.readouterr().out


def test_verify_torn_tail_warns_and_exits_0(log_path: Path, capsys) -> None:
    write_log(log_path, 3)
    log_path.write_bytes(log_path.read_bytes()[:-30])
    assert _run(["audit", "verify", str(log_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("OK: 3 records")
    assert f"warning: {log_path} line 4: torn last line" in captured.err


def test_verify_missing_log_and_bad_anchor(log_path: Path) -> None:
    with pytest.raises(AuditLogError, match="no audit log"):
        _run(["audit", "verify", str(log_path)])
    write_log(log_path, 1)
    with pytest.raises(ValueError, match="prev-hash"):
        _run(["audit", "verify", str(log_path), "--prev-hash", "xyz"])


def test_show_json_prints_the_whole_record(log_path: Path, capsys) -> None:
    write_log(log_path, 3)
    assert _run(["audit", "show", "req-1", "--log", str(log_path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["request_id"] == "req-1" and record["outputs"][0]["token_ids"] == [101, 102, 103]
    assert record["outputs"][0]["tokens"][0]["top"] == [[101, -0.25 - 1 / 1024], [7, -3.5]]
    assert _run(["audit", "show", "req-9", "--log", str(log_path)]) == 1
    assert "no audit record for request req-9" in capsys.readouterr().err


def test_show_prints_a_summary_by_default(log_path: Path, capsys) -> None:
    """Not 280 lines of JSON for an 8-token request: one line per fact an auditor asks."""
    with AuditWriter(AuditWriterConfig(path=str(log_path))) as writer:
        record = make_record(1)
        second = dataclasses.replace(record.samples[0], index=1, token_ids=(5,), tokens=None)
        second = dataclasses.replace(second, finish_reason="stop")
        switched = dataclasses.replace(
            make_record(2), precision="int4", precision_switches=1, samples=(second,)
        )
        assert writer.submit(dataclasses.replace(record, samples=(record.samples[0], second)))
        assert writer.submit(switched)
    assert _run(["audit", "show", "req-1", "--log", str(log_path)]) == 0
    verify = f"`sits audit verify {log_path}` checks the whole chain"
    assert capsys.readouterr().out.splitlines() == [
        "request    req-1",
        "time       2023-11-14T22:13:22.250000Z",
        "tenant     acme",
        "model      tiny-llama (weights sha256:" + "ab" * 32 + ")",
        "tokens     4 in, 3 + 1 out (2 samples)",
        "finish     length, stop",
        "precision  none recorded (no --precision-switch, or no token)",
        "latency    ttft 0.500 s, e2e 1.250 s",
        f"hash       ok, the record matches its hash; {verify}",
    ]
    assert _run(["audit", "show", "req-2", "--log", str(log_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4:7] == [
        "tokens     4 in, 1 out",
        "finish     stop",
        "precision  int4, 1 switch(es) while it ran",
    ]
    # An edited record (the chain's values changed in place) no longer matches its hash.
    log_path.write_bytes(log_path.read_bytes().replace(b'"tenant":"acme"', b'"tenant":"evil"'))
    assert _run(["audit", "show", "req-2", "--log", str(log_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "tenant     evil"
    assert out[-1] == f"hash       MISMATCH: the record was altered; {verify}"


def _write_ids(path: Path, request_ids: list[str]) -> None:
    """A log of `make_record(i)` renamed to `request_ids[i]`, in that order."""
    with AuditWriter(AuditWriterConfig(path=str(path))) as writer:
        for i, request_id in enumerate(request_ids):
            assert writer.submit(dataclasses.replace(make_record(i), request_id=request_id))


def _shown(out: str) -> list[dict]:
    decoder = json.JSONDecoder()
    records, pos = [], 0
    while pos < len(out):
        record, end = decoder.raw_decode(out, pos)
        records.append(record)
        pos = end + 1  # the newline print adds
    return records


def test_show_multi_prompt_request_by_the_client_id(log_path: Path, capsys) -> None:
    # prompt 1 of cmpl-ab finished first; cmpl-ab2 and cmpl-ab-x are other requests
    ids = ["cmpl-ab-1", "cmpl-ab2", "cmpl-ab-0", "cmpl-ab-x", "cmpl-ab-10", "cmpl-c"]
    _write_ids(log_path, ids)
    assert _run(["audit", "show", "cmpl-ab", "--log", str(log_path), "--json"]) == 0
    shown = _shown(capsys.readouterr().out)
    assert [r["request_id"] for r in shown] == ["cmpl-ab-0", "cmpl-ab-1", "cmpl-ab-10"]
    assert _run(["audit", "show", "cmpl-ab", "--log", str(log_path)]) == 0
    summaries = capsys.readouterr().out.split("\n\n")  # one summary per prompt, in order
    assert [text.splitlines()[0] for text in summaries] == [
        "request    cmpl-ab-0",
        "request    cmpl-ab-1",
        "request    cmpl-ab-10",
    ]
    assert _run(["audit", "show", "cmpl-ab-1", "--log", str(log_path), "--json"]) == 0
    assert [r["request_id"] for r in _shown(capsys.readouterr().out)] == ["cmpl-ab-1"]
    assert _run(["audit", "show", "cmpl-c", "--log", str(log_path), "--json"]) == 0
    assert [r["request_id"] for r in _shown(capsys.readouterr().out)] == ["cmpl-c"]
    assert _run(["audit", "show", "cmpl-a", "--log", str(log_path)]) == 1


def test_show_into_a_closed_pipe_exits_quietly(log_path: Path) -> None:
    # ~1 MB of output: more than a pipe buffer, so the write fails whatever the timing
    _write_ids(log_path, [f"cmpl-big-{i}" for i in range(400)])
    argv = ["audit", "show", "cmpl-big", "--log", str(log_path), "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sits.cli.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head` that has read enough
    err = proc.stderr.read().decode()
    assert proc.wait(HANG_S) == 0
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


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
    assert proc.returncode == 1 and "line 2 (request req-0): hash mismatch" in proc.stdout
