"""The pure Scheduler with a real KVCacheManager, driven by hand-made runner outputs
(in the style of vLLM's tests/v1/core)."""
from __future__ import annotations

import pytest

from actors.scheduler.scheduler import MAX_WORKER_FAILURES
from sched_utils import EOS, FakeWorker, Harness, held_blocks
from actors.engine.messages import EngineCoreRequest
from actors.engine.sampling_params import SamplingParams


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    h = Harness(max_num_batched_tokens=16)
    h.add("a", 40)
    chunks, outs = [], None
    for _ in range(3):
        so, outs = h.step()
        chunks.append(so.num_scheduled_tokens["a"])
    assert chunks == [16, 16, 8]
    assert outs[-1].new_token_ids == [7]          # sampled only once the prompt is done
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1}     # then one token per step


def test_decodes_and_a_new_prefill_share_one_step():
    h = Harness()
    h.add("a", 5)
    h.step()
    h.add("b", 9)
    so, outs = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [n.req_id for n in so.new_reqs] == ["b"] and so.cached_reqs.req_ids == ["a"]
    assert {o.request_id for o in outs} == {"a", "b"}


def test_max_num_seqs_limits_the_running_batch():
    h = Harness(max_num_seqs=2)
    for r in "abc":
        h.add(r, 3)
    so, _ = h.step()
    assert set(so.num_scheduled_tokens) == {"a", "b"} and len(h.s.waiting) == 1


def test_token_budget_limits_what_joins_a_step():
    h = Harness(max_num_batched_tokens=10)
    h.add("a", 6)
    h.add("b", 6)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 6, "b": 4}     # b's prompt starts in a chunk
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 2}


def test_without_chunked_prefill_a_prompt_is_scheduled_whole_or_waits_its_turn():
    """--no-enable-chunked-prefill (an encoder's prompts): a prompt that does not fit what is
    left of the step's budget waits for the next step, keeping its place; neither the long
    prefill threshold nor a shared budget ever cuts one."""
    h = Harness(max_num_batched_tokens=10, enable_chunked_prefill=False, long_prefill_token_threshold=4)
    h.add("a", 6)
    h.add("b", 6)
    h.add("c", 3)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 6}             # b does not fit beside a; c waits behind b
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 6, "c": 3}
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}


def test_long_prefill_threshold_caps_chunks_but_not_a_lone_request():
    h = Harness(long_prefill_token_threshold=4, max_num_batched_tokens=64, max_num_partial_prefills=2,
                max_long_partial_prefills=2)
    h.add("alone", 12)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"alone": 12}
    h.add("x", 12)
    h.add("y", 12)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"alone": 1, "x": 4, "y": 4}


def test_finished_requests_free_their_blocks_and_are_dropped_by_workers():
    h = Harness()
    h.add("a", 6, max_tokens=2)
    h.step()
    assert held_blocks(h.kv) == 2
    _, outs = h.step()
    assert outs[0].finish_reason == "length"
    assert "a" not in h.kv.req_to_blocks            # released at once though the engine is idle
    h.add("b", 3)
    so, _ = h.step()
    assert so.finished_req_ids == ["a"]


def test_eos_stops_unless_ignored_and_min_tokens_defers_it():
    h = Harness()
    h.add("a", 3)
    h.add("b", 3, ignore_eos=True)
    h.add("c", 3, min_tokens=2)
    _, outs = h.step(token=EOS)
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "stop", "b": None, "c": None}
    _, outs = h.step(token=EOS)
    assert {o.request_id: o.finish_reason for o in outs} == {"b": None, "c": "stop"}


def test_stop_token_ids_end_a_request_and_are_reported():
    h = Harness()
    h.add("a", 3, stop_token_ids=[9])
    _, outs = h.step(token=9)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 9


def test_repetition_detection_ends_a_request_whose_output_repeats_a_pattern():
    """vLLM's repetition_detection: (7, 8) three times in a row ends the request with finish
    reason "repetition", not before min_tokens; a request without it runs on."""
    from actors.engine.sampling_params import RepetitionDetectionParams
    rd = RepetitionDetectionParams(max_pattern_size=3, min_count=3)
    h = Harness()
    h.add("a", 3, repetition_detection=rd, max_tokens=50)
    h.add("b", 3, repetition_detection=rd, max_tokens=50, min_tokens=8)
    h.add("c", 3, max_tokens=50)
    ends: dict[str, tuple] = {}
    for tok in [5, 7, 8, 7, 8, 7, 8, 7, 8, 7]:
        _, outs = h.step(token=tok)
        ends.update({o.request_id: (o.finish_reason, o.stop_reason, tok) for o in outs if o.finish_reason})
    assert ends == {"a": ("repetition", "repetition_detected", 8), "b": ("repetition", "repetition_detected", 7)}


