"""KVManager actor: the shell around KVCacheManager."""
from __future__ import annotations

from typing import Any

from actors.kv_manager.manager import KVCacheManager
from actors.kv_manager.messages import KVCommit, KVReset
from actors.runtime import Actor

KVManagerProtocol = KVCommit | KVReset


class KVManager(Actor):
    protocol = KVManagerProtocol

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.core = KVCacheManager(num_blocks, block_size)

    async def receive(self, msg: KVManagerProtocol) -> Any:
        match msg:
            case KVCommit():
                return self.core.commit(msg)
            case KVReset():
                return self.core.reset()
