"""vLLM's KV cache residency metrics (--kv-cache-metrics): for a sample of the blocks the pool
hands out (--kv-cache-metrics-sample, 1% by default), when the block was handed out, when a
request last reused it from the prefix cache and the gaps between its last reuses; when the
pool hands it out again (its cached contents evicted), one event: its lifetime, how long it sat
idle before the eviction, and those gaps. The scheduler sends the events with its step stats;
the frontend's /metrics counts them in vLLM's three histograms."""
from __future__ import annotations

import random
import time
from collections import deque

KVEvictionEvent = tuple[float, float, list[float]]     # lifetime, idle before eviction, reuse gaps (seconds)
GAPS_KEPT = 4                                           # the last accesses a block remembers (vLLM's)


class _Block:
    __slots__ = ("born_ns", "last_ns", "accesses")

    def __init__(self, now_ns: int) -> None:
        self.born_ns = self.last_ns = now_ns
        self.accesses: deque[int] = deque(maxlen=GAPS_KEPT)

    def event(self, now_ns: int) -> KVEvictionEvent:
        a = list(self.accesses)
        return ((now_ns - self.born_ns) / 1e9, (now_ns - self.last_ns) / 1e9,
                [(a[i] - a[i - 1]) / 1e9 for i in range(1, len(a))])


class BlockResidency:
    """The sampled blocks' lives, by block id; ``drain`` takes the eviction events so far."""

    def __init__(self, sample_rate: float, rng: random.Random | None = None,
                 clock=time.monotonic_ns) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"the KV cache metrics' sample rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._rng = rng or random.Random()
        self._clock = clock
        self._blocks: dict[int, _Block] = {}
        self._events: list[KVEvictionEvent] = []

    def allocated(self, block_id: int) -> None:
        if self._rng.random() < self.sample_rate:
            self._blocks[block_id] = _Block(self._clock())

    def accessed(self, block_id: int) -> None:
        b = self._blocks.get(block_id)
        if b is not None:
            b.last_ns = now = self._clock()
            b.accesses.append(now)

    def evicted(self, block_id: int) -> None:
        b = self._blocks.pop(block_id, None)
        if b is not None:
            self._events.append(b.event(self._clock()))

    def reset(self) -> None:
        """The prefix cache was cleared: nothing sampled lives on."""
        self._blocks.clear()
        self._events.clear()

    def drain(self) -> list[KVEvictionEvent]:
        events, self._events = self._events, []
        return events