def test_preemption_frees_the_tail_and_resumes_it_with_recompute():
    # 7 usable blocks of 4 tokens: two 12-token prompts take 6; growing needs more
    h = Harness(num_blocks=8, watermark=0.0, enable_prefix_caching=False)
    h.add("a", 12, max_tokens=10)
    h.add("b", 12, max_tokens=10)
    h.step()
    preempted_at = None
    for i in range(40):
        so, _ = h.step()
        if "b" in so.finished_req_ids and preempted_at is None:
            preempted_at = i
            assert h.s.requests["b"].num_computed_tokens == 0          # recompute from scratch
        if preempted_at is not None and "b" in {r.req_id for r in so.new_reqs}:
            resumed = next(r for r in so.new_reqs if r.req_id == "b")
            assert resumed.output_token_ids and resumed.num_computed_tokens == 0
        if not h.s.has_work():
            break
    assert preempted_at is not None and h.s.counters.num_preemptions >= 1
    assert not h.s.has_work() and held_blocks(h.kv) == 0


def test_preempted_request_budget_is_refunded_to_later_requests():
    # priority policy: the lowest-priority victim sits before the request that needs blocks
    h = Harness(num_blocks=7, watermark=0.0, policy="priority", enable_prefix_caching=False,
                max_num_batched_tokens=64)
    h.add("low", 8, priority=5, arrival=0.0, max_tokens=20)
    h.add("high", 8, priority=0, arrival=1.0, max_tokens=20)
    so, _ = h.step()
    assert set(so.num_scheduled_tokens) == {"low", "high"}
    for _ in range(12):
        so, _ = h.step()
        if "low" in so.finished_req_ids:
            break
    assert "low" in so.finished_req_ids and "high" in so.num_scheduled_tokens
    assert h.s.requests["low"].status.name == "PREEMPTED"


def test_priority_policy_admits_the_most_urgent_first():
    h = Harness(max_num_seqs=1, policy="priority")
    h.add("later-urgent", 3, priority=0, arrival=2.0)
    h.add("early-lax", 3, priority=3, arrival=1.0)
    so, _ = h.step()
    assert list(so.num_scheduled_tokens) == ["later-urgent"]


