"""Clients that leave: 16 streams closed mid-stream (and plain requests whose client gives
up) are aborted in the engine, counted in /metrics, and their KV blocks freed."""
from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from server import Server

pytestmark = pytest.mark.slow

# One compute thread: on a shared 2-core machine, two spinning torch threads per step make
# every step several times slower, and these tests are about the API, not throughput.
SERVER_ARGS = ("--threads", "1")

SAMPLE = re.compile(r"^(troupe:[a-z0-9_]+)(?:\{([^}]*)\})? (\S+)$")


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_ARGS)
    yield s
    s.stop()


def parse_metrics(text: str) -> dict[str, float]:
    """Samples keyed by name plus the labels other than model_name and engine: ``name{label=value}``."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m is None:
            continue
        labels = [p for p in (m.group(2) or "").split(",")
                  if p and not p.startswith(("model_name=", "engine="))]
        key = m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")
        out[key] = float(m.group(3))
    return out


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        return parse_metrics(await resp.text())


async def open_and_leave(session: aiohttp.ClientSession, url: str, i: int) -> int:
    """Start a long stream, read three content events, then drop the connection."""
    resp = await session.post(url + "/v1/completions", json={
        "prompt": f"Tell a long story about dragon number {i}.", "max_tokens": 1000,
        "ignore_eos": True, "stream": True})
    assert resp.status == 200
    seen = 0
    async for line in resp.content:
        if line.startswith(b"data: {"):
            seen += 1
            if seen == 3:
                break
    resp.close()          # closes the connection: the server sees the client leave
    return seen


async def wait_for(session, url, check, timeout: float) -> tuple[float, dict[str, float]]:
    start = time.monotonic()
    while True:
        m = await metrics(session, url)
        if check(m) or time.monotonic() - start > timeout:
            return time.monotonic() - start, m
        await asyncio.sleep(0.05)


ABORTED = "troupe:request_success_total{finished_reason=\"abort\"}"


def test_sixteen_streams_closed_mid_stream_are_aborted_and_freed(server):
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            before = (await metrics(session, server.url)).get(ABORTED, 0)
            seen = await asyncio.gather(*[open_and_leave(session, server.url, i) for i in range(16)])
            assert seen == [3] * 16
            took, m = await wait_for(session, server.url, lambda m: (
                m.get(ABORTED, 0) - before == 16 and m["troupe:num_requests_running"] == 0
                and m["troupe:num_requests_waiting"] == 0), timeout=2.0)
            return before, took, m
    before, took, m = asyncio.run(main())
    assert m.get(ABORTED, 0) - before == 16, m
    assert m["troupe:num_requests_running"] == 0 and m["troupe:num_requests_waiting"] == 0, m
    assert took < 2.0


def test_kv_cache_usage_returns_to_zero_after_disconnects(server):
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(*[open_and_leave(session, server.url, i) for i in range(16)])
            return await wait_for(session, server.url,
                                  lambda m: m["troupe:kv_cache_usage_perc"] == 0.0, timeout=2.0)
    took, m = asyncio.run(main())
    assert m["troupe:kv_cache_usage_perc"] == 0.0, m
    assert took < 2.0


def test_plain_request_whose_client_gives_up_is_aborted(server):
    async def main():
        async with aiohttp.ClientSession() as session:
            before = (await metrics(session, server.url)).get(ABORTED, 0)
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(server.url + "/v1/completions", json={
                        "prompt": "A very long essay:", "max_tokens": 1000, "ignore_eos": True},
                        timeout=aiohttp.ClientTimeout(total=1.5)) as resp:
                    await resp.read()
            return before, await wait_for(session, server.url, lambda m: (
                m.get(ABORTED, 0) - before == 1 and m["troupe:num_requests_running"] == 0), timeout=2.0)
    before, (took, m) = asyncio.run(main())
    assert m.get(ABORTED, 0) - before == 1 and m["troupe:num_requests_running"] == 0, m


def test_metrics_count_tokens_and_latencies(server):
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            before = await metrics(session, server.url)
            async with session.post(server.url + "/v1/completions", json={
                    "prompt": ["One, two,", "The sky is"], "max_tokens": 5, "ignore_eos": True}) as resp:
                body = await resp.json()
            return before, body, await metrics(session, server.url)
    before, body, after = asyncio.run(main())

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)
    assert grew("troupe:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert grew("troupe:generation_tokens_total") == body["usage"]["completion_tokens"] == 10
    assert grew('troupe:request_success_total{finished_reason="length"}') == 2
    assert grew("troupe:time_to_first_token_seconds_count") == 2
    assert grew("troupe:inter_token_latency_seconds_count") == 8
    assert grew("troupe:e2e_request_latency_seconds_count") == 2
    assert grew("troupe:e2e_request_latency_seconds_sum") > 0
    for name in ("troupe:kv_cache_usage_perc", "troupe:num_preemptions_total",
                 "troupe:prefix_cache_queries_total", "troupe:prefix_cache_hits_total",
                 "troupe:request_queue_time_seconds_count", 'troupe:time_to_first_token_seconds_bucket{le="+Inf"}'):
        assert name in after, name
    assert after["troupe:prefix_cache_queries_total"] >= after["troupe:prefix_cache_hits_total"]


def test_queue_time_is_observed(server):
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            before = await metrics(session, server.url)
            async with session.post(server.url + "/v1/completions",
                                    json={"prompt": "Queue me", "max_tokens": 2}) as resp:
                assert resp.status == 200
            return before, await metrics(session, server.url)
    before, after = asyncio.run(main())
    name = "troupe:request_queue_time_seconds_count"
    assert after[name] - before.get(name, 0) == 1



def test_request_whose_client_left_at_once_does_not_run(server):
    """A client that sends a whole request and closes at once: whether the server notices before
    or after its handler starts, nothing is left generating for nobody."""
    import socket
    from urllib.parse import urlparse
    u = urlparse(server.url)
    body = b'{"prompt": "A very long essay:", "max_tokens": 1000, "ignore_eos": true}'
    for _ in range(3):
        with socket.create_connection((u.hostname, u.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            sock.shutdown(socket.SHUT_RDWR)

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.sleep(0.5)                       # let the requests reach the engine
            return await wait_for(session, server.url, lambda m: (
                m["troupe:num_requests_running"] == 0 and m["troupe:num_requests_waiting"] == 0),
                timeout=2.0)
    took, m = asyncio.run(main())
    assert m["troupe:num_requests_running"] == 0 and m["troupe:num_requests_waiting"] == 0, m
