"""The pure Scheduler with a real KVCacheManager, driven by hand-made runner outputs."""
from __future__ import annotations

from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler, SchedulerConfig
from transport.messages import EngineCoreRequest, ModelRunnerOutput, SamplingParams, SchedulerOutput

EOS = 2


def make(num_blocks=64, **cfg):
    config = SchedulerConfig(**{"block_size": 4, "max_num_batched_tokens": 64, **cfg})
    return Scheduler(config, num_blocks), KVCacheManager(num_blocks, config.block_size)


def add(s, rid, n_prompt, max_tokens=8, **params):
    err = s.add_request(EngineCoreRequest(rid, list(range(10, 10 + n_prompt)),
                                          SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                                          0.0, [EOS]))
    assert err is None


def step(s, kv, token=7) -> tuple[SchedulerOutput, list]:
    """One step: schedule, commit blocks, and sample ``token`` for every request whose
    prompt is complete (as a worker would)."""
    plan = s.schedule()
    so = s.build_output(plan, kv.commit(plan.kv_commit))
    sampled = []
    for req, n in plan.scheduled:
        sampled.append([token] if req.num_computed_tokens == req.num_tokens else [])
    outs = s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled))
    if not s.has_work():   # idle: the actor hands finished requests' blocks back at once
        release = s.release_commit()
        if release is not None:
            kv.commit(release)
    kv.check_integrity()
    return so, outs


def held_blocks(kv):
    return sum(len(b) for b in kv.req_to_blocks.values())


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    s, kv = make(max_num_batched_tokens=16)
    add(s, "a", 40)
    chunks = []
    for _ in range(3):
        so, outs = step(s, kv)
        chunks.append(so.num_scheduled_tokens["a"])
    assert chunks == [16, 16, 8]
    assert outs[-1].new_token_ids == [7]          # sampled only once the prompt is done
    so, _ = step(s, kv)
    assert so.num_scheduled_tokens == {"a": 1}     # then one token per step


def test_decodes_and_a_new_prefill_share_one_step():
    s, kv = make()
    add(s, "a", 5)
    step(s, kv)
    add(s, "b", 9)
    so, outs = step(s, kv)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [n.req_id for n in so.new_reqs] == ["b"] and so.cached_reqs.req_ids == ["a"]
    assert {o.request_id for o in outs} == {"a", "b"}


def test_max_num_seqs_limits_the_running_batch():
    s, kv = make(max_num_seqs=2)
    for r in "abc":
        add(s, r, 3)
    so, _ = step(s, kv)
    assert set(so.num_scheduled_tokens) == {"a", "b"} and len(s.waiting) == 1


def test_finished_requests_free_their_blocks_and_are_dropped_by_workers():
    s, kv = make()
    add(s, "a", 6, max_tokens=2)
    step(s, kv)
    assert held_blocks(kv) == 2
    _, outs = step(s, kv)
    assert outs[0].finish_reason == "length"
    add(s, "b", 3)
    so, _ = step(s, kv)
    assert so.finished_req_ids == ["a"] and "a" not in kv.req_to_blocks


def test_eos_stops_unless_ignored_and_min_tokens_defers_it():
    s, kv = make()
    add(s, "a", 3)
    add(s, "b", 3, ignore_eos=True)
    add(s, "c", 3, min_tokens=2)
    _, outs = step(s, kv, token=EOS)
    reasons = {o.request_id: o.finish_reason for o in outs}
    assert reasons == {"a": "stop", "b": None, "c": None}
    _, outs = step(s, kv, token=EOS)
    assert {o.request_id: o.finish_reason for o in outs} == {"b": None, "c": "stop"}


def test_preemption_frees_the_tail_and_recomputes_it_later():
    # 7 usable blocks of 4 tokens: two requests of 12 prompt tokens take 6; growing needs more.
    s, kv = make(num_blocks=8, watermark=0.0)
    add(s, "a", 12, max_tokens=10)
    add(s, "b", 12, max_tokens=10)
    step(s, kv)
    preempted_seen = False
    for _ in range(30):
        so, _ = step(s, kv)
        if "b" in so.finished_req_ids and "b" in s.requests:
            preempted_seen = True
            assert s.requests["b"].num_computed_tokens == 0 or "b" in so.num_scheduled_tokens
        if not s.has_work():
            break
    assert preempted_seen and s.counters.num_preemptions >= 1
    assert not s.has_work() and held_blocks(kv) == 0


def test_abort_running_and_waiting_requests_frees_everything():
    s, kv = make(max_num_seqs=1)
    add(s, "a", 5)
    add(s, "b", 5)
    step(s, kv)
    outs = s.abort_requests(["a", "b", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort"), ("b", "abort")]
    assert not s.has_work() and s.num_free_blocks == s.num_usable_blocks
    kv.commit(s.release_commit())
    assert held_blocks(kv) == 0


def test_prompt_that_can_never_fit_is_refused_at_once():
    s, _ = make(num_blocks=4)
    err = s.add_request(EngineCoreRequest("big", list(range(20)), SamplingParams(), 0.0))
    assert err is not None and err.finish_reason == "error" and "20 tokens" in err.error