def test_abort_running_and_waiting_requests_frees_everything():
    h = Harness(max_num_seqs=1)
    h.add("a", 5)
    h.add("b", 5)
    h.step()
    outs = h.s.abort_requests(["a", "b", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort"), ("b", "abort")]
    assert not h.s.has_work()
    assert held_blocks(h.kv) == 0 and h.kv.num_free_blocks == h.kv.pool.num_usable_blocks


def test_prompt_that_can_never_fit_is_refused_at_once():
    h = Harness(num_blocks=4)
    err = h.s.add_request(EngineCoreRequest("big", list(range(20)), SamplingParams(), 0.0))
    assert err is not None and err.finish_reason == "error" and "20 tokens" in err.error


# -- prefix caching --------------------------------------------------------------------------

def test_prefix_hit_across_requests_skips_full_cached_blocks():
    h = Harness()
    h.add("a", list(range(100, 114)), max_tokens=1)      # 14 tokens: 3 full blocks of 4
    h.step()
    h.add("b", list(range(100, 114)) + [500, 501])
    so, _ = h.step()
    (new,) = so.new_reqs
    assert new.num_computed_tokens == 12 and so.num_scheduled_tokens == {"b": 4}
    assert h.s.counters.prefix_cache_hits == 12


def test_blocks_filled_while_decoding_are_cached_once_each():
    h = Harness()
    h.add("a", list(range(100, 106)), max_tokens=12)     # 6 prompt tokens, then decodes to 18
    offered = []
    cache = h.kv.pool.cache_full_block
    h.kv.pool.cache_full_block = lambda b, bh, *group: (offered.append(b.block_id), cache(b, bh, *group))
    for _ in range(12):
        h.step()
    assert sorted(offered) == sorted(set(offered)) and len(offered) == 4     # 16 of 18 tokens: 4 blocks
    h.add("b", list(range(100, 106)) + [7] * 11 + [9])  # a's whole text so far, then something new
    so, _ = h.step()
    assert so.new_reqs[0].num_computed_tokens == 16


def test_running_request_offers_its_blocks_again_after_a_prefix_cache_reset():
    h = Harness()
    h.add("a", list(range(100, 110)), max_tokens=20)
    h.step()
    h.step()
    h.kv.reset_prefix_cache()
    h.step()
    h.add("b", list(range(100, 110)) + [7, 7, 5])
    so, _ = h.step()
    assert so.new_reqs[0].num_computed_tokens == 12       # a's 3 full blocks, cached again


def test_partial_last_block_is_not_a_hit():
    h = Harness()
    h.add("a", list(range(100, 110)), max_tokens=1)      # 2 full blocks + 2 tokens
    h.step()
    h.add("b", list(range(100, 110)) + [7])
    so, _ = h.step()
    assert so.new_reqs[0].num_computed_tokens == 8


def test_full_hit_is_capped_so_the_last_token_is_computed():
    h = Harness()
    prompt = list(range(100, 112))                        # exactly 3 blocks
    h.add("a", prompt, max_tokens=1)
    h.step()
    h.add("b", prompt)
    so, outs = h.step()
    assert so.new_reqs[0].num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 4}
    assert outs[0].new_token_ids == [7]


def test_shared_prefix_blocks_are_reference_counted():
    h = Harness()
    h.add("a", list(range(100, 116)), max_tokens=20)
    h.step()
    h.add("b", list(range(100, 116)), max_tokens=20)
    h.step()
    shared = [b for b in h.kv.req_to_blocks["a"] if b in h.kv.req_to_blocks["b"]]
    assert len(shared) == 3 and all(b.ref_cnt == 2 for b in shared)
    h.s.abort_requests(["a"])
    h.step()
    assert all(b.ref_cnt == 1 and b.owners == {"b"} for b in shared)


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    h = Harness(num_blocks=9, watermark=0.0)              # 8 usable blocks
    h.add("old", list(range(100, 108)), max_tokens=1)     # 2 full blocks, cached
    h.step()
    h.add("new", list(range(200, 208)), max_tokens=1)
    h.step()
    free_order = [b.block_hash is not None for b in h.kv.pool.free_queue]
    assert free_order[:4] == [False] * 4                  # never-hashed blocks are reused first
    h.add("filler", list(range(300, 324)), max_tokens=1)  # needs 6 blocks: evicts "old" first
    h.step()
    old_hashes = _hashes(list(range(100, 108)))
    new_hashes = _hashes(list(range(200, 208)))
    assert len(h.kv.get_computed_blocks(old_hashes)) == 0
    assert len(h.kv.get_computed_blocks(new_hashes)) == 2


def test_cache_salt_isolates_prefixes():
    h = Harness()
    h.s.add_request(EngineCoreRequest("a", list(range(100, 114)), SamplingParams(max_tokens=1), 0.0,
                                      [EOS], cache_salt="tenant-1"))
    h.step()
    h.s.add_request(EngineCoreRequest("b", list(range(100, 114)), SamplingParams(max_tokens=1), 0.0,
                                      [EOS], cache_salt="tenant-2"))
    so, _ = h.step()
    assert so.new_reqs[0].num_computed_tokens == 0


def test_preempted_request_resumes_from_its_cached_blocks():
    h = Harness(num_blocks=8, watermark=0.0)
    h.add("a", 12, max_tokens=10)
    h.add("b", 12, max_tokens=10)
    resumed = None
    for _ in range(40):
        so, _ = h.step()
        for r in so.new_reqs:
            if r.req_id == "b" and h.s.requests["b"].num_preemptions:
                resumed = r
        if not h.s.has_work():
            break
    assert resumed is not None and resumed.num_computed_tokens > 0


def _hashes(tokens: list[int], bs: int = 4) -> list[bytes]:
    from actors.kv_manager.block_hash import extend_block_hashes
    out: list = []
    extend_block_hashes(out, tokens, bs)
    return out


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_many_requests_through_a_tight_cache_all_finish(policy):
    h = Harness(num_blocks=12, watermark=0.0, policy=policy)
    for i in range(10):
        h.add(f"r{i}", 6 + i, max_tokens=6, priority=i % 3)
    finished = set()
    for _ in range(400):
        _, outs = h.step()
        finished |= {o.request_id for o in outs if o.finish_reason}
        if not h.s.has_work():
            break
    assert finished == {f"r{i}" for i in range(10)} and held_blocks(h.kv) == 0


def test_requests_running_when_the_worker_died_are_recomputed_then_fail_past_the_limit():
    h = Harness()
    h.add("a", 6, max_tokens=30)
    h.add("b", 5, max_tokens=30)
    h.step()
    h.step()
    assert h.s.requeue_running("the worker died") == []             # both go back to the queue
    assert held_blocks(h.kv) == 0 and [r.request_id for r in h.s.waiting.first(2)] == ["a", "b"]
    h.s.reset_blocks()                                             # the replacement's cache is empty
    h.worker = FakeWorker(64, 4)
    so, _ = h.step()
    assert {r.req_id: (len(r.output_token_ids), r.num_computed_tokens) for r in so.new_reqs} == \
        {"a": (2, 0), "b": (2, 0)}                                 # recomputed with the tokens so far
    for _ in range(MAX_WORKER_FAILURES - 1):
        outs = h.s.requeue_running("the worker died")
        h.s.reset_blocks()
        h.worker = FakeWorker(64, 4)
        h.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "error"), ("b", "error")]
    assert "died 3 times" in outs[0].error and not h.s.has_work()


