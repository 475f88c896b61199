"""Chained block hashes for prefix caching, computed as vLLM computes them, so the hashes a KV
event carries are the ones a vLLM instance would publish for the same tokens (a KV-aware router
that hashes prompts itself finds Troupe's cached blocks).

The hash of block i covers the whole prefix up to the end of block i: vLLM's ``--prefix-caching-
hash-algo`` applied to ``(parent hash, the block's token ids as a tuple, its extra keys)``, the
first block's parent being ``NONE_HASH``, the algorithm applied to a seed (PYTHONHASHSEED when
set, else "vllm-none-hash"; xxhash's seed is random per process without PYTHONHASHSEED, as vLLM's:
it is not collision resistant). The algorithms: ``sha256`` (pickle, then SHA-256: vLLM's default),
``sha256_cbor`` (canonical CBOR, then SHA-256: reproducible from any language), ``xxhash`` and
``xxhash_cbor`` (xxHash's 128-bit XXH3; the ``xxhash`` package). Extra keys, vLLM's: the LoRA
adapter on every block (``("lora", name, path)``), each image whose placeholders the block holds
(``("mm", identifier, its offset from the block's start)``), the cache salt on the first block only
(``("cache_salt", salt)``), and a prompt given as embeddings' rows in the block (``("prompt_embeds",
SHA-256 of their bytes)``, every block: the token ids of such a prompt are placeholders).
"""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import TYPE_CHECKING, Any, Callable, NewType, Sequence

import numpy as np

if TYPE_CHECKING:
    from actors.engine.lora import LoRARequest
    from actors.engine.messages import MultiModalFeature

BlockHash = NewType("BlockHash", bytes)

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
NONE_HASH_SEED = "vllm-none-hash"


def _serializer(algo: str) -> Callable[[Any], bytes]:
    if algo.endswith("_cbor"):
        import cbor2
        return lambda obj: cbor2.dumps(obj, canonical=True)
    return lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _digest(algo: str) -> Callable[[bytes], bytes]:
    if algo.startswith("xxhash"):
        try:
            import xxhash
        except ImportError:
            raise ValueError(f"--prefix-caching-hash-algo {algo} needs the xxhash package "
                             "(pip install xxhash)") from None
        return xxhash.xxh3_128_digest
    return lambda data: hashlib.sha256(data).digest()


class BlockHasher:
    """One algorithm's block hashes (``algo``, one of HASH_ALGOS; ValueError for another)."""

    def __init__(self, algo: str = "sha256") -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")
        self.algo = algo
        serialize, digest = _serializer(algo), _digest(algo)
        self.hash = lambda obj: digest(serialize(obj))
        seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            seed = os.urandom(32).hex() if algo.startswith("xxhash") else NONE_HASH_SEED
        self.none_hash = BlockHash(self.hash(seed))

    def __call__(self, parent: BlockHash | None, token_ids: Sequence[int],
                 extra_keys: tuple | None = None) -> BlockHash:
        return BlockHash(self.hash((parent or self.none_hash, tuple(token_ids), extra_keys)))


DEFAULT_HASHER = BlockHasher()
NONE_HASH = DEFAULT_HASHER.none_hash


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None,
                      hasher: BlockHasher = DEFAULT_HASHER) -> BlockHash:
    return hasher(parent, token_ids, extra_keys)


def block_extra_keys(block_index: int, lora: LoRARequest | None, cache_salt: str | None,
                     prompt_embeds: np.ndarray | None = None, block_size: int = 0,
                     mm_features: Sequence[MultiModalFeature] | None = None) -> tuple | None:
    """vLLM's extra keys of a block: its adapter's name and path, then each multimodal item
    whose placeholders it holds (``("mm", identifier, the item's offset from the block's start)``:
    their tokens are alike, their embeddings are not), then the cache salt (first block), then,
    for a prompt given as embeddings, the SHA-256 of the block's rows of them (their bytes; none
    past the prompt: the digest of nothing)."""
    keys: list = []
    if lora is not None:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    if mm_features:
        start, end = block_index * block_size, (block_index + 1) * block_size
        keys.extend(("mm", f.identifier, f.offset - start) for f in mm_features if f.offset < end and f.end > start)
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    if prompt_embeds is not None:
        rows = prompt_embeds[block_index * block_size:(block_index + 1) * block_size]
        keys.append(("prompt_embeds", hashlib.sha256(np.ascontiguousarray(rows).tobytes()).digest()))
    return tuple(keys) or None


def event_extra_keys(keys: tuple | None) -> tuple | None:
    """A block's extra keys as vLLM's KV events show them: the bare adapter name and salt, an
    item's (identifier, offset)."""
    return None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        lora: LoRARequest | None = None, cache_salt: str | None = None,
                        hasher: BlockHasher = DEFAULT_HASHER, prompt_embeds: np.ndarray | None = None,
                        mm_features: Sequence[MultiModalFeature] | None = None) -> None:
    """Append the hashes of the blocks of ``token_ids`` that became full since the last call
    (``prompt_embeds``: the prompt's embeddings, when it was given as those; ``mm_features``:
    its images)."""
    start = len(hashes) * block_size
    while start + block_size <= len(token_ids):
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        keys = block_extra_keys(i, lora, cache_salt, prompt_embeds, block_size, mm_features)
        hashes.append(hasher(parent, token_ids[start:start + block_size], keys))
        start += block_size
