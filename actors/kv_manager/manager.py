"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and allocation; the
only record of the KV cache's blocks (the scheduler asks it, it keeps no copy). Pure: no
asyncio, no transport.

The blocks of one request, as ``allocate_slots`` lays them out:

    | < computed > | < new computed > | < new > |
                   |  (cache hits)    |  < to be computed >
                   |      < to be allocated >   |

``computed``: blocks it already holds; ``new computed``: cached blocks hit at admission
(taken, not allocated); ``new``: fresh blocks from the free queue for the tokens this step
computes.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence, TypeVar

from actors.kv_manager.block_hash import BlockHash
from actors.kv_manager.block_pool import BlockPool, KVCacheBlock


def blocks_needed(num_tokens: int, block_size: int, num_held: int) -> int:
    """New blocks a request holding ``num_held`` blocks needs to hold ``num_tokens`` tokens."""
    return max(-(-num_tokens // block_size) - num_held, 0)


F = TypeVar("F", bound=Callable[..., Any])


def _timed(method: F) -> F:
    """Count the method's time in ``busy_ns`` (the engine step's KV bookkeeping phase)."""
    @functools.wraps(method)
    def timed(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.busy_ns += time.perf_counter_ns() - t0
    return timed  # type: ignore[return-value]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.busy_ns = 0                 # time spent in lookups, allocation and freeing
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # per request: how many of its leading full blocks were offered to the prefix cache
        self._num_registered: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # -- admission ---------------------------------------------------------------------------
    @_timed
    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The longest cached prefix of ``block_hashes`` (the caller caps the hashes so that a
        request's last prompt token is always computed)."""
        out = []
        if self.pool.enable_caching:
            for h in block_hashes:
                b = self.pool.get_cached_block(h)
                if b is None:
                    break
                out.append(b)
        return out

    # -- every step --------------------------------------------------------------------------
    @_timed
    def allocate_slots(self, req_id: str, num_tokens: int, block_hashes: Sequence[BlockHash],
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       watermark_blocks: int = 0) -> list[int] | None:
        """Blocks for ``req_id`` to hold its first ``num_tokens`` tokens: those it holds, the
        cache hits ``new_computed_blocks`` (admission only), then fresh ones. Returns the ids
        of the blocks it gained, hits first; None, with nothing changed, when they do not fit
        and leave ``watermark_blocks`` free. Blocks full once ``num_tokens`` are computed are
        offered to the prefix cache under ``block_hashes``."""
        held = self.req_to_blocks.get(req_id, [])
        if new_computed_blocks and held:
            raise RuntimeError(f"request {req_id} takes cache hits but already holds blocks")
        num_new = blocks_needed(num_tokens, self.block_size, len(held) + len(new_computed_blocks))
        revived = sum(1 for b in new_computed_blocks if not b.owners)   # hits now in the free queue
        if num_new + revived > self.pool.num_free_blocks - watermark_blocks:
            return None
        self.pool.touch(req_id, list(new_computed_blocks))              # pinned before any eviction
        new = self.pool.get_new_blocks(req_id, num_new)
        blocks = self.req_to_blocks.setdefault(req_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(new)
        self._cache_full_blocks(req_id, blocks, num_tokens // self.block_size, block_hashes)
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in new]

    def _cache_full_blocks(self, req_id: str, blocks: list[KVCacheBlock], num_full: int,
                           block_hashes: Sequence[BlockHash]) -> None:
        """Offer the blocks that became full since the request's last step to the prefix cache."""
        n = min(num_full, len(block_hashes), len(blocks))
        done = self._num_registered.get(req_id, 0)
        for i in range(done, n):
            self.pool.cache_full_block(blocks[i], block_hashes[i])
        if n > done:
            self._num_registered[req_id] = n

    # -- release -----------------------------------------------------------------------------
    @_timed
    def free(self, req_id: str) -> None:
        """Release a finished or preempted request's blocks, its tail first (so its tail is
        evicted before its head)."""
        blocks = self.req_to_blocks.pop(req_id, None)
        self._num_registered.pop(req_id, None)
        if blocks:
            self.pool.free_blocks(req_id, blocks[::-1])

    def num_blocks_held(self, req_id: str) -> int:
        return len(self.req_to_blocks.get(req_id, ()))

    def reset(self) -> None:
        """Forget every allocation and cached prefix (the workers lost their caches)."""
        for req_id in list(self.req_to_blocks):
            self.free(req_id)
        self.pool.reset_prefix_cache()

    def reset_prefix_cache(self) -> bool:
        self.pool.reset_prefix_cache()
        self._num_registered.clear()      # running requests offer their full blocks again
        return True

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
