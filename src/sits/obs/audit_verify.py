"""Verify the audit log's hash chain and look records up by request id.

`verify_log(PATH)` walks the rotated series `PATH.1, ..., PATH` (see `audit_series`) as one chain
and stops at the FIRST line that breaks it. For each line, in this order:
1. it must parse as a JSON object with string `prev_hash` and `hash` (else UNPARSEABLE);
2. `prev_hash` must equal the previous line's `hash` (GENESIS_HASH, or `first_prev_hash`, for
   the first line) (else PREV_HASH_MISMATCH, or INSERTED_LINE when the line before it claims
   the same predecessor: that line was slipped in between);
3. `hash` must equal `sha256(prev_hash + canonical JSON without hash)` (else HASH_MISMATCH);
4. the line's bytes must be exactly the canonical JSON (else NOT_CANONICAL: bytes were changed
   in a way that parses to the same values, e.g. an escape's case).
So a changed byte is found on its own line (3 or 4; 2 for bytes inside `prev_hash`), a deleted
line on the line after the gap, two swapped lines on the first of them, and a forged line on
itself (3 if its hash is wrong, INSERTED_LINE if it was hashed correctly).

A final segment of the newest file without a newline that is not a complete valid record is a
torn tail (a crash mid-write): reported in `VerifyResult.torn_tail`, not as a break.

Limits: a chain without a secret proves order and integrity relative to its head, not
authorship: removing the LAST records, or appending correctly hashed forged ones at the end,
is only caught by comparing the head hash with one kept elsewhere (`VerifyResult.last_hash`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sits.obs.audit import (
    GENESIS_HASH,
    HASH_FIELD,
    PREV_HASH_FIELD,
    AuditLogError,
    audit_series,
    chain_hash,
    encode_line,
)

_INDEX_RE = re.compile(r"[0-9]+")  # the prompt index of a record id `request_id-<index>`


class BreakReason(StrEnum):
    """Why a line breaks the chain."""

    UNPARSEABLE = "unparseable line"
    PREV_HASH_MISMATCH = "prev_hash mismatch"
    INSERTED_LINE = "inserted line"
    HASH_MISMATCH = "hash mismatch"
    NOT_CANONICAL = "non-canonical encoding"


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """The first line that breaks the chain.

    Attributes:
        path: the file holding it.
        line_number: 1-based line number in that file.
        request_id: the line's request id when it parses, else None.
        reason: why it breaks.
        detail: a human explanation (expected vs found, where the line chains to).
    """

    path: str
    line_number: int
    request_id: str | None
    reason: BreakReason
    detail: str


@dataclass(frozen=True, slots=True)
class TornTail:
    """An incomplete last line of the newest file (crash mid-write), ignored for the chain.

    Attributes:
        path: the file.
        line_number: 1-based line number of the torn segment.
        num_bytes: its length in bytes.
    """

    path: str
    line_number: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome of `verify_log`.

    Attributes:
        files: the files checked, oldest first.
        num_records: records verified before the first break (all of them when ok).
        last_hash: hash of the last verified record (keep it elsewhere to detect truncation).
        chain_break: the first break, or None.
        torn_tail: the torn final line, or None.
    """

    files: tuple[str, ...]
    num_records: int
    last_hash: str
    chain_break: ChainBreak | None
    torn_tail: TornTail | None

    @property
    def ok(self) -> bool:
        """True when no line breaks the chain (a torn tail alone is ok)."""
        return self.chain_break is None


@dataclass(slots=True)
class _Line:
    path: str
    line_number: int
    raw: bytes  # without its newline
    complete: bool  # ended with a newline


def verify_log(path: str | os.PathLike[str], first_prev_hash: str = GENESIS_HASH) -> VerifyResult:
    """Verify the series at `path` as one chain starting from `first_prev_hash`.

    Args:
        path: the active log file (its rotated siblings are found automatically).
        first_prev_hash: the expected `prev_hash` of the oldest record: GENESIS_HASH, or the
            last hash of older files archived elsewhere.

    Raises:
        AuditLogError: no file of the series exists.
    """
    files = audit_series(path)
    if not files:
        raise AuditLogError(f"no audit log at {os.fspath(path)}")
    prev_hash = first_prev_hash
    prev_claim: str | None = None  # prev_hash field of the previous record
    num_records = 0
    last = files[-1]
    for line in _lines(files):
        record, why = _parse(line.raw)
        if not line.complete and line.path == last and record is None:
            torn = TornTail(line.path, line.line_number, len(line.raw))
            return VerifyResult(tuple(files), num_records, prev_hash, None, torn)
        found = _check(line, record, why, prev_hash, prev_claim, files)
        if found is not None:
            return VerifyResult(tuple(files), num_records, prev_hash, found, None)
        assert record is not None
        prev_claim, prev_hash = record[PREV_HASH_FIELD], record[HASH_FIELD]
        num_records += 1
    return VerifyResult(tuple(files), num_records, prev_hash, None, None)


def find_records(path: str | os.PathLike[str], request_id: str) -> list[dict[str, Any]]:
    """Every record of the series at `path` whose `request_id` matches, oldest first.

    Unparseable lines are skipped (use `verify_log` to judge integrity).

    Raises:
        AuditLogError: no file of the series exists.
    """
    files = audit_series(path)
    if not files:
        raise AuditLogError(f"no audit log at {os.fspath(path)}")
    needle = json.dumps(request_id, ensure_ascii=False).encode("utf-8")
    found = []
    for line in _lines(files):
        if needle not in line.raw:  # cheap pre-filter before parsing
            continue
        record, _ = _parse(line.raw)
        if record is not None and record.get("request_id") == request_id:
            found.append(record)
    return found


