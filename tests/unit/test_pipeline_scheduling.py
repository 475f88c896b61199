"""The scheduler's batch queue under pipeline parallelism: with as many steps in flight as there
are stages, a request is never in two steps in flight at once, the other requests fill the next
step (micro-batches), and every request still gets the tokens it gets with one step in flight,
through chunked prompts, preemptions and requests finishing or aborted mid-flight. The stages
that do not sample learn each step's tokens from it (``new_token_ids``)."""
from __future__ import annotations

from collections import deque

from actors.engine.config import ParallelConfig
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler
from sched_utils import EOS, FakeWorker, add, engine_config


def _token(tokens: list[int]) -> int:
    return 3 + (sum(tokens) * 7 + len(tokens)) % 97          # never EOS; depends on every token so far


def _run(pp: int, num_blocks: int, budget: int, abort_after: int = -1) -> tuple[dict[str, list[int]], dict]:
    """Requests arriving in two waves, served to the end with up to ``pp`` steps in flight
    (the scheduler actor's loop); their outputs, and what was observed of the steps."""
    config = engine_config(num_blocks, max_num_batched_tokens=budget, max_num_seqs=8)
    config = config.replace(parallel=ParallelConfig(pipeline_parallel_size=pp))
    s = Scheduler(config, KVCacheManager(num_blocks, 4, True))
    worker = FakeWorker(num_blocks, 4)
    outputs: dict[str, list[int]] = {}
    seen = {"overlapped": 0, "max_in_flight": 0, "preemptions": 0}
    for i, n in enumerate((13, 5, 9, 22)):
        add(s, f"a{i}", n, max_tokens=12)
    in_flight: deque = deque()
    steps = 0
    while s.has_work() or in_flight:
        if steps == 6:
            for i, n in enumerate((7, 17, 3)):
                add(s, f"b{i}", n, max_tokens=10)
        if steps == abort_after:
            s.abort_requests(["a1"])
        so = s.schedule()
        steps += 1
        if so.num_scheduled_tokens:
            busy = {rid for o in in_flight for rid in o.num_scheduled_tokens}
            assert not busy & set(so.num_scheduled_tokens), "a request in two steps in flight"
            seen["overlapped"] += bool(in_flight)
            c = so.cached_reqs
            assert len(c.new_token_ids) == (len(c.req_ids) if pp > 1 else 0)
            for rid, start, toks in zip(c.req_ids, c.num_computed_tokens, c.new_token_ids):
                assert toks == worker.tokens[rid][start:start + so.num_scheduled_tokens[rid]]
            in_flight.append(so)
            seen["max_in_flight"] = max(seen["max_in_flight"], len(in_flight))
        while in_flight and (len(in_flight) >= s.batch_queue_size or not so.num_scheduled_tokens):
            done = in_flight.popleft()
            for out in s.update_from_output(done, worker.run(done, _token)):
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if not so.num_scheduled_tokens:
                break
    seen["preemptions"] = s.counters.num_preemptions
    return outputs, seen


def test_micro_batches_overlap_and_give_every_request_its_one_stage_tokens():
    want, one = _run(1, 64, 16)
    got, two = _run(2, 64, 16)
    assert got == want and all(len(v) in (10, 12) for v in got.values()) and len(got) == 7
    assert one["max_in_flight"] == 1 and two["max_in_flight"] == 2 and two["overlapped"] > 5
    assert EOS not in sum(got.values(), [])


def test_preemptions_with_steps_in_flight_keep_every_requests_tokens():
    want, _ = _run(1, 14, 12)
    got, seen = _run(2, 14, 12)
    assert seen["preemptions"] > 0 and seen["overlapped"] > 0
    assert got == want


def test_a_request_aborted_with_its_step_in_flight_is_dropped_and_the_others_go_on():
    want, _ = _run(1, 64, 16, abort_after=3)
    got, _ = _run(2, 64, 16, abort_after=3)
    assert "a1" not in got or len(got["a1"]) < 12
    assert {k: v for k, v in got.items() if k != "a1"} == {k: v for k, v in want.items() if k != "a1"}


def test_the_batch_queue_holds_one_step_per_stage():
    config = engine_config(16).replace(parallel=ParallelConfig(pipeline_parallel_size=3))
    assert Scheduler(config, KVCacheManager(16, 4, True)).batch_queue_size == 3
    assert Scheduler(engine_config(16), KVCacheManager(16, 4, True)).batch_queue_size == 1
