"""Verify the audit log's hash chain (and its checkpoints), and look records up by request id.

`verify_log(PATH, key=, checkpoint_path=)` walks the rotated series `PATH.1, ..., PATH` (see
`audit_series`) as one chain and stops at the FIRST line that breaks it. For each line, in this
order:
1. it must parse as a JSON object with string `prev_hash` and `hash` (else UNPARSEABLE);
2. `prev_hash` must equal the previous line's `hash` (GENESIS_HASH, or `first_prev_hash`, for
   the first line) (else PREV_HASH_MISMATCH, or INSERTED_LINE when the line before it claims
   the same predecessor: that line was slipped in between);
3. headers: with a key every file starts with a header naming that key (else MISSING_HEADER or
   KEY_MISMATCH); a header stands only on a file's first line (else MISPLACED_HEADER);
4. `hash` must equal the chain hash (`sits.obs.audit.chain_hash`: HMAC-SHA256 with the key's
   chain key, else SHA-256) of `prev_hash` and the canonical JSON without `hash` (else
   HASH_MISMATCH: with a key, no one without it can make a record that passes);
5. the line's bytes must be exactly the canonical JSON (else NOT_CANONICAL: bytes were changed
   in a way that parses to the same values, e.g. an escape's case);
6. `seq`, when present, must count on from the first record's (from 0 at the genesis) (else
   SEQUENCE_GAP).
So a changed byte is found on its own line (4 or 5; 2 for bytes inside `prev_hash`), a deleted
line on the line after the gap, two swapped lines on the first of them, and a forged line on
itself (4 if its hash is wrong, INSERTED_LINE if it was hashed correctly).
Then, over an intact chain: with a key, a log without any record is EMPTY_LOG (a keyed log
starts with its header); with checkpoints (`sits.obs.audit_checkpoints`), fewer records than a
checkpoint counts is TRUNCATED and another hash at a checkpointed count is HEAD_MISMATCH; a
checkpoint line that is not valid (with the key: not signed by it) is BAD_CHECKPOINT.

A final segment of the newest file without a newline that is not a complete valid record is a
torn tail (a crash mid-write): reported in `VerifyResult.torn_tail`, not as a break, unless a
checkpoint counted the record it held (then the log is TRUNCATED).

Limits: an unkeyed chain (no secret) proves order and integrity relative to its head, not
authorship: whoever can write the log can drop its last records, empty it, append records or
edit any record and recompute every later hash; only checkpoints kept out of that writer's
reach catch the first two and a rewrite before a checkpoint. A keyed chain catches every
forged or edited record; dropped last records are caught up to the last checkpoint.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sits.obs.audit import (
    GENESIS_HASH,
    HASH_FIELD,
    HEADER_KIND,
    KEYED_CHAIN,
    KIND_FIELD,
    PREV_HASH_FIELD,
    REFUSED_KIND,
    SEQ_FIELD,
    AuditLogError,
    audit_series,
    chain_hash,
    encode_line,
)
from sits.obs.audit_checkpoints import (
    AnchoredRecord,
    AuditKeyRequiredError,
    Checkpoint,
    CheckpointFailure,
    check_checkpoints,
    read_checkpoints,
)
from sits.obs.audit_files import first_line
from sits.obs.audit_keys import AuditKey

_INDEX_RE = re.compile(r"[0-9]+")  # the prompt index of a record id `request_id-<index>`


class BreakReason(StrEnum):
    """Why a line (or the log as a whole) fails verification."""

    UNPARSEABLE = "unparseable line"
    PREV_HASH_MISMATCH = "prev_hash mismatch"
    INSERTED_LINE = "inserted line"
    MISSING_HEADER = "missing header"
    MISPLACED_HEADER = "misplaced header"
    KEY_MISMATCH = "key mismatch"
    HASH_MISMATCH = "hash mismatch"
    NOT_CANONICAL = "non-canonical encoding"
    SEQUENCE_GAP = "sequence gap"
    EMPTY_LOG = "empty log"
    TRUNCATED = "truncated"
    HEAD_MISMATCH = "head mismatch"
    BAD_CHECKPOINT = "bad checkpoint"


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """The first line that breaks the chain (or where the missing records would be).

    Attributes:
        path: the file holding it (the checkpoint file for BAD_CHECKPOINT).
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
        num_records: records verified before the first break (all of them when ok), headers
            included.
        last_hash: hash of the last verified record (keep it elsewhere to detect truncation).
        chain_break: the first break, or None.
        torn_tail: the torn final line, or None.
        key_id: the key's id when verified with a key; None for an unkeyed check.
        num_headers, num_refusals: header and refusal records among `num_records` (the rest
            are request records).
        checkpoints: the checkpoints read (empty without a checkpoint file).
        checkpoint_torn: the checkpoint file's last line was torn (ignored).
        first_seq: the seq of the first record checked (0 from the genesis).
    """

    files: tuple[str, ...]
    num_records: int
    last_hash: str
    chain_break: ChainBreak | None
    torn_tail: TornTail | None
    key_id: str | None = None
    num_headers: int = 0
    num_refusals: int = 0
    checkpoints: tuple[Checkpoint, ...] = ()
    checkpoint_torn: bool = False
    first_seq: int = 0

    @property
    def end_count(self) -> int:
        """The chain's length up to the last verified record (its seq + 1)."""
        return self.first_seq + self.num_records

    @property
    def ok(self) -> bool:
        """True when nothing breaks the chain (a torn tail past the checkpoints alone is ok)."""
        return self.chain_break is None

    @property
    def num_requests(self) -> int:
        """Request records among `num_records`."""
        return self.num_records - self.num_headers - self.num_refusals


