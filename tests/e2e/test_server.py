"""The real server, started as a user would start it, over real HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import aiohttp
import pytest

from server import Server, alive

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(url + path, json=body) as resp:
            return resp.status, await resp.json()


async def _stream(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> list[str]:
    """The raw SSE lines of one streamed request (blank separators dropped)."""
    async with session.post(url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    assert raw.endswith("\n\n")
    return [line for line in raw.split("\n") if line]


async def _until_running(session: aiohttp.ClientSession, url: str, n: int, timeout: float = 60) -> None:
    """Until the server's /metrics shows ``n`` requests running at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with session.get(url + "/metrics") as resp:
            m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", await resp.text(), re.M)
        if m and float(m.group(1)) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{n} requests never ran at once")


def _events(lines: list[str]) -> list[dict]:
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    assert lines.count("data: [DONE]") == 1
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_chat_at_temperature_zero_answers_paris(server):
    status, body = asyncio.run(_post(server.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 32}))
    assert status == 200, body
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["object"] == "chat.completion"
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_eight_concurrent_streams_complete_and_share_engine_steps(server):
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            chats = [_stream(session, server.url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"Write a short poem about the number {i}."}],
                "max_tokens": 48, "temperature": 0.8, "seed": i}) for i in range(4)]
            texts = [_stream(session, server.url, "/v1/completions", {
                "prompt": f"Item {i}: the history of", "max_tokens": 48, "temperature": 0}) for i in range(4)]
            results = await asyncio.gather(*chats, *texts)
            async with session.get(server.url + "/debug/engine") as resp:
                stats = await resp.json()
            async with session.get(server.url + "/metrics") as resp:
                metrics = await resp.text()
        return results, stats, metrics
    results, stats, metrics = asyncio.run(main())
    for i, lines in enumerate(results):
        events = _events(lines)
        chat = i < 4
        assert all(e["object"] == ("chat.completion.chunk" if chat else "text_completion") for e in events)
        assert len({e["id"] for e in events}) == 1
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"] or finishes == ["stop"], finishes
        if chat:
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        else:
            text = "".join(e["choices"][0]["text"] for e in events)
        assert text.strip()
    assert stats["max_batch_size"] > 1, stats
    kv = stats["kv_cache"]                     # the resolved cache: dtype, blocks, tokens
    assert kv["dtype"] == "float32" and kv["num_blocks"] > 1 and kv["num_tokens"] == kv["num_blocks"] * kv["block_size"]
    assert "troupe:batch_size_bucket" in metrics and "troupe:num_requests_running" in metrics
    assert "troupe:iteration_tokens_total_bucket" in metrics and "troupe:engine_compute_seconds_total" in metrics


def test_the_worker_starts_with_a_short_openmp_spin_and_the_engine_core_without_one(server):
    """The worker's OpenMP threads sleep soon after a parallel region (actors/worker/openmp.py),
    so a process that wants their core is not held off for milliseconds at every region."""
    def environ(pid: int) -> dict[str, str]:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0") if item)
    own = os.environ.get("GOMP_SPINCOUNT")             # a wait setting of the user running the tests is kept
    worker = environ(server.worker_pid())
    if "OMP_WAIT_POLICY" not in os.environ and own is None:
        assert worker["GOMP_SPINCOUNT"] == "3000"
    else:
        assert worker.get("GOMP_SPINCOUNT") == own
    assert environ(server.engine_pid()).get("GOMP_SPINCOUNT") == own


def test_bad_input_gets_openai_shaped_4xx_never_500(server):
    async def main():
        cases = [
            ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
            ({"prompt": "x", "temperature": 7}, 400, "temperature"),
            ({"prompt": "x", "bogus_field": 1}, 400, "bogus_field"),
            ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
            ({"prompt": "x", "max_tokens": 100_000}, 400, "prompt"),
        ]
        out = []
        for body, status, param in cases:
            got, payload = await _post(server.url, "/v1/completions", body)
            out.append((got, payload, status, param))
        return out
    for got, payload, status, param in asyncio.run(main()):
        assert got == status, payload
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param


