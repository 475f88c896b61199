"""KVCacheManager: which blocks each request holds. Pure: no asyncio, no transport."""
from __future__ import annotations

from actors.kv_manager.block_pool import BlockPool
from actors.kv_manager.messages import KVCommit, KVCommitResult


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

    def commit(self, c: KVCommit) -> KVCommitResult:
        for req_id in c.free:
            self.free(req_id)
        new_ids = []
        for req_id, n in c.allocate:
            ids = self.pool.allocate(n)
            self.req_to_blocks.setdefault(req_id, []).extend(ids)
            new_ids.append(ids)
        return KVCommitResult(new_ids, self.pool.num_free_blocks)

    def free(self, req_id: str) -> None:
        ids = self.req_to_blocks.pop(req_id, None)
        if ids:
            # Freed in reverse so the tail block (least likely shared later) is reused first.
            self.pool.free(ids[::-1])

    def reset(self) -> int:
        for req_id in list(self.req_to_blocks):
            self.free(req_id)
        return self.pool.num_free_blocks

    def check_integrity(self) -> None:
        held = sum(len(b) for b in self.req_to_blocks.values())
        if held + self.pool.num_free_blocks != self.pool.num_usable_blocks:
            raise RuntimeError(f"KV blocks leaked: {held} held + {self.pool.num_free_blocks} free "
                               f"!= {self.pool.num_usable_blocks}")
