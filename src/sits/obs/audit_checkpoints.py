"""Signed checkpoints of the audit log: its record count and head hash, kept in a second file.

A checkpoint is one canonical JSON line appended (and fsynced, after the log itself) to the
checkpoint file (`--audit-checkpoint-file`) every `--audit-checkpoint-interval` records and at
a clean shutdown:

    {"schema": "sits.audit-checkpoint/1", "num_records": N, "head_hash": H, "time": ISO,
     "reason": "interval" | "shutdown", "key_id": K, "mac": M}

N counts every record of the chain from its genesis (headers included), H is the hash of the
record with seq N - 1, and M = HMAC-SHA256(checkpoint key, canonical JSON without "mac") with
the log's key (`sits.obs.audit_keys`); an unkeyed log writes `key_id` and `mac` null (such
checkpoints anchor the log only as well as their file is out of an attacker's reach).

`check_checkpoints` holds a verified chain to them: fewer records than a checkpoint counts is
a truncation (dropped last records, an emptied log, a torn last line); another hash at a
checkpointed count is a rewritten history (a middle edit with every later hash recomputed).
Records after the last checkpoint are anchored only by the key's MACs: dropping them (and
nothing else) goes unnoticed, so the interval is the window a truncation can hide in.

Other sinks (syslog, an HTTP endpoint an auditor polls) would carry the same lines; only the
file is built.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sits.obs.audit import AuditLogError, canonical_json, encode_line, utc_iso
from sits.obs.audit_files import open_private_append, write_all
from sits.obs.audit_keys import AuditKey, hmac_hex

CHECKPOINT_SCHEMA = "sits.audit-checkpoint/1"
MAC_FIELD = "mac"
INTERVAL_REASON = "interval"
SHUTDOWN_REASON = "shutdown"


class AuditKeyRequiredError(AuditLogError):
    """The log or its checkpoints are keyed and no key was given (a usage error)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One checkpoint line as read back.

    Attributes:
        num_records: records of the chain it covers (headers included).
        head_hash: the hash of record `num_records - 1`.
        time: when it was written (UTC ISO 8601).
        reason: "interval" or "shutdown".
        signed: it carries a MAC (checked when read with the key).
        line_number: 1-based line of the checkpoint file.
    """

    num_records: int
    head_hash: str
    time: str
    reason: str
    signed: bool
    line_number: int


def checkpoint_line(
    num_records: int, head_hash: str, unix_s: float, reason: str, key: AuditKey | None
) -> bytes:
    """The bytes of one checkpoint line (module docstring), signed with `key` when given."""
    body: dict[str, Any] = {
        "schema": CHECKPOINT_SCHEMA,
        "num_records": num_records,
        "head_hash": head_hash,
        "time": utc_iso(unix_s),
        "reason": reason,
        "key_id": None if key is None else key.key_id,
    }
    mac = None if key is None else _mac(body, key)
    return encode_line(body | {MAC_FIELD: mac})


def _mac(body: Mapping[str, Any], key: AuditKey) -> str:
    return hmac_hex(key.checkpoints, canonical_json(body).encode("utf-8"))


class CheckpointFile:
    """The writer's side: appends checkpoint lines to one private (0600) file.

    Raises (constructor):
        OSError: the file cannot be created or opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open_private_append(path)

    def append(self, line: bytes) -> None:
        """Write `line` and fsync the file.

        Raises:
            OSError: the write or the fsync failed.
        """
        write_all(self._file, line)
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


@dataclass(frozen=True, slots=True)
class CheckpointRead:
    """The checkpoints of a file, or the first line that is not one.

    Attributes:
        checkpoints: the valid checkpoints before `problem`, in file order.
        problem: why the first bad line (tampered or foreign) is not a checkpoint, or None.
        problem_line: its 1-based line number (0 with no problem).
        torn_last_line: the last line lacks its newline and does not parse (a crash
            mid-append): ignored.
    """

    checkpoints: tuple[Checkpoint, ...]
    problem: str | None
    torn_last_line: bool
    problem_line: int = 0


