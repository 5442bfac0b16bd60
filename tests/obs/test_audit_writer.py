"""The background writer: exactly-once under concurrency, drops, fsync batching, rotation,
restart and crash recovery (keys, checkpoints and file modes: test_audit_keyed.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from sits.obs.audit import AuditLogError, audit_series
from sits.obs.audit_verify import verify_log
from sits.obs.audit_writer import AuditWriter, AuditWriterConfig
from tests.obs.records import make_record, write_log


def _records(path) -> list[dict]:
    """Every record of the series, headers included."""
    out = []
    for file_path in audit_series(path):
        with open(file_path, "rb") as f:
            out += [json.loads(line) for line in f]
    return out


def _requests(path) -> list[dict]:
    """The request records of the series (no headers)."""
    return [r for r in _records(path) if r["kind"] != "header"]


def test_concurrent_producers_each_record_once(log_path, open_writer) -> None:
    writer = open_writer(max_queue_records=16, enqueue_timeout_s=30.0)
    num_threads, per_thread = 8, 40

    def produce(t: int) -> None:
        for j in range(per_thread):
            assert writer.submit(make_record(t * 1000 + j))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    writer.close()
    ids = [r["request_id"] for r in _requests(log_path)]
    expected = {f"req-{t * 1000 + j}" for t in range(num_threads) for j in range(per_thread)}
    assert len(ids) == num_threads * per_thread and set(ids) == expected
    stats = writer.stats()
    assert (stats.num_submitted, stats.num_written, stats.num_dropped) == (320, 320, 0)
    result = verify_log(log_path)
    assert result.ok and result.num_records == 321 and result.last_hash == stats.last_hash
    assert (result.num_headers, result.num_requests) == (1, 320)
    assert [r["seq"] for r in _records(log_path)] == list(range(321))


class _BlockingRecord:
    """A record whose encoding waits for `release`, to hold the writer thread."""

    def __init__(self, started: threading.Event, release: threading.Event) -> None:
        self.request_id = "blocker"
        self._started, self._release = started, release

    def to_body(self, digest) -> dict:
        self._started.set()
        assert self._release.wait(30)
        return make_record(0).to_body(digest) | {"request_id": "blocker"}


def test_full_queue_drops_counts_and_calls_hook(log_path) -> None:
    dropped: list[str] = []
    cfg = AuditWriterConfig(path=str(log_path), max_queue_records=1, enqueue_timeout_s=0.0)
    writer = AuditWriter(cfg, on_drop=dropped.append)
    started, release = threading.Event(), threading.Event()
    assert writer.submit(_BlockingRecord(started, release))
    assert started.wait(30)  # the thread holds the blocker; the queue is empty
    assert writer.submit(make_record(1))  # fills the queue
    assert not writer.submit(make_record(2))  # full: dropped at once
    release.set()
    writer.close()
    assert dropped == ["req-2"]
    assert writer.stats().num_dropped == 1
    assert [r["request_id"] for r in _requests(log_path)] == ["blocker", "req-1"]
    assert not writer.submit(make_record(3))  # closed
    assert dropped == ["req-2", "req-3"]


def test_fsync_batching_by_count(log_path, open_writer) -> None:
    writer = open_writer(fsync_every_records=5, fsync_interval_s=1000.0)
    for i in range(12):
        writer.submit(make_record(i))
    writer.close()
    assert writer.stats().num_fsyncs == 3  # after lines 5 and 10 (the header first), at close


def test_fsync_batching_by_time(log_path) -> None:
    now = [0.0]
    cfg = AuditWriterConfig(path=str(log_path), fsync_every_records=100, fsync_interval_s=1.0)
    writer = AuditWriter(cfg, clock=lambda: now[0])
    writer.submit(make_record(0))
    while writer.stats().num_written < 1:
        time.sleep(0.001)
    now[0] = 2.0  # record 0 is now older than the interval
    writer.submit(make_record(1))
    while writer.stats().num_written < 2:
        time.sleep(0.001)
    writer.submit(make_record(2))
    writer.close()
    assert writer.stats().num_fsyncs == 2  # records 0+1 when 1 arrived late, record 2 at close


def test_rotation_keeps_one_chain(log_path) -> None:
    write_log(log_path, 10, max_file_bytes=3000)
    files = audit_series(log_path)
    assert files[-1] == str(log_path) and files[0] == f"{log_path}.1"
    assert len(files) >= 4
    assert [r["request_id"] for r in _requests(log_path)] == [f"req-{i}" for i in range(10)]
    result = verify_log(log_path)
    assert result.ok and result.num_records == 10 + len(files) and len(result.files) == len(files)
    first_of_second = json.loads(Path(files[1]).read_bytes().splitlines()[0])
    last_of_first = json.loads(Path(files[0]).read_bytes().splitlines()[-1])
    assert first_of_second["kind"] == "header"  # every file starts with its own header
    assert first_of_second["prev_hash"] == last_of_first["hash"]
    salts = {json.loads(Path(p).read_bytes().splitlines()[0])["input_salt"] for p in files}
    assert len(salts) == len(files)  # a fresh salt per file


def test_restart_continues_chain_across_rotation(log_path) -> None:
    write_log(log_path, 3)
    head = json.loads(log_path.read_bytes().splitlines()[-1])["hash"]
    with AuditWriter(AuditWriterConfig(path=str(log_path))) as writer:
        assert writer.last_hash == head
        writer.submit(make_record(3))
    requests = _requests(log_path)
    assert requests[3]["prev_hash"] == head
    assert [r["kind"] for r in _records(log_path)] == ["header"] + ["request"] * 4
    # an empty active file after a rotation continues from the newest rotated file
    log_path.rename(f"{log_path}.1")
    log_path.touch()
    write_log(log_path, 1)
    new_header, last = _records(log_path)[-2:]
    assert new_header["kind"] == "header" and new_header["prev_hash"] == requests[3]["hash"]
    assert last["prev_hash"] == new_header["hash"] and last["seq"] == 6
    assert verify_log(log_path).num_records == 7


def test_restart_counts_existing_bytes_for_rotation(log_path) -> None:
    write_log(log_path, 1, max_file_bytes=3000)  # one line is about 1.2 kB
    write_log(log_path, 3, max_file_bytes=3000)
    sizes = [Path(p).stat().st_size for p in audit_series(log_path)]
    assert len(sizes) == 2 and max(sizes) <= 3000
    assert verify_log(log_path).num_records == 4 + 2


def test_restart_after_torn_tail_moves_it_aside(log_path) -> None:
    write_log(log_path, 4)
    data = log_path.read_bytes()
    cut = data.rstrip(b"\n").rfind(b"\n") + 1 + 40  # 40 bytes into the last line
    log_path.write_bytes(data[:cut])
    write_log(log_path, 2)
    torn = list(log_path.parent.glob("audit.log.torn-*"))
    assert len(torn) == 1 and torn[0].read_bytes() == data[cut - 40 : cut]
    result = verify_log(log_path)
    assert result.ok and result.torn_tail is None and result.num_records == 1 + 5
    assert [r["request_id"] for r in _requests(log_path)] == [
        "req-0", "req-1", "req-2", "req-0", "req-1"
    ]  # fmt: skip


def test_restart_completes_record_missing_only_newline(log_path) -> None:
    write_log(log_path, 2)
    log_path.write_bytes(log_path.read_bytes()[:-1])
    write_log(log_path, 1)
    assert list(log_path.parent.glob("audit.log.torn-*")) == []
    assert verify_log(log_path).num_records == 1 + 3


def test_refuses_corrupt_last_line_and_second_writer(log_path, open_writer) -> None:
    first = open_writer()
    with pytest.raises(AuditLogError, match="in use"):
        AuditWriter(AuditWriterConfig(path=str(log_path)))
    first.close()
    log_path.write_bytes(b'{"not": "a record"}\n')
    with pytest.raises(AuditLogError, match="not a valid record"):
        AuditWriter(AuditWriterConfig(path=str(log_path)))
    # the lock was released by the failed open: a good log opens again
    log_path.unlink()
    with AuditWriter(AuditWriterConfig(path=str(log_path))) as writer:
        assert writer.stats().num_records == 1  # its header


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_queue_records"):
        AuditWriterConfig(path="x", max_queue_records=0)
    with pytest.raises(ValueError, match="fsync_interval_s"):
        AuditWriterConfig(path="x", fsync_interval_s=-1)
