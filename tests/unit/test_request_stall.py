"""How long a request waits for its output: while the engine runs steps (the request is queued
behind others) it waits on; when the engine has run nothing for the stall timeout it fails, so
nothing hangs."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from actors.frontend.client import RequestHandle
from actors.frontend.stats import EngineStats
from actors.frontend.streams import OutputStream, RequestOutput, StreamTimeout
from helpers import run_async


def _handle(stall: float, pause_mode: str | None = None) -> tuple[RequestHandle, OutputStream, EngineStats]:
    stats = EngineStats()
    client = SimpleNamespace(stall_timeout_s=stall, stats=stats, pause_mode=pause_mode)
    stream = OutputStream("r")
    return RequestHandle(client, "r", stream, 3), stream, stats   # type: ignore[arg-type]


def test_a_queued_request_outwaits_the_stall_timeout_while_the_engine_progresses():
    async def main():
        handle, stream, stats = _handle(stall=0.2)

        async def engine():                       # steps for others, then this request's output
            for _ in range(10):
                await asyncio.sleep(0.05)
                stats.last_progress = time.monotonic()
            stream.put(RequestOutput("r", "hi", [5], finished=True, finish_reason="stop"))
        task = asyncio.ensure_future(engine())
        out = await handle.__anext__()
        await task
        return out
    out = run_async(main())
    assert out.finished and out.token_ids == [5]


def test_a_request_fails_when_the_engine_runs_nothing_for_the_stall_timeout():
    async def main():
        handle, _, stats = _handle(stall=0.2)
        stats.last_progress = time.monotonic() - 1.0
        with pytest.raises(StreamTimeout, match="no output for request r"):
            await handle.__anext__()
    run_async(main(), timeout=30)                   # fails rather than waiting on


def test_a_request_queued_while_generation_is_paused_outwaits_the_stall_timeout():
    async def main():
        handle, stream, stats = _handle(stall=0.1, pause_mode="keep")
        stats.last_progress = time.monotonic() - 1.0       # the engine runs nothing while paused
        asyncio.get_running_loop().call_later(0.5, stream.put,
                                              RequestOutput("r", "hi", [5], finished=True, finish_reason="stop"))
        return await handle.__anext__()
    out = run_async(main(), timeout=30)
    assert out.finished and out.token_ids == [5]
