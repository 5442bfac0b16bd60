"""The audit log's secret: the key file (`--audit-key-file`, `--key-file`) and its derived keys.

The key file holds a secret the auditor keeps outside the log (and outside the reach of
whoever could edit the log). Its bytes, less one trailing line ending, must be at least
`MIN_KEY_BYTES` long. From them HKDF-SHA256 (RFC 5869: extract with a fixed salt, then one
expand block per label; standard-library `hmac`) derives one 32-byte key per use, so a MAC made
for one purpose is never valid for another (a prompt chosen to equal `prev_hash || record`
cannot turn its stored input HMAC into a record hash):
- `chain`: a record's `hash` = HMAC-SHA256(chain, prev_hash || canonical record bytes);
- `inputs`: the input text and the prompt's token ids are stored as HMAC-SHA256(inputs, ...);
- `checkpoints`: each checkpoint's `mac`;
- `key_id`: 16 hex digits (a MAC of a fixed label, revealing nothing of the key) written in
  the log's header records and checkpoints, so a wrong key file is told from a forged log.

Invariants: the secret and the derived keys never appear in a repr, a log line or a message.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass, field

from sits.core.errors import InvalidParameterError

MIN_KEY_BYTES = 16
KEY_ID_HEX_DIGITS = 16
_HKDF_SALT = b"sits.audit/1 hkdf salt"


def hkdf_sha256(secret: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) of `secret` with a fixed salt: one 32-byte output block."""
    prk = hmac.new(_HKDF_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def hmac_hex(key: bytes, data: bytes) -> str:
    """HMAC-SHA256 of `data` under `key`, as 64 lowercase hex digits."""
    return hmac.new(key, data, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class AuditKey:
    """The keys derived from one audit secret (see the module docstring).

    Attributes:
        chain: 32 bytes, the record-hash key.
        inputs: 32 bytes, the key of the input and prompt-token HMACs.
        checkpoints: 32 bytes, the checkpoint MAC key.
        key_id: 16 hex digits naming the secret.
        source: where the secret came from (a path), for messages.
    """

    chain: bytes = field(repr=False)
    inputs: bytes = field(repr=False)
    checkpoints: bytes = field(repr=False)
    key_id: str
    source: str = "<bytes>"

    @classmethod
    def from_secret(cls, secret: bytes, source: str = "<bytes>") -> AuditKey:
        """Derive the keys of `secret`.

        Raises:
            ValueError: `secret` is shorter than `MIN_KEY_BYTES`.
        """
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"an audit key needs at least {MIN_KEY_BYTES} bytes")
        key_id = hkdf_sha256(secret, b"sits.audit/1 key id").hex()[:KEY_ID_HEX_DIGITS]
        return cls(
            chain=hkdf_sha256(secret, b"sits.audit/1 chain"),
            inputs=hkdf_sha256(secret, b"sits.audit/1 inputs"),
            checkpoints=hkdf_sha256(secret, b"sits.audit/1 checkpoints"),
            key_id=key_id,
            source=source,
        )


def load_key_file(path: str, param: str = "audit_key_file") -> AuditKey:
    """Read and check the key file at `path` (its bytes less one trailing line ending).

    Args:
        path: the key file.
        param: the flag to name in errors ("audit_key_file" for `sits serve`, "key_file" for
            `sits audit verify`).

    Raises:
        InvalidParameterError(param): the file is missing or not a regular file, cannot be
            read, is empty or shorter than `MIN_KEY_BYTES`, or (POSIX) its group or other
            users may read or write it (mode & 0o077: `chmod 600`).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InvalidParameterError(param, f"the audit key file {path} does not exist") from None
    except OSError as exc:
        raise InvalidParameterError(param, f"cannot read the audit key file {path}: {exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise InvalidParameterError(param, f"the audit key file {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if os.name == "posix" and mode & 0o077:
        raise InvalidParameterError(
            param,
            f"the audit key file {path} is open to other users (mode {mode:04o}): the key "
            f"must be private to the server's user; run `chmod 600 {path}`",
        )
    try:
        with open(path, "rb") as f:
            secret = f.read()
    except OSError as exc:
        raise InvalidParameterError(param, f"cannot read the audit key file {path}: {exc}") from exc
    secret = strip_line_ending(secret)
    if not secret:
        raise InvalidParameterError(param, f"the audit key file {path} is empty")
    if len(secret) < MIN_KEY_BYTES:
        raise InvalidParameterError(
            param,
            f"the audit key file {path} holds {len(secret)} bytes; an audit key needs at least "
            f"{MIN_KEY_BYTES} (e.g. `openssl rand -hex 32 > {path}`)",
        )
    return AuditKey.from_secret(secret, source=path)


def strip_line_ending(data: bytes) -> bytes:
    """`data` without one trailing "\\n" or "\\r\\n" (`echo KEY > file` and `printf` agree)."""
    if data.endswith(b"\r\n"):
        return data[:-2]
    if data.endswith(b"\n"):
        return data[:-1]
    return data
