"""`AuditWriter`: appends sealed audit records to the log from one background thread.

Invariants:
- only the writer thread touches the file and the chain head (after the constructor), so
  records are chained in the order they leave the queue, each exactly once, `seq` counting up;
- every file of the log starts with a header record (`sits.obs.audit.header_body`): written
  when a new log or an empty active file is opened and after each rotation; unkeyed, each
  header carries a fresh random input salt;
- a line is written with one `write` of `canonical_json(record) + "\\n"`; a failed write is
  truncated away so the file always ends on a complete line (or on a crash's torn tail);
- at most `fsync_every_records` records or `fsync_interval_s` seconds of records are not yet
  fsynced; `close()` flushes and fsyncs everything queued before it;
- with a checkpoint file, a checkpoint (`sits.obs.audit_checkpoints`) follows every
  `checkpoint_every_records` records and `close()`; the log is fsynced before each, so a
  checkpoint never counts a record a crash could lose;
- the log, its rotations, the lock and the checkpoint file are created 0600
  (`sits.obs.audit_files`);
- one writer per log: an exclusive `flock` on `PATH.lock` is held while open (POSIX).

Queue policy (the caller's side): `submit` never raises and returns quickly. The queue is large
(default 10,000 records: tens of seconds of a busy server's completions); only when it is full
(the disk has stalled) does `submit` wait up to `enqueue_timeout_s` (default 0.1 s, back
pressure instead of silent loss), then drops the record, counts it in `num_dropped`, calls
`on_drop(request_id)` (hook a Prometheus counter there) and logs an ERROR naming the request.
Set `enqueue_timeout_s=0` where even that short wait is unacceptable.

Restart: opening an existing log continues the chain from the last complete line of the newest
file, with the key its header names (`sits.obs.audit_files.recover_head`, which also repairs a
torn last line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from sits.core.errors import InvalidParameterError
from sits.obs.audit import (
    HASH_FIELD,
    SALT_BYTES,
    SEQ_FIELD,
    AuditLogError,
    InputDigest,
    audit_series,
    encode_line,
    header_body,
    seal,
    to_jsonable,
)
from sits.obs.audit_checkpoints import (
    INTERVAL_REASON,
    SHUTDOWN_REASON,
    CheckpointFile,
    checkpoint_line,
)
from sits.obs.audit_files import (
    PRIVATE_MODE,
    fsync_dir,
    open_private_append,
    recover_head,
    write_all,
)
from sits.obs.audit_keys import AuditKey

logger = logging.getLogger(__name__)

_CLOSE = object()  # queue sentinel


class AuditEntry(Protocol):
    """What the writer reads of a record (`AuditRecord`, `AuditRefusal`)."""

    @property
    def request_id(self) -> str: ...

    def to_body(self, digest: InputDigest) -> Mapping[str, Any]: ...


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
            single larger line still goes into a file of its own, after its header).
        key: the audit key (`--audit-key-file`): HMAC chain, keyed input hashes, signed
            checkpoints; None = an unkeyed SHA-256 chain with salted input hashes.
        checkpoint_path: the checkpoint file (`--audit-checkpoint-file`); None = none.
        checkpoint_every_records: records between two checkpoints (`--audit-checkpoint-interval`).
    """

    path: str
    max_queue_records: int = 10_000
    enqueue_timeout_s: float = 0.1
    fsync_every_records: int = 64
    fsync_interval_s: float = 1.0
    max_file_bytes: int = 256 * 1024 * 1024
    key: AuditKey | None = field(default=None, repr=False)
    checkpoint_path: str | None = None
    checkpoint_every_records: int = 100

    def __post_init__(self) -> None:
        if not self.path:
            raise InvalidParameterError("audit_log", "the audit log path is empty")
        names = ("max_queue_records", "fsync_every_records", "max_file_bytes")
        for name in (*names, "checkpoint_every_records"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"{name} must be >= 1")
        for name in ("enqueue_timeout_s", "fsync_interval_s"):
            if getattr(self, name) < 0:
                raise InvalidParameterError(name, f"{name} must be >= 0")
        if self.checkpoint_path is not None and _same_file(self.checkpoint_path, self.path):
            raise InvalidParameterError(
                "audit_checkpoint_file", "the checkpoint file must not be the audit log"
            )


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