def find_request_records(path: str | os.PathLike[str], request_id: str) -> list[dict[str, Any]]:
    """Every record of one HTTP request: those whose `request_id` is `request_id` itself,
    else (a completion with several prompts is logged one record per prompt) those whose id
    is `request_id` followed by `-<prompt index>`, ordered by index (log order within one).

    Unparseable lines are skipped (use `verify_log` to judge integrity).

    Raises:
        AuditLogError: no file of the series exists.
    """
    files = audit_series(path)
    if not files:
        raise AuditLogError(f"no audit log at {os.fspath(path)}")
    needle = json.dumps(request_id, ensure_ascii=False).encode("utf-8")[:-1]  # no closing "
    prefix = request_id + "-"
    exact: list[dict[str, Any]] = []
    by_index: list[tuple[int, int, dict[str, Any]]] = []
    for number, line in enumerate(_lines(files)):
        if needle not in line.raw:  # cheap pre-filter before parsing
            continue
        record, _ = _parse(line.raw)
        found_id = None if record is None else record.get("request_id")
        if not isinstance(found_id, str):
            continue
        if found_id == request_id:
            exact.append(record)
        elif found_id.startswith(prefix) and _INDEX_RE.fullmatch(found_id[len(prefix) :]):
            by_index.append((int(found_id[len(prefix) :]), number, record))
    if exact:
        return exact
    return [record for _, _, record in sorted(by_index, key=lambda item: item[:2])]


def _lines(files: list[str]) -> Iterator[_Line]:
    for file_path in files:
        with open(file_path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                complete = raw.endswith(b"\n")
                yield _Line(file_path, number, raw[:-1] if complete else raw, complete)


def _parse(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """The record of one line, or None and why not."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 ({exc.reason} at byte {exc.start})"
    except ValueError as exc:
        return None, f"invalid JSON ({exc})"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    for name in (PREV_HASH_FIELD, HASH_FIELD):
        if not isinstance(record.get(name), str):
            return None, f"no string field {name!r}"
    return record, ""


def _check(
    line: _Line,
    record: dict[str, Any] | None,
    why: str,
    prev_hash: str,
    prev_claim: str | None,
    files: list[str],
) -> ChainBreak | None:
    """The break at `line`, or None when it extends the chain."""
    where = (line.path, line.line_number)
    if record is None:
        return ChainBreak(*where, None, BreakReason.UNPARSEABLE, why)
    rid = record.get("request_id")
    rid = rid if isinstance(rid, str) else None
    claim = record[PREV_HASH_FIELD]
    if claim != prev_hash:
        if prev_claim is not None and claim == prev_claim:
            return _inserted_before(line, claim, files)
        detail = f"expected {prev_hash[:16]}…, found {claim[:16]}…; " + _chains_to(claim, files)
        return ChainBreak(*where, rid, BreakReason.PREV_HASH_MISMATCH, detail)
    body = {k: v for k, v in record.items() if k != HASH_FIELD}
    computed = chain_hash(claim, body)
    if computed != record[HASH_FIELD]:
        detail = f"stored {record[HASH_FIELD][:16]}…, computed {computed[:16]}… (line altered)"
        return ChainBreak(*where, rid, BreakReason.HASH_MISMATCH, detail)
    try:
        canonical = encode_line(record)[:-1]
    except (TypeError, ValueError):  # e.g. NaN written by something other than the writer
        canonical = b""
    if canonical != line.raw:
        detail = "the values hash correctly but the bytes differ from the canonical encoding"
        return ChainBreak(*where, rid, BreakReason.NOT_CANONICAL, detail)
    return None


def _inserted_before(line: _Line, claim: str, files: list[str]) -> ChainBreak:
    """The line before `line` claims the same predecessor: it was inserted (forged)."""
    previous = _previous_line(line, files)
    record, _ = _parse(previous.raw)
    rid = record.get("request_id") if record else None
    detail = (
        f"line {line.line_number} of {line.path} chains to {claim[:16]}…, the same predecessor "
        f"this line claims: this line was inserted"
    )
    return ChainBreak(
        previous.path,
        previous.line_number,
        rid if isinstance(rid, str) else None,
        BreakReason.INSERTED_LINE,
        detail,
    )


def _previous_line(line: _Line, files: list[str]) -> _Line:
    """The line just before `line` in the series (it exists: `line` is not the first)."""
    before: _Line | None = None
    for candidate in _lines(files):
        if (candidate.path, candidate.line_number) == (line.path, line.line_number):
            break
        before = candidate
    assert before is not None
    return before


def _chains_to(claim: str, files: list[str]) -> str:
    """Where a record's `prev_hash` points: a line elsewhere (reordered) or nowhere (removed)."""
    for candidate in _lines(files):
        record, _ = _parse(candidate.raw)
        if record is not None and record[HASH_FIELD] == claim:
            return (
                f"it chains to line {candidate.line_number} of {candidate.path} (lines reordered)"
            )
    return "no line has that hash (a line before it was removed or altered)"
