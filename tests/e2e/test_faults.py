"""Faults injected into the real server's processes (the runtime's fault injection, armed over
POST /debug/fault): a step whose handler raises fails that step's requests alone; a slow step is
not taken for a hang; a request frame lost on its way to the engine costs that request a clear
timeout, and a step or step reply lost between engine and worker is recovered; the server serves
on after each. (A server started without fault injection refuses it: tests/e2e/test_server.py.)"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from server import Server

pytestmark = pytest.mark.slow

WORKER = "worker0"


@pytest.fixture(scope="module")
def server():
    s = Server("--request-timeout", "8", "--threads", "1", env={"TROUPE_FAULT_INJECTION": "1"})
    yield s
    s.stop()


async def inject(session: aiohttp.ClientSession, url: str, **fault) -> bool:
    async with session.post(url + "/debug/fault", json=fault) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["armed"]


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 6) -> tuple[int, dict]:
    async with session.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                           "ignore_eos": True}) as resp:
        return resp.status, await resp.json()


def run(coro_fn):
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await coro_fn(session)
    return asyncio.run(main())


def test_a_step_that_raises_fails_its_requests_and_the_server_serves_on(server):
    async def scenario(session):
        assert await inject(session, server.url, kind="raise", node=WORKER, actor="worker",
                            message_type="SchedulerOutput")
        failed = await complete(session, server.url, "The first step fails:")
        after = await complete(session, server.url, "Then it works:")
        return failed, after
    (status, body), (after_status, after) = run(scenario)
    assert status == 500 and "injected fault" in body["error"]["message"], body
    assert after_status == 200 and after["usage"]["completion_tokens"] == 6
    assert "Traceback" in server.log_when(lambda log: "Traceback" in log)     # our fault: logged as one, with its traceback


def test_a_slow_step_is_not_taken_for_a_hang(server):
    worker = server.worker_pid()

    async def scenario(session):
        stall = asyncio.ensure_future(inject(session, server.url, kind="stall", node=WORKER, seconds=4.0, busy=True))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        result = await complete(session, server.url, "Slowly:")
        await stall
        return result, time.monotonic() - t0
    (status, body), took = run(scenario)
    assert status == 200 and body["usage"]["completion_tokens"] == 6 and took >= 3.0
    assert server.worker_pid() == worker


def test_a_lost_frame_costs_its_request_a_timeout_not_a_hang(server):
    async def scenario(session):
        assert await inject(session, server.url, kind="drop", node="frontend", count=1)
        t0 = time.monotonic()
        lost = await complete(session, server.url, "This one is lost:")   # its AddRequest is dropped
        took = time.monotonic() - t0
        after = await complete(session, server.url, "This one is not:")
        return lost, took, after
    (status, body), took, (after_status, _) = run(scenario)
    assert status == 504 and "timeout of 8 s" in body["error"]["message"] and took < 12, (body, took)
    assert after_status == 200


@pytest.mark.parametrize("node", ["engine", WORKER])
def test_a_step_or_its_reply_lost_between_engine_and_worker_is_recovered(server, node):
    """The engine's next step to the worker, or the worker's next reply to a step, is lost; either
    way the executor asks the worker about the late step and sends it again or takes its
    output again: the request completes, a few seconds late."""
    async def scenario(session):
        lost = "SchedulerOutput" if node == "engine" else "ModelRunnerOutput"     # the step, or its reply
        assert await inject(session, server.url, kind="drop", node=node, message_type=lost, count=1)
        t0 = time.monotonic()
        result = await complete(session, server.url, "Despite a lost frame:")
        return result, time.monotonic() - t0
    (status, body), took = run(scenario)
    assert status == 200 and body["usage"]["completion_tokens"] == 6 and took < 7.0, (body, took)
    said = "never reached the worker" if node == "engine" else "reply was lost"
    assert said in server.log_when(lambda log: said in log)

