"""Per-message trace records in a per-process ring buffer, and their Chrome-trace export.

One record per handled message: who handled what, when it was enqueued, started and ended
(monotonic ns), the mailbox depth it found, its status, and the requests it served (links).
When tracing is off, recording costs one branch.
"""
from __future__ import annotations

import contextvars
import itertools
import os
import random
import time
from typing import Any, NamedTuple


class TraceContext(NamedTuple):
    trace_id: int
    span_id: int


class SpanRecord(NamedTuple):
    trace_id: int
    span_id: int
    parent_span: int
    msg_id: int
    node: str
    actor: str
    msg_type: str
    enqueue_ns: int
    start_ns: int
    end_ns: int
    mailbox_depth: int
    status: str          # "ok" | "error" | "rejected"
    size: int            # serialized bytes, 0 for an in-process message
    links: tuple[str, ...]


# The span being handled in the current task; messages sent from it become its children.
current_context: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar(
    "troupe_trace_context", default=None)


def new_trace_id() -> int:
    return random.getrandbits(63) or 1


class Tracer:
    """A preallocated ring of ``capacity`` records."""

    def __init__(self, node: str, capacity: int = 65536, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = os.environ.get("TROUPE_TRACE", "1") != "0"
        self.node = node
        self.enabled = enabled
        self._ring: list[SpanRecord | None] = [None] * capacity
        self._next = 0
        self._span_ids = itertools.count(1)
        self._span_base = (os.getpid() & 0x3FFFFF) << 40

    def new_span_id(self) -> int:
        return self._span_base | next(self._span_ids)

    def record(self, rec: SpanRecord) -> None:
        self._ring[self._next % len(self._ring)] = rec
        self._next += 1

    def snapshot(self, since: int = 0) -> tuple[int, list[SpanRecord]]:
        """Records with sequence number >= ``since`` still in the ring, and the next sequence."""
        cap = len(self._ring)
        start = max(since, self._next - cap)
        return self._next, [self._ring[i % cap] for i in range(start, self._next)]  # type: ignore[misc]


def now_ns() -> int:
    return time.monotonic_ns()


def to_chrome_trace(records: list[SpanRecord]) -> dict[str, Any]:
    """Chrome trace / Perfetto JSON: one process per node, one thread lane per actor, an ``X``
    slice per handled message, a ``C`` counter of mailbox depth, and a flow arrow from each
    parent span to its child."""
    events: list[dict[str, Any]] = []
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    by_span: dict[int, SpanRecord] = {r.span_id: r for r in records}
    for r in records:
        pid = pids.setdefault(r.node, len(pids) + 1)
        tid = tids.setdefault((r.node, r.actor), len(tids) + 1)
        ts, dur = r.start_ns / 1000, max(r.end_ns - r.start_ns, 0) / 1000
        events.append({"ph": "X", "name": r.msg_type, "pid": pid, "tid": tid, "ts": ts,
                       "dur": dur, "args": {"status": r.status, "queued_us": (r.start_ns - r.enqueue_ns) / 1000,
                                            "trace_id": r.trace_id, "links": list(r.links)}})
        events.append({"ph": "C", "name": f"{r.actor} mailbox", "pid": pid, "ts": ts,
                       "args": {"depth": r.mailbox_depth}})
        parent = by_span.get(r.parent_span)
        if parent is not None:
            flow = {"name": "msg", "cat": "msg", "id": r.span_id}
            events.append({**flow, "ph": "s", "pid": pids.setdefault(parent.node, len(pids) + 1),
                           "tid": tids.setdefault((parent.node, parent.actor), len(tids) + 1),
                           "ts": parent.start_ns / 1000})
            events.append({**flow, "ph": "f", "bp": "e", "pid": pid, "tid": tid, "ts": ts})
    for node, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": node}})
    for (node, actor), tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pids[node], "tid": tid,
                       "args": {"name": actor}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
