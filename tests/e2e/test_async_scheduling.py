"""Async scheduling on the real default model: the engine plans step N+1 while the worker (in a
process of its own) computes step N, and every request gets exactly the tokens of synchronous
scheduling: greedy, seeded, stop strings, max_tokens, structured outputs, and under KV pressure
(a cache of 16 blocks of 16 tokens for 8 requests of about 300 tokens in all: they preempt)."""
from __future__ import annotations

import pytest

from actors.api import LLM, SamplingParams
from actors.engine.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Dear diary, today",
           "The three laws of robotics are", "Once upon a time, in a faraway land,",
           "Write a haiku about the sea:", "The best way to learn a language is"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=36, seed=11),
    SamplingParams(temperature=0, max_tokens=32, stop=["\n\n"]),
    SamplingParams(temperature=1.0, max_tokens=3, seed=5),
    SamplingParams(temperature=0, max_tokens=40,
                   structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
    SamplingParams(temperature=0.7, max_tokens=40, seed=99, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=36),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=40, seed=3, ignore_eos=True),
]


def _run(async_scheduling: bool) -> list[tuple[list[int], str]]:
    with LLM(multiprocess=True, async_scheduling=async_scheduling, num_gpu_blocks_override=16,
             max_num_batched_tokens=64) as llm:
        results = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(r.token_ids, r.finish_reason) for r in results]


@pytest.fixture(scope="module")
def synchronous():
    return _run(False)


def test_async_scheduling_gives_every_request_the_tokens_of_synchronous_scheduling(synchronous):
    assert _run(True) == synchronous
    assert synchronous[3][1] == "length" and len(synchronous[3][0]) == 3
    assert synchronous[4][0] and synchronous[4][1] == "stop"
