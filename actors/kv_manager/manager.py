"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and allocation; the
only record of the KV cache's blocks (the scheduler asks it, it keeps no copy). Pure: no
asyncio, no transport.

One block pool serves every KV cache group (kv_cache_spec.py: one per kind of attention layer,
vLLM's hybrid KV cache manager); each group keeps its own block table per request
(single_type.py) and the coordinating here is vLLM's KVCacheCoordinator's: a request's blocks
are allocated in every group at once, or in none, and a prefix-cache hit is the longest
prefix every group can serve.

The blocks of one request in one group, as ``allocate_slots`` lays them out:

    | < computed > | < new computed > | < new > |
                   |  (cache hits)    |  < to be computed >
                   |      < to be allocated >   |

``computed``: blocks it already holds; ``new computed``: cached blocks hit at admission
(taken, not allocated); ``new``: fresh blocks from the free queue for the tokens this step
computes. A sliding-window group first releases the computed blocks out of the window.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from actors.kv_manager.block_hash import BlockHash
from actors.kv_manager.block_pool import NULL_BLOCK as NULL_ID, BlockPool, KVCacheBlock
from actors.kv_manager.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from actors.kv_manager.single_type import FullAttentionManager, SingleTypeKVCacheManager, create_single_type_manager

KEEPS_ALL_BLOCKS = (FullAttentionManager,)        # the managers whose requests never release a block early


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks of every KV cache group (vLLM's name), one list per group, all of one length: a
    prefix-cache hit, null blocks where a group does not need the block. ``len`` is that length
    in blocks."""
    blocks: tuple[list[KVCacheBlock], ...]

    def __len__(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0


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
    """``groups``: the KV cache groups (None: one full-attention group, every layer)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroupSpec] | None = None) -> None:
        self.busy_ns = 0                 # time spent in lookups, allocation and freeing
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = tuple(groups or (KVCacheGroupSpec((), FullAttentionSpec(block_size, 1, 1, 1)),))
        sizes = {g.kv_cache_spec.block_size for g in self.groups}
        if sizes != {block_size}:
            raise ValueError(f"every KV cache group must have blocks of {block_size} tokens, got {sorted(sizes)}")
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            create_single_type_manager(g, self.pool, i) for i, g in enumerate(self.groups))
        # every group keeps all its blocks (no window releases any): a running request whose
        # blocks already hold its next tokens changes nothing (the decode steps' common case)
        self._keeps_all_blocks = all(type(m) in KEEPS_ALL_BLOCKS for m in self.managers)
        # per request: the tokens its blocks cover (all computed before its next step runs), and
        # those computed when its blocks were last allocated (the first query of that step)
        self._num_tokens: dict[str, int] = {}
        self._num_computed: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Every block each request holds, all groups together (null entries left out)."""
        out: dict[str, list[KVCacheBlock]] = {}
        null = self.pool.null_block
        for m in self.managers:
            for req_id, blocks in m.req_to_blocks.items():
                out.setdefault(req_id, []).extend(b for b in blocks if b is not null)
        return out

    # -- admission ---------------------------------------------------------------------------
    @_timed
    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> KVCacheBlocks:
        """The longest prefix of ``block_hashes`` every group serves from the cache (the caller
        caps the hashes so that a request's last prompt token is always computed). Each group
        finds its longest hit no longer than the others'; the length only shrinks, and stops
        when every group serves it."""
        empty = KVCacheBlocks(tuple([] for _ in self.managers))
        if not self.pool.enable_caching or not block_hashes:
            return empty
        length = len(block_hashes)
        while length:
            hits = tuple(m.find_longest_cache_hit(block_hashes, length) for m in self.managers)
            shortest = min(len(h) for h in hits)
            if shortest == length:
                return KVCacheBlocks(hits)
            length = shortest
        return empty

    # -- every step --------------------------------------------------------------------------
    @_timed
    def allocate_slots(self, req_id: str, num_tokens: int, block_hashes: Sequence[BlockHash],
                       new_computed_blocks: KVCacheBlocks | None = None,
                       watermark_blocks: int = 0,
                       num_computed_tokens: int | None = None,
                       num_lookahead_tokens: int = 0,
                       full_num_tokens: int = 0) -> tuple[list[int], ...] | None:
        """Blocks for ``req_id`` to hold its first ``num_tokens`` tokens in every group: those
        it holds, the cache hits ``new_computed_blocks`` (admission only), then fresh ones.
        Returns, per group, the ids of the blocks it gained, hits first (0: the null block);
        None when they do not fit and leave ``watermark_blocks`` free, with nothing changed but
        the release of blocks already out of a window. Blocks full once ``num_tokens`` are
        computed are offered to the prefix cache under ``block_hashes``. ``num_computed_tokens``:
        the request's computed tokens when fewer than it asked slots for at its last step (draft
        tokens rejected); the blocks a sliding window no longer reads are counted from there.
        ``num_lookahead_tokens``: slots past ``num_tokens`` for a draft model to write the KV of
        its drafts into (vLLM's lookahead slots); never offered to the prefix cache.
        ``full_num_tokens`` (admission, vLLM's scheduler_reserve_full_isl): None also when the
        request's whole sequence would not fit (its full-attention groups' blocks for all of it,
        beside the watermark), though only its first ``num_tokens`` get blocks now."""
        computed = self._num_tokens.get(req_id)
        if computed is not None and num_computed_tokens is not None:
            computed = min(computed, num_computed_tokens)
        if computed is not None and self._keeps_all_blocks and not new_computed_blocks \
                and watermark_blocks <= self.pool.num_free_blocks and self._holds_already(req_id, num_tokens, num_tokens + num_lookahead_tokens, len(block_hashes)):
            self._num_computed[req_id] = computed
            self._num_tokens[req_id] = num_tokens
            return tuple([] for _ in self.managers)
        hits = new_computed_blocks.blocks if new_computed_blocks else tuple([] for _ in self.managers)
        if computed is not None:
            if any(hits):
                raise RuntimeError(f"request {req_id} takes cache hits but already holds blocks")
            for m in self.managers:
                m.remove_skipped_blocks(req_id, computed)
        num_slots = num_tokens + num_lookahead_tokens
        num_new = sum(m.num_blocks_to_allocate(req_id, num_slots, h) for m, h in zip(self.managers, hits))
        if num_new > self.pool.num_free_blocks - watermark_blocks:
            return None
        if full_num_tokens > num_slots and sum(
                m.num_blocks_to_allocate(req_id, full_num_tokens if m.holds_whole_sequence else num_slots, h)
                for m, h in zip(self.managers, hits)) > self.pool.num_free_blocks - watermark_blocks:
            return None
        for m, h in zip(self.managers, hits):      # every group's hits pinned before any eviction
            m.save_new_computed_blocks(req_id, h)
        out = []
        for m, h in zip(self.managers, hits):
            new = m.allocate_new_blocks(req_id, num_slots)
            m.cache_full_blocks(req_id, num_tokens // self.block_size, block_hashes)
            out.append([b.block_id for b in h] + [b.block_id for b in new])
        self._num_computed[req_id] = computed if computed is not None else len(hits[0]) * self.block_size
        self._num_tokens[req_id] = num_tokens
        return tuple(out)

    def _holds_already(self, req_id: str, num_tokens: int, num_slots: int, num_hashes: int) -> bool:
        """Every group's blocks of ``req_id`` hold ``num_slots`` slots, and every block full at
        ``num_tokens`` that has a hash was offered to the prefix cache: nothing to allocate or cache."""
        bs = self.block_size
        for m in self.managers:
            blocks = m.req_to_blocks.get(req_id)
            if blocks is None or len(blocks) * bs < num_slots \
                    or m.num_registered.get(req_id, 0) < min(num_tokens // bs, num_hashes, len(blocks)):
                return False
        return True

    # -- release -----------------------------------------------------------------------------
    @_timed
    def free(self, req_id: str, written_tokens: int | None = None) -> None:
        """Release a finished or preempted request's blocks in every group, each group's tail
        first (so its tail is evicted before its head). ``written_tokens``: a request preempted
        in the step that allocated for it holds the KV of that many tokens only; the blocks
        offered to the prefix cache for the tokens that step would have computed are taken back
        (their KV is never written, so no later request may hit them)."""
        self._num_tokens.pop(req_id, None)
        self._num_computed.pop(req_id, None)
        written_blocks = None if written_tokens is None else written_tokens // self.block_size
        for m in self.managers:
            m.free(req_id, written_blocks)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block table in every group (0: the null block)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(req_id, ())] for m in self.managers)

    def num_blocks_held(self, req_id: str) -> int:
        """Blocks the request holds in all groups (null entries left out)."""
        return sum(self.num_blocks_held_per_group(req_id))

    def num_blocks_held_per_group(self, req_id: str) -> tuple[int, ...]:
        null = self.pool.null_block
        return tuple(sum(1 for b in m.req_to_blocks.get(req_id, ()) if b is not null) for m in self.managers)

    def reset(self) -> None:
        """Forget every allocation and cached prefix (the workers lost their caches)."""
        for req_id in list(self._num_tokens):
            self.free(req_id)
        self.pool.reset_prefix_cache()

    def reset_prefix_cache(self) -> bool:
        self.pool.reset_prefix_cache()
        for m in self.managers:           # running requests offer their full blocks again
            m.num_registered.clear()
        return True

    def check_integrity(self) -> None:
        """free + in use = total; owners match holders; a block in one group at a time; every
        group's table of a request covers the same tokens; no sliding-window group holds a
        block out of its window; every cached block carries its key."""
        pool, null = self.pool, self.pool.null_block
        holders: dict[int, set[str]] = {}
        group_of: dict[int, int] = {}
        for g, m in enumerate(self.managers):
            for req_id, bs in m.req_to_blocks.items():
                real = [b for b in bs if b is not null]
                if len({id(b) for b in real}) != len(real):
                    raise RuntimeError(f"request {req_id} holds a block twice in group {g}")
                skipped = m.num_skipped_blocks(self._num_computed.get(req_id, 0))
                if any(b is not null for b in bs[:skipped]):
                    raise RuntimeError(f"request {req_id} holds blocks out of group {g}'s window")
                for b in real:
                    if group_of.setdefault(b.block_id, g) != g:
                        raise RuntimeError(f"block {b.block_id} is in groups {group_of[b.block_id]} and {g}")
                    holders.setdefault(b.block_id, set()).add(req_id)
        free = {b.block_id for b in pool.free_queue}
        if holders.keys() & free or len(holders) + len(free) != pool.num_usable_blocks or NULL_ID in free:
            raise RuntimeError(f"KV blocks leaked or double-booked: {len(holders)} in use, "
                               f"{len(free)} free, {pool.num_usable_blocks} usable")
        for b in pool.blocks:
            if b.owners != holders.get(b.block_id, set()):
                raise RuntimeError(f"block {b.block_id}: owners {b.owners} != holders {holders.get(b.block_id)}")
        for req_id in self._num_tokens:
            lengths = {len(m.req_to_blocks.get(req_id, ())) for m in self.managers}
            if len(lengths) != 1:
                raise RuntimeError(f"request {req_id}'s block tables differ in length across groups: {lengths}")
        for key, b in pool.cached.items():
            if b.block_hash != key or b is null:
                raise RuntimeError(f"block {b.block_id} is cached under a key it does not carry")