@dataclass(slots=True)
class _Line:
    path: str
    line_number: int
    raw: bytes  # without its newline
    complete: bool  # ended with a newline


@dataclass(slots=True)
class _Walk:
    """What the walk has verified so far."""

    files: list[str]
    prev_hash: str
    chain_key: bytes | None
    key_id: str | None
    want_counts: frozenset[int]
    prev_claim: str | None = None  # prev_hash field of the previous record
    num_records: int = 0
    num_headers: int = 0
    num_refusals: int = 0
    first_seq: int | None = None  # position of the first record
    last_line: tuple[str, int] | None = None  # where the last verified record is
    anchored: dict[int, AnchoredRecord] = field(default_factory=dict)

    @property
    def next_position(self) -> int:
        return (self.first_seq or 0) + self.num_records


def read_header(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The header record starting the oldest file of the series at `path`, or None (no file,
    an empty one, or a log of an older sits)."""
    files = audit_series(path)
    if not files:
        return None
    try:
        record = json.loads(first_line(files[0]) or b"")
    except ValueError:
        return None
    if isinstance(record, dict) and record.get(KIND_FIELD) == HEADER_KIND:
        return record
    return None


def verify_log(
    path: str | os.PathLike[str],
    first_prev_hash: str = GENESIS_HASH,
    *,
    key: AuditKey | None = None,
    checkpoint_path: str | None = None,
) -> VerifyResult:
    """Verify the series at `path` as one chain starting from `first_prev_hash`.

    Args:
        path: the active log file (its rotated siblings are found automatically).
        first_prev_hash: the expected `prev_hash` of the oldest record: GENESIS_HASH, or the
            last hash of older files archived elsewhere.
        key: the log's key (`--audit-key-file`); None checks an unkeyed chain.
        checkpoint_path: the checkpoint file (`--audit-checkpoint-file`) to hold the log to.

    Raises:
        AuditLogError: no file of the series exists (and no checkpoint counts a record), or
            the checkpoint file cannot be read.
        AuditKeyRequiredError: no key, and the log or its checkpoints are keyed.
    """
    files = audit_series(path)
    header = read_header(path)
    if key is None and header is not None and header.get("chain") == KEYED_CHAIN:
        raise AuditKeyRequiredError(
            f"the audit log {os.fspath(path)} is keyed (key id {header.get('key_id')}): pass "
            "--key-file to verify it"
        )
    read = None if checkpoint_path is None else read_checkpoints(checkpoint_path, key)
    checkpoints = () if read is None else read.checkpoints
    if not files and not checkpoints:
        raise AuditLogError(f"no audit log at {os.fspath(path)}")
    walk = _Walk(
        files=files,
        prev_hash=first_prev_hash,
        chain_key=None if key is None else key.chain,
        key_id=None if key is None else key.key_id,
        want_counts=frozenset(c.num_records for c in checkpoints),
    )
    found, torn = _walk(walk, first_prev_hash)
    if found is None and read is not None and read.problem is not None:
        detail = f"checkpoint line {read.problem_line}: {read.problem}"
        where = (str(checkpoint_path), read.problem_line)
        found = ChainBreak(*where, None, BreakReason.BAD_CHECKPOINT, detail)
    if found is None and checkpoints:
        failure = check_checkpoints(
            checkpoints, walk.next_position, walk.first_seq or 0, walk.anchored
        )
        if failure is not None:
            found = _checkpoint_break(failure, walk, torn, os.fspath(path))
    if found is None and key is not None and walk.num_records == 0 and torn is None:
        where = files[-1] if files else os.fspath(path)
        detail = "the log holds no record, but a keyed log starts with its header (emptied?)"
        found = ChainBreak(where, 1, None, BreakReason.EMPTY_LOG, detail)
    return VerifyResult(
        files=tuple(files),
        num_records=walk.num_records,
        last_hash=walk.prev_hash,
        chain_break=found,
        torn_tail=torn,
        key_id=walk.key_id,
        num_headers=walk.num_headers,
        num_refusals=walk.num_refusals,
        checkpoints=checkpoints,
        checkpoint_torn=read is not None and read.torn_last_line,
        first_seq=walk.first_seq or 0,
    )


def _walk(walk: _Walk, first_prev_hash: str) -> tuple[ChainBreak | None, TornTail | None]:
    """Verify every line (module docstring, steps 1-6) into `walk`; the first break and a
    torn tail."""
    last = walk.files[-1] if walk.files else None
    for line in _lines(walk.files):
        record, why = _parse(line.raw)
        if not line.complete and line.path == last and record is None:
            return None, TornTail(line.path, line.line_number, len(line.raw))
        found = _check(line, record, why, walk)
        if found is None:
            assert record is not None
            found = _check_seq(line, record, walk, first_prev_hash)
        if found is not None:
            return found, None
        assert record is not None
        position = walk.next_position
        if position + 1 in walk.want_counts:
            rid = record.get("request_id")
            walk.anchored[position + 1] = AnchoredRecord(
                line.path,
                line.line_number,
                rid if isinstance(rid, str) else None,
                record[HASH_FIELD],
            )
        walk.prev_claim, walk.prev_hash = record[PREV_HASH_FIELD], record[HASH_FIELD]
        walk.num_records += 1
        kind = record.get(KIND_FIELD)
        walk.num_headers += kind == HEADER_KIND
        walk.num_refusals += kind == REFUSED_KIND
        walk.last_line = (line.path, line.line_number)
    return None, None


def _check_seq(
    line: _Line, record: dict[str, Any], walk: _Walk, first_prev_hash: str
) -> ChainBreak | None:
    """Step 6: `seq` counts on (its first value is 0 at the genesis, else sets the base)."""
    seq = record.get(SEQ_FIELD)
    if seq is None:  # a record of an older sits
        if walk.first_seq is None:
            walk.first_seq = 0
        return None
    valid = isinstance(seq, int) and not isinstance(seq, bool)
    if walk.first_seq is None and valid and (seq == 0 or first_prev_hash != GENESIS_HASH):
        walk.first_seq = seq
    expected = walk.next_position
    if valid and seq == expected:
        return None
    rid = record.get("request_id")
    return ChainBreak(
        line.path,
        line.line_number,
        rid if isinstance(rid, str) else None,
        BreakReason.SEQUENCE_GAP,
        f"seq {seq!r}, expected {expected} (records were removed or renumbered)",
    )


def _checkpoint_break(
    failure: CheckpointFailure, walk: _Walk, torn: TornTail | None, path: str
) -> ChainBreak:
    cp = failure.checkpoint
    when = f"checkpoint line {cp.line_number} ({cp.time}, {cp.reason})"
    if failure.truncated:
        have = walk.next_position
        missing = cp.num_records - have
        if torn is not None:
            where = (torn.path, torn.line_number)
            cause = "its last line is torn"
        else:
            last_file = walk.files[-1] if walk.files else path
            in_last = walk.last_line is not None and walk.last_line[0] == last_file
            where = (last_file, walk.last_line[1] + 1 if in_last else 1)
            cause = "its last records were dropped" if have else "it was emptied or removed"
        detail = (
            f"the log ends after {have} records, but {when} counts {cp.num_records}: "
            f"{missing} record(s) missing ({cause})"
        )
        return ChainBreak(*where, None, BreakReason.TRUNCATED, detail)
    record = failure.record
    assert record is not None
    detail = (
        f"{when} says record {cp.num_records - 1} hashed to {cp.head_hash[:16]}…, the log's "
        f"hashes to {record.hash[:16]}…: the history up to it was rewritten"
    )
    return ChainBreak(
        record.path, record.line_number, record.request_id, BreakReason.HEAD_MISMATCH, detail
    )


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


def _check(line: _Line, record: dict[str, Any] | None, why: str, walk: _Walk) -> ChainBreak | None:
    """The break at `line` (steps 1-5), or None when it extends the chain."""
    where = (line.path, line.line_number)
    if record is None:
        return ChainBreak(*where, None, BreakReason.UNPARSEABLE, why)
    rid = record.get("request_id")
    rid = rid if isinstance(rid, str) else None
    claim = record[PREV_HASH_FIELD]
    if claim != walk.prev_hash:
        if walk.prev_claim is not None and claim == walk.prev_claim:
            return _inserted_before(line, claim, walk.files)
        detail = f"expected {walk.prev_hash[:16]}…, found {claim[:16]}…; "
        detail += _chains_to(claim, walk.files)
        return ChainBreak(*where, rid, BreakReason.PREV_HASH_MISMATCH, detail)
    header_problem = _header_problem(line, record, walk.key_id)
    if header_problem is not None:
        reason, detail = header_problem
        return ChainBreak(*where, rid, reason, detail)
    body = {k: v for k, v in record.items() if k != HASH_FIELD}
    try:
        computed = chain_hash(claim, body, walk.chain_key)
    except (TypeError, ValueError):  # NaN or a lone surrogate, written by something else
        computed = ""
    if computed != record[HASH_FIELD]:
        detail = f"stored {record[HASH_FIELD][:16]}…, computed {computed[:16]}… " + (
            "(line altered)"
            if walk.chain_key is None
            else "(forged or altered: its hash was not made with this key)"
        )
        return ChainBreak(*where, rid, BreakReason.HASH_MISMATCH, detail)
    try:
        canonical = encode_line(record)[:-1]
    except (TypeError, ValueError):  # e.g. NaN written by something other than the writer
        canonical = b""
    if canonical != line.raw:
        detail = "the values hash correctly but the bytes differ from the canonical encoding"
        return ChainBreak(*where, rid, BreakReason.NOT_CANONICAL, detail)
    return None


def _header_problem(
    line: _Line, record: dict[str, Any], key_id: str | None
) -> tuple[BreakReason, str] | None:
    """Step 3: a header only on line 1, and with a key on every file's line 1, naming it."""
    is_header = record.get(KIND_FIELD) == HEADER_KIND
    if is_header and line.line_number != 1:
        return BreakReason.MISPLACED_HEADER, "a header record inside a file (inserted)"
    keyed = record.get("chain") == KEYED_CHAIN
    if key_id is None:
        if is_header and keyed:
            return BreakReason.KEY_MISMATCH, "a keyed file in an unkeyed log: pass --key-file"
        return None
    if line.line_number != 1:
        return None
    if not is_header:
        detail = "a keyed log starts every file with a header record: this file has none"
        return BreakReason.MISSING_HEADER, detail
    if not keyed:
        return BreakReason.KEY_MISMATCH, "the header says unkeyed: not written with this key"
    if record.get("key_id") != key_id:
        detail = (
            f"the header names key id {record.get('key_id')}, the key file is {key_id}: "
            "another key, or a forged header"
        )
        return BreakReason.KEY_MISMATCH, detail
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
