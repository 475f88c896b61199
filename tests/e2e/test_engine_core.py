"""The engine core on the real model: prefix caching and preemption are invisible to users,
except in speed."""
from __future__ import annotations

import random

import pytest

from actors.api import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_shared_512_token_prefix_is_served_from_the_cache_with_identical_output():
    rng = random.Random(0)
    prefix = [rng.randrange(200, 40000) for _ in range(512)]
    first = prefix + [rng.randrange(200, 40000) for _ in range(8)]
    second = prefix + [rng.randrange(200, 40000) for _ in range(20)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    with LLM() as llm:
        llm.generate(first, params, use_tqdm=False)
        before = llm._llm.client.stats.last
        (cached,) = llm.generate(second, params, use_tqdm=False)
        after = llm._llm.client.stats.last
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    assert queries == len(second)
    computed = len(second) - hits
    assert computed < len(second) / 2, (hits, len(second))
    with LLM(enable_prefix_caching=False) as llm:
        (uncached,) = llm.generate(second, params, use_tqdm=False)
        assert llm._llm.client.stats.last.prefix_cache_hits == 0
    assert cached.token_ids == uncached.token_ids


def test_64_requests_through_a_tiny_kv_cache_match_a_large_cache():
    rng = random.Random(1)
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randint(8, 20))] for _ in range(64)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    per_token = 2 * 30 * 3 * 64 * 4                  # SmolLM2: layers x K/V x heads x dims x fp32
    with LLM(kv_cache_bytes=25 * 16 * per_token) as small:   # 24 usable blocks: ~10 requests
        tight = small.generate(prompts, params, use_tqdm=False)
        preemptions = small._llm.client.stats.last.num_preemptions
    with LLM() as large:
        roomy = large.generate(prompts, params, use_tqdm=False)
    assert preemptions > 0
    assert all(r.finish_reason == "length" and len(r.token_ids) == 16 for r in tight)
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]


def test_a_seeded_request_samples_the_same_tokens_alone_in_a_batch_and_under_preemption():
    rng = random.Random(2)
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randint(8, 20))] for _ in range(16)]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    per_token = 2 * 30 * 3 * 64 * 4
    with LLM() as roomy:
        (alone,) = roomy.generate(prompts[3], params, use_tqdm=False)
        batch = roomy.generate(prompts, params, use_tqdm=False)
    with LLM(kv_cache_bytes=13 * 16 * per_token) as tiny:           # 12 usable blocks: ~5 requests
        tight = tiny.generate(prompts, params, use_tqdm=False)
        preemptions = tiny._llm.client.stats.last.num_preemptions
    assert preemptions > 0
    assert batch[3].token_ids == alone.token_ids and len(set(alone.token_ids)) > 4
    assert [r.token_ids for r in tight] == [r.token_ids for r in batch]
