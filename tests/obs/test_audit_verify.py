"""`verify_log` finds the exact first breaking line after every kind of tampering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sits.obs.audit import chain_hash, encode_line, seal
from sits.obs.audit_verify import BreakReason, find_records, verify_log
from tests.obs.records import TEST_DIGEST, make_record, write_log

NUM_RECORDS = 6


@pytest.fixture
def lines(log_path: Path) -> list[bytes]:
    """An untouched 6-record log, as lines with their newlines."""
    write_log(log_path, NUM_RECORDS)
    return log_path.read_bytes().splitlines(keepends=True)


def _line_of(request: int) -> int:
    """The 0-based line of record `req-<request>` (line 0 is the header)."""
    return request + 1


def _flip(line: bytes, offset: int) -> bytes:
    return line[:offset] + bytes([line[offset] ^ 0x01]) + line[offset + 1 :]


def test_untouched_log_verifies(log_path: Path, lines: list[bytes]) -> None:
    result = verify_log(log_path)
    assert result.ok and result.num_records == NUM_RECORDS + 1 and result.torn_tail is None
    assert (result.num_headers, result.num_requests, result.key_id) == (1, NUM_RECORDS, None)
    assert result.last_hash == json.loads(lines[-1])["hash"]


@pytest.mark.parametrize(
    ("marker", "reason"),
    [
        (b"answer number 3", BreakReason.HASH_MISMATCH),  # inside the output text
        (b'"logprob":-0.', BreakReason.HASH_MISMATCH),  # inside a logprob
        (b'"hash":"', BreakReason.HASH_MISMATCH),  # inside the hash field
        (b'"prev_hash":"', BreakReason.PREV_HASH_MISMATCH),  # inside the link
        (b'"tenant":"', BreakReason.HASH_MISMATCH),
    ],
)
def test_flipped_byte_named_at_its_line(
    log_path: Path, lines: list[bytes], marker: bytes, reason: BreakReason
) -> None:
    target = _line_of(3)  # 0-based: line 5
    offset = lines[target].index(marker) + len(marker) + 2
    lines[target] = _flip(lines[target], offset)
    log_path.write_bytes(b"".join(lines))
    result = verify_log(log_path)
    brk = result.chain_break
    assert brk is not None and brk.line_number == target + 1 and brk.reason is reason
    assert brk.request_id == "req-3" and result.num_records == target


def test_every_single_byte_flip_is_found_on_its_line(log_path: Path, lines: list[bytes]) -> None:
    target = 2
    original = lines[target]
    for offset in range(len(original)):  # the newline included
        lines[target] = _flip(original, offset)
        log_path.write_bytes(b"".join(lines))
        brk = verify_log(log_path).chain_break
        assert brk is not None, offset
        assert brk.line_number == target + 1, (offset, brk)


def test_same_value_different_bytes_is_not_canonical(tmp_path: Path) -> None:
    path = tmp_path / "one.log"
    write_log(path, 1)
    prev = json.loads(path.read_bytes().splitlines()[-1])["hash"]
    line = encode_line(seal(make_record(1, text="bell\x1f").to_body(TEST_DIGEST), prev))
    assert b"\\u001f" in line
    path.write_bytes(path.read_bytes() + line.replace(b"\\u001f", b"\\u001F"))
    brk = verify_log(path).chain_break
    assert brk is not None and brk.line_number == 3 and brk.reason is BreakReason.NOT_CANONICAL


def test_deleted_line(log_path: Path, lines: list[bytes]) -> None:
    del lines[_line_of(2)]
    log_path.write_bytes(b"".join(lines))
    brk = verify_log(log_path).chain_break
    assert brk is not None and brk.line_number == 4 and brk.request_id == "req-3"
    assert brk.reason is BreakReason.PREV_HASH_MISMATCH and "removed" in brk.detail


def test_deleted_first_line(log_path: Path, lines: list[bytes]) -> None:
    log_path.write_bytes(b"".join(lines[1:]))  # the header
    brk = verify_log(log_path).chain_break
    assert brk is not None and brk.line_number == 1 and brk.request_id == "req-0"
    log_path.write_bytes(lines[0] + b"".join(lines[2:]))  # the first request
    brk = verify_log(log_path).chain_break
    assert brk is not None and brk.line_number == 2 and brk.request_id == "req-1"


def test_swapped_lines(log_path: Path, lines: list[bytes]) -> None:
    lines[3], lines[4] = lines[4], lines[3]  # req-2, req-3
    log_path.write_bytes(b"".join(lines))
    brk = verify_log(log_path).chain_break
    assert brk is not None and brk.line_number == 4 and brk.request_id == "req-3"
    assert brk.reason is BreakReason.PREV_HASH_MISMATCH and "line 5" in brk.detail


def test_forged_line_with_correct_hash(log_path: Path, lines: list[bytes]) -> None:
    prev = json.loads(lines[2])["hash"]  # req-1
    body = make_record(99, text="forged").to_body(TEST_DIGEST) | {"prev_hash": prev}
    forged = encode_line(body | {"hash": chain_hash(prev, body)})
    lines.insert(3, forged)
    log_path.write_bytes(b"".join(lines))
    brk = verify_log(log_path).chain_break
    assert brk is not None and brk.line_number == 4 and brk.request_id == "req-99"
    assert brk.reason is BreakReason.INSERTED_LINE


def test_forged_line_copied_and_edited(log_path: Path, lines: list[bytes]) -> None:
    lines.insert(5, lines[2].replace(b"answer number 1", b"answer number X"))
    log_path.write_bytes(b"".join(lines))
    brk = verify_log(log_path).chain_break
    assert brk is not None and brk.line_number == 6 and brk.request_id == "req-1"


def test_torn_tail_verifies_up_to_last_complete_line(log_path: Path, lines: list[bytes]) -> None:
    cut = len(lines[-1]) // 2
    log_path.write_bytes(b"".join(lines[:-1]) + lines[-1][:cut])
    result = verify_log(log_path)
    assert result.ok and result.num_records == NUM_RECORDS
    assert result.torn_tail is not None and result.torn_tail.line_number == NUM_RECORDS + 1
    assert result.torn_tail.num_bytes == cut
    assert result.last_hash == json.loads(lines[-2])["hash"]


def test_tampering_in_rotated_file_names_that_file(log_path: Path) -> None:
    write_log(log_path, 8, max_file_bytes=3000)
    rotated = Path(f"{log_path}.2")
    data = rotated.read_bytes().splitlines(keepends=True)
    data[1] = data[1].replace(b"answer number", b"answer numbeR")
    rotated.write_bytes(b"".join(data))
    brk = verify_log(log_path).chain_break
    assert brk is not None and brk.path == str(rotated) and brk.line_number == 2


def test_missing_rotated_file_breaks_next_file(log_path: Path) -> None:
    write_log(log_path, 8, max_file_bytes=3000)
    Path(f"{log_path}.2").rename(log_path.parent / "elsewhere")
    brk = verify_log(log_path).chain_break
    assert brk is not None and brk.path == f"{log_path}.3" and brk.line_number == 1


def test_first_prev_hash_anchor(log_path: Path, lines: list[bytes]) -> None:
    anchor = json.loads(lines[2])["hash"]  # req-1: its file was archived elsewhere
    log_path.write_bytes(b"".join(lines[3:]))
    result = verify_log(log_path, first_prev_hash=anchor)
    assert result.ok and result.num_records == NUM_RECORDS - 2
    assert result.first_seq == 3 and result.end_count == NUM_RECORDS + 1


def test_find_records(log_path: Path, lines: list[bytes]) -> None:
    (record,) = find_records(log_path, "req-4")
    assert record["hash"] == json.loads(lines[5])["hash"]
    assert find_records(log_path, "req-40") == []
