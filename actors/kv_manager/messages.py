"""The KV manager's protocol with the scheduler: at most a couple of round trips per step."""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from transport.msg import Msg


class KVCommitResult(msgspec.Struct, array_like=True):
    new_block_ids: list[list[int]]     # one list per entry of KVCommit.allocate, in order
    num_free_blocks: int


class KVCommit(Msg):
    """Free the blocks of finished and preempted requests, then give each entry of
    ``allocate`` (request id, number of new blocks) its blocks, in order. The scheduler has
    already checked that they fit; a shortage here means broken state."""
    reply_type: ClassVar[Any] = KVCommitResult
    free: list[str]
    allocate: list[tuple[str, int]]


class KVReset(Msg):
    """Forget every allocation (the workers lost their caches)."""
    reply_type: ClassVar[Any] = int