def read_checkpoints(path: str, key: AuditKey | None) -> CheckpointRead:
    """Read and check every line of the checkpoint file at `path`.

    With `key`, every line must be signed by it; without, signed lines cannot be checked.

    Raises:
        AuditLogError: the file does not exist or cannot be read.
        AuditKeyRequiredError: no key and a line is signed.
    """
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except OSError as exc:
        raise AuditLogError(f"cannot read the checkpoint file {path}: {exc}") from exc
    last = raw_lines.pop()  # b"" after a final newline
    found: list[Checkpoint] = []
    for number, raw in enumerate(raw_lines, start=1):
        checkpoint, why = _parse(raw, key, number)
        if checkpoint is None:
            return CheckpointRead(tuple(found), why, False, problem_line=number)
        found.append(checkpoint)
    if last:
        checkpoint, why = _parse(last, key, len(raw_lines) + 1)
        if checkpoint is None:
            return CheckpointRead(tuple(found), None, True)
        found.append(checkpoint)
    return CheckpointRead(tuple(found), None, False)


def _parse(raw: bytes, key: AuditKey | None, number: int) -> tuple[Checkpoint | None, str]:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None, "not JSON"
    if not isinstance(obj, dict) or obj.get("schema") != CHECKPOINT_SCHEMA:
        return None, f"not a {CHECKPOINT_SCHEMA} line"
    count, head = obj.get("num_records"), obj.get("head_hash")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None, "no valid num_records"
    if not isinstance(head, str) or not isinstance(obj.get("time"), str):
        return None, "no valid head_hash or time"
    mac = obj.get(MAC_FIELD)
    if mac is not None and key is None:
        raise AuditKeyRequiredError(
            f"the checkpoints in the file are signed (key id {obj.get('key_id')}): pass "
            "--key-file to check them"
        )
    if key is not None:
        if mac is None:
            return None, "unsigned, but the log is keyed (forged)"
        body = {k: v for k, v in obj.items() if k != MAC_FIELD}
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(body, key)):
            return None, "its MAC does not match: forged, altered, or made with another key"
    elif obj.get("key_id") is not None:
        return None, "names a key but carries no MAC (forged)"
    checkpoint = Checkpoint(
        num_records=count,
        head_hash=head,
        time=obj["time"],
        reason=str(obj.get("reason")),
        signed=mac is not None,
        line_number=number,
    )
    return checkpoint, ""


@dataclass(frozen=True, slots=True)
class AnchoredRecord:
    """Where the record ending a checkpointed count sits (collected by the verifier).

    Attributes:
        path: its file.
        line_number: its 1-based line in that file.
        request_id: its request id, if any.
        hash: its stored hash.
    """

    path: str
    line_number: int
    request_id: str | None
    hash: str


@dataclass(frozen=True, slots=True)
class CheckpointFailure:
    """A verified chain that contradicts a checkpoint.

    Attributes:
        checkpoint: the first checkpoint (in file order) it contradicts.
        truncated: True: the log holds fewer records than it counts; False: the record at its
            count has another hash.
        record: the record at the checkpointed count (None when truncated).
    """

    checkpoint: Checkpoint
    truncated: bool
    record: AnchoredRecord | None


def check_checkpoints(
    checkpoints: Sequence[Checkpoint],
    end_count: int,
    first_seq: int,
    anchored: Mapping[int, AnchoredRecord],
) -> CheckpointFailure | None:
    """How the verified chain contradicts the checkpoints, or None: the first checkpoint (in
    file order) whose count ends on another hash, else the one with the largest count past the
    chain's end (truncation).

    Args:
        checkpoints: as read (`read_checkpoints`).
        end_count: the chain's record count: the last verified record's seq + 1 (0: none).
        first_seq: the seq of the first record checked (0 from the genesis; more when older
            files were archived and `--prev-hash` given): checkpoints at or below it are not
            covered by the files given and are skipped.
        anchored: count -> the record with seq count - 1, for every checkpointed count.
    """
    beyond: Checkpoint | None = None
    for checkpoint in checkpoints:
        count = checkpoint.num_records
        if count <= first_seq:
            continue
        if count > end_count:
            if beyond is None or count > beyond.num_records:
                beyond = checkpoint
            continue
        record = anchored[count]
        if record.hash != checkpoint.head_hash:
            return CheckpointFailure(checkpoint, truncated=False, record=record)
    if beyond is not None:
        return CheckpointFailure(beyond, truncated=True, record=None)
    return None