def test_one_prompt_is_part_way_computed_at_a_time_by_default_and_whole_prompts_pass_it():
    h = Harness(long_prefill_token_threshold=4, max_num_batched_tokens=64)
    h.add("x", 12)
    h.add("y", 12)
    h.add("short", 3)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"x": 4, "short": 3}      # y would be a second partial prompt
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"x": 4, "short": 1}
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"x": 4, "short": 1, "y": 4}   # x's last chunk: y may start


def test_max_long_partial_prefills_lets_short_prompts_pass_long_ones():
    h = Harness(long_prefill_token_threshold=8, max_num_batched_tokens=20, max_num_partial_prefills=2,
                max_long_partial_prefills=1)
    h.add("long-1", 30)
    h.add("long-2", 30)
    h.add("short", 8)
    h.add("short-2", 8)
    so, _ = h.step()
    # long-1 takes 8 (capped), long-2 would be a second long partial prompt, short fits whole,
    # short-2 gets the 4 tokens left: a second partial prompt, but not a long one
    assert so.num_scheduled_tokens == {"long-1": 8, "short": 8, "short-2": 4}


def test_async_scheduling_plans_no_step_past_max_tokens_and_drops_a_stopped_requests_extra_token():
    from sched_utils import AsyncHarness
    h = AsyncHarness()
    h.add("capped", 4, max_tokens=2)
    h.add("stops", 4, max_tokens=10)
    so, _ = h.step(token=7)                          # both prompts; nothing back yet
    assert so.num_scheduled_tokens == {"capped": 4, "stops": 4}
    so, outs = h.step(token=7)                       # their first tokens are in flight ...
    assert so.num_scheduled_tokens == {"capped": 1, "stops": 1}       # ... and computed already
    assert {o.request_id: o.new_token_ids for o in outs} == {"capped": [7], "stops": [7]}
    so, outs = h.step(token=EOS)                     # capped has its 2 tokens in flight: not planned
    assert so.num_scheduled_tokens == {"stops": 1}
    assert {o.request_id: (o.new_token_ids, o.finish_reason) for o in outs} == {
        "capped": ([7], "length"), "stops": ([7], None)}
    so, outs = h.step(token=7)                       # stops' EOS comes back: its planned step is waste
    assert {o.request_id: (o.new_token_ids, o.finish_reason) for o in outs} == {"stops": ([EOS], "stop")}
    while h.busy():
        _, outs = h.step(token=7)
        assert not outs                              # the extra token sampled for it is dropped
    assert h.kv.pool.num_free_blocks == h.kv.pool.num_usable_blocks


def test_a_pause_for_new_requests_keeps_decoding_the_running_ones_and_starts_none():
    from actors.scheduler.scheduler import PauseState
    h = Harness()
    h.add("a", 5)
    h.step()
    h.s.pause_state = PauseState.PAUSED_NEW
    h.add("b", 5)
    so, outs = h.step()
    assert so.num_scheduled_tokens == {"a": 1} and [o.request_id for o in outs] == ["a"]
    assert len(h.s.waiting) == 1
    h.s.abort_requests(["a"])
    assert not h.s.has_work()                      # drained: b waits for the pause to end
    h.s.pause_state = PauseState.UNPAUSED
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"b": 5}