@dataclass(frozen=True, slots=True)
class AuditWriterStats:
    """Counters of one writer (a snapshot).

    Attributes:
        num_submitted: records accepted into the queue.
        num_written: records written to the file (not necessarily fsynced yet; headers not
            counted).
        num_dropped: records lost: queue full, writer closed, or a write/encode error.
        num_fsyncs: fsync calls made.
        num_rotations: files rotated.
        num_checkpoints: checkpoints written.
        queue_depth: records waiting now.
        last_hash: the chain head (hash of the last written record).
        num_records: records in the chain, headers included (the next seq).
    """

    num_submitted: int
    num_written: int
    num_dropped: int
    num_fsyncs: int
    num_rotations: int
    num_checkpoints: int
    queue_depth: int
    last_hash: str
    num_records: int


class AuditWriter:
    """Background writer of one audit log; thread-safe `submit`, idempotent `close`.

    Usage: `w = AuditWriter(cfg); w.submit(record); ...; w.close()` (or a `with` block).

    Raises (constructor):
        AuditLogError: the log is locked by another writer, its newest file's header names
            another key (or none, or one where the config has none), or its last complete line
            is not a valid record (run `sits audit verify` and move the file aside).
        OSError: a file cannot be created, opened or written.
    """

    def __init__(
        self,
        config: AuditWriterConfig,
        on_drop: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._key = config.key
        self._chain_key = None if config.key is None else config.key.chain
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
        self._num_checkpoints = 0
        self._num_unsynced = 0
        self._oldest_unsynced_s = 0.0
        directory = os.path.dirname(os.path.abspath(config.path))
        os.makedirs(directory, exist_ok=True)
        self._lock_fd = _acquire_lock(config.path + ".lock")
        self._checkpoints: CheckpointFile | None = None
        try:
            head = recover_head(config.path, config.key)
            self._file = open_private_append(config.path)
            if config.checkpoint_path is not None:
                self._checkpoints = CheckpointFile(config.checkpoint_path)
            self._size_bytes = self._file.seek(0, os.SEEK_END)
            self._last_hash = head.last_hash
            self._num_records = head.num_records
            self._since_checkpoint = 0
            if head.needs_header:
                self._start_file()
            else:
                self._digest = self._file_digest(head.input_salt)
        except BaseException:
            self._close_files()
            _release_lock(self._lock_fd)
            raise
        self._thread = threading.Thread(target=self._run, name="sits-audit-writer", daemon=True)
        self._thread.start()

    def __enter__(self) -> AuditWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def last_hash(self) -> str:
        """The hash of the last record written (the header's when no request was written)."""
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
                num_checkpoints=self._num_checkpoints,
                queue_depth=self._queue.qsize(),
                last_hash=self._last_hash,
                num_records=self._num_records,
            )

    def submit(self, record: AuditEntry) -> bool:
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
        """Write everything queued, fsync, checkpoint, close the files and release the lock
        (idempotent). Records submitted after `close()` starts are dropped (and counted).
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
            self._checkpoint(SHUTDOWN_REASON)
            self._close_files()

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

    def _write_record(self, record: AuditEntry) -> None:
        try:
            line, new_hash = self._encode(record.to_body(self._digest))
        except (TypeError, ValueError) as exc:
            self._drop(record.request_id, f"cannot encode the record: {exc}")
            return
        if self._size_bytes > 0 and self._size_bytes + len(line) > self.config.max_file_bytes:
            try:
                self._rotate()
            except OSError:
                logger.exception("audit log rotation failed; continuing in %s", self.config.path)
            # after the new file's header: the next seq, its hash, its input digest
            line, new_hash = self._encode(record.to_body(self._digest))
        try:
            self._append(line, new_hash)
        except (OSError, ValueError) as exc:
            self._drop(record.request_id, f"write failed: {exc}")
            return
        with self._counter_lock:
            self._num_written += 1
        if self._since_checkpoint >= self.config.checkpoint_every_records:
            self._checkpoint(INTERVAL_REASON)

    def _encode(self, body: Mapping[str, Any]) -> tuple[bytes, str]:
        """The line and hash of `body` as the next record of the chain."""
        body = {**body, SEQ_FIELD: self._num_records}
        try:
            sealed = seal(body, self._last_hash, self._chain_key)
        except (UnicodeEncodeError, ValueError):
            # NaN/inf or lone surrogates in a field: encode a cleaned copy, never lose the record.
            sealed = seal(to_jsonable(body), self._last_hash, self._chain_key)
        return encode_line(sealed), sealed[HASH_FIELD]

    def _append(self, line: bytes, new_hash: str) -> None:
        """Write one sealed line; a partial write is truncated away before the error leaves.

        Raises:
            OSError, ValueError: the write failed (nothing of the line stays in the file).
        """
        start_bytes = self._size_bytes
        try:
            write_all(self._file, line)
        except (OSError, ValueError):
            self._undo_partial_write(start_bytes)
            raise
        self._size_bytes += len(line)
        self._last_hash = new_hash
        with self._counter_lock:
            self._num_records += 1
        self._since_checkpoint += 1
        if self._num_unsynced == 0:
            self._oldest_unsynced_s = self._clock()
        self._num_unsynced += 1

    def _file_digest(self, salt_hex: str | None) -> InputDigest:
        if self._key is not None:
            return InputDigest(self._key.inputs)
        assert salt_hex is not None, "an unkeyed file has a salt"
        return InputDigest(bytes.fromhex(salt_hex))

    def _start_file(self) -> None:
        """Write the header of the (empty) active file and take its input digest.

        Raises:
            OSError, ValueError: the header could not be written.
        """
        salt = None if self._key is not None else secrets.token_hex(SALT_BYTES)
        key_id = None if self._key is None else self._key.key_id
        line, new_hash = self._encode(header_body(time.time(), key_id, salt))
        self._append(line, new_hash)
        self._digest = self._file_digest(salt)

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

    def _fsync(self) -> bool:
        """fsync what is written; True when nothing is left unsynced."""
        if self._num_unsynced == 0:
            return True
        if self._file.closed:
            return False
        try:
            os.fsync(self._file.fileno())
        except OSError:
            logger.exception("fsync of the audit log %s failed", self.config.path)
            return False
        self._num_unsynced = 0
        with self._counter_lock:
            self._num_fsyncs += 1
        return True

    def _checkpoint(self, reason: str) -> None:
        """Append a checkpoint of the durable head (the log is fsynced first)."""
        if self._checkpoints is None or self._num_records == 0:
            return
        if not self._fsync():
            logger.error("audit checkpoint skipped: the log %s is not synced", self.config.path)
            return
        line = checkpoint_line(self._num_records, self._last_hash, time.time(), reason, self._key)
        try:
            self._checkpoints.append(line)
        except (OSError, ValueError):
            logger.exception("cannot write the audit checkpoint to %s", self._checkpoints.path)
            return
        self._since_checkpoint = 0
        with self._counter_lock:
            self._num_checkpoints += 1

    def _rotate(self) -> None:
        """Rename the full active file to `PATH.<k+1>` and start a new `PATH` with a header."""
        self._fsync()
        self._file.close()
        path = self.config.path
        rotated = [p for p in audit_series(path) if p != path]
        next_index = int(rotated[-1].rsplit(".", 1)[1]) + 1 if rotated else 1
        os.rename(path, f"{path}.{next_index}")
        self._file = open_private_append(path)
        fsync_dir(path)
        self._size_bytes = 0
        with self._counter_lock:
            self._num_rotations += 1
        self._start_file()

    def _close_files(self) -> None:
        for file in (getattr(self, "_file", None), self._checkpoints):
            if file is not None:
                with contextlib.suppress(OSError):
                    file.close()

    def _drop(self, request_id: str, why: str) -> None:
        with self._counter_lock:
            self._num_dropped += 1
        logger.error("audit record of request %s DROPPED: %s", request_id, why)
        if self._on_drop is not None:
            try:
                self._on_drop(request_id)
            except Exception:
                logger.exception("audit on_drop callback failed")


def _acquire_lock(lock_path: str) -> int:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, PRIVATE_MODE)
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
