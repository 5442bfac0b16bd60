"""`sits tenants hash-key` and `sits tenants check`."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from sits.cli.tenants import add_tenants_parser
from sits.core.errors import InvalidParameterError

ABC_SHA256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sits")
    add_tenants_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_hash_key_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["tenants", "hash-key", "abc"]) == 0
    assert capsys.readouterr().out == ABC_SHA256 + "\n"


@pytest.mark.parametrize("stdin", ["abc", "abc\n", "abc\r\n"])
def test_hash_key_from_stdin(
    stdin: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert _run(["tenants", "hash-key", "-"]) == 0
    assert capsys.readouterr().out == ABC_SHA256 + "\n"


def test_hash_key_keeps_inner_whitespace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(" abc\n\n"))
    _run(["tenants", "hash-key", "-"])
    # only one trailing newline is dropped: the key is " abc\n"
    assert capsys.readouterr().out != ABC_SHA256 + "\n"


def test_hash_key_refuses_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    with pytest.raises(InvalidParameterError, match="empty"):
        _run(["tenants", "hash-key", "-"])


def test_check_prints_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        f'[[tenants]]\nid = "pay"\napi_key_sha256 = ["{ABC_SHA256}"]\n'
        'tier = "guaranteed"\nreserved_kv_fraction = 0.5\n'
    )
    assert _run(["tenants", "check", str(path)]) == 0
    assert capsys.readouterr().out == (
        "pay: tier=guaranteed reserved_kv_fraction=0.5 keys=1\n"
        "1 tenant(s) OK; anonymous tenant: none (auth required)\n"
    )
    path.write_text('[[tenants]]\nid = "pay"\nkeys = 1\n')
    assert _run(["tenants", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}:3: tenants[0] field 'keys': unknown tenant field 'keys'" in err


def test_check_reports_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        f'[[tenants]]\nid = "pay"\napi_key_sha256 = ["{ABC_SHA256}"]\ntier = "gold"\n\n'
        '[[tenants]]\nid = "search"\napi_key_sha256 = ["abc"]\nweight = 1\n'
    )
    assert _run(["tenants", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"error: {path}:4: tenants[0] field 'tier': tier must be one of "
        "guaranteed | burstable | best_effort, got 'gold'",
        f"error: {path}:8: tenants[1] field 'api_key_sha256': 'abc' is not a SHA-256 hex "
        "digest (64 hex characters); make one with `sits tenants hash-key -`",
        f"2 error(s) in {path}",
    ]


def test_check_of_a_missing_file_exits_2(tmp_path: Path, capsys) -> None:
    assert _run(["tenants", "check", str(tmp_path / "nope.toml")]) == 2
    assert "cannot read tenants file" in capsys.readouterr().err