def test_client_errors_are_logged_in_one_line_not_as_server_errors(server):
    before = len(server.lines)
    status, body = asyncio.run(_post(server.url, "/v1/completions", {
        "prompt": "word " * 9000, "max_tokens": 4}))                 # past the 8192-token context
    assert status == 400 and "maximum context length" in body["error"]["message"], body
    time.sleep(0.5)
    logged = server.lines[before:]
    assert not any("ERROR" in line or "Traceback" in line for line in logged), logged
    assert sum("refused Generate" in line for line in logged) == 1


def test_a_huge_prompt_is_refused_at_once_and_a_long_one_does_not_stall_the_server(server):
    """A 5 MB prompt cannot fit the context whatever its tokens: 400 before tokenizing. A long
    prompt is tokenized off the event loop: probes keep answering meanwhile."""
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            t0 = time.monotonic()
            async with session.post(server.url + "/v1/completions",
                                    json={"prompt": "word " * 1_000_000, "max_tokens": 1}) as resp:
                huge = resp.status, await resp.json(), time.monotonic() - t0
            long_text = " ".join(f"w{i * 7919 % 1_000_003}" for i in range(80_000))   # ~650k characters
            long = asyncio.ensure_future(session.post(server.url + "/v1/completions",
                                                      json={"prompt": long_text, "max_tokens": 1}))
            lags = []
            while not long.done():
                t1 = time.monotonic()
                async with session.get(server.url + "/health") as probe:
                    assert probe.status == 200
                lags.append(time.monotonic() - t1)
                await asyncio.sleep(0.02)
            async with await long as resp:
                return huge, (resp.status, await resp.json()), lags
    (status, body, took), (long_status, long_body), lags = asyncio.run(main())
    assert status == 400 and "at least" in body["error"]["message"] and took < 1.0, (body, took)
    assert long_status == 400 and "maximum context length" in long_body["error"]["message"]
    assert len(lags) >= 5 and max(lags) < 0.25, lags


def test_streams_running_when_the_worker_is_killed_are_recomputed_and_complete():
    """SIGKILL of the worker under 20 streaming requests (16 running, 4 queued): the engine
    restarts the worker, the requests that were running are recomputed from their prompt and the
    tokens they already streamed, every stream completes, nothing hangs, and a new request is
    served within 30 s of the kill."""
    s = Server("--max-num-seqs", "16")
    try:
        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as session:
                body = {"max_tokens": 40, "ignore_eos": True, "temperature": 0,
                        "stream_options": {"include_usage": True}}
                streams = [asyncio.ensure_future(_stream(session, s.url, "/v1/completions",
                                                         {**body, "prompt": f"Story {i}:"})) for i in range(20)]
                await _until_running(session, s.url, 16)   # 16 running (40 tokens to go at most), 4 wait
                worker = s.worker_pid()
                killed_at = time.monotonic()
                os.kill(worker, signal.SIGKILL)
                async with session.post(s.url + "/v1/completions", json={
                        "prompt": "After the restart,", "max_tokens": 8}) as resp:
                    after = resp.status, await resp.json(), time.monotonic() - killed_at
                return worker, await asyncio.wait_for(asyncio.gather(*streams), 200), after
        worker, streams, (status, after, served_in) = asyncio.run(main())
        for lines in streams:
            events = _events(lines)
            assert not any("error" in e for e in events), events[-2:]
            assert events[-1]["usage"]["completion_tokens"] == 40
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
            assert finish == ["length"]
        print(f"\nworker killed under 20 streams: all completed; a new request served {served_in:.1f} s after the kill")
        assert status == 200 and after["choices"][0]["text"] and served_in < 30.0
        assert s.worker_pid() != worker and s.proc.poll() is None
        assert "worker restarted (generation 1)" in s.log_when(lambda log: "worker restarted (generation 1)" in log)
    finally:
        s.stop()


def test_reset_prefix_cache_makes_a_repeated_prompt_miss(server):
    prompt = list(range(1000, 1100))          # 100 tokens: 6 full blocks

    async def hits_of_one_request():
        async with aiohttp.ClientSession() as session:
            async def stats():
                async with session.get(server.url + "/debug/engine") as resp:
                    return (await resp.json())["prefix_cache_hits"]
            before = await stats()
            async with session.post(server.url + "/v1/completions",
                                    json={"prompt": prompt, "max_tokens": 1}) as resp:
                assert resp.status == 200
            return await stats() - before

    async def reset():
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/reset_prefix_cache") as resp:
                return resp.status
    asyncio.run(hits_of_one_request())
    assert asyncio.run(hits_of_one_request()) == 96
    assert asyncio.run(reset()) == 200
    assert asyncio.run(hits_of_one_request()) == 0


