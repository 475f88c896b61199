"""The pool of physical KV blocks, with reference counts and the prefix-cache map.

Block 0 is the null block: never handed out; padding rows of block tables point at it, and so
do the entries of a sliding-window group's table for blocks that fell out of the window. Holding
it, touching it or freeing it does nothing.

The prefix-cache map is keyed by (block hash, KV cache group): the same prefix has one block per
group, each holding that group's layers.

Free blocks wait in an eviction-ordered queue (head = evicted first). A freed block with a hash
goes to the tail, so cached prefixes are evicted least-recently-used first; a freed block
without a hash goes to the head, since nothing can reuse its contents. A cached free block that
a new request hits leaves the queue from the middle ("touch"): the queue is an intrusive doubly
linked list so that removal is O(1), which a deque cannot do.

With KV events on (``record_events``), the pool notes each change of the prefix cache in
``events`` (blocks cached, a block's hash dropped, the cache cleared) for the scheduler to
publish (actors/kv_manager/kv_events.py); ``on_event`` is called when the first one is noted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from actors.kv_manager.block_hash import BlockHash
from actors.kv_manager.residency import BlockResidency

NULL_BLOCK = 0

BlockHashWithGroupId = tuple[BlockHash, int]     # vLLM's name: a prefix's block in one group


class KVCacheExhausted(RuntimeError):
    pass


NO_OWNERS: frozenset[str] = frozenset()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    # requests holding it (ref count = len(owners)); a set of its own from the first owner on, so
    # a pool of a million blocks (a GPU's) is made in a fraction of a second
    owners: set[str] | frozenset[str] = NO_OWNERS
    block_hash: BlockHashWithGroupId | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def ref_cnt(self) -> int:
        return len(self.owners)


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order, as a doubly linked list between two sentinels."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = len(blocks)
        prev = self._head                   # linked in order, inline (a pool may hold a million)
        for b in blocks:
            b.prev_free, prev.next_free = prev, b
            prev = b
        prev.next_free, self._tail.prev_free = self._tail, prev

    def append(self, b: KVCacheBlock) -> None:
        self._insert(b, self._tail.prev_free, self._tail)

    def appendleft(self, b: KVCacheBlock) -> None:
        self._insert(b, self._head, self._head.next_free)

    def _insert(self, b: KVCacheBlock, before: KVCacheBlock, after: KVCacheBlock) -> None:
        b.prev_free, b.next_free = before, after
        before.next_free = after.prev_free = b
        self.num_free_blocks += 1

    def remove(self, b: KVCacheBlock) -> None:
        if b.prev_free is None or b.next_free is None:
            raise RuntimeError(f"block {b.block_id} is not in the free queue")
        b.prev_free.next_free, b.next_free.prev_free = b.next_free, b.prev_free
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        b = self._head.next_free
        if b is self._tail:
            raise KVCacheExhausted("no free KV blocks")
        self.remove(b)
        return b

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        self.events: list[tuple] | None = None       # KV events noted, not yet taken (None: off)
        self.on_event: Callable[[], None] | None = None
        self.residency: BlockResidency | None = None  # --kv-cache-metrics (None: off)

    def record_events(self, on_event: Callable[[], None] | None = None) -> None:
        """Note the prefix cache's changes from now on (KV events)."""
        self.events = []
        self.on_event = on_event

    def note(self, event: tuple) -> None:
        """``("stored", req_id, group, first_block_index, hashes)``, ``("removed", hash, group)``
        or ``("cleared",)``."""
        if self.events is None:
            return
        self.events.append(event)
        if len(self.events) == 1 and self.on_event is not None:
            self.on_event()

    def take_events(self) -> list[tuple]:
        events, self.events = self.events or [], ([] if self.events is not None else None)
        return events

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, owner: str, n: int) -> list[KVCacheBlock]:
        """``n`` blocks from the head of the free queue, their old cached contents evicted."""
        if n > self.num_free_blocks:
            raise KVCacheExhausted(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        residency = self.residency
        for _ in range(n):
            b = self.free_queue.popleft()
            if residency is not None:
                if self.enable_caching:             # its cached contents evicted (vLLM's rule)
                    residency.evicted(b.block_id)
                residency.allocated(b.block_id)
            self.uncache_block(b)
            b.owners = {owner}                      # a free block has none
            out.append(b)
        return out

    def touch(self, owner: str, blocks: list[KVCacheBlock]) -> None:
        """Add ``owner`` to cache-hit blocks, reviving free ones out of the free queue."""
        for b in blocks:
            if b is self.null_block:
                continue
            if not b.owners:
                self.free_queue.remove(b)
                b.owners = {owner}
            else:
                b.owners.add(owner)
            if self.residency is not None:
                self.residency.accessed(b.block_id)

    def free_blocks(self, owner: str, blocks: list[KVCacheBlock]) -> None:
        """Release ``owner``'s hold, in the given order (callers pass a request's blocks tail
        first, so its tail is evicted before its head)."""
        for b in blocks:
            if b is self.null_block or owner not in b.owners:
                continue
            b.owners.discard(owner)     # (a set: the owner was in it)
            if not b.owners:
                if b.block_hash is not None:
                    self.free_queue.append(b)
                else:
                    self.free_queue.appendleft(b)

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self.cached.get((block_hash, group))

    def cache_full_block(self, b: KVCacheBlock, block_hash: BlockHash, group: int = 0) -> bool:
        """Register a block of ``group`` whose tokens are complete (computed by the step being
        scheduled); whether it entered the prefix cache."""
        if not self.enable_caching or b.block_hash is not None or b is self.null_block:
            return False
        key = (block_hash, group)
        if key in self.cached:          # an identical block is cached already: keep that one
            return False
        b.block_hash = key
        self.cached[key] = b
        return True

    def uncache_block(self, b: KVCacheBlock) -> None:
        """Take ``b`` out of the prefix cache: it is handed out again, or its tokens will not be
        computed after all (the step that was to compute them dropped its request)."""
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
                self.note(("removed", *b.block_hash))
            b.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents, lose their hash)."""
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        self.note(("cleared",))
        if self.residency is not None:
            self.residency.reset()
