"""The actor tracing dashboard: one static page (``index.html``, ``dashboard.js``,
``dashboard.css``) served at ``GET /dashboard``, which draws the JSON of ``/debug/actors``,
``/debug/steps`` and ``/debug/requests`` as the ``/debug/live`` event stream delivers it. No
build step and nothing fetched from elsewhere: the files are served as they are. The page names
its script, style and streams relative to its own address, so it works under --root-path."""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

HERE = Path(__file__).parent
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# The only names /dashboard/static/{name} serves: no path from the URL reaches the file system.
ASSETS = {p.name: p for p in HERE.iterdir() if p.suffix in CONTENT_TYPES}


def add_routes(app: web.Application) -> None:
    """``GET /dashboard`` (the page) and ``GET /dashboard/static/{name}`` (its script and style)."""
    app.router.add_get("/dashboard", index)
    app.router.add_get("/dashboard/static/{name}", static)


def _file(path: Path) -> web.Response:
    # Read per request (a few kB): an edited asset shows on reload; no-cache for the same reason.
    return web.Response(body=path.read_bytes(), content_type=CONTENT_TYPES[path.suffix],
                        charset="utf-8", headers={"Cache-Control": "no-cache"})


async def index(request: web.Request) -> web.Response:
    return _file(ASSETS["index.html"])


async def static(request: web.Request) -> web.Response:
    path = ASSETS.get(request.match_info["name"])
    if path is None:
        raise web.HTTPNotFound(reason=f"no dashboard asset {request.match_info['name']!r}")
    return _file(path)
