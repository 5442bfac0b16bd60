"""API-key hashing: keys are stored and compared only as SHA-256 hex digests.

Invariants: a key hash is exactly 64 lowercase hexadecimal characters (`normalize_key_hash`
lowercases an uppercase one); a key itself is never kept after hashing.
"""

from __future__ import annotations

import hashlib
import hmac
import string

KEY_HASH_LEN = 64
_HEX_DIGITS = frozenset(string.hexdigits)


def hash_api_key(key: str) -> str:
    """SHA-256 of the key's UTF-8 bytes, as 64 lowercase hex characters.

    This is what `sits tenants hash-key KEY` prints and what `api_key_sha256` holds.
    """
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def is_key_hash(value: str) -> bool:
    """True when `value` is 64 hex characters (either case)."""
    return len(value) == KEY_HASH_LEN and all(ch in _HEX_DIGITS for ch in value)


def normalize_key_hash(value: str) -> str:
    """The lowercase form of a key hash.

    Raises:
        ValueError: `value` is not 64 hex characters.
    """
    if not is_key_hash(value):
        raise ValueError(f"expected 64 hex characters (a SHA-256 digest), got {value!r}")
    return value.lower()


def key_hashes_equal(a: str, b: str) -> bool:
    """Constant-time equality of two key hashes (`hmac.compare_digest`)."""
    return hmac.compare_digest(a.encode("ascii"), b.encode("ascii"))
