"""`AuditWriter`: appends sealed audit records to the log from one background thread.

Invariants:
- only the writer thread touches the file and the chain head, so records are chained in the
  order they leave the queue, each exactly once;
- a line is written with one `write` of `canonical_json(record) + "\\n"`; a failed write is
  truncated away so the file always ends on a complete line (or on a crash's torn tail);
- at most `fsync_every_records` records or `fsync_interval_s` seconds of records are not yet
  fsynced; `close()` flushes and fsyncs everything queued before it;
- one writer per log: an exclusive `flock` on `PATH.lock` is held while open (POSIX).

Queue policy (the caller's side): `submit` never raises and returns quickly. The queue is large
(default 10,000 records: tens of seconds of a busy server's completions); only when it is full
(the disk has stalled) does `submit` wait up to `enqueue_timeout_s` (default 0.1 s, back
pressure instead of silent loss), then drops the record, counts it in `num_dropped`, calls
`on_drop(request_id)` (hook a Prometheus counter there) and logs an ERROR naming the request.
Set `enqueue_timeout_s=0` where even that short wait is unacceptable.

Restart: opening an existing log continues the chain from the last complete line of the newest
file. A torn last line (crash mid-write) is kept if it is a complete, valid record missing only
its newline; otherwise its bytes are moved to `PATH.torn-<unix_ns>` and the file is truncated
to the last complete line (logged as a WARNING).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sits.core.errors import InvalidParameterError
from sits.obs.audit import (
    GENESIS_HASH,
    HASH_FIELD,
    PREV_HASH_FIELD,
    AuditLogError,
    AuditRecord,
    audit_series,
    chain_hash,
    encode_line,
    seal,
    to_jsonable,
)

logger = logging.getLogger(__name__)

_CLOSE = object()  # queue sentinel
_TAIL_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class AuditWriterConfig:
    """How the audit log is written.

    Attributes:
        path: the active log file; rotated files are `path.1`, `path.2`, ... (higher = newer).
        max_queue_records: records that may wait for the writer thread.
        enqueue_timeout_s: how long `submit` waits on a full queue before dropping (0 = never).
        fsync_every_records: fsync after this many records written since the last fsync.
        fsync_interval_s: fsync records older than this many seconds (checked by the thread).
        max_file_bytes: rotate before a line would grow the active file past this size (a
            single larger line still goes into a file of its own).
    """

    path: str
    max_queue_records: int = 10_000
    enqueue_timeout_s: float = 0.1
    fsync_every_records: int = 64
    fsync_interval_s: float = 1.0
    max_file_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.path:
            raise InvalidParameterError("audit_log", "the audit log path is empty")
        for name in ("max_queue_records", "fsync_every_records", "max_file_bytes"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"{name} must be >= 1")
        for name in ("enqueue_timeout_s", "fsync_interval_s"):
            if getattr(self, name) < 0:
                raise InvalidParameterError(name, f"{name} must be >= 0")


@dataclass(frozen=True, slots=True)
class AuditWriterStats:
    """Counters of one writer (a snapshot).

    Attributes:
        num_submitted: records accepted into the queue.
        num_written: records written to the file (not necessarily fsynced yet).
        num_dropped: records lost: queue full, writer closed, or a write/encode error.
        num_fsyncs: fsync calls made.
        num_rotations: files rotated.
        queue_depth: records waiting now.
        last_hash: the chain head (hash of the last written record).
    """

    num_submitted: int
    num_written: int
    num_dropped: int
    num_fsyncs: int
    num_rotations: int
    queue_depth: int
    last_hash: str


class AuditWriter:
    """Background writer of one audit log; thread-safe `submit`, idempotent `close`.

    Usage: `w = AuditWriter(cfg); w.submit(record); ...; w.close()` (or a `with` block).

    Raises (constructor):
        AuditLogError: the log is locked by another writer, or its last complete line is not a
            valid record (run `sits audit verify` and move the file aside).
        OSError: the file cannot be created or opened.
    """

    def __init__(
        self,
        config: AuditWriterConfig,
        on_drop: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._on_drop = on_drop
        self._clock = clock
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.max_queue_records)
        self._counter_lock = threading.Lock()
        self._closed = False
        self._num_submitted = 0
        self._num_written = 0
        self._num_dropped = 0
        self._num_fsyncs = 0
        self._num_rotations = 0
        directory = os.path.dirname(os.path.abspath(config.path))
        os.makedirs(directory, exist_ok=True)
        self._lock_fd = _acquire_lock(config.path + ".lock")
        try:
            self._last_hash = _recover_head(config.path)
            self._file = open(config.path, "ab", buffering=0)  # noqa: SIM115 - owned until close()
        except BaseException:
            _release_lock(self._lock_fd)
            raise
        self._size_bytes = self._file.seek(0, os.SEEK_END)
        self._num_unsynced = 0
        self._oldest_unsynced_s = 0.0
        self._thread = threading.Thread(target=self._run, name="sits-audit-writer", daemon=True)
        self._thread.start()

    def __enter__(self) -> AuditWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def last_hash(self) -> str:
        """The hash of the last record written (GENESIS_HASH for a new log)."""
        return self._last_hash

    def stats(self) -> AuditWriterStats:
        """A snapshot of the counters."""
        with self._counter_lock:
            return AuditWriterStats(
                num_submitted=self._num_submitted,
                num_written=self._num_written,
                num_dropped=self._num_dropped,
                num_fsyncs=self._num_fsyncs,
                num_rotations=self._num_rotations,
                queue_depth=self._queue.qsize(),
                last_hash=self._last_hash,
            )

    def submit(self, record: AuditRecord) -> bool:
        """Queue one record for writing; True if queued, False if dropped (never raises).

        Waits at most `enqueue_timeout_s`, and only when the queue is full.
        """
        if self._closed:
            self._drop(record.request_id, "the audit writer is closed")
            return False
        try:
            timeout_s = self.config.enqueue_timeout_s
            self._queue.put(record, block=timeout_s > 0, timeout=timeout_s or None)
        except queue.Full:
            self._drop(record.request_id, f"the queue is full ({self.config.max_queue_records})")
            return False
        with self._counter_lock:
            self._num_submitted += 1
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Write everything queued, fsync, close the file and release the lock (idempotent).

        Records submitted after `close()` starts are dropped (and counted).
        """
        if self._closed:
            return
        self._closed = True
        self._queue.put(_CLOSE)  # unbounded wait: the thread drains the queue
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("audit writer did not finish within %.1f s", timeout_s or 0.0)
            return
        _release_lock(self._lock_fd)
        while True:  # a submit racing with close() may have queued behind the sentinel
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _CLOSE:
                self._drop(item.request_id, "submitted while the audit writer was closing")

    # ---- writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                item = self._next_item()
                if item is _CLOSE:
                    break
                try:
                    if item is not None:
                        self._write_record(item)
                    self._maybe_fsync()
                except Exception:  # keep the thread alive whatever one record does
                    logger.exception("audit writer failed on one record")
                    if item is not None:
                        self._drop(item.request_id, "unexpected error (logged above)")
        finally:
            self._fsync()
            self._file.close()

    def _next_item(self) -> Any:
        """The next record, or None when the fsync deadline passes first."""
        if self._num_unsynced == 0:
            return self._queue.get()
        deadline_s = self._oldest_unsynced_s + self.config.fsync_interval_s
        wait_s = max(0.0, deadline_s - self._clock())
        try:
            return self._queue.get(timeout=wait_s)
        except queue.Empty:
            return None

    def _write_record(self, record: AuditRecord) -> None:
        try:
            line, new_hash = self._encode(record)
        except (TypeError, ValueError) as exc:
            self._drop(record.request_id, f"cannot encode the record: {exc}")
            return
        if self._size_bytes > 0 and self._size_bytes + len(line) > self.config.max_file_bytes:
            try:
                self._rotate()
            except OSError:
                logger.exception("audit log rotation failed; continuing in %s", self.config.path)
        start_bytes = self._size_bytes
        try:
            _write_all(self._file, line)
        except (OSError, ValueError) as exc:
            self._undo_partial_write(start_bytes)
            self._drop(record.request_id, f"write failed: {exc}")
            return
        self._size_bytes += len(line)
        self._last_hash = new_hash
        if self._num_unsynced == 0:
            self._oldest_unsynced_s = self._clock()
        self._num_unsynced += 1
        with self._counter_lock:
            self._num_written += 1

    def _encode(self, record: AuditRecord) -> tuple[bytes, str]:
        body = record.to_body()
        try:
            sealed = seal(body, self._last_hash)
            return encode_line(sealed), sealed[HASH_FIELD]
        except (UnicodeEncodeError, ValueError):
            # NaN/inf or lone surrogates in a field: encode a cleaned copy, never lose the record.
            sealed = seal(to_jsonable(body), self._last_hash)
            return encode_line(sealed), sealed[HASH_FIELD]

    def _undo_partial_write(self, start_bytes: int) -> None:
        try:
            os.truncate(self.config.path, start_bytes)
        except OSError:
            logger.exception("cannot truncate a partial audit line in %s", self.config.path)

    def _maybe_fsync(self) -> None:
        if self._num_unsynced == 0:
            return
        due = self._num_unsynced >= self.config.fsync_every_records
        if due or self._clock() - self._oldest_unsynced_s >= self.config.fsync_interval_s:
            self._fsync()

    def _fsync(self) -> None:
        if self._num_unsynced == 0 or self._file.closed:
            return
        try:
            os.fsync(self._file.fileno())
        except OSError:
            logger.exception("fsync of the audit log %s failed", self.config.path)
            return
        self._num_unsynced = 0
        with self._counter_lock:
            self._num_fsyncs += 1

    def _rotate(self) -> None:
        """Rename the full active file to `PATH.<k+1>` and start a new, empty `PATH`."""
        self._fsync()
        self._file.close()
        path = self.config.path
        rotated = [p for p in audit_series(path) if p != path]
        next_index = int(rotated[-1].rsplit(".", 1)[1]) + 1 if rotated else 1
        os.rename(path, f"{path}.{next_index}")
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - owned until close()
        _fsync_dir(path)
        self._size_bytes = 0
        with self._counter_lock:
            self._num_rotations += 1

    def _drop(self, request_id: str, why: str) -> None:
        with self._counter_lock:
            self._num_dropped += 1
        logger.error("audit record of request %s DROPPED: %s", request_id, why)
        if self._on_drop is not None:
            try:
                self._on_drop(request_id)
            except Exception:
                logger.exception("audit on_drop callback failed")


