"""Random sequences of add / step / finish / abort / preemption against the real Scheduler and
KVCacheManager; the block accounting is checked after every operation."""
from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sched_utils import EOS, Harness, check_cached_contents

# Prompts drawn from a tiny alphabet of 4-token blocks, so requests share prefixes often.
BLOCKS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]

op = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=5),
              st.integers(0, 3), st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("step"), st.sampled_from([7, 8, EOS])),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=60), num_blocks=st.integers(6, 24),
       policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans(),
       budget=st.sampled_from([8, 16, 64]))
def test_block_accounting_holds_after_every_operation(ops, num_blocks, policy, caching, budget):
    h = Harness(num_blocks=num_blocks, watermark=0.0, policy=policy, enable_prefix_caching=caching,
                max_num_batched_tokens=budget, max_num_seqs=6)
    added = 0
    for o in ops:
        if o[0] == "add":
            _, blocks, extra, max_tokens, priority = o
            prompt = [t for b in blocks for t in BLOCKS[b]] + [20 + i for i in range(extra)]
            if len(prompt) >= (num_blocks - 1) * 4:
                continue
            h.add(f"r{added}", prompt, max_tokens=max_tokens, priority=priority, arrival=added)
            added += 1
        elif o[0] == "step":
            if h.s.has_work():
                h.step(token=o[1])
        else:
            h.s.abort_requests([f"r{o[1]}"])
        h.kv.check_integrity()
        check_cached_contents(h)
    for _ in range(500):                  # everything still finishes, nothing leaks
        if not h.s.has_work():
            break
        h.step()
        check_cached_contents(h)
    assert not h.s.has_work()
    event(f"preempted: {h.s.counters.num_preemptions > 0}")
    event(f"prefix hits: {h.s.counters.prefix_cache_hits > 0}")
    assert sum(len(b) for b in h.kv.req_to_blocks.values()) == 0
    assert h.kv.pool.num_free_blocks == num_blocks - 1
