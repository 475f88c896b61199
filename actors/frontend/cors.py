"""Cross-origin requests from browsers (vLLM's --allowed-origins, --allowed-methods,
--allowed-headers and --allow-credentials, with their defaults and meanings: vLLM serves
through Starlette's CORS middleware, and this answers as it does).

No origin is allowed by default, so a page from another origin cannot read the server's
answers. A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is
answered here, before the API key is checked (a browser sends no key with it): 200 with what
may be sent, or 400 naming what is not allowed. Every other answer to a request that names an
allowed origin carries ``Access-Control-Allow-Origin`` (streamed answers included)."""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = frozenset({"Accept", "Accept-Language", "Content-Language", "Content-Type"})
MAX_AGE_S = 600           # how long a browser may keep a preflight's answer
_PREFLIGHT_VARY = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ()          # "*": any
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @property
    def any_origin(self) -> bool:
        return "*" in self.allowed_origins

    def allows_origin(self, origin: str) -> bool:
        return self.any_origin or origin in self.allowed_origins

    def methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.allowed_methods else tuple(self.allowed_methods)

    def is_preflight(self, request: web.Request) -> bool:
        return (request.method == "OPTIONS" and "Origin" in request.headers
                and "Access-Control-Request-Method" in request.headers)

    def preflight(self, request: web.Request) -> web.Response:
        """The answer to a preflight request."""
        origin = request.headers["Origin"]
        method = request.headers["Access-Control-Request-Method"]
        asked = request.headers.get("Access-Control-Request-Headers")
        headers = {"Vary": _PREFLIGHT_VARY, "Access-Control-Allow-Methods": ", ".join(self.methods()),
                   "Access-Control-Max-Age": str(MAX_AGE_S)}
        explicit = not self.any_origin or self.allow_credentials
        if not explicit:
            headers["Access-Control-Allow-Origin"] = "*"
        any_header = "*" in self.allowed_headers
        allowed_headers = sorted(SAFELISTED_HEADERS | set(self.allowed_headers))
        if not any_header:
            headers["Access-Control-Allow-Headers"] = ", ".join(allowed_headers)
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        failures = []
        if self.allows_origin(origin):
            if explicit:
                headers["Access-Control-Allow-Origin"] = origin
        else:
            failures.append("origin")
        if method not in self.methods():
            failures.append("method")
        if any_header and asked is not None:
            headers["Access-Control-Allow-Headers"] = asked
        elif asked is not None:
            lowered = {h.lower() for h in allowed_headers}
            if any(h.strip().lower() not in lowered for h in asked.split(",")):
                failures.append("headers")
        if failures:
            return web.Response(status=400, text="Disallowed CORS " + ", ".join(failures), headers=headers)
        return web.Response(status=200, text="OK", headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """aiohttp's on_response_prepare: the CORS headers of an answer to a request from
        another origin, set just before its headers are sent (so streamed answers get them)."""
        origin = request.headers.get("Origin")
        if origin is None or self.is_preflight(request):
            return
        headers = response.headers
        if self.any_origin:
            headers["Access-Control-Allow-Origin"] = "*"
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        if (self.any_origin and self.allow_credentials) or (not self.any_origin and self.allows_origin(origin)):
            headers["Access-Control-Allow-Origin"] = origin      # credentials need the origin itself
        _vary_origin(headers)


def _vary_origin(headers) -> None:
    vary = [v.strip() for v in headers.get("Vary", "").split(",") if v.strip()]
    if "Origin" not in vary:
        headers["Vary"] = ", ".join([*vary, "Origin"])
