"""Stall-free batching (--max-step-latency-ms): the step cost model fitted on observed steps, and
the scheduler sizing prompt chunks so that a step with decodes in it stays under the target
(a synthetic cost model in place of the worker's timings), with no starvation: every request
still finishes, its prompt progressing by at least a block per step; and the worker's start-up
profile that fits the model before the first request (a tiny random model)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.args import EngineArgs
from actors.scheduler.cost_model import (AUTO_CHUNK_COST, AUTO_MIN_CHUNK_TOKENS, MIN_OBSERVATIONS, StepCostModel,
                                        attention_pairs)
from actors.worker.worker import Worker
from sched_utils import Harness

COEF = (0.002, 0.0004, 0.00002)        # seconds: per step, per token, per 1000 attention pairs
TARGET_MS = 40.0
BS = 4


def test_the_cost_model_recovers_the_coefficients_of_the_steps_it_observes():
    rng = random.Random(0)
    model = StepCostModel()
    true = StepCostModel(COEF)
    for i in range(60):
        tokens, computed = rng.randint(1, 512), rng.randint(0, 4000)
        pairs = attention_pairs(computed, tokens)
        assert model.ready == (i >= MIN_OBSERVATIONS)
        model.observe(tokens, pairs, true.predict(tokens, pairs) * rng.uniform(0.97, 1.03))
    for tokens, computed in ((1, 100), (64, 2000), (512, 0), (256, 8000)):
        pairs = attention_pairs(computed, tokens)
        assert abs(model.predict(tokens, pairs) - true.predict(tokens, pairs)) <= 0.05 * true.predict(tokens, pairs)


def test_the_largest_chunk_fits_its_time_and_one_more_token_does_not():
    model = StepCostModel(COEF)
    for computed in (0, 100, 3000):
        for seconds in (0.001, 0.01, 0.1):
            n = model.max_chunk(computed, seconds)
            cost = lambda k: model.predict(k, attention_pairs(computed, k)) - COEF[0]   # noqa: E731
            assert cost(n) <= seconds < cost(n + 1)


def _predicted(so, model: StepCostModel) -> float:
    starts = dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
    starts |= {r.req_id: r.num_computed_tokens for r in so.new_reqs}
    pairs = sum(attention_pairs(starts[rid], n) for rid, n in so.num_scheduled_tokens.items())
    return model.predict(so.total_num_scheduled_tokens, pairs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 30)), min_size=2, max_size=8),
       st.integers(0, 6))
def test_steps_with_decodes_stay_under_the_target_and_every_request_finishes(requests, decode_first):
    """Prompts of up to 300 tokens arrive while others decode. Every step that had decoding
    requests when it was planned is predicted within the target, unless its one prompt chunk is
    the one-block minimum that keeps the oldest prompt going; every request finishes within a
    bound of steps."""
    h = Harness(num_blocks=512, max_step_latency_ms=TARGET_MS, max_num_batched_tokens=512)
    h.s.cost = StepCostModel(COEF)
    steps = 0
    finished: set[str] = set()
    for i, (prompt, max_tokens) in enumerate(requests):
        h.add(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True)
        if i < decode_first:       # some requests get going before the others arrive
            for _ in range(2):
                _, outs = h.step()
                finished |= {o.request_id for o in outs if o.finish_reason}
                steps += 1
    bound = sum(-(-p // BS) + m for p, m in requests) + 10
    while h.s.has_work():
        decoding = [r for r in h.s.running if r.num_computed_tokens >= r.num_prompt_tokens]
        so = h.schedule()
        outs = h.s.update_from_output(so, h.worker.run(so, 7))
        finished |= {o.request_id for o in outs if o.finish_reason}
        steps += 1
        assert steps <= bound, "a request starved"
        starts = dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
        starts |= {r.req_id: r.num_computed_tokens for r in so.new_reqs}
        chunks = [n for rid, n in so.num_scheduled_tokens.items()     # prompt chunks, 1-token ones too
                  if n > 1 or starts[rid] < requests[int(rid[1:])][0]]
        if decoding and chunks:
            assert (_predicted(so, h.s.cost) <= TARGET_MS / 1000 + 1e-9
                    or (len(chunks) == 1 and chunks[0] <= BS)), (so.num_scheduled_tokens, _predicted(so, h.s.cost))
    assert finished == {f"r{i}" for i in range(len(requests))}


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 30)), min_size=2, max_size=8))
def test_with_an_auto_target_prompt_chunks_beside_decodes_cost_at_most_the_auto_budget(requests):
    """--max-step-latency-ms auto: the target follows the machine's fitted costs (ten fixed step
    costs, or 128 prompt tokens' cost where that is more); every request still finishes within the
    bound of steps."""
    h = Harness(num_blocks=512, max_step_latency_ms="auto", max_num_batched_tokens=512)
    h.s.cost = StepCostModel(COEF)
    for i, (prompt, max_tokens) in enumerate(requests):
        h.add(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True)
    _, c1, c2 = COEF
    steps, bound = 0, sum(-(-p // BS) + m for p, m in requests) + 10
    while h.s.has_work():
        # what the scheduler counts as decoding: running with one token to go (its cost is the
        # decodes' share, not the chunks')
        decoding = {r.request_id for r in h.s.running if 0 < r.num_tokens - r.num_computed_tokens <= 1}
        so = h.schedule()
        h.s.update_from_output(so, h.worker.run(so, 7))
        steps += 1
        assert steps <= bound, "a request starved"
        starts = dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
        starts |= {r.req_id: r.num_computed_tokens for r in so.new_reqs}
        chunks = {rid: n for rid, n in so.num_scheduled_tokens.items() if rid not in decoding}
        cost = sum(c1 * n + c2 * attention_pairs(starts[rid], n) / 1000 for rid, n in chunks.items())
        if decoding and chunks:
            assert cost <= h.s.cost.auto_chunk_seconds() + 1e-9 or (len(chunks) == 1 and max(chunks.values()) <= BS)
    assert not h.s.requests


@pytest.mark.parametrize("coef, most", [
    ((0.020, 0.0004, 0.00002), AUTO_CHUNK_COST * 0.020 / 0.0004),   # a large fixed cost: ten of them, 500 tokens
    (COEF, AUTO_MIN_CHUNK_TOKENS),                                  # a small one (20 ms for 50 tokens): 128 tokens
])
def test_an_auto_target_cuts_a_long_prompt_beside_a_decode_to_the_auto_budget(coef, most):
    h = Harness(num_blocks=512, max_step_latency_ms="auto", max_num_batched_tokens=1024)
    h.s.cost = StepCostModel(coef)
    h.add("d", 8, max_tokens=50)
    h.step()
    h.add("p", 2000, max_tokens=2)
    so, _ = h.step()
    # the chunk's attention (its own causal pairs) takes a little of the budget
    assert so.num_scheduled_tokens["d"] == 1 and 0.8 * most <= so.num_scheduled_tokens["p"] <= most


def test_without_decodes_or_a_target_prompts_take_the_whole_token_budget():
    for options in ({"max_step_latency_ms": TARGET_MS}, {"max_step_latency_ms": "auto"}, {}):
        h = Harness(num_blocks=512, max_num_batched_tokens=512, **options)
        h.s.cost = StepCostModel(COEF)
        h.add("a", 1000, max_tokens=2)
        so, _ = h.step()
        assert so.num_scheduled_tokens == {"a": 512}


def test_a_one_token_prompt_is_a_prompt_chunk_too_and_waits_when_the_step_is_full():
    """Requests decoding, a 93-token prompt sized to fill the step's time, then a 1-token prompt:
    that token would push the step past the target, so it waits for the next step."""
    h = Harness(num_blocks=512, max_step_latency_ms=TARGET_MS, max_num_batched_tokens=512)
    h.s.cost = StepCostModel(COEF)
    h.add("r0", 1, max_tokens=3, ignore_eos=True)
    for _ in range(2):
        h.step()
    h.add("r1", 93, max_tokens=1, ignore_eos=True)
    h.add("r2", 1, max_tokens=1, ignore_eos=True)
    so = h.schedule()
    assert _predicted(so, h.s.cost) <= TARGET_MS / 1000 + 1e-9, so.num_scheduled_tokens


def test_a_decode_beside_a_long_prompt_gets_a_small_chunk_of_it_not_the_whole_budget():
    h = Harness(num_blocks=512, max_step_latency_ms=TARGET_MS, max_num_batched_tokens=512)
    h.s.cost = StepCostModel(COEF)
    h.add("d", 8, max_tokens=50)
    h.step()                                   # d's prompt; it decodes from now on
    h.add("p", 1000, max_tokens=2)
    so, _ = h.step()
    chunk = so.num_scheduled_tokens["p"]
    assert so.num_scheduled_tokens["d"] == 1 and BS <= chunk < 512
    assert _predicted(so, h.s.cost) <= TARGET_MS / 1000
    off = Harness(num_blocks=512, max_num_batched_tokens=512)
    off.add("d", 8, max_tokens=50)
    off.step()
    off.add("p", 1000, max_tokens=2)
    so, _ = off.step()
    assert so.num_scheduled_tokens["p"] == 511              # the rest of the budget: the stall


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from helpers import save_tiny_llama, save_tiny_tokenizer
    return save_tiny_tokenizer(save_tiny_llama(tmp_path_factory.mktemp("cost") / "ckpt", 64, 64, 96, 4, 2, 16, 512), 64)


def test_the_worker_profiles_steps_at_start_up_so_the_cost_model_predicts_from_the_first_request(tiny):
    """The worker times steps of known sizes on its real model and KV cache (prompt chunks after
    cached context, prompts beside decodes, decodes): enough of them, of different shapes, to fit
    the model before any request; its predictions grow with the tokens, and the requests it used
    are gone (the next step's batch does not hold them)."""
    config = EngineArgs(model=tiny, multiprocess=False, max_step_latency_ms=50,
                        kv_cache_bytes=1 << 22).create_engine_config()
    worker = Worker(config)
    worker.init_kv_cache()
    costs = worker.profile_step_costs()
    assert len(costs) >= MIN_OBSERVATIONS
    assert len({tokens for tokens, _, _ in costs}) >= 3 and all(s > 0 for _, _, s in costs)
    assert len(worker.runner.batch) == 0
    model = StepCostModel()
    for row in costs:
        model.observe(*row)
    assert model.ready
    assert model.predict(256, attention_pairs(0, 256)) > model.predict(1, attention_pairs(100, 1))
    assert worker.profile_step_costs()            # again: the first run's requests were dropped


def test_too_small_a_kv_cache_profiles_nothing_and_the_model_fits_as_requests_come(tiny):
    config = EngineArgs(model=tiny, multiprocess=False, max_step_latency_ms=50, num_gpu_blocks_override=8,
                        kv_cache_bytes=1 << 22).create_engine_config()
    worker = Worker(config)
    worker.init_kv_cache()
    assert worker.profile_step_costs() == []


def test_a_profile_that_overruns_its_budget_stops_early_and_leaves_no_request_behind(tiny):
    config = EngineArgs(model=tiny, multiprocess=False, max_step_latency_ms=50,
                        kv_cache_bytes=1 << 22).create_engine_config()
    worker = Worker(config)
    worker.init_kv_cache()
    assert worker.profile_step_costs(budget_s=0.0) == []       # no step ran
    assert len(worker.runner.batch) == 0
