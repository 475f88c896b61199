"""Server-sent events for streamed completions: ``data: {json}`` per event, an error event if
the request fails mid-stream, then ``data: [DONE]``. A client that leaves ends the stream
quietly (the caller's ``finally`` aborts its engine requests)."""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator

from aiohttp import web

from actors.frontend import http_trace
from actors.frontend.errors import error_body, json_encoder
from actors.runtime.tracing import now_ns

log = logging.getLogger("troupe.http")

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
# seconds of silence after which a stream sends a comment line (vLLM's --sse-keep-alive-interval; 0: never)
KEEP_ALIVE_S = web.AppKey("sse_keep_alive_s", float)


def event(payload: dict) -> bytes:
    return b"data: " + json_encoder.encode(payload) + b"\n\n"


def named_event(payload: dict) -> bytes:
    """The Responses API's form: ``event: {type}`` before the data."""
    return b"event: " + str(payload.get("type", "error")).encode() + b"\n" + event(payload)


async def send_events(request: web.Request, events: AsyncIterator[dict], response_id: str,
                      named: bool = False) -> web.StreamResponse:
    """``response_id``: the X-Request-Id header. Each chunk written is a span of the request's
    trace. ``named``: each event with its type's name and no ``[DONE]`` after the last (the
    Responses API's stream)."""
    encode = named_event if named else event
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": response_id})
    await resp.prepare(request)
    keep_alive = request.app.get(KEEP_ALIVE_S, 0.0)
    try:
        try:
            async with aclosing(events) as stream:
                async for payload in (_kept_alive(stream, resp, keep_alive) if keep_alive > 0 else stream):
                    t = now_ns()
                    await resp.write(encode(payload))
                    http_trace.mark("chunk", t)
        except ConnectionResetError:
            raise
        except Exception:
            log.exception("%s %s failed mid-stream", request.method, request.path)
            await resp.write(encode(error_body("internal error (see the server log)", code=500)))
        if not named:
            await resp.write(DONE)
        await resp.write_eof()
    except ConnectionResetError:
        log.debug("%s %s: the client left mid-stream", request.method, request.path)
    return resp


async def _kept_alive(events: AsyncIterator[dict], resp: web.StreamResponse, every: float) -> AsyncIterator[dict]:
    """``events``, with a keep-alive comment written whenever none came for ``every`` seconds
    (queued, in prefill, between tokens), so proxies with read timeouts keep the connection."""
    while True:
        nxt = asyncio.ensure_future(anext(events))
        try:
            while not (await asyncio.wait({nxt}, timeout=every))[0]:
                await resp.write(KEEP_ALIVE)
        except BaseException:
            nxt.cancel()                     # and let it end before the caller closes ``events``
            await asyncio.wait({nxt})
            raise
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return
