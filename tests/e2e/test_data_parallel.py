"""Data parallelism (--data-parallel-size 2): two engine cores, each with its own worker process,
behind one server. Concurrent requests are spread over both and answered as one engine answers
them; a prompt prefix sent again goes back to the engine that holds it in its prefix cache; one
engine core killed fails only its own requests while the other serves on, and it comes back."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from server import Server, alive

pytestmark = pytest.mark.slow

LONG = ("You are a careful assistant. Answer in one short sentence, and never make anything up. "
        "The user asks about geography and history. " * 3)


@pytest.fixture(scope="module")
def server():
    s = Server("--data-parallel-size", "2", "--max-num-seqs", "8")
    try:
        yield s
    finally:
        s.stop()


def _complete(server: Server, prompt: str, max_tokens: int = 8, timeout: float = 120.0) -> tuple[int, dict]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _metric(server: Server, name: str) -> dict[str, float]:
    """Each engine's sample of vllm:``name``, by its engine label."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^vllm:{name}{{[^}}]*engine="(\d+)"[^}}]*}} (\S+)$',
                                                               text, re.M)}


def _concurrently(fn, args_list) -> list:
    out = [None] * len(args_list)

    def run(i, args):
        out[i] = fn(*args)
    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def _kill_amid_four_streams(server: Server, kill, max_tokens: int) -> list:
    """Four requests of ``max_tokens``; once two run on each engine core, ``kill()``; their
    (status, body) once all have ended."""
    results: list = [None] * 4

    def run(i):
        results[i] = _complete(server, f"Story {i}: once upon a time", max_tokens=max_tokens)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(_metric(server, "num_requests_running").values()) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, "num_requests_running") == {"0": 2.0, "1": 2.0}
    kill()
    for t in threads:
        t.join(180)
    return results


def _engine_pids(server: Server) -> dict[int, int]:
    line = next(line for line in server.lines if "engine pids" in line)
    return {int(r): int(p) for r, p in re.findall(r"(\d+): (\d+)", line.split("engine pids")[1])}


def test_concurrent_requests_are_spread_over_both_engines_and_answered_alike(server):
    before = _metric(server, "prefix_cache_queries_total")
    results = _concurrently(_complete, [(server, "The capital of France is")] * 6)
    assert all(status == 200 for status, _ in results)
    assert len({body["choices"][0]["text"] for _, body in results}) == 1
    after = _metric(server, "prefix_cache_queries_total")
    assert set(after) == {"0", "1"}
    assert all(after[e] > before.get(e, 0) for e in ("0", "1"))       # both engines took requests


def test_a_prompt_prefix_sent_again_goes_to_the_engine_that_cached_it(server):
    before = _metric(server, "prefix_cache_hits_total")
    for i in range(3):                        # one at a time: without affinity they would alternate
        status, _ = _complete(server, LONG + f"Question {i}: where is Paris?")
        assert status == 200
    after = _metric(server, "prefix_cache_hits_total")
    gained = {e: after[e] - before.get(e, 0) for e in after}
    assert sorted(gained.values())[0] == 0 and sorted(gained.values())[1] >= 2 * 64


def test_a_killed_engine_core_fails_only_its_requests_and_comes_back(server):
    pids = _engine_pids(server)
    assert sorted(pids) == [0, 1] and all(alive(p) for p in pids.values())
    results = _kill_amid_four_streams(server, lambda: os.kill(pids[1], signal.SIGKILL), 96)
    failed = [body for status, body in results if status != 200]
    assert len(failed) == 2 and all("engine core 1 died" in body["error"]["message"] for body in failed)
    assert sorted(body["usage"]["completion_tokens"] for status, body in results if status == 200) == [96, 96]
    status, _ = _complete(server, "The capital of France is")       # engine 0 serves meanwhile
    assert status == 200
    deadline = time.monotonic() + 120
    while not any("engine core 1 restarted" in line for line in server.lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any("engine core 1 restarted" in line for line in server.lines)
    results = _concurrently(_complete, [(server, "The capital of France is")] * 4)
    assert all(status == 200 for status, _ in results)
    assert _metric(server, "num_requests_running") == {"0": 0.0, "1": 0.0}
