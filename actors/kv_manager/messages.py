"""The KV manager's protocol with the scheduler: at most two round trips per step, whatever
the batch size. ``KVPrepare`` (frees, then prefix lookups for waiting requests) and
``KVCommit`` (the step's allocations). Both carry the requests' block hashes by reference: the
KV manager lives in the scheduler's process."""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from transport.msg import Msg


class KVPrepareResult(msgspec.Struct, array_like=True):
    hits: list[tuple[int, int]]          # per lookup: (cached blocks hit, of which now free)
    num_free_blocks: int
    exclusive: dict[str, int]            # changed counts of blocks held by one request only


class KVPrepare(Msg):
    """Release finished requests' blocks, then look up cached prefixes. Each lookup is
    (request id, its block hashes capped so the last prompt token is always computed)."""
    reply_type: ClassVar[Any] = KVPrepareResult
    free: list[str]
    lookup: list[tuple[str, list[bytes]]]


class KVAlloc(msgspec.Struct, array_like=True):
    req_id: str
    num_hit_blocks: int        # cached blocks to take first (admissions only), from block_hashes
    num_new_blocks: int
    num_full_blocks: int       # blocks full once this step ran: registered in the prefix cache
    block_hashes: list[bytes]


class KVCommitResult(msgspec.Struct, array_like=True):
    block_ids: list[list[int]]           # per allocation: hit block ids, then new ones
    num_free_blocks: int
    exclusive: dict[str, int]


class KVCommit(Msg):
    """Free preempted requests' blocks, take every cache hit, then allocate, in that order
    (hits are pinned before any allocation could evict them). The scheduler has checked that
    everything fits; a shortage here means broken state."""
    reply_type: ClassVar[Any] = KVCommitResult
    free: list[str]
    allocate: list[KVAlloc]


class KVReset(Msg):
    """Forget every allocation and cached prefix (the workers lost their caches)."""
    reply_type: ClassVar[Any] = int


class ResetPrefixCache(Msg):
    reply_type: ClassVar[Any] = bool
