"""What every node records for tracing: one span per handled message (who handled what, sent by
whom, when it was enqueued, started and ended, the mailbox depth it found, its status and the
requests it served), the engine's steps with their phases, and each actor's running counters.
Records live in per-process rings (bounded: the oldest are overwritten, and a reader that falls
behind is told how many it missed), which are also the flight recorder: the last seconds of a
process, written as a trace file when it dies. ``to_chrome_trace`` writes records as Chrome
trace-event / Perfetto JSON. When tracing is off, recording costs one branch.

Times are ``time.monotonic_ns()``: one clock for every process of a machine, so records of
different processes line up."""
from __future__ import annotations

import contextvars
import itertools
import json
import logging
import os
import random
import tempfile
import time
import zlib
from collections import deque
from typing import Any, Iterable, NamedTuple

import msgspec

log = logging.getLogger("troupe.tracing")

FLIGHT_RECORDER_S = 10.0          # the last seconds a flight-recorder file holds


class TraceContext(NamedTuple):
    trace_id: int
    span_id: int
    actor: str = ""      # "node/actor" handling the message: the sender of what it sends


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
    status: str          # "ok" | "error" | "refused"
    size: int            # serialized bytes, 0 for an in-process message
    links: tuple[str, ...]
    sender: str = ""     # "node/actor" that sent it ("node/" from outside any actor)


class StepRecord(NamedTuple):
    """One engine step: its batch, and where its time went (milliseconds per phase)."""
    step: int
    start_ns: int
    end_ns: int
    gap_ns: int          # since the previous step ended (idle, or other messages handled)
    batch: int
    tokens: int
    phases: dict[str, float]


class ActorStats(msgspec.Struct, array_like=True):
    """An actor's counters since its node started."""
    actor: str
    depth: int           # messages waiting now
    max_depth: int
    handled: int
    busy_ns: int         # time spent in its handler
    errors: int
    restarts: int
    last_error: str | None = None


# The span being handled in the current task; messages sent from it become its children.
current_context: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar(
    "troupe_trace_context", default=None)


# The requests the message being handled in the current task serves (``ActorContext.link``).
current_links: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("troupe_trace_links", default=())


def new_trace_id() -> int:
    return random.getrandbits(63) or 1


def trace_enabled_by_env() -> bool:
    return os.environ.get("TROUPE_TRACE", "1") != "0"


class Ring:
    """The newest ``capacity`` items, numbered from 0 in the order they came."""

    def __init__(self, capacity: int) -> None:
        self._items: list[Any] = [None] * capacity
        self.next = 0

    def append(self, item: Any) -> None:
        self._items[self.next % len(self._items)] = item
        self.next += 1

    def since(self, seq: int, limit: int = 0) -> tuple[list[Any], int]:
        """Items numbered ``seq`` on (at most the newest ``limit``), and how many of those
        were overwritten before they could be read."""
        cap = len(self._items)
        if seq > self.next:           # a cursor of an earlier process of the same name
            seq = 0
        start = max(seq, self.next - cap)
        missed = start - seq if seq < start else 0
        if limit and self.next - start > limit:
            missed += self.next - limit - start
            start = self.next - limit
        return [self._items[i % cap] for i in range(start, self.next)], missed


class Tracer:
    """A node's rings: spans (``capacity``) and engine steps."""

    def __init__(self, node: str, capacity: int = 65536, enabled: bool | None = None) -> None:
        self.node = node
        self.enabled = trace_enabled_by_env() if enabled is None else enabled
        self.spans = Ring(capacity)
        self.steps = Ring(4096)
        self._span_ids = itertools.count(1)
        self._span_base = (os.getpid() & 0x3FFFFF) << 40

    def new_span_id(self) -> int:
        return self._span_base | next(self._span_ids)

    def record(self, rec: SpanRecord) -> None:
        self.spans.append(rec)

    def record_step(self, rec: StepRecord) -> None:
        self.steps.append(rec)

    def snapshot(self, since: int = 0) -> tuple[int, list[SpanRecord]]:
        """Span records numbered ``since`` on still in the ring, and the next number."""
        records, _ = self.spans.since(since)
        return self.spans.next, records

    def recent(self, seconds: float = FLIGHT_RECORDER_S) -> list[SpanRecord]:
        cutoff = now_ns() - int(seconds * 1e9)
        records, _ = self.spans.since(0)
        return [r for r in records if r.end_ns >= cutoff]


def now_ns() -> int:
    return time.monotonic_ns()


def wall_offset_ns() -> int:
    """Add to a monotonic time to get Unix time."""
    return time.time_ns() - time.monotonic_ns()


# -- Chrome trace-event / Perfetto JSON -----------------------------------------------------------

def flow_id(span_id: int) -> int:
    return span_id & 0x1FFFFFFFFFFFFF        # JSON numbers are exact below 2**53


def request_track_id(request_id: str) -> int:
    return zlib.crc32(request_id.encode()) + 1


