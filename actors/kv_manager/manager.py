"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and allocation.
Pure: no asyncio, no transport.

The blocks of one request, as ``allocate`` lays them out:

    | < computed > | < new computed > | < new > | < lookahead > |
                   |  (cache hits)    |  < to be computed >     |
                   |          < to be allocated >              |

``computed``: blocks it already holds; ``new computed``: cached blocks hit at admission
(taken, not allocated); ``new`` and ``lookahead``: fresh blocks from the free queue.
"""
from __future__ import annotations

from actors.kv_manager.block_hash import BlockHash
from actors.kv_manager.block_pool import BlockPool, KVCacheBlock
from actors.kv_manager.messages import (KVAlloc, KVCommit, KVCommitResult, KVPrepare,
                                        KVPrepareResult)


def blocks_needed(num_tokens: int, block_size: int, num_held: int) -> int:
    """New blocks a request holding ``num_held`` blocks needs to hold ``num_tokens`` tokens."""
    return max(-(-num_tokens // block_size) - num_held, 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # per request: how many of its leading full blocks were offered to the prefix cache
        self._num_registered: dict[str, int] = {}
        self._exclusive_changed: set[str] = set()

    # -- round trip 1 ------------------------------------------------------------------------
    def prepare(self, msg: KVPrepare) -> KVPrepareResult:
        for req_id in msg.free:
            self.free(req_id)
        hits = []
        for _, hashes in msg.lookup:
            blocks = self.find_longest_cache_hit(hashes)
            hits.append((len(blocks), sum(1 for b in blocks if not b.owners)))
        return KVPrepareResult(hits, self.pool.num_free_blocks, self._take_exclusive())

    def find_longest_cache_hit(self, hashes: list[BlockHash]) -> list[KVCacheBlock]:
        out = []
        if self.pool.enable_caching:
            for h in hashes:
                b = self.pool.get_cached_block(h)
                if b is None:
                    break
                out.append(b)
        return out

    # -- round trip 2 ------------------------------------------------------------------------
    def commit(self, msg: KVCommit) -> KVCommitResult:
        for req_id in msg.free:
            self.free(req_id)
        hit_blocks = [self._take_hits(a) for a in msg.allocate]   # pin every hit first
        ids = []
        for a, hits in zip(msg.allocate, hit_blocks):
            blocks = self.req_to_blocks.setdefault(a.req_id, [])
            new = self.pool.get_new_blocks(a.req_id, a.num_new_blocks)
            blocks.extend(new)
            if new:
                self._exclusive_changed.add(a.req_id)
            self._cache_full_blocks(a, blocks)
            ids.append([b.block_id for b in hits] + [b.block_id for b in new])
        return KVCommitResult(ids, self.pool.num_free_blocks, self._take_exclusive())

    def _take_hits(self, a: KVAlloc) -> list[KVCacheBlock]:
        if not a.num_hit_blocks:
            return []
        if self.req_to_blocks.get(a.req_id):
            raise RuntimeError(f"request {a.req_id} takes cache hits but already holds blocks")
        blocks = self.find_longest_cache_hit(a.block_hashes[:a.num_hit_blocks])
        if len(blocks) != a.num_hit_blocks:
            raise RuntimeError(f"request {a.req_id}: {a.num_hit_blocks} cached blocks were planned, "
                               f"{len(blocks)} are still cached")
        for b in self.pool.touch(a.req_id, blocks):
            self._exclusive_changed.update(b.owners)
        self.req_to_blocks[a.req_id] = list(blocks)
        self._exclusive_changed.add(a.req_id)
        return blocks

    def _cache_full_blocks(self, a: KVAlloc, blocks: list[KVCacheBlock]) -> None:
        """Offer the blocks that became full since the request's last step to the prefix cache."""
        n = min(a.num_full_blocks, len(a.block_hashes), len(blocks))
        done = self._num_registered.get(a.req_id, 0)
        for i in range(done, n):
            self.pool.cache_full_block(blocks[i], a.block_hashes[i])
        if n > done:
            self._num_registered[a.req_id] = n

    # -- release -----------------------------------------------------------------------------
    def free(self, req_id: str) -> None:
        blocks = self.req_to_blocks.pop(req_id, None)
        self._num_registered.pop(req_id, None)
        self._exclusive_changed.discard(req_id)
        if blocks:
            for b in self.pool.free_blocks(req_id, blocks[::-1]):
                self._exclusive_changed.update(b.owners)

    def exclusive_blocks(self, req_id: str) -> int:
        """Blocks that would return to the free queue if ``req_id`` freed them."""
        return sum(1 for b in self.req_to_blocks.get(req_id, ()) if len(b.owners) == 1)

    def _take_exclusive(self) -> dict[str, int]:
        changed = {r: self.exclusive_blocks(r) for r in self._exclusive_changed if r in self.req_to_blocks}
        self._exclusive_changed.clear()
        return changed

    def reset(self) -> int:
        for req_id in list(self.req_to_blocks):
            self.free(req_id)
        self.pool.reset_prefix_cache()
        return self.pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        self.pool.reset_prefix_cache()
        self._num_registered.clear()      # running requests offer their full blocks again
        return True

    def usage(self) -> float:
        return self.pool.usage()

    def check_integrity(self) -> None:
        """free + in use = total; owners match holders; every cached block carries its hash."""
        pool = self.pool
        in_use = {b.block_id for bs in self.req_to_blocks.values() for b in bs}
        free = {b.block_id for b in pool.free_queue}
        if in_use & free or len(in_use) + len(free) != pool.num_usable_blocks:
            raise RuntimeError(f"KV blocks leaked or double-booked: {len(in_use)} in use, "
                               f"{len(free)} free, {pool.num_usable_blocks} usable")
        for b in pool.blocks[1:]:
            holders = {r for r, bs in self.req_to_blocks.items() if b in bs}
            if holders != b.owners:
                raise RuntimeError(f"block {b.block_id}: owners {b.owners} != holders {holders}")
        for req_id, bs in self.req_to_blocks.items():
            if len({id(b) for b in bs}) != len(bs):
                raise RuntimeError(f"request {req_id} holds a block twice")
        for h, b in pool.cached.items():
            if b.block_hash != h:
                raise RuntimeError(f"block {b.block_id} is cached under a hash it does not carry")
