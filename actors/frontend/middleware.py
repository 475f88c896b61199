"""vLLM's ``--middleware``: extra middleware for the HTTP server, by import path. vLLM's server
is Starlette, ours aiohttp, so a middleware here is aiohttp's: a coroutine function
``async def mw(request, handler) -> response`` (``@web.middleware`` or not), or a class whose
instances are such callables (one instance is made, with no arguments). They run in the order
given, inside the server's own (CORS, the API key, error mapping): a request they see was let
in."""
from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

from aiohttp import web

from actors.runtime.plugins import resolve_object

Middleware = Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]],
                      Awaitable[web.StreamResponse]]


def load_middleware(path: str) -> Middleware:
    """The middleware ``path`` names; ValueError naming it when it cannot be one."""
    obj: Any = resolve_object(path, "--middleware")
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise ValueError(f"--middleware {path!r}: the class could not be made with no arguments ({exc})") from None
    call = obj if inspect.isfunction(obj) or inspect.ismethod(obj) else getattr(obj, "__call__", None)
    if call is None or not inspect.iscoroutinefunction(call):
        raise ValueError(f"--middleware {path!r}: not an aiohttp middleware (async def mw(request, handler), or a "
                         "class whose instances are one)")
    if getattr(obj, "__middleware_version__", None) == 1:
        return obj

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        return await obj(request, handler)
    return middleware
