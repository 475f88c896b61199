"""A request's deadline and the server's graceful stop, on the real server: a request past its
timeout is aborted (its KV freed) with a clear error; SIGTERM stops taking requests, lets the
running ones finish, fails those that outlive --shutdown-timeout, and leaves no process behind."""
from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from server import Server, alive

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell a very long story:", "max_tokens": 4000, "ignore_eos": True}


RUNNING_TOKENS = 96       # long enough to be running still when SIGTERM comes, on a fast machine too


async def until_running(session: aiohttp.ClientSession, url: str, n: int, timeout: float = 60.0) -> None:
    """Wait until the engine runs ``n`` requests (each has its first token)."""
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(url + "/debug/engine") as resp:
            stats = await resp.json()
        if stats["num_requests_running"] >= n:
            return
        assert time.monotonic() < deadline, f"{n} requests never ran at once: {stats}"
        await asyncio.sleep(0.05)


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json(), time.monotonic() - t0


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        return (await resp.read()).decode()


def test_a_request_past_the_server_timeout_is_aborted_with_a_clear_error():
    s = Server("--request-timeout", "2", "--threads", "1")
    try:
        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                plain = await post(session, s.url, LONG)
                streamed = await stream_text(session, s.url, LONG)
                short = await post(session, s.url, {"prompt": "Hi", "max_tokens": 4})
                await asyncio.sleep(0.5)
                async with session.get(s.url + "/debug/engine") as resp:
                    return plain, streamed, short, await resp.json()
        (status, body, took), streamed, short, state = asyncio.run(main())
    finally:
        s.stop()
    assert status == 504 and "timeout of 2 s" in body["error"]["message"] and 2.0 <= took < 4.0, body
    assert "timeout of 2 s" in streamed and streamed.endswith("data: [DONE]\n\n")
    assert short[0] == 200
    assert state["num_requests_running"] == 0 and state["kv_cache_usage"] == 0.0
    assert state["requests_finished"].get("abort", 0) >= 2


def test_sigterm_lets_running_requests_finish_refuses_new_ones_and_exits_cleanly():
    """With --shutdown-timeout: requests refused with a 400 (a request_id past 256 characters,
    found after the prompt was checked) leave nothing open: the stop waits for the four running
    requests only."""
    s = Server("--shutdown-timeout", "60", "--threads", "1")
    pids = s.all_pids()
    try:
        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 2})):
                    async with session.post(s.url + path, json={**body, "request_id": "x" * 300}) as resp:
                        assert resp.status == 400 and (await resp.json())["error"]["param"] == "request_id"
                running = [asyncio.ensure_future(post(session, s.url, {
                    "prompt": f"Count to ten, take {i}:", "max_tokens": RUNNING_TOKENS, "ignore_eos": True}))
                    for i in range(4)]
                await until_running(session, s.url, 4)
                s.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                refused = await post(session, s.url, {"prompt": "Too late", "max_tokens": 4})
                return await asyncio.gather(*running), refused
        finished, (refused_status, refused_body, _) = asyncio.run(main())
        code = s.wait(30)
    finally:
        s.stop()
    assert [status for status, _, _ in finished] == [200] * 4
    assert all(body["usage"]["completion_tokens"] == RUNNING_TOKENS for _, body, _ in finished)
    assert refused_status == 503 and "shutting down" in refused_body["error"]["message"]
    assert code == 0
    assert "no new requests; 4 running" in s.log_when(lambda log: "no new requests; 4 running" in log), s.log()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_a_sigterm_to_every_process_of_the_server_drains_as_one_to_the_server():
    """systemd stops a service by signalling every process of it at once (as `kill -- -PGID` does):
    the engine core and the worker wait for the server's drain to shut them down, so the running
    request finishes within --shutdown-timeout, nothing logs a crash and no process is left."""
    import os
    s = Server("--shutdown-timeout", "60", "--threads", "1")
    pids = s.all_pids()
    assert len(pids) == 3, pids
    try:
        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                running = asyncio.ensure_future(post(session, s.url, {
                    "prompt": "Count to ten:", "max_tokens": RUNNING_TOKENS, "ignore_eos": True}))
                await until_running(session, s.url, 1)
                for pid in pids:
                    os.kill(pid, signal.SIGTERM)
                return await running
        status, body, _ = asyncio.run(main())
        code = s.wait(30)
    finally:
        s.stop()
    assert status == 200 and body["usage"]["completion_tokens"] == RUNNING_TOKENS, body
    assert code == 0
    log = s.log()
    assert all(f"it stops when '{parent}' shuts it down" in log for parent in ("frontend", "engine")), log[-3000:]
    assert "CRITICAL" not in log and "flight recorder" not in log, log[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_requests_outliving_the_shutdown_timeout_end_with_an_error():
    """vLLM's default --shutdown-timeout 0: SIGTERM ends a running request at once, with an error."""
    s = Server("--threads", "1")
    try:
        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                long = asyncio.ensure_future(post(session, s.url, LONG))
                await asyncio.sleep(1.0)
                s.proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                return await long, time.monotonic() - t0
        (status, body, _), ended_after = asyncio.run(main())
        code = s.wait(30)
    finally:
        s.stop()
    assert status == 500 and "shut down before the request finished" in body["error"]["message"], body
    assert ended_after < 10, ended_after          # not the 4,000 tokens it asked for
    assert code == 0
