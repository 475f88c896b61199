"""The engine core on the real model: prefix caching and preemption are invisible to users,
except in speed."""
from __future__ import annotations

import random

import pytest

from actors.api import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)
PER_TOKEN = 2 * 30 * 3 * 64 * 4                  # SmolLM2: layers x K/V x heads x dims x fp32


@pytest.fixture(scope="module")
def roomy():
    """The default engine (prefix caching on, a KV cache of plenty), shared by the tests."""
    with LLM() as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny():
    """An engine with 12 usable KV blocks (about 5 short requests at once): preemption."""
    with LLM(kv_cache_bytes=13 * 16 * PER_TOKEN) as llm:
        yield llm


def test_shared_512_token_prefix_is_served_from_the_cache_with_identical_output(roomy):
    rng = random.Random(0)
    prefix = [rng.randrange(200, 40000) for _ in range(512)]
    first = prefix + [rng.randrange(200, 40000) for _ in range(8)]
    second = prefix + [rng.randrange(200, 40000) for _ in range(20)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    roomy.generate(first, params, use_tqdm=False)
    before = roomy._llm.client.stats.last
    (cached,) = roomy.generate(second, params, use_tqdm=False)
    after = roomy._llm.client.stats.last
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    assert queries == len(second)
    computed = len(second) - hits
    assert computed < len(second) / 2, (hits, len(second))
    with LLM(enable_prefix_caching=False) as llm:
        (uncached,) = llm.generate(second, params, use_tqdm=False)
        assert llm._llm.client.stats.last.prefix_cache_hits == 0
    assert cached.token_ids == uncached.token_ids


def test_64_requests_through_a_tiny_kv_cache_match_a_large_cache(roomy, tiny):
    rng = random.Random(1)
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randint(8, 20))] for _ in range(64)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    before = tiny._llm.client.stats.last.num_preemptions
    tight = tiny.generate(prompts, params, use_tqdm=False)
    preemptions = tiny._llm.client.stats.last.num_preemptions - before
    large = roomy.generate(prompts, params, use_tqdm=False)
    assert preemptions > 0
    assert all(r.finish_reason == "length" and len(r.token_ids) == 16 for r in tight)
    assert [r.token_ids for r in tight] == [r.token_ids for r in large]


def test_a_seeded_request_samples_the_same_tokens_alone_in_a_batch_and_under_preemption(roomy, tiny):
    rng = random.Random(2)
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randint(8, 20))] for _ in range(16)]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    (alone,) = roomy.generate(prompts[3], params, use_tqdm=False)
    batch = roomy.generate(prompts, params, use_tqdm=False)
    before = tiny._llm.client.stats.last.num_preemptions
    tight = tiny.generate(prompts, params, use_tqdm=False)
    preemptions = tiny._llm.client.stats.last.num_preemptions - before
    assert preemptions > 0
    assert batch[3].token_ids == alone.token_ids and len(set(alone.token_ids)) > 4
    assert [r.token_ids for r in tight] == [r.token_ids for r in batch]
