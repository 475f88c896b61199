"""HTTP requests in the trace: each one is a span of the frontend's ``http`` actor (the messages
its handler sends are its children, the engine requests it served its links), and the steps of
a generation (its admission, each chunk streamed) are spans of their own, so a request's
waterfall starts where the client's request arrived and ends with the last byte sent."""
from __future__ import annotations

import contextvars
from typing import Iterable

from aiohttp import web

from actors.runtime.tracing import (SpanRecord, TraceContext, Tracer, current_context, current_links, new_trace_id,
                                    now_ns)
from actors.topology import FRONTEND_NODE, HTTP

UNTRACED_PATHS = ("/debug/", "/dashboard")      # the dashboard watching itself is noise


class HttpSpan:
    __slots__ = ("tracer", "request", "path", "span", "trace_id", "t0", "tokens")

    @classmethod
    def start(cls, tracer: Tracer | None, request: web.Request, path: str | None = None) -> HttpSpan:
        """``path``: the route's (the request's own without --root-path's)."""
        self = cls()
        self.path = request.path if path is None else path
        on = tracer is not None and tracer.enabled and not self.path.startswith(UNTRACED_PATHS)
        self.tracer = tracer if on else None
        self.request, self.t0 = request, now_ns()
        self.span = tracer.new_span_id() if tracer is not None else 0
        self.trace_id = new_trace_id()
        self.tokens = (current_context.set(TraceContext(self.trace_id, self.span, f"{FRONTEND_NODE}/{HTTP}")),
                       current_links.set(()), current_http.set(self))
        return self

    def request_id(self) -> str:
        served = current_links.get()
        return served[0] if served else f"http-{self.span:x}"

    def end(self) -> None:
        served = current_links.get()
        context, links, http = self.tokens
        current_http.reset(http)
        current_links.reset(links)
        current_context.reset(context)
        if self.tracer is not None:
            req = self.request
            self.tracer.record(SpanRecord(self.trace_id, self.span, 0, 0, self.tracer.node, HTTP,
                                          f"{req.method} {self.path}", self.t0, self.t0, now_ns(), 0, "ok",
                                          req.content_length or 0, served, "client"))

    def mark(self, name: str, start_ns: int | None = None) -> None:
        if self.tracer is None:
            return
        start = self.t0 if start_ns is None else start_ns
        self.tracer.record(SpanRecord(self.trace_id, self.tracer.new_span_id(), self.span, 0, self.tracer.node,
                                      HTTP, name, start, start, now_ns(), 0, "ok", 0,
                                      current_links.get(), f"{FRONTEND_NODE}/{HTTP}"))


current_http: contextvars.ContextVar[HttpSpan | None] = contextvars.ContextVar("troupe_http_span", default=None)


def serving(request_ids: Iterable[str]) -> None:
    """The engine requests the current HTTP request runs (its links from now on)."""
    current_links.set(tuple(request_ids))


def mark(name: str, start_ns: int | None = None) -> None:
    """A step of the current HTTP request as a span: from ``start_ns`` (or the request's
    arrival) to now."""
    span = current_http.get()
    if span is not None:
        span.mark(name, start_ns)
