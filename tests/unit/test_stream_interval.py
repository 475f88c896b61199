"""vLLM's --stream-interval: after a request's first token its outputs are handed over N new
tokens at a time, or when it finishes; a stall hands over what has come."""
from __future__ import annotations

import asyncio

from actors.frontend.streams import OutputStream, RequestOutput
from helpers import run_async


def _token(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", text=f"t{i}", token_ids=[i], finished=finished,
                         finish_reason="length" if finished else None)


def test_outputs_after_the_first_token_come_interval_tokens_at_a_time():
    async def main() -> list[list[int]]:
        stream = OutputStream("r", interval=3)
        got: list[list[int]] = []

        async def read() -> None:
            while True:
                out = await stream.get(timeout=5)
                got.append(out.token_ids)
                if out.finished:
                    return
        reader = asyncio.ensure_future(read())
        for i in range(8):
            stream.put(_token(i, finished=i == 7))
            await asyncio.sleep(0.01)       # the reader runs between tokens
        await asyncio.wait_for(reader, 5)
        return got
    got = run_async(main())
    assert got == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert [t for chunk in got for t in chunk] == list(range(8))


def test_interval_one_hands_over_every_token():
    async def main() -> list[list[int]]:
        stream = OutputStream("r")
        got = []
        for i in range(3):
            stream.put(_token(i, finished=i == 2))
            got.append((await stream.get(timeout=5)).token_ids)
        return got
    assert run_async(main()) == [[0], [1], [2]]


def test_a_stall_hands_over_what_came_short_of_the_interval():
    async def main() -> list[int]:
        stream = OutputStream("r", interval=4)
        stream.put(_token(0))
        assert (await stream.get(timeout=5)).token_ids == [0]
        stream.put(_token(1))
        return (await stream.get(timeout=0.05)).token_ids
    assert run_async(main()) == [1]
