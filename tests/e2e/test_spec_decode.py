"""Speculative decoding on the real default model, in one process, with n-gram drafts and with
self_draft (the model's own weights in gguf-i8 draft for the exact model; gguf on a CPU whose
native kernels cannot take int8 activations): greedy requests, and a
seeded sampled one, get the tokens they get without speculation (a repetitive code prompt, a stop
string, max_tokens that end a request mid-draft, penalties and structured outputs applied per
draft position, a request that takes no drafts in the same batch), also with a KV cache small
enough to preempt, and drafts are accepted; the self-draft's KV cache comes along with the
target's in prefix cache hits."""
from __future__ import annotations

import json
import logging
import os
import re
import time

import pytest

from actors.api import LLM, SamplingParams
from actors.engine.sampling_params import StructuredOutputsParams
from kernels.cpu.panels import int8_available

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SELF_DRAFT = {"method": "self_draft", "quantization": "gguf-i8" if int8_available() else "gguf",
              "num_speculative_tokens": 4}
METHODS = {"ngram": NGRAM, "self_draft": SELF_DRAFT}
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
CAT = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}'
PROMPTS = [CODE, COUNT, "red green blue red green blue red green blue", "The capital of France is", CODE,
           "Dear diary, today", "Describe a cat as JSON with its name and age: ", COUNT, CODE]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40, stop=[" 15,"]),         # a stop string mid-draft
    SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),      # max_tokens mid-draft
    SamplingParams(temperature=0, max_tokens=32),
    SamplingParams(temperature=0, max_tokens=21, ignore_eos=True, repetition_penalty=1.2),   # penalty per position
    SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2),                # no drafts
    SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=CAT)),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.5,       # grammar and penalty
                   structured_outputs=StructuredOutputsParams(regex=r"( \d+,){12}")),
    SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=40, ignore_eos=True),   # seeded: the same draws
]
SMALL_CACHE = dict(num_gpu_blocks_override=8, max_num_batched_tokens=64)


def _run(speculative_config: dict | None, **options) -> tuple[list[tuple[list[int], str, str]], object]:
    with LLM(multiprocess=False, speculative_config=speculative_config, **options) as llm:
        results = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        stats = llm.client.stats.last
    return [(r.token_ids, r.text, r.finish_reason) for r in results], stats


@pytest.fixture(scope="module")
def plain():
    return _run(None)[0]


@pytest.fixture(scope="module", params=list(METHODS))
def spec(request):
    """(method, (results, stats), the engine, kept for more requests; it logs vLLM's periodic
    statistics lines every half second, and each request's drafts' acceptance is counted (vLLM's
    --per-request-spec-decode-metrics detailed: ``llm.per_request`` holds each result's))."""
    os.environ["VLLM_LOG_STATS_INTERVAL"] = "0.5"
    try:
        llm = LLM(multiprocess=False, speculative_config=METHODS[request.param], disable_log_stats=False,
                  per_request_spec_decode_metrics="detailed")
    finally:
        del os.environ["VLLM_LOG_STATS_INTERVAL"]
    with llm:
        results = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.per_request = [r.outputs[0].spec_decode_metrics for r in results]
        yield request.param, ([(r.token_ids, r.text, r.finish_reason) for r in results], llm.client.stats.last), llm


def test_speculation_gives_every_greedy_request_the_tokens_of_plain_decoding(plain, spec):
    _, (results, _), _ = spec
    assert results == plain
    assert len(results[0][0]) == 48 and len(results[2][0]) == 23
    assert results[1][2] == "stop" and results[1][1].endswith(" 14,")


def test_constrained_and_penalized_requests_take_drafts_and_keep_their_tokens(plain, spec):
    """Structured outputs (a bitmask row per verified position, drafts cut to what the grammar
    allows) and penalties (over the tokens so far and the drafts before each position)."""
    _, _, llm = spec
    picked = [4, 6, 7]
    before = llm.client.stats.last
    results = llm.generate([PROMPTS[i] for i in picked], [PARAMS[i] for i in picked], use_tqdm=False)
    after = llm.client.stats.last
    assert [(r.token_ids, r.text, r.finish_reason) for r in results] == [plain[i] for i in picked]
    assert after.spec_num_drafts > before.spec_num_drafts
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens
    assert json.loads(results[1].text).keys() == {"name", "age"}


def test_drafts_are_accepted_and_counted(spec):
    method, (_, stats), _ = spec
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_num_accepted_tokens_per_pos) == stats.spec_num_accepted_tokens
    assert len(stats.spec_num_accepted_tokens_per_pos) == METHODS[method]["num_speculative_tokens"]
    if method == "self_draft":     # the quantized copy nearly always agrees with the exact weights
        assert stats.spec_num_accepted_tokens >= 0.8 * stats.spec_num_draft_tokens


def test_get_metrics_reads_the_drafts_as_vllms_spec_decode_example_does(spec):
    """``LLM.get_metrics()`` as vLLM's: the counters under their family names, the accepted
    drafts by position one Vector, histograms with cumulative buckets (vLLM's
    examples/offline_inference/spec_decode.py loop runs on it unchanged)."""
    from actors.frontend.metrics_reader import Counter, Histogram, Vector
    method, _, llm = spec
    stats = llm.client.stats.last
    num_drafts = num_accepted = 0
    acceptance_counts = [0] * METHODS[method]["num_speculative_tokens"]
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            for pos in range(len(metric.values)):
                acceptance_counts[pos] += metric.values[pos]
        elif metric.name == "vllm:e2e_request_latency_seconds":
            assert isinstance(metric, Histogram)
            finished = metric.count
            assert metric.buckets["+Inf"] == metric.count and metric.sum > 0
            assert list(metric.buckets.values()) == sorted(metric.buckets.values())
    assert (num_drafts, num_accepted) == (stats.spec_num_drafts, stats.spec_num_accepted_tokens) and num_drafts > 0
    assert acceptance_counts == list(stats.spec_num_accepted_tokens_per_pos)
    assert finished >= len(PROMPTS)


