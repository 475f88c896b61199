"""The dashboard's JSON endpoints, usable by scripts too: ``GET /debug/actors`` (the actor
table and graph), ``/debug/steps`` (engine steps and time series), ``/debug/requests`` and
``/debug/requests/{id}`` (recent requests, one request's hops), ``/debug/trace`` (Chrome
trace-event / Perfetto JSON, of the last seconds or of one request) and ``/debug/live`` (all of
the first three, pushed as server-sent events about once a second)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from actors.frontend.errors import error_response, json_encoder, not_found
from actors.frontend.protocol import BadRequest
from actors.frontend.telemetry import WINDOW_S, Telemetry, TelemetryWindow

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

LIVE_PERIOD_S = 1.0
MAX_LIVE_S = 3600.0              # a live stream ends after an hour (the page reconnects)


def _json(body: object) -> web.Response:
    return web.Response(body=json_encoder.encode(body), content_type="application/json")


def _telemetry(server: OpenAIServer) -> Telemetry:
    telemetry = server.telemetry() if server.telemetry is not None else None
    if telemetry is None:
        raise not_found("telemetry is not collected here (it starts with the model)")
    return telemetry


async def _window(server: OpenAIServer) -> TelemetryWindow:
    """The window, brought up to date: what happened before the call is in the answer."""
    return await _telemetry(server).fresh()


def _number(request: web.Request, name: str, default: float, lo: float, hi: float) -> float:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise BadRequest(f"{name} must be a number, got {text!r}", name) from None
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be in [{lo:g}, {hi:g}], got {text}", name)
    return value


async def actors(server: OpenAIServer, request: web.Request) -> web.Response:
    return _json((await _window(server)).actors_view())


async def steps(server: OpenAIServer, request: web.Request) -> web.Response:
    return _json((await _window(server)).steps_view(_number(request, "seconds", WINDOW_S, 1, WINDOW_S)))


async def requests(server: OpenAIServer, request: web.Request) -> web.Response:
    return _json((await _window(server)).requests_view(int(_number(request, "limit", 50, 1, 1000))))


async def request_hops(server: OpenAIServer, request: web.Request) -> web.Response:
    rid = request.match_info["request_id"]
    view = (await _window(server)).request_view(rid)
    if view is None:
        return error_response(404, f"no request {rid!r} among the recent ones", param="request_id")
    return _json(view)


async def trace(server: OpenAIServer, request: web.Request) -> web.Response:
    """Chrome trace-event JSON of the last ``seconds`` (at most the window), or of the request
    ``request_id`` alone."""
    window = await _window(server)
    seconds = _number(request, "seconds", WINDOW_S, 0.001, WINDOW_S)
    rid = request.query.get("request_id")
    if rid is not None and not window.resolve(rid):
        return error_response(404, f"no request {rid!r} among the recent ones", param="request_id")
    return _json(window.chrome_trace(seconds, rid))


async def live(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    """About once a second, ``data: {"actors", "steps", "requests"}`` until the client leaves."""
    window = _telemetry(server).window
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    end = loop.time() + MAX_LIVE_S
    try:
        while loop.time() < end:
            body = {"actors": window.actors_view(), "steps": window.steps_view(), "requests": window.requests_view()}
            await resp.write(b"data: " + json_encoder.encode(body) + b"\n\n")
            await asyncio.sleep(LIVE_PERIOD_S)
        await resp.write_eof()
    except ConnectionResetError:           # the page went away
        pass
    return resp


ROUTES = [("GET", "/debug/actors", actors), ("GET", "/debug/steps", steps),
          ("GET", "/debug/requests", requests), ("GET", "/debug/requests/{request_id}", request_hops),
          ("GET", "/debug/trace", trace), ("GET", "/debug/live", live)]
