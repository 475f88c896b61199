"""Random sequences of add / step / finish / abort / preemption against the real Scheduler and
KVCacheManager; the block accounting is checked after every operation."""
from __future__ import annotations

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from sched_utils import EOS, AsyncHarness, Harness, check_cached_contents

# Prompts drawn from a tiny alphabet of 4-token blocks, so requests share prefixes often.
BLOCKS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]

op = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=5),
              st.integers(0, 3), st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("step"), st.sampled_from([7, 8, EOS])),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


def _apply(h, ops, num_blocks: int, busy) -> None:
    """Run ``ops`` (add / step / abort) on ``h``, checking the block accounting and the cached
    blocks' contents after each."""
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
            if busy():
                h.step(token=o[1])
        else:
            h.s.abort_requests([f"r{o[1]}"])
        h.kv.check_integrity()
        check_cached_contents(h)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=60), num_blocks=st.integers(6, 24),
       policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans(),
       budget=st.sampled_from([8, 16, 64]))
# a request preempted by a higher-priority one in the step that had just allocated for it: the
# blocks offered to the prefix cache for the tokens that step would have computed are taken back
@example(ops=[("add", [0], 0, 5, 1), ("add", [0, 0], 0, 6, 0), ("step", 7), ("step", 7), ("add", [0], 0, 4, 0),
              ("add", [0], 2, 4, 0)], num_blocks=10, policy="priority", caching=True, budget=8)
def test_block_accounting_holds_after_every_operation(ops, num_blocks, policy, caching, budget):
    h = Harness(num_blocks=num_blocks, watermark=0.0, policy=policy, enable_prefix_caching=caching,
                max_num_batched_tokens=budget, max_num_seqs=6)
    _apply(h, ops, num_blocks, h.s.has_work)
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


def next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the tokens so far (EOS now
    and then), so two schedules of the same requests must give the same outputs."""
    v = (sum(tokens) * 7 + len(tokens) * 13) % 23
    return EOS if v == 0 else 20 + v


def _outputs(h, requests, max_steps: int = 2000) -> dict[str, tuple[list[int], str]]:
    for rid, prompt, max_tokens, priority in requests:
        h.add(rid, prompt, max_tokens=max_tokens, priority=priority, arrival=len(h.s.requests))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    busy = h.busy if isinstance(h, AsyncHarness) else h.s.has_work
    for _ in range(max_steps):
        if not busy():
            break
        _, outs = h.step(token=next_token)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
        check_cached_contents(h)
    assert not busy()
    assert h.kv.pool.num_free_blocks == h.kv.pool.num_usable_blocks      # nothing leaked
    return {rid: (tokens.get(rid, []), reasons.get(rid)) for rid, *_ in requests}


request = st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=4), st.integers(0, 3),
                    st.integers(1, 14), st.integers(0, 2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=8), num_blocks=st.integers(8, 24),
       policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans(),
       budget=st.sampled_from([8, 16, 64]), threshold=st.sampled_from([0, 4]))
def test_async_scheduling_gives_the_tokens_of_synchronous_scheduling(reqs, num_blocks, policy, caching,
                                                                      budget, threshold):
    """Under preemption, prefix hits, chunked prompts, EOS and max_tokens, planning each step
    before the previous one's output came back changes no request's tokens or finish reason."""
    requests = []
    for i, (blocks, extra, max_tokens, priority) in enumerate(reqs):
        prompt = [t for b in blocks for t in BLOCKS[b]] + [30 + i for i in range(extra)]
        if len(prompt) + max_tokens < (num_blocks - 2) * 4:
            requests.append((f"r{i}", prompt, max_tokens, priority))
    cfg = dict(num_blocks=num_blocks, watermark=0.0, policy=policy, enable_prefix_caching=caching,
               max_num_batched_tokens=budget, max_num_seqs=6, long_prefill_token_threshold=threshold)
    sync = _outputs(Harness(**cfg), requests)
    async_h = AsyncHarness(**cfg)
    assert _outputs(async_h, requests) == sync
    event(f"preempted: {async_h.s.counters.num_preemptions > 0}")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=60), num_blocks=st.integers(6, 24),
       policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans())
def test_block_accounting_holds_with_a_step_in_flight(ops, num_blocks, policy, caching):
    """Aborts and finishes while a step is in flight leak no block and double-book none."""
    h = AsyncHarness(num_blocks=num_blocks, watermark=0.0, policy=policy, enable_prefix_caching=caching,
                     max_num_batched_tokens=16, max_num_seqs=6)
    _apply(h, ops, num_blocks, h.busy)
    for _ in range(500):
        if not h.busy():
            break
        h.step()
    assert not h.busy()
    assert h.kv.pool.num_free_blocks == num_blocks - 1
    assert all(not r.num_output_placeholders for r in h.s.requests.values())
