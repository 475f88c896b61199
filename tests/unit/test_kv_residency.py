"""vLLM's KV cache residency metrics (--kv-cache-metrics): a sampled block's lifetime, idle time
before its eviction and the gaps between its reuses, as the block pool hands blocks out, revives
them from the prefix cache and hands them out again; the frontend's three histograms."""
from __future__ import annotations

import random

import pytest

from actors.engine.messages import SchedulerStats
from actors.frontend.stats import EngineStats
from actors.kv_manager.block_pool import BlockPool
from actors.kv_manager.residency import BlockResidency


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns

    def at(self, seconds: float) -> None:
        self.ns = int(seconds * 1e9)


def test_a_block_reports_its_lifetime_idle_time_and_reuse_gaps_when_evicted():
    clock = Clock()
    r = BlockResidency(1.0, clock=clock)
    r.allocated(7)
    for t in (2, 5, 6):
        clock.at(t)
        r.accessed(7)
    clock.at(10)
    r.evicted(7)
    r.evicted(7)                     # once only
    assert r.drain() == [(10.0, 4.0, [3.0, 1.0])] and r.drain() == []


def test_only_the_sampled_fraction_is_followed():
    r = BlockResidency(0.25, rng=random.Random(0))
    for b in range(4000):
        r.allocated(b)
        r.evicted(b)
    assert 850 < len(r.drain()) < 1150
    with pytest.raises(ValueError, match="sample rate"):
        BlockResidency(0.0)


def test_the_pool_evicts_a_cached_block_when_it_hands_it_out_again():
    pool = BlockPool(4, enable_caching=True)                  # 3 usable blocks
    clock = Clock()
    pool.residency = BlockResidency(1.0, clock=clock)
    a = pool.get_new_blocks("r1", 3)
    for i, b in enumerate(a):
        pool.cache_full_block(b, i.to_bytes(4, "little"))
    clock.at(1)
    pool.free_blocks("r1", a)
    clock.at(3)
    pool.touch("r2", a[:1])                                   # a prefix hit revives the first block
    pool.free_blocks("r2", a[:1])
    clock.at(4)
    pool.get_new_blocks("r3", 2)                              # the two least recently freed go
    assert sorted(pool.residency.drain()) == [(4.0, 4.0, []), (4.0, 4.0, [])]
    pool.reset_prefix_cache()
    assert pool.residency.drain() == []


def test_without_prefix_caching_no_block_is_evicted():
    pool = BlockPool(3, enable_caching=False)
    pool.residency = BlockResidency(1.0)
    pool.free_blocks("r1", pool.get_new_blocks("r1", 2))
    pool.get_new_blocks("r2", 2)
    assert pool.residency.drain() == []


def test_the_frontend_counts_the_events_in_vllms_histograms():
    stats = EngineStats()
    stats.observe_step(SchedulerStats(kv_cache_eviction_events=[(12.0, 3.0, [0.5, 2.0]), (0.004, 0.004, [])]))
    text = stats.prometheus(("vllm",))
    assert 'vllm:kv_block_lifetime_seconds_count{model_name="",engine="0"} 2' in text
    assert 'vllm:kv_block_idle_before_evict_seconds_bucket{model_name="",engine="0",le="5"} 2' in text
    assert 'vllm:kv_block_reuse_gap_seconds_count{model_name="",engine="0"} 2' in text