def test_killed_engine_fails_inflight_requests_within_5s_and_is_restarted(server):
    """SIGKILL of the engine-core process: every request in flight gets an OpenAI-shaped error
    within 5 s, requests meanwhile get 503 with Retry-After, and the server restarts the engine
    and serves again. The killed engine's worker is frozen at the kill (as one in the middle of a
    long step would be) and thawed once the new engine serves: a worker outliving its engine
    neither keeps the new one from starting nor breaks it when it exits. (The module's server,
    after the tests that need its first engine.)"""
    s = server
    old_worker = s.worker_pid()

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def long_request(i):
                async with session.post(s.url + "/v1/completions", json={
                        "prompt": f"Story {i}:", "max_tokens": 2000, "ignore_eos": True}) as resp:
                    return resp.status, await resp.json(), time.monotonic()
            tasks = [asyncio.ensure_future(long_request(i)) for i in range(4)]
            streaming = asyncio.ensure_future(_stream(session, s.url, "/v1/completions", {
                "prompt": "Streamed story:", "max_tokens": 2000, "ignore_eos": True}))
            await asyncio.sleep(2.0)   # all are running by now
            engine = s.engine_pid()
            os.kill(old_worker, signal.SIGSTOP)
            killed_at = time.monotonic()
            os.kill(engine, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            stream_lines = await asyncio.wait_for(streaming, 10)
            # a restart takes 3-5 s; a new engine whose messages reach the frozen old worker
            # waits for ZeroMQ's 30 s handshake timeout (or, if that worker exits at the wrong
            # moment, for ever)
            refusals, deadline = [], time.monotonic() + 25
            while True:
                async with session.post(s.url + "/v1/completions", json={
                        "prompt": "After the restart,", "max_tokens": 8}) as resp:
                    if resp.status == 200:
                        recovered_in = time.monotonic() - killed_at
                        return engine, killed_at, results, stream_lines, refusals, await resp.json(), recovered_in
                    refusals.append((resp.status, resp.headers.get("Retry-After"), await resp.json()))
                if time.monotonic() > deadline:
                    raise AssertionError(f"the server did not recover: {refusals[-3:]}")
                await asyncio.sleep(0.5)
    async def after_the_old_worker_exits():
        os.kill(old_worker, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while alive(old_worker) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.post(s.url + "/v1/completions", json={
                    "prompt": "Once the old worker is gone,", "max_tokens": 8}) as resp:
                return resp.status, await resp.json()
    try:
        engine, killed_at, results, stream_lines, refusals, after, recovered_in = asyncio.run(main())
        status, later = asyncio.run(after_the_old_worker_exits())
        assert not alive(old_worker), "the killed engine's worker outlived it by 30 s"
    finally:
        if alive(old_worker):
            os.kill(old_worker, signal.SIGKILL)
    assert status == 200 and later["choices"][0]["text"], later
    print(f"\nengine killed: in-flight errors after {max(r[2] for r in results) - killed_at:.2f} s at most; "
          f"{len(refusals)} requests got 503 while it restarted; served again {recovered_in:.1f} s after the kill")
    for status, body, done_at in results:
        assert status == 500, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert "engine core died" in body["error"]["message"]
        assert done_at - killed_at < 5.0
    assert any('"error"' in line for line in stream_lines) and stream_lines[-1] == "data: [DONE]"
    for status, retry_after, body in refusals:
        assert status == 503 and int(retry_after) > 0 and "engine" in body["error"]["message"]
    assert after["choices"][0]["text"]
    assert s.engine_pid() != engine and s.proc.poll() is None
    assert "engine core restarted" in s.log_when(lambda log: "engine core restarted" in log)


def test_faults_cannot_be_injected_into_a_server_started_without_them(server):
    async def arm():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.post(server.url + "/debug/fault", json={"kind": "kill"}) as resp:
                return resp.status
    assert asyncio.run(arm()) == 404


def test_sigterm_stops_all_three_processes(server):
    """The module's server, last: SIGTERM stops it and every process it started."""
    s = server
    pids = s.all_pids()
    assert len(pids) == 3
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
