"""An endpoint plugin: ``GET /example/plugin`` answers which process serves it."""
from __future__ import annotations

import os

from aiohttp import web


async def example(request: web.Request) -> web.Response:
    return web.json_response({"plugin": "troupe-example-plugins", "pid": os.getpid()})


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/example/plugin", example)
