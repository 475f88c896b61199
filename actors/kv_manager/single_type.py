"""One KV cache group's blocks (vLLM's single-type KV cache managers): each request's block table
for the group, its prefix-cache hits, and which of its blocks the group still needs.

A request's list holds one entry per ``block_size`` tokens, in position order. Full attention
keeps every block. A sliding window W keeps the blocks a query can still see; the others are
released and their entries replaced by the null block, so positions keep their index:

    positions   0 ............................................ num_computed  (the next query)
    full        | b1 | b2 | b3 | b4 | b5 | b6 | b7 | b8 | b9 |
    window W    | 0  | 0  | 0  | 0  | b5 | b6 | b7 | b8 | b9 |
                                     ^ holds num_computed - W + 1, the oldest key still visible
"""
from __future__ import annotations

from typing import Sequence

from actors.kv_manager.block_hash import BlockHash
from actors.kv_manager.block_pool import BlockPool, KVCacheBlock
from actors.kv_manager.kv_cache_spec import KVCacheGroupSpec


def blocks_needed(num_tokens: int, block_size: int, num_held: int) -> int:
    """New blocks a request holding ``num_held`` blocks needs to hold ``num_tokens`` tokens."""
    return max(-(-num_tokens // block_size) - num_held, 0)


class SingleTypeKVCacheManager:
    """Full attention: every block of the sequence."""
    holds_whole_sequence = True      # a request holds a block for each of its tokens' blocks

    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # per request: how many of its leading full blocks were offered to the prefix cache
        self.num_registered: dict[str, int] = {}

    # -- prefix-cache hits -------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """The blocks of the longest prefix, of at most ``max_blocks`` blocks, that this group
        serves from the cache: every block of it cached."""
        out = []
        for h in block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h, self.group_id)
            if b is None:
                break
            out.append(b)
        return out

    # -- allocation --------------------------------------------------------------------------
    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Release the blocks no query at or past ``num_computed_tokens`` reads (none here)."""

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at or past ``num_computed_tokens`` reads."""
        return 0

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, new_computed: Sequence[KVCacheBlock]) -> int:
        """Blocks the free queue must give for ``num_tokens`` tokens: fresh ones, and cache
        hits that sit in it now (no request holds them)."""
        held = len(self.req_to_blocks.get(req_id, ())) + len(new_computed)
        revived = sum(1 for b in new_computed if not b.owners and b is not self.pool.null_block)
        return blocks_needed(num_tokens, self.block_size, held) + revived

    def save_new_computed_blocks(self, req_id: str, new_computed: Sequence[KVCacheBlock]) -> None:
        """Take the cache hits (pinned before any eviction)."""
        self.pool.touch(req_id, list(new_computed))
        self.req_to_blocks.setdefault(req_id, []).extend(new_computed)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(req_id, [])
        new = self.pool.get_new_blocks(req_id, blocks_needed(num_tokens, self.block_size, len(blocks)))
        blocks.extend(new)
        return new

    def cache_full_blocks(self, req_id: str, num_full: int, block_hashes: Sequence[BlockHash]) -> None:
        """Offer the blocks that became full since the request's last step to the prefix cache
        (null entries are skipped)."""
        blocks = self.req_to_blocks.get(req_id, [])
        n = min(num_full, len(block_hashes), len(blocks))
        done = self.num_registered.get(req_id, 0)
        run: list[BlockHash] = []              # blocks newly cached in a row (one KV event)
        noting = self.pool.events is not None
        for i in range(done, n):
            if self.pool.cache_full_block(blocks[i], block_hashes[i], self.group_id) and noting:
                run.append(block_hashes[i])
            elif run:
                self.pool.note(("stored", req_id, self.group_id, i - len(run), run))
                run = []
        if run:
            self.pool.note(("stored", req_id, self.group_id, n - len(run), run))
        if n > done:
            self.num_registered[req_id] = n

    # -- release -----------------------------------------------------------------------------
    def free(self, req_id: str, written_blocks: int | None = None) -> None:
        """Release the request's blocks, its tail first (so its tail is evicted before its head).
        ``written_blocks``: only the blocks before it hold their tokens' KV; those from it on
        that were offered to the prefix cache are taken back."""
        blocks = self.req_to_blocks.pop(req_id, None)
        registered = self.num_registered.pop(req_id, 0)
        if blocks and written_blocks is not None:
            for b in blocks[written_blocks:registered]:
                self.pool.uncache_block(b)
        if blocks:
            self.pool.free_blocks(req_id, blocks[::-1])


class FullAttentionManager(SingleTypeKVCacheManager):
    pass


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding window of W tokens: a query at position p reads keys p - W < k <= p only."""
    holds_whole_sequence = False     # blocks out of the window are given back as it computes

    def __init__(self, pool: BlockPool, block_size: int, group_id: int, sliding_window: int) -> None:
        super().__init__(pool, block_size, group_id)
        self.sliding_window = sliding_window

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """The longest prefix, of at most ``max_blocks`` blocks, whose last window is cached:
        the query after a prefix of n blocks reads the last cdiv(W - 1, block_size) of them
        only (or all n when shorter), so the older ones need not be cached and are returned as
        null blocks. Searched from the longest prefix down."""
        null = self.pool.null_block
        need = max(-(-(self.sliding_window - 1) // self.block_size), 1)
        hit = [null] * min(max_blocks, len(block_hashes))
        run = 0                                  # cached blocks in a row, ending at block i + run - 1
        for i in range(len(hit) - 1, -1, -1):
            b = self.pool.get_cached_block(block_hashes[i], self.group_id)
            if b is None:
                run = 0
                continue
            hit[i] = b
            run += 1
            if run >= need:
                return hit[:i + run]
        return hit[:run]                         # the run reaching block 0, shorter than a window

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Release the blocks wholly before position num_computed_tokens - W + 1, the oldest key
        the next query reads; their entries become the null block."""
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        null = self.pool.null_block
        removed = []
        for i in range(min(self.num_skipped_blocks(num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break                            # the older ones were released before
            removed.append(blocks[i])
            blocks[i] = null
        self.pool.free_blocks(req_id, removed)   # the newest first, as ``free`` frees a tail


def create_single_type_manager(group: KVCacheGroupSpec, pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
    bs = group.kv_cache_spec.block_size
    if group.sliding_window is not None:
        return SlidingWindowManager(pool, bs, group_id, group.sliding_window)
    return FullAttentionManager(pool, bs, group_id)