def _write_all(file: Any, data: bytes) -> None:
    """Write every byte of `data` to an unbuffered (raw) file."""
    view = memoryview(data)
    while view:
        written = file.write(view)
        view = view[written:]


def _recover_head(path: str) -> str:
    """The chain head to continue from; repairs a torn tail of `path` (see the module doc).

    Raises:
        AuditLogError: the last complete line is not a self-consistent record.
    """
    for file_path in reversed(audit_series(path)):
        if file_path == path:
            _repair_torn_tail(path)
        line = _last_line(file_path)
        if line is not None:
            return _head_of(line, file_path)
    return GENESIS_HASH


def _head_of(line: bytes, file_path: str) -> str:
    try:
        record = json.loads(line)
        stored = record[HASH_FIELD]
        body = {k: v for k, v in record.items() if k != HASH_FIELD}
        ok = chain_hash(record[PREV_HASH_FIELD], body) == stored
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise AuditLogError(
            f"the last line of the audit log {file_path} is not a valid record; run "
            f"`sits audit verify` and move the file aside before writing a new log"
        )
    return stored


def _last_line(file_path: str) -> bytes | None:
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


def _repair_torn_tail(path: str) -> None:
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
    if _is_valid_continuation(path, torn, keep_offset):
        with open(path, "ab") as f:
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
        logger.warning("audit log %s: completed a final record that lacked its newline", path)
        return
    aside = f"{path}.torn-{time.time_ns()}"
    with open(aside, "wb") as f:
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


def _is_valid_continuation(path: str, torn: bytes, keep_offset: int) -> bool:
    """True if `torn` is a complete record chaining to the line before it."""
    try:
        record = json.loads(torn)
        body = {k: v for k, v in record.items() if k != HASH_FIELD}
        if chain_hash(record[PREV_HASH_FIELD], body) != record[HASH_FIELD]:
            return False
        if encode_line(record) != torn + b"\n":
            return False
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    prev = GENESIS_HASH
    if keep_offset > 0:
        prev_line = _line_before(path, keep_offset)
        if prev_line is None:
            return False
        try:
            prev = json.loads(prev_line)[HASH_FIELD]
        except (ValueError, KeyError, TypeError):
            return False
    else:
        series = [p for p in audit_series(path) if p != path]
        if series:
            last = _last_line(series[-1])
            if last is None:
                return False
            try:
                prev = json.loads(last)[HASH_FIELD]
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


def _acquire_lock(lock_path: str) -> int:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process protection
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise AuditLogError(f"the audit log {lock_path[:-5]} is in use by another writer") from exc
    return fd


def _release_lock(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)  # closing the descriptor releases the flock


def _fsync_dir(path: str) -> None:
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
