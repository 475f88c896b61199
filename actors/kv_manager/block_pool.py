"""The pool of physical KV blocks.

Block 0 is the null block: it is never handed out, and padding rows of block tables point at
it, so a padded lane reads harmless memory and never a live request's KV.
"""
from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class KVCacheExhausted(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheExhausted(f"asked for {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_usable_blocks
