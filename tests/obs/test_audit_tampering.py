"""The audit tampering table (issue 30): every way to forge the tail or the history of a keyed
log with checkpoints fails verification, at the line and for the reason expected; the same
table against an unkeyed log shows what a chain without a secret cannot see. Also the exit
codes of `sits audit verify` (0 valid, 1 tampered, 2 usage error)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from sits.cli.main import main
from sits.obs.audit import chain_hash, encode_line
from sits.obs.audit_keys import AuditKey
from sits.obs.audit_verify import BreakReason, verify_log
from sits.obs.audit_writer import AuditWriter, AuditWriterConfig
from tests.obs.records import TEST_DIGEST, make_record

SECRET = b"the auditor's secret, 32 bytes.."
KEY = AuditKey.from_secret(SECRET)
NUM_REQUESTS = 10  # + the header: 11 lines; checkpoints at 4, 8 and 11 (shutdown)
EVERY = 4

Lines = list[bytes]


def _write(log: Path, checkpoints: Path, key: AuditKey | None) -> Lines:
    config = AuditWriterConfig(
        path=str(log), key=key, checkpoint_path=str(checkpoints), checkpoint_every_records=EVERY
    )
    with AuditWriter(config) as writer:
        for i in range(NUM_REQUESTS):
            assert writer.submit(make_record(i))
    return log.read_bytes().splitlines(keepends=True)


def _rechain(lines: Lines, start: int) -> Lines:
    """`lines` with the records from `start` on re-linked and re-hashed with plain SHA-256
    (what a forger without the key can compute)."""
    out = list(lines[:start])
    prev = json.loads(out[-1])["hash"] if out else "0" * 64
    for seq, raw in enumerate(lines[start:], start=start):
        record = json.loads(raw)
        body = {k: v for k, v in record.items() if k != "hash"} | {"prev_hash": prev, "seq": seq}
        prev = chain_hash(prev, body)
        out.append(encode_line(body | {"hash": prev}))
    return out


def _drop_last(lines: Lines) -> Lines:
    return lines[:-2]


def _empty(lines: Lines) -> Lines:
    return []


def _tear_last(lines: Lines) -> Lines:
    return [*lines[:-1], lines[-1][: len(lines[-1]) // 2]]


def _append_plain(lines: Lines) -> Lines:
    body = make_record(99, text="forged").to_body(TEST_DIGEST) | {"seq": len(lines)}
    return _rechain([*lines, encode_line(body | {"prev_hash": "", "hash": ""})], len(lines))


def _edit_middle(lines: Lines) -> Lines:
    edited = lines[5].replace(b"answer number 4", b"answer number X")
    assert edited != lines[5]
    return _rechain([*lines[:5], edited, *lines[6:]], 5)


def _reorder(lines: Lines) -> Lines:
    return [*lines[:3], lines[4], lines[3], *lines[5:]]


Tamper = Callable[[Lines], Lines]
# (tampering, with key + checkpoints: reason and 1-based line of the break,
#  unkeyed with checkpoints: reason and line, or None where it cannot be seen)
TABLE: list[tuple[Tamper, tuple[BreakReason, int], tuple[BreakReason, int] | None]] = [
    (_drop_last, (BreakReason.TRUNCATED, 10), (BreakReason.TRUNCATED, 10)),
    (_empty, (BreakReason.TRUNCATED, 1), (BreakReason.TRUNCATED, 1)),
    (_tear_last, (BreakReason.TRUNCATED, 11), (BreakReason.TRUNCATED, 11)),
    (_append_plain, (BreakReason.HASH_MISMATCH, 12), None),
    (_edit_middle, (BreakReason.HASH_MISMATCH, 6), (BreakReason.HEAD_MISMATCH, 8)),
    (_reorder, (BreakReason.PREV_HASH_MISMATCH, 4), (BreakReason.PREV_HASH_MISMATCH, 4)),
]
IDS = [tamper.__name__.strip("_") for tamper, _, _ in TABLE]


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "audit.log", tmp_path / "audit.checkpoints"


def test_intact_log_passes(files: tuple[Path, Path]) -> None:
    log, checkpoints = files
    _write(log, checkpoints, KEY)
    result = verify_log(log, key=KEY, checkpoint_path=str(checkpoints))
    assert result.ok and result.num_records == NUM_REQUESTS + 1
    assert [c.num_records for c in result.checkpoints] == [4, 8, 11]


@pytest.mark.parametrize(("tamper", "keyed", "unkeyed"), TABLE, ids=IDS)
def test_tampering_fails_with_key_and_checkpoints(
    files: tuple[Path, Path], tamper: Tamper, keyed: tuple[BreakReason, int], unkeyed: object
) -> None:
    log, checkpoints = files
    log.write_bytes(b"".join(tamper(_write(log, checkpoints, KEY))))
    brk = verify_log(log, key=KEY, checkpoint_path=str(checkpoints)).chain_break
    assert brk is not None and (brk.reason, brk.line_number) == keyed, brk


@pytest.mark.parametrize(("tamper", "keyed", "unkeyed"), TABLE, ids=IDS)
def test_tampering_of_an_unkeyed_log(
    files: tuple[Path, Path],
    tamper: Tamper,
    keyed: object,
    unkeyed: tuple[BreakReason, int] | None,
) -> None:
    log, checkpoints = files
    log.write_bytes(b"".join(tamper(_write(log, checkpoints, None))))
    result = verify_log(log, checkpoint_path=str(checkpoints))
    if unkeyed is None:  # appended records with correct hashes: only the key reveals them
        assert result.ok
        return
    brk = result.chain_break
    assert brk is not None and (brk.reason, brk.line_number) == unkeyed, brk


def test_removed_log_and_forged_checkpoints(files: tuple[Path, Path]) -> None:
    log, checkpoints = files
    lines = _write(log, checkpoints, KEY)
    log.unlink()
    brk = verify_log(log, key=KEY, checkpoint_path=str(checkpoints)).chain_break
    assert brk is not None and brk.reason is BreakReason.TRUNCATED
    assert "11 record(s) missing (it was emptied or removed)" in brk.detail
    # cutting the log and the checkpoints that count the cut records: the MAC of an edited
    # checkpoint fails; dropping whole checkpoint lines leaves the window after the last one
    log.write_bytes(b"".join(lines[:-2]))
    cps = checkpoints.read_bytes().splitlines(keepends=True)
    checkpoints.write_bytes(
        b"".join(cps[:2]) + cps[2].replace(b'"num_records":11', b'"num_records":9')
    )
    brk = verify_log(log, key=KEY, checkpoint_path=str(checkpoints)).chain_break
    assert brk is not None and (brk.reason, brk.line_number) == (BreakReason.BAD_CHECKPOINT, 3)
    assert brk.path == str(checkpoints) and "MAC does not match" in brk.detail
    # the whole log replaced by an unkeyed chain of forged records
    header = lines[0].replace(b'"chain":"hmac-sha256"', b'"chain":"sha256"')
    log.write_bytes(b"".join(_rechain([header, *lines[1:]], 0)))
    brk = verify_log(log, key=KEY).chain_break
    assert brk is not None and (brk.reason, brk.line_number) == (BreakReason.KEY_MISMATCH, 1)
    # an empty keyed log fails even without checkpoints: a keyed log starts with its header
    log.write_bytes(b"")
    brk = verify_log(log, key=KEY).chain_break
    assert brk is not None and brk.reason is BreakReason.EMPTY_LOG


def _verify(*argv: str) -> int:
    return main(["audit", "verify", *argv])


def test_cli_exit_codes(files: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    log, checkpoints = files
    lines = _write(log, checkpoints, KEY)
    key_file = tmp_path / "audit.key"
    key_file.write_bytes(SECRET + b"\n")
    key_file.chmod(0o600)
    args = [str(log), "--key-file", str(key_file), "--checkpoints", str(checkpoints)]
    assert _verify(*args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("OK: 11 records in 1 file(s) (1 header(s), 10 request(s), 0 refused)")
    assert out[1] == f"keyed: HMAC-SHA256 chain, key id {KEY.key_id}: no record was made or " + (
        "altered without the key"
    )
    assert out[2].startswith("checkpoints: 3 (signed), the last at 11 records (")
    assert out[2].endswith(", shutdown): the log holds them all")
    log.write_bytes(b"".join(lines[:-1]))
    assert _verify(*args) == 1
    out = capsys.readouterr().out
    assert f"FAILED: {log} line 11: truncated: the log ends after 10 records" in out
    # usage errors: a keyed log without its key, a key open to others, no log, bad flags
    assert _verify(str(log)) == 2
    assert "is keyed (key id" in capsys.readouterr().err
    key_file.chmod(0o644)
    assert _verify(*args) == 2
    assert "argument --key-file: the audit key file" in capsys.readouterr().err
    key_file.chmod(0o600)
    assert _verify(str(tmp_path / "none.log")) == 2
    assert _verify(*args[:3], "--checkpoints", str(tmp_path / "none.cp")) == 2
    assert "cannot read the checkpoint file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        _verify()
    assert exit_info.value.code == 2
