"""KVManager actor: the shell around KVCacheManager. The scheduler, on the same node, calls the
core directly every step (the runtime's co-located fast path: no message, no copy of its
state); other actors ask it by message."""
from __future__ import annotations

from typing import Any, ClassVar

from actors.engine.config import EngineConfig
from actors.kv_manager.manager import KVCacheManager
from actors.runtime import Actor, Msg


class ResetPrefixCache(Msg):
    """Forget every cached prefix (POST /reset_prefix_cache); blocks in use keep their contents."""
    reply_type: ClassVar[Any] = bool


KVManagerProtocol = ResetPrefixCache


class KVManager(Actor):
    protocol = KVManagerProtocol
    on_failure = "escalate"      # a failed allocation means the block accounting is broken

    def __init__(self, config: EngineConfig) -> None:
        c = config.cache
        groups = config.kv_cache_groups() if config.resolved else None   # no model known: one group
        self.core = KVCacheManager(c.num_blocks, c.block_size, c.enable_prefix_caching, groups)

    def colocated(self) -> KVCacheManager:
        return self.core         # every handler here is synchronous

    async def receive(self, msg: KVManagerProtocol) -> Any:
        match msg:
            case ResetPrefixCache():
                return self.core.reset_prefix_cache()
