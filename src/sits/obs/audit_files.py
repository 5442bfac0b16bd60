"""The audit log's files on disk: private (0600) files, first and last lines, a torn tail's
repair and the chain's head at restart.

Invariants:
- every file this package creates for the audit (log, rotated logs, lock, torn tails,
  checkpoints) is created with mode 0600, and an existing log or checkpoint file open to
  group or others is set to 0600 when a writer opens it (logged as a WARNING);
- `recover_head` leaves the active file ending on a complete line: a torn last line (crash
  mid-write) is kept if it is a complete, valid record missing only its newline; otherwise its
  bytes are moved to `PATH.torn-<unix_ns>` and the file is truncated to the last complete line;
- a log is continued only with the key (or the absence of one) its header names: a writer
  never mixes keyed and unkeyed records, or two keys, in one chain.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from typing import Any

from sits.obs.audit import (
    GENESIS_HASH,
    HASH_FIELD,
    HEADER_KIND,
    KEYED_CHAIN,
    KIND_FIELD,
    PREV_HASH_FIELD,
    SALT_BYTES,
    SEQ_FIELD,
    UNKEYED_CHAIN,
    AuditLogError,
    audit_series,
    chain_hash,
    encode_line,
)
from sits.obs.audit_keys import AuditKey

logger = logging.getLogger(__name__)

PRIVATE_MODE = 0o600
_TAIL_CHUNK_BYTES = 64 * 1024


def open_private_append(path: str) -> Any:
    """An unbuffered append-only binary file at `path`, created 0600 (a wider mode of an
    existing file is narrowed to 0600).

    Raises:
        OSError: the file cannot be opened or created.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_MODE)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if os.name == "posix" and mode & 0o077:
            os.fchmod(fd, PRIVATE_MODE)
            logger.warning("%s was mode %04o; set to 0600 (it holds audit data)", path, mode)
        return os.fdopen(fd, "ab", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def write_all(file: Any, data: bytes) -> None:
    """Write every byte of `data` to an unbuffered (raw) file."""
    view = memoryview(data)
    while view:
        written = file.write(view)
        view = view[written:]


def fsync_dir(path: str) -> None:
    """fsync the directory of `path` so a rename/create survives a crash (POSIX)."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class LogHead:
    """Where the chain of an opened log stands.

    Attributes:
        last_hash: the hash of the last record (GENESIS_HASH for a new log).
        num_records: records in the chain so far, headers included (the next `seq`).
        input_salt: hex of the active file's input salt (unkeyed, active file not empty).
        needs_header: the active file is empty: the writer starts it with a header.
    """

    last_hash: str
    num_records: int
    input_salt: str | None
    needs_header: bool


def recover_head(path: str, key: AuditKey | None) -> LogHead:
    """The head to continue the log at `path` from, with `key` (None: unkeyed); repairs a torn
    tail of the active file first (see the module docstring).

    Raises:
        AuditLogError: the newest non-empty file has no header record (an older sits wrote
            it), its header names another key or none (or a key where none is given), or its
            last complete line is not a valid record.
    """
    chain_key = None if key is None else key.chain
    if os.path.exists(path):
        _repair_torn_tail(path, chain_key)
    for file_path in reversed(audit_series(path)):
        line = last_line(file_path)
        if line is None:
            continue
        record = _parsed_last(line, file_path)
        header = _checked_header(first_line(file_path), key, file_path)
        if not _self_consistent(record, chain_key):
            raise _invalid_last(file_path)
        seq = record.get(SEQ_FIELD)
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise AuditLogError(f"the last record of the audit log {file_path} has no valid seq")
        active = file_path == path
        salt = header.get("input_salt") if active and key is None else None
        return LogHead(record[HASH_FIELD], seq + 1, salt, needs_header=not active)
    return LogHead(GENESIS_HASH, 0, None, needs_header=True)


def _checked_header(line: bytes | None, key: AuditKey | None, file_path: str) -> dict[str, Any]:
    """The header of `file_path` when it fits `key`, else AuditLogError naming the fix."""
    try:
        header = json.loads(line or b"")
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get(KIND_FIELD) != HEADER_KIND:
        raise AuditLogError(
            f"the audit log {file_path} starts with no header record (an older sits wrote "
            "it): move the log aside (keep it for `sits audit verify`) to start a new one"
        )
    chain, key_id = header.get("chain"), header.get("key_id")
    if key is None and chain != UNKEYED_CHAIN:
        raise AuditLogError(
            f"the audit log {file_path} is keyed (key id {key_id}): give its --audit-key-file, "
            "or move the log aside to start an unkeyed one"
        )
    if key is not None and chain != KEYED_CHAIN:
        raise AuditLogError(
            f"the audit log {file_path} was written without a key: move it aside (keep it for "
            "`sits audit verify`) to start a keyed log"
        )
    if key is not None and key_id != key.key_id:
        raise AuditLogError(
            f"the audit log {file_path} was written with another key (key id {key_id}; "
            f"{key.source} is key id {key.key_id}): give that key, or move the log aside"
        )
    salt = header.get("input_salt")
    if key is None and not (isinstance(salt, str) and _is_hex(salt, 2 * SALT_BYTES)):
        raise AuditLogError(f"the header of the audit log {file_path} has no valid input_salt")
    return header


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


def _self_consistent(record: Any, chain_key: bytes | None) -> bool:
    """True when `record` is an object whose `hash` matches its other fields."""
    try:
        body = {k: v for k, v in record.items() if k != HASH_FIELD}
        return chain_hash(record[PREV_HASH_FIELD], body, chain_key) == record[HASH_FIELD]
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def _parsed_last(line: bytes, file_path: str) -> dict[str, Any]:
    """The last line as a record with string chain fields (checked against the key later)."""
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not all(
        isinstance(record.get(name), str) for name in (PREV_HASH_FIELD, HASH_FIELD)
    ):
        raise _invalid_last(file_path)
    return record


def _invalid_last(file_path: str) -> AuditLogError:
    return AuditLogError(
        f"the last line of the audit log {file_path} is not a valid record; run "
        f"`sits audit verify` and move the file aside before writing a new log"
    )


def first_line(file_path: str) -> bytes | None:
    """The first newline-terminated line of the file (without its newline), or None."""
    with open(file_path, "rb") as f:
        head = b""
        while chunk := f.read(_TAIL_CHUNK_BYTES):
            head += chunk
            nl = head.find(b"\n")
            if nl >= 0:
                return head[:nl]
        return None


def last_line(file_path: str) -> bytes | None:
    """The last newline-terminated line of the file (without its newline), or None."""
    with open(file_path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        tail = b""
        pos = end
        while pos > 0:
            step = min(_TAIL_CHUNK_BYTES, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
            last_nl = tail.rfind(b"\n")
            if last_nl < 0:
                continue
            prev_nl = tail.rfind(b"\n", 0, last_nl)
            if prev_nl >= 0 or pos == 0:
                return tail[prev_nl + 1 : last_nl]
        return None


def _repair_torn_tail(path: str, chain_key: bytes | None) -> None:
    """Make `path` end on a complete line (module doc: keep a valid record, else move aside)."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos, tail = end, b""
        while pos > 0 and b"\n" not in tail:
            step = min(_TAIL_CHUNK_BYTES, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
    cut = tail.rfind(b"\n") + 1  # 0 when the whole file is one torn line
    torn = tail[cut:]
    keep_offset = pos + cut
    if _is_valid_continuation(path, torn, keep_offset, chain_key):
        with open(path, "ab") as f:
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
        logger.warning("audit log %s: completed a final record that lacked its newline", path)
        return
    aside = f"{path}.torn-{time.time_ns()}"
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(torn)
        f.flush()
        os.fsync(f.fileno())
    os.truncate(path, keep_offset)
    logger.warning(
        "audit log %s: torn last line (%d bytes, crash mid-write?) moved to %s",
        path,
        len(torn),
        aside,
    )


def _is_valid_continuation(
    path: str, torn: bytes, keep_offset: int, chain_key: bytes | None
) -> bool:
    """True if `torn` is a complete record chaining to the line before it."""
    try:
        record = json.loads(torn)
        if not _self_consistent(record, chain_key) or encode_line(record) != torn + b"\n":
            return False
    except (ValueError, TypeError):
        return False
    if keep_offset > 0:
        prev_line = _line_before(path, keep_offset)
    else:
        series = [p for p in audit_series(path) if p != path]
        prev_line = last_line(series[-1]) if series else None
        if not series:
            return record[PREV_HASH_FIELD] == GENESIS_HASH
    if prev_line is None:
        return False
    try:
        prev = json.loads(prev_line)[HASH_FIELD]
    except (ValueError, KeyError, TypeError):
        return False
    return record[PREV_HASH_FIELD] == prev


def _line_before(path: str, end_offset: int) -> bytes | None:
    """The complete line ending just before `end_offset` (which follows a newline)."""
    with open(path, "rb") as f:
        pos, tail = end_offset, b""
        while pos > 0:
            step = min(_TAIL_CHUNK_BYTES, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
            body = tail[:-1]  # drop the newline at end_offset - 1
            nl = body.rfind(b"\n")
            if nl >= 0:
                return body[nl + 1 :]
        return tail[:-1] if tail else None