def to_chrome_trace(records: Iterable[SpanRecord], pids: dict[str, int] | None = None,
                    steps: Iterable[tuple[str, StepRecord]] = (),
                    requests: Iterable[str] = ()) -> dict[str, Any]:
    """Chrome trace-event JSON: one process per node (its real pid where ``pids`` knows it), one
    thread track per actor with an ``X`` slice per handled message, a ``C`` counter track of each
    actor's mailbox depth, an async track per request in ``requests`` (from its first to its last
    span), a slice per engine step on an ``engine steps`` track of its node, and a flow from each
    message's sending span to its handling (one ``s`` and one ``f`` per flow id)."""
    records = sorted(records, key=lambda r: r.start_ns)
    pids = dict(pids or {})
    fallback = itertools.count(1_000_000)
    tids: dict[tuple[str, str], int] = {}
    by_span = {r.span_id: r for r in records}
    events: list[dict[str, Any]] = []

    def pid_of(node: str) -> int:
        if node not in pids:
            pids[node] = next(fallback)
        return pids[node]

    def tid_of(node: str, actor: str) -> int:
        return tids.setdefault((node, actor), len(tids) + 1)

    for r in records:
        pid, tid, ts = pid_of(r.node), tid_of(r.node, r.actor), r.start_ns / 1000
        events.append({"ph": "X", "name": r.msg_type, "cat": "message", "pid": pid, "tid": tid, "ts": ts,
                       "dur": max(r.end_ns - r.start_ns, 0) / 1000,
                       "args": {"status": r.status, "queued_us": max(r.start_ns - r.enqueue_ns, 0) / 1000,
                                "sender": r.sender, "size": r.size, "requests": list(r.links)}})
        events.append({"ph": "C", "name": f"{r.actor} mailbox", "pid": pid, "tid": tid, "ts": ts,
                       "args": {"depth": r.mailbox_depth}})
        parent = by_span.get(r.parent_span)
        if parent is not None and parent is not r:
            flow = {"name": "message", "cat": "flow", "id": flow_id(r.span_id)}
            events.append({**flow, "ph": "s", "pid": pid_of(parent.node), "tid": tid_of(parent.node, parent.actor),
                           "ts": parent.start_ns / 1000})
            events.append({**flow, "ph": "f", "bp": "e", "pid": pid, "tid": tid, "ts": ts})
    for node, step in steps:
        pid = pid_of(node)
        events.append({"ph": "X", "name": f"step {step.step}", "cat": "step", "pid": pid,
                       "tid": tid_of(node, "engine steps"), "ts": step.start_ns / 1000,
                       "dur": max(step.end_ns - step.start_ns, 0) / 1000,
                       "args": {"batch": step.batch, "tokens": step.tokens, "gap_ms": step.gap_ns / 1e6,
                                **{f"{k}_ms": v for k, v in step.phases.items()}}})
    events += _request_tracks(records, set(requests), pid_of)
    for node, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": node}})
    for (node, actor), tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pids[node], "tid": tid, "args": {"name": actor}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _request_tracks(records: list[SpanRecord], requests: set[str], pid_of: Any) -> list[dict[str, Any]]:
    spans: dict[str, list[SpanRecord]] = {}
    for r in records:
        for rid in r.links:
            if rid in requests:
                spans.setdefault(rid, []).append(r)
    events = []
    for rid, rs in spans.items():
        first = rs[0]
        track = {"name": f"request {rid}", "cat": "request", "id": request_track_id(rid),
                 "pid": pid_of(first.node), "tid": 0}
        events.append({**track, "ph": "b", "ts": first.start_ns / 1000, "args": {"request_id": rid}})
        events.append({**track, "ph": "e", "ts": max(r.end_ns for r in rs) / 1000})
    return events


def write_flight_record(directory: str, node: str, pid: int, reason: str,
                        records: list[SpanRecord], steps: list[tuple[str, StepRecord]] = (),
                        pids: dict[str, int] | None = None) -> str | None:
    """Write a dead (or dying) process's last records as a trace file; returns its path, or
    None (with a log line) when it cannot be written."""
    try:
        os.makedirs(directory, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        path = os.path.join(directory, f"{node}-{pid}-{stamp}.json")
        trace = to_chrome_trace(records, {node: pid, **(pids or {})}, steps)
        trace["metadata"] = {"node": node, "pid": pid, "reason": reason, "records": len(records)}
        partial = os.path.join(directory, f".{node}-{pid}-{stamp}.{os.getpid()}.partial")
        with open(partial, "w") as f:                 # a reader never sees half a file:
            json.dump(trace, f)                       # the .json name appears whole
        os.replace(partial, path)
        return path
    except OSError as exc:
        log.error("flight recorder: could not write the trace of node '%s' (pid %d): %s", node, pid, exc)
        return None


def default_flight_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "troupe-flight-recorder")


class RecentRecords:
    """The last ``seconds`` of records of one node, kept by its parent for the flight recorder."""

    def __init__(self, seconds: float = FLIGHT_RECORDER_S) -> None:
        self.seconds = seconds
        self.spans: deque[SpanRecord] = deque()
        self.steps: deque[tuple[str, StepRecord]] = deque()
        self.pids: dict[str, int] = {}

    def add(self, spans: list[SpanRecord], steps: list[tuple[str, StepRecord]]) -> None:
        self.spans.extend(spans)
        self.steps.extend(steps)
        cutoff = now_ns() - int(self.seconds * 1e9)
        while self.spans and self.spans[0].end_ns < cutoff:
            self.spans.popleft()
        while self.steps and self.steps[0][1].end_ns < cutoff:
            self.steps.popleft()
