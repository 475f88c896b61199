"""Chained block hashes for prefix caching.

The hash of block i covers the whole prefix up to the end of block i: it hashes the parent's
hash, the block's token ids and the block's extra keys (LoRA name on every block, the cache salt
on the first block only). SHA-256 with a fixed seed for the first parent, so every process (and
every node sharing a cache) computes the same hash for the same prefix.
"""
from __future__ import annotations

import hashlib
from typing import NewType, Sequence

import msgspec
import numpy as np

BlockHash = NewType("BlockHash", bytes)

NONE_HASH = BlockHash(hashlib.sha256(b"troupe-prefix-cache-none-hash").digest())

_encode = msgspec.msgpack.Encoder().encode


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    h = hashlib.sha256(parent or NONE_HASH)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(_encode(extra_keys))
    return BlockHash(h.digest())


def block_extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> tuple | None:
    keys: list = []
    if lora_name is not None:
        keys.append(("lora", lora_name))
    if cache_salt is not None and block_index == 0:
        keys.append(("salt", cache_salt))
    return tuple(keys) or None


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        lora_name: str | None = None, cache_salt: str | None = None) -> None:
    """Append the hashes of the blocks of ``token_ids`` that became full since the last call."""
    start = len(hashes) * block_size
    while start + block_size <= len(token_ids):
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size],
                                        block_extra_keys(i, lora_name, cache_salt)))
        start += block_size
