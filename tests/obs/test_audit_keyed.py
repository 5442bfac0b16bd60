"""The keyed audit log: the key file's checks, the HMAC chain and input hashes, checkpoints
every N records and at close, private (0600) files, and restarts that refuse another key."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from pathlib import Path

import pytest

from sits.core.errors import InvalidParameterError
from sits.obs.audit import (
    GENESIS_HASH,
    AuditLogError,
    audit_series,
    canonical_json,
    encode_line,
    seal,
)
from sits.obs.audit_checkpoints import read_checkpoints
from sits.obs.audit_keys import AuditKey, hkdf_sha256, load_key_file
from sits.obs.audit_verify import verify_log
from sits.obs.audit_writer import AuditWriter, AuditWriterConfig
from tests.obs.records import make_record, write_log

SECRET = b"an audit secret of 32 bytes ...."
KEY = AuditKey.from_secret(SECRET)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _key_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "audit.key"
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def test_key_file_checks(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="does not exist") as err:
        load_key_file(str(tmp_path / "nothing"))
    assert err.value.param == "audit_key_file"
    with pytest.raises(InvalidParameterError, match="is empty"):
        load_key_file(_key_file(tmp_path, b"\n"))
    with pytest.raises(
        InvalidParameterError, match="holds 5 bytes; an audit key needs at least 16"
    ):
        load_key_file(_key_file(tmp_path, b"short"))
    open_file = _key_file(tmp_path, SECRET, mode=0o644)
    with pytest.raises(InvalidParameterError, match=r"open to other users \(mode 0644\)") as err:
        load_key_file(open_file, param="key_file")
    assert err.value.param == "key_file" and f"chmod 600 {open_file}" in str(err.value)
    with pytest.raises(InvalidParameterError, match="mode 0640"):
        load_key_file(_key_file(tmp_path, SECRET, mode=0o640))
    with pytest.raises(InvalidParameterError, match="not a regular file"):
        load_key_file(str(tmp_path))
    # `echo KEY > file` and `printf KEY > file` give the same key
    with_newline = load_key_file(_key_file(tmp_path, SECRET + b"\n"))
    assert with_newline.key_id == load_key_file(_key_file(tmp_path, SECRET)).key_id == KEY.key_id
    assert SECRET.hex() not in repr(with_newline) and "chain" not in repr(with_newline)


def test_derived_keys_are_hkdf_of_the_secret() -> None:
    prk = hmac.new(b"sits.audit/1 hkdf salt", SECRET, hashlib.sha256).digest()
    expand = hmac.new(prk, b"sits.audit/1 chain\x01", hashlib.sha256).digest()
    assert hkdf_sha256(SECRET, b"sits.audit/1 chain") == expand == KEY.chain
    assert len({KEY.chain, KEY.inputs, KEY.checkpoints}) == 3
    assert len(KEY.key_id) == 16 and KEY.key_id != AuditKey.from_secret(SECRET + b"!").key_id


def test_keyed_chain_and_input_hmacs(log_path: Path) -> None:
    write_log(log_path, 3, key=KEY)
    lines = _lines(log_path)
    header = lines[0]
    assert header["kind"] == "header" and header["chain"] == "hmac-sha256"
    assert header["key_id"] == KEY.key_id and header["input_salt"] is None
    prev = GENESIS_HASH
    for seq, record in enumerate(lines):
        body = {k: v for k, v in record.items() if k != "hash"}
        data = (prev + canonical_json(body)).encode()
        assert record["seq"] == seq and record["prev_hash"] == prev
        assert record["hash"] == hmac.new(KEY.chain, data, hashlib.sha256).hexdigest()
        prev = record["hash"]
    first = lines[1]
    assert first["input_hmac"] == hmac.new(KEY.inputs, b"prompt 0", hashlib.sha256).hexdigest()
    ids_hmac = hmac.new(KEY.inputs, b"[1,2,3,0]", hashlib.sha256).hexdigest()
    assert first["prompt_token_ids_hmac"] == ids_hmac
    result = verify_log(log_path, key=KEY)
    assert result.ok and result.num_records == 4 and result.key_id == KEY.key_id


def test_checkpoints_every_n_records_and_at_close(log_path: Path, tmp_path: Path) -> None:
    checkpoints = tmp_path / "audit.checkpoints"
    config = AuditWriterConfig(
        path=str(log_path), key=KEY, checkpoint_path=str(checkpoints), checkpoint_every_records=4
    )
    with AuditWriter(config) as writer:
        for i in range(10):
            assert writer.submit(make_record(i))
    assert writer.stats().num_checkpoints == 3
    lines = _lines(log_path)
    written = _lines(checkpoints)
    assert [(c["num_records"], c["reason"]) for c in written] == [
        (4, "interval"),
        (8, "interval"),
        (11, "shutdown"),
    ]
    for c in written:
        assert c["head_hash"] == lines[c["num_records"] - 1]["hash"]
        assert c["key_id"] == KEY.key_id
        body = {k: v for k, v in c.items() if k != "mac"}
        mac = hmac.new(KEY.checkpoints, canonical_json(body).encode(), hashlib.sha256)
        assert c["mac"] == mac.hexdigest()
    read = read_checkpoints(str(checkpoints), KEY)
    assert read.problem is None and [c.num_records for c in read.checkpoints] == [4, 8, 11]
    # a restart continues the count; its own checkpoints follow the old ones
    with AuditWriter(config) as writer:
        assert writer.submit(make_record(10))
    assert [c["num_records"] for c in _lines(checkpoints)] == [4, 8, 11, 12]
    result = verify_log(log_path, key=KEY, checkpoint_path=str(checkpoints))
    assert result.ok and result.num_records == 12 and len(result.checkpoints) == 4


def test_unkeyed_checkpoints_carry_no_mac(log_path: Path, tmp_path: Path) -> None:
    checkpoints = tmp_path / "audit.checkpoints"
    write_log(log_path, 2, checkpoint_path=str(checkpoints))
    (only,) = _lines(checkpoints)
    assert (only["num_records"], only["key_id"], only["mac"]) == (3, None, None)
    result = verify_log(log_path, checkpoint_path=str(checkpoints))
    assert result.ok and not result.checkpoints[0].signed


def test_files_are_private(log_path: Path, tmp_path: Path) -> None:
    checkpoints = tmp_path / "audit.checkpoints"
    write_log(log_path, 6, max_file_bytes=3000, key=KEY, checkpoint_path=str(checkpoints))
    files = audit_series(log_path)
    assert len(files) >= 2
    for path in (*files, f"{log_path}.lock", checkpoints):
        assert _mode(path) == 0o600, path
    # a log (and checkpoint file) left world-readable by an older sits is narrowed on open
    os.chmod(log_path, 0o644)
    os.chmod(checkpoints, 0o644)
    write_log(log_path, 1, key=KEY, checkpoint_path=str(checkpoints))
    assert _mode(log_path) == _mode(checkpoints) == 0o600
    # a torn tail moved aside keeps its record bytes private too
    log_path.write_bytes(log_path.read_bytes()[:-40])
    write_log(log_path, 1, key=KEY)
    (torn,) = log_path.parent.glob("audit.log.torn-*")
    assert _mode(torn) == 0o600


def test_restart_refuses_another_key_or_none(log_path: Path) -> None:
    write_log(log_path, 2, key=KEY)
    with pytest.raises(AuditLogError, match=f"is keyed \\(key id {KEY.key_id}\\)"):
        AuditWriter(AuditWriterConfig(path=str(log_path)))
    other = AuditKey.from_secret(b"another secret of enough bytes")
    with pytest.raises(AuditLogError, match="written with another key"):
        AuditWriter(AuditWriterConfig(path=str(log_path), key=other))
    unkeyed = log_path.with_name("plain.log")
    write_log(unkeyed, 1)
    with pytest.raises(AuditLogError, match="written without a key"):
        AuditWriter(AuditWriterConfig(path=str(unkeyed), key=KEY))
    with AuditWriter(AuditWriterConfig(path=str(log_path), key=KEY)) as writer:
        assert writer.stats().num_records == 3
    assert verify_log(log_path, key=KEY).ok


def test_restart_refuses_a_log_without_header(log_path: Path) -> None:
    """A log of an older sits (SHA-256 chain, no header, no salt) is kept for verify only."""
    write_log(log_path, 2)
    lines = log_path.read_bytes().splitlines(keepends=True)
    legacy = log_path.with_name("legacy.log")
    body = {k: v for k, v in json.loads(lines[1]).items() if k not in ("hash", "prev_hash", "seq")}
    legacy.write_bytes(encode_line(seal(body, GENESIS_HASH)))
    with pytest.raises(AuditLogError, match="starts with no header record"):
        AuditWriter(AuditWriterConfig(path=str(legacy)))
    assert verify_log(legacy).ok  # still verifiable, unkeyed
