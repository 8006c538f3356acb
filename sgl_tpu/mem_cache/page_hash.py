"""Chain hashes of KV pages: one 16-byte digest per page that names the page's tokens and every
token before them, so equal digests mean equal KV (for one model, dtype and page size).

    h[-1] = ROOT_HASH (the base model), or namespace_seed(ns) (a LoRA adapter's tree)
    h[i]  = blake2b(h[i-1] || token ids of page i as little-endian int32, 16 bytes)

The lower cache tiers (`tiers.py`) key pages by these digests, and a restarted server finds its
earlier prefixes on disk by recomputing them from a prompt. KV events (`kv_events.py`) name
blocks by `block_hash`, the digest's first 8 bytes as a signed 64-bit integer.
"""

from __future__ import annotations

import hashlib

import numpy as np

HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)


def chain_hashes(parent_hash: bytes, key: np.ndarray, page_size: int) -> np.ndarray:
    """uint8 [len(key) // page_size, HASH_BYTES]: the chain hashes of the whole pages of `key`,
    continuing from `parent_hash` (the hash of the page before `key`, or ROOT_HASH)."""
    key = np.ascontiguousarray(key, dtype="<i4")
    num_pages = len(key) // page_size
    out = np.empty((num_pages, HASH_BYTES), dtype=np.uint8)
    prev = parent_hash
    for i in range(num_pages):
        prev = hashlib.blake2b(prev + key[i * page_size:(i + 1) * page_size].tobytes(),
                               digest_size=HASH_BYTES).digest()
        out[i] = np.frombuffer(prev, dtype=np.uint8)
    return out


def namespace_seed(namespace: str) -> bytes:
    """The chain's start in a namespace of the radix tree (a LoRA adapter's digest): pages of
    equal tokens under different adapters never hash alike."""
    return hashlib.blake2b(b"namespace:" + namespace.encode(), digest_size=HASH_BYTES).digest()


def block_hash(page_hash: bytes | np.ndarray) -> int:
    """The signed 64-bit integer that names a page in KV events."""
    return int.from_bytes(bytes(page_hash)[:8], "little", signed=True)
