"""Async scheduling on the real default model: the engine plans step N+1 while the worker (in a
process of its own, or offline on a thread of its own beside the event loop) computes step N, and
every request gets exactly the tokens of synchronous scheduling: greedy, seeded, stop strings,
max_tokens, structured outputs, and under KV pressure (a cache of 16 blocks of 16 tokens for 8
requests of about 300 tokens in all: they preempt)."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from actors.api import LLM, AsyncLLM, SamplingParams
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


def _run(async_scheduling: bool, multiprocess: bool = True) -> list[tuple[list[int], str]]:
    with LLM(multiprocess=multiprocess, async_scheduling=async_scheduling, num_gpu_blocks_override=16,
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


def test_offline_async_scheduling_in_one_process_gives_the_same_tokens(synchronous):
    """In one process the worker computes on its own thread while the scheduler, on the event
    loop, plans the next step: the same tokens as the server layout without async scheduling."""
    assert _run(True, multiprocess=False) == synchronous


def test_the_offline_event_loop_stays_free_while_the_model_computes_a_long_prompt():
    """A user's coroutines on the offline engine's event loop keep running during a step: a
    2,000-token prompt is one step of the model (long, on this CPU), and a ticker sleeping 2 ms at
    a time is never held up for a sizeable part of it."""
    async def main() -> tuple[float, list[float]]:
        llm = await AsyncLLM.create(max_num_batched_tokens=2048, async_scheduling=False)
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        try:
            prompt = random.Random(0).choices(range(1000, 30000), k=2000)
            task = asyncio.ensure_future(ticker())
            t0 = time.perf_counter()
            async for _ in llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1)):
                pass
            first_token_s = time.perf_counter() - t0
            done.set()
            await asyncio.wait_for(task, 5)
        finally:
            await llm.shutdown()
        return first_token_s, gaps

    first_token_s, gaps = asyncio.run(main())
    assert len(gaps) > 10 and max(gaps) < first_token_s / 4, (first_token_s, max(gaps), len(gaps))
