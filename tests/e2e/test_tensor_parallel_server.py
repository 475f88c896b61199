"""Tensor parallelism on the real default model (--tensor-parallel-size 2: SmolLM2's 9 query and
3 KV heads split 6 + 3 and 2 + 1 over two worker processes in a gloo group): greedy answers are
those of one worker, and a rank killed mid-request brings both ranks back, the request
recomputed on them and answered in full."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from actors.api import LLM, SamplingParams
from server import Server, alive, children

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


@pytest.fixture(scope="module")
def one_worker() -> list[str]:
    with LLM(multiprocess=False) as llm:
        results = llm.generate(PROMPTS + ["Write a poem about the sea."],
                               [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3
                               + [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)], use_tqdm=False)
    return [r.text for r in results]


@pytest.fixture(scope="module")
def server():
    s = Server("--tensor-parallel-size", "2")
    try:
        yield s
    finally:
        s.stop()


def _text(server: Server, prompt: str, max_tokens: int) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        choice = json.load(r)["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"]


def test_two_ranks_answer_as_one_worker_does(server, one_worker):
    (engine,) = children(server.pid)
    assert len(children(engine)) == 2                   # a worker process per rank
    for prompt, want in zip(PROMPTS, one_worker):
        assert _text(server, prompt, 24) == want


def test_a_killed_rank_brings_both_back_and_the_request_is_recomputed(server, one_worker):
    (engine,) = children(server.pid)
    before = children(engine)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(text=_text(server, "Write a poem about the sea.", 64)))
    thread.start()
    time.sleep(1.0)
    os.kill(before[1], signal.SIGKILL)
    thread.join(240)
    assert result.get("text") == one_worker[3]
    after = children(engine)
    assert len(after) == 2 and not set(after) & set(before) and not any(alive(p) for p in before)
    assert any("workers restarted" in line for line in server.lines)