def test_each_requests_drafts_are_counted_as_its_own_and_add_up_to_the_engines(spec):
    """vLLM's per-request speculative decoding metrics: each request's verify steps, drafts and
    accepted drafts (the per-step lists agree with the histogram and the totals), the request
    that asked for log-probs took no drafts and has none, and together they are the engine's
    counts (a request a stop string ended may have had one more step verified before its abort
    reached the engine: the engine's counts are at least theirs)."""
    method, (results, stats), llm = spec
    k = METHODS[method]["num_speculative_tokens"]
    assert llm.per_request[5] is None                       # logprobs=2: no drafts
    counted = [m for m in llm.per_request if m is not None]
    assert len(counted) >= 6
    for m, (tokens, _, _) in zip(llm.per_request, results):
        if m is None:
            continue
        assert m["num_spec_tokens"] == k and len(m["acceptance_histogram"]) == k + 1
        assert m["per_step_accepted"] and len(m["per_step_accepted"]) == m["num_spec_steps"] == sum(m["acceptance_histogram"])
        assert sum(m["per_step_accepted"]) == m["num_accepted_draft_tokens"]
        assert sum(m["per_step_drafted"]) == m["num_draft_tokens"]
        assert m["acceptance_histogram"] == [m["per_step_accepted"].count(j) for j in range(k + 1)]
        assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_draft_tokens"] / m["num_spec_steps"])
        assert m["draft_acceptance_rate"] == pytest.approx(m["num_accepted_draft_tokens"] / m["num_draft_tokens"])
        assert m["num_spec_steps"] + m["num_accepted_draft_tokens"] <= len(tokens) + k
    assert 0 < sum(m["num_spec_steps"] for m in counted) <= stats.spec_num_drafts
    assert 0 < sum(m["num_draft_tokens"] for m in counted) <= stats.spec_num_draft_tokens
    assert 0 < sum(m["num_accepted_draft_tokens"] for m in counted) <= stats.spec_num_accepted_tokens
    assert sum(m["num_accepted_draft_tokens"] for m in counted) >= 0.8 * stats.spec_num_accepted_tokens


def test_the_periodic_log_lines_report_throughput_and_the_draft_acceptance_rate(spec, caplog):
    """vLLM's lines: the engine's throughput, requests and KV cache use, then speculative
    decoding's mean acceptance length, per-position and overall acceptance."""
    method, _, llm = spec
    caplog.set_level(logging.INFO, logger="troupe.stats")
    llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)

    def spec_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "SpecDecoding metrics" in r.getMessage()]
    deadline = time.monotonic() + 10.0
    while not spec_lines() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [r.getMessage() for r in caplog.records if r.name == "troupe.stats"]
    assert any(re.fullmatch(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                            r"[1-9][\d.]* tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, CPU KV cache usage: "
                            r"[\d.]+%, Prefix cache hit rate: [\d.]+%", line) for line in lines), lines
    m = re.fullmatch(r"Engine 000: SpecDecoding metrics: Mean acceptance length: ([\d.]+), Accepted throughput: "
                     r"[\d.]+ tokens/s, Drafted throughput: [\d.]+ tokens/s, Accepted: (\d+) tokens, Drafted: "
                     r"(\d+) tokens, Per-position acceptance rate: ([\d., ]+), Avg Draft acceptance rate: "
                     r"([\d.]+)%", spec_lines()[0])
    assert m, spec_lines()
    accepted, drafted = int(m[2]), int(m[3])
    assert 0 < accepted <= drafted and float(m[5]) == pytest.approx(100 * accepted / drafted, abs=0.06)
    assert float(m[1]) > 1.0 and len(m[4].split(", ")) == METHODS[method]["num_speculative_tokens"]


@pytest.mark.parametrize("method", list(METHODS))
def test_speculation_under_preemption_gives_the_same_tokens(plain, method):
    results, stats = _run(METHODS[method], **SMALL_CACHE)
    assert stats.num_preemptions > 0
    assert results == plain


def test_a_prefix_cache_hit_brings_the_self_drafts_kv_cache_along(plain):
    """The second time, the prompt's blocks come from the prefix cache: they hold the draft
    model's keys and values too, so its drafts are as good as the first time."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(multiprocess=False, speculative_config=SELF_DRAFT) as llm:
        runs = []
        for _ in range(2):
            before = llm.client.stats.last
            result = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
            after = llm.client.stats.last
            drafted = after.spec_num_draft_tokens - (before.spec_num_draft_tokens if before else 0)
            accepted = after.spec_num_accepted_tokens - (before.spec_num_accepted_tokens if before else 0)
            hits = after.prefix_cache_hits - (before.prefix_cache_hits if before else 0)
            runs.append((result.token_ids, hits, accepted / drafted))
    (first, cached_first, rate_first), (second, cached_second, rate_second) = runs
    assert second == first == plain[0][0][:40]
    assert cached_first == 0 and cached_second > 0
    assert rate_second >= 0.8 and rate_second >= rate_first - 0.1
