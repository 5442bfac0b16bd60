"""Prefix-cache block hashes: a chain of SHA-256 digests over full blocks of token ids.

A full block's hash is `sha256(version, parent_hash, namespace, token_ids)`, so two blocks have
the same hash only when their whole prefixes (every earlier block) and their namespaces (the
tenant's cache salt) are equal. The encoding is explicit and fixed-width, so a hash is stable
across processes, machines and Python versions (unlike Python's `hash()` of a tuple, which is
salted per process for strings).

Invariants:
- Only FULL blocks (exactly `block_size` token ids) are hashed.
- `namespace=None` and `namespace=""` are different namespaces.
- Token ids are encoded as unsigned 64-bit little-endian integers (any vocabulary fits).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# A block hash: the 32-byte SHA-256 digest (full width, so a collision of the parent chain is
# not a practical concern; the block's own token ids are still checked on every hit).
BlockHash = bytes

_VERSION = b"sits-kv-block-v1"
_ROOT_PARENT = bytes(32)  # parent hash of a request's first block


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], namespace: str | None
) -> BlockHash:
    """Hash one full block chained to its parent block's hash.

    Args:
        parent_hash: hash of the previous block of the same sequence; None for the first block.
        token_ids: the block's token ids (non-negative ints, exactly one block's worth).
        namespace: the request's cache salt (tenant isolation); None when it has none.

    Returns:
        32-byte SHA-256 digest.
    """
    digest = hashlib.sha256(_VERSION)
    digest.update(_ROOT_PARENT if parent_hash is None else parent_hash)
    if namespace is None:
        digest.update(b"\x00")
    else:
        salt = namespace.encode("utf-8")
        digest.update(b"\x01" + struct.pack("<Q", len(salt)) + salt)
    digest.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str | None,
    prev_hashes: Sequence[BlockHash] = (),
    max_num_blocks: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, extending an already computed chain.

    Args:
        token_ids: the sequence's tokens (prompt then outputs).
        block_size: tokens per block.
        namespace: the request's cache salt, or None.
        prev_hashes: hashes already computed for the first `len(prev_hashes)` blocks; they are
            kept as they are (token ids of earlier blocks never change).
        max_num_blocks: hash at most this many blocks in all (None: every full block).

    Returns:
        A new list: `prev_hashes` followed by the hashes of the following full blocks.
    """
    num_full_blocks = len(token_ids) // block_size
    if max_num_blocks is not None:
        num_full_blocks = min(num_full_blocks, max_num_blocks)
    hashes = list(prev_hashes)
    parent = hashes[-1] if hashes else None
    for block_idx in range(len(hashes), num_full_blocks):
        start = block_idx * block_size
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes
