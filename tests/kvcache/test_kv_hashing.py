"""Chained block hashes: namespace isolation, prefix chaining, stable encoding."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

from sits.kvcache.kv_manager import hash_block_tokens, hash_full_blocks


def test_digest_matches_the_documented_encoding() -> None:
    expected = hashlib.sha256(
        b"sits-kv-block-v1"
        + bytes(32)
        + b"\x01"
        + struct.pack("<Q", 5)
        + b"alice"
        + struct.pack("<4Q", 1, 2, 3, 2**40)
    ).digest()
    assert hash_block_tokens(None, [1, 2, 3, 2**40], "alice") == expected
    no_salt = hashlib.sha256(
        b"sits-kv-block-v1" + expected + b"\x00" + struct.pack("<2Q", 7, 8)
    ).digest()
    assert hash_block_tokens(expected, [7, 8], None) == no_salt


def test_same_tokens_different_salt_different_hash() -> None:
    tokens = [11, 12, 13, 14]
    by_salt = {salt: hash_block_tokens(None, tokens, salt) for salt in (None, "", "a", "b")}
    assert len(set(by_salt.values())) == 4
    assert hash_block_tokens(None, tokens, "a") == by_salt["a"]


def test_same_prefix_same_chain_and_parent_changes_child() -> None:
    first = hash_full_blocks(list(range(8)), block_size=4, namespace="t")
    longer = hash_full_blocks(list(range(8)) + [100, 101, 102, 103, 104], 4, "t")
    assert len(first) == 2 and len(longer) == 3  # the partial block (104) is not hashed
    assert longer[:2] == first
    assert longer[1] == hash_block_tokens(longer[0], [4, 5, 6, 7], "t")
    # Same second-block tokens after a different first block: a different hash.
    other = hash_full_blocks([9, 1, 2, 3, 4, 5, 6, 7], 4, "t")
    assert other[0] != first[0] and other[1] != first[1]


def test_extending_a_chain_equals_hashing_from_scratch() -> None:
    tokens = list(range(30))
    full = hash_full_blocks(tokens, 4, None)
    assert len(full) == 7
    head = hash_full_blocks(tokens, 4, None, max_num_blocks=3)
    assert head == full[:3]
    assert hash_full_blocks(tokens, 4, None, prev_hashes=head) == full
    assert hash_full_blocks(tokens, 4, None, prev_hashes=head, max_num_blocks=5) == full[:5]


def test_hash_is_stable_across_processes() -> None:
    code = (
        "from sits.kvcache.kv_manager import hash_full_blocks;"
        "print(hash_full_blocks(list(range(10)), 4, 'tenant')[-1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == hash_full_blocks(list(range(10)), 4, "tenant")[-1].hex()
