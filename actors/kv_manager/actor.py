"""KVManager actor: the shell around KVCacheManager."""
from __future__ import annotations

from typing import Any

from actors.kv_manager.manager import KVCacheManager
from actors.kv_manager.messages import KVCommit, KVPrepare, KVReset, ResetPrefixCache
from actors.runtime import Actor

KVManagerProtocol = KVPrepare | KVCommit | KVReset | ResetPrefixCache


class KVManager(Actor):
    protocol = KVManagerProtocol
    on_failure = "escalate"      # a failed allocation means the block accounting is broken

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.core = KVCacheManager(num_blocks, block_size, enable_caching)

    async def receive(self, msg: KVManagerProtocol) -> Any:
        match msg:
            case KVPrepare():
                return self.core.prepare(msg)
            case KVCommit():
                return self.core.commit(msg)
            case KVReset():
                return self.core.reset()
            case ResetPrefixCache():
                return self.core.reset_prefix_cache()