def test_a_pause_of_everything_schedules_nothing_and_keeps_every_request_and_its_blocks():
    from actors.scheduler.scheduler import PauseState
    h = Harness()
    h.add("a", 5)
    h.step()
    h.add("b", 5)
    blocks = held_blocks(h.kv)
    h.s.pause_state = PauseState.PAUSED_ALL
    assert not h.s.has_work()
    so = h.s.schedule()
    assert so.num_scheduled_tokens == {} and held_blocks(h.kv) == blocks
    h.s.pause_state = PauseState.UNPAUSED
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 5}


def test_abort_all_ends_every_request_the_scheduler_holds():
    h = Harness(max_num_seqs=1)
    h.add("a", 5)
    h.add("b", 5)
    h.step()
    outs = h.s.abort_all()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "abort"), ("b", "abort")]
    assert not h.s.has_work() and held_blocks(h.kv) == 0


def test_max_num_active_seqs_limits_the_running_batch_below_max_num_seqs():
    """vLLM's max_num_active_seqs: fewer requests run at once than the runner is sized for; the
    others start as running ones finish."""
    h = Harness(max_num_seqs=4, max_num_active_seqs=2)
    for r in "abcd":
        h.add(r, 3, max_tokens=2)
    seen = []
    for _ in range(12):
        so, _ = h.step()
        assert len(h.s.running) <= 2 and len(so.num_scheduled_tokens) <= 2
        seen += list(so.num_scheduled_tokens)
    assert set(seen) == set("abcd") and not h.s.waiting and not h.s.running


def test_max_num_scheduled_tokens_is_each_steps_budget():
    """vLLM's max_num_scheduled_tokens: a step schedules at most that many tokens, however many the
    worker could take (max_num_batched_tokens)."""
    h = Harness(max_num_batched_tokens=64, max_num_scheduled_tokens=10)
    h.add("a", 24)
    h.add("b", 6)
    chunks = []
    for _ in range(4):
        so, _ = h.step()
        assert sum(so.num_scheduled_tokens.values()) <= 10
        chunks.append(dict(so.num_scheduled_tokens))
    assert chunks[0] == {"a": 10} and chunks[2] == {"a": 4, "b": 6}


@pytest.mark.parametrize("reserve", [True, False])
def test_a_prompt_is_admitted_only_when_its_whole_sequence_fits_unless_told_otherwise(reserve):
    """vLLM's scheduler_reserve_full_isl (on by default): with chunked prefill, a waiting prompt
    whose first chunk fits but whose whole prompt does not (beside the running ones) waits; off,
    it starts on its first chunk. Either way every request finishes."""
    h = Harness(num_blocks=16, max_num_batched_tokens=8, watermark=0.0, scheduler_reserve_full_isl=reserve)
    h.add("a", 24, max_tokens=4)         # 6 of the 15 usable blocks of 4 tokens, then 1 more
    for _ in range(3):
        h.step()
    h.add("b", 40, max_tokens=2)         # 10 blocks: only 8 are free while a runs
    so, _ = h.step()
    assert ("b" in so.num_scheduled_tokens) is not reserve
    for _ in range(40):
        if not (h.s.running or h.s.waiting):
            break
        h.step()
    assert not h.s.running and not h.s.waiting


def test_the_adaptive_long_prefill_threshold_is_at_least_a_fair_share_of_the_budget():
    """vLLM's long_prefill_token_threshold_adaptive: two long prompts in a budget of 32 get 16
    tokens each rather than the threshold's 4; four get 8 each."""
    for n, chunk in ((2, 16), (4, 8)):
        h = Harness(long_prefill_token_threshold=4, max_num_batched_tokens=32, max_num_partial_prefills=4,
                    max_long_partial_prefills=4, long_prefill_token_threshold_adaptive=True)
        for i in range(n):
            h.add(f"r{i}", 40)
        so, _ = h.step()
        assert list(so.num_scheduled_tokens.values()) == [chunk] * n
    fixed = Harness(long_prefill_token_threshold=4, max_num_batched_tokens=32, max_num_partial_prefills=2,
                    max_long_partial_prefills=2)
    fixed.add("x", 40)
    fixed.add("y", 40)
    assert list(fixed.step()[0].num_scheduled_tokens.values()) == [4, 4]
