"""The dashboard's data. The Telemetry actor on the frontend node collects every process's
records a few times a second: one GetTelemetry through the system actors (each node answers
with what it recorded since the cursor it was given, so a record comes once; a node that fell
behind says how many it missed), and keeps them in a ``TelemetryWindow``: the last minute of
message spans and engine steps, each actor's counters over time, and the spans of recent
requests. The window answers what the JSON endpoints and the page show: the actor table and
graph, the step view, the engine's time series, a request's hops, and Chrome-trace exports.

Percentiles are exact over each (actor, message type)'s newest ``SAMPLES`` messages of the
window; rates and utilisation come from the actors' own counters, so they hold even when
records were missed."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.runtime import Actor, Msg
from actors.runtime.system import SYSTEM_ACTOR, Cursor, GetTelemetry, TelemetryChunk
from actors.runtime.ticker import Ticker
from actors.runtime.tracing import ActorStats, SpanRecord, StepRecord, now_ns, to_chrome_trace, wall_offset_ns

log = logging.getLogger("troupe.telemetry")

POLL_S = 0.5                   # between two collections
WINDOW_S = 60.0                # what the percentiles, edges and traces cover
RATE_S = 10.0                  # what msgs/s and utilisation cover
SAMPLES = 2048                 # per actor and message type, for percentiles
MAX_SPANS = 200_000            # spans kept for traces and waterfalls
MAX_REQUESTS = 1000            # requests whose hops are kept
MAX_HOPS = 4096                # hops kept per request
SERIES_POINTS = 600            # engine samples (one per collection: five minutes)
SLOW_HANDLER_MS = 1000.0       # a handler p99 above this is "slow"
GROWING_DEPTH = 32             # a mailbox this deep, or deeper at each of the last samples, is "growing"
RESPONSE_PREFIXES = ("chatcmpl-", "cmpl-")


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(int(q * len(sorted_values)), len(sorted_values) - 1)]


@dataclass(slots=True)
class _Actor:
    node: str
    name: str
    stats: ActorStats | None = None
    history: deque[tuple[int, int, int, int, int]] = field(default_factory=deque)  # (t, handled, busy, errors, restarts)
    by_type: dict[str, deque[tuple[int, int, int, str]]] = field(default_factory=dict)  # end, wait, run, status


@dataclass(slots=True)
class _Process:
    node: str
    pid: int
    alive: bool = True
    restarts: int = 0
    down_reason: str | None = None


class TelemetryWindow:
    def __init__(self) -> None:
        self.processes: dict[str, _Process] = {}
        self.actors: dict[tuple[str, str], _Actor] = {}
        self.edges: dict[tuple[str, str], deque[list[int]]] = {}     # (src, dst) -> [second, count] runs
        self.spans: deque[SpanRecord] = deque(maxlen=MAX_SPANS)
        self.steps: deque[tuple[str, StepRecord]] = deque(maxlen=4096)
        self.requests: OrderedDict[str, list[SpanRecord]] = OrderedDict()
        self.series: deque[dict[str, Any]] = deque(maxlen=SERIES_POINTS)
        self.missed = 0
        self.polls = 0

    # -- ingest ------------------------------------------------------------------------------
    def ingest(self, root: TelemetryChunk, now: int | None = None) -> None:
        now = now_ns() if now is None else now
        self.polls += 1
        for chunk in root.walk():
            self._process(chunk.node, chunk.pid)
            self.missed += chunk.missed
            for stats in chunk.actors:
                self._actor_stats(chunk.node, stats, now)
            for rec in chunk.spans:
                self._span(rec)
            self.steps.extend((chunk.node, s) for s in chunk.steps)
            for node, reason in chunk.down.items():
                if node in self.processes:
                    self.processes[node].alive = False
                    self.processes[node].down_reason = reason

    def _process(self, node: str, pid: int) -> None:
        p = self.processes.get(node)
        if p is None:
            self.processes[node] = _Process(node, pid)
            return
        if p.pid != pid:                      # a new process under the same name: a restart
            p.pid, p.restarts = pid, p.restarts + 1
            for key in [k for k in self.actors if k[0] == node]:
                del self.actors[key]          # its counters start again from zero
        p.alive, p.down_reason = True, None

    def _actor_stats(self, node: str, stats: ActorStats, now: int) -> None:
        a = self.actors.get((node, stats.actor))
        if a is None:
            a = self.actors[(node, stats.actor)] = _Actor(node, stats.actor)
        a.stats = stats
        a.history.append((now, stats.handled, stats.busy_ns, stats.errors, stats.restarts))
        while a.history and now - a.history[0][0] > WINDOW_S * 1e9:
            a.history.popleft()

    def _span(self, r: SpanRecord) -> None:
        self.spans.append(r)
        a = self.actors.get((r.node, r.actor))
        if a is None:
            a = self.actors[(r.node, r.actor)] = _Actor(r.node, r.actor)
        samples = a.by_type.get(r.msg_type)
        if samples is None:
            samples = a.by_type[r.msg_type] = deque(maxlen=SAMPLES)
        samples.append((r.end_ns, max(r.start_ns - r.enqueue_ns, 0), r.end_ns - r.start_ns, r.status))
        if r.sender:
            runs = self.edges.setdefault((r.sender.rstrip("/") or "?", f"{r.node}/{r.actor}"), deque())
            sec = r.end_ns // 1_000_000_000
            if runs and runs[-1][0] == sec:
                runs[-1][1] += 1
            else:
                runs.append([sec, 1])
        for rid in r.links:
            hops = self.requests.get(rid)
            if hops is None:
                hops = self.requests[rid] = []
                if len(self.requests) > MAX_REQUESTS:
                    self.requests.popitem(last=False)
            if len(hops) < MAX_HOPS:
                hops.append(r)

    def sample_engine(self, kv_usage: float, running: int, waiting: int, queries: int, hits: int) -> None:
        """One point of the engine's time series (prefix-cache hit rate since the last point)."""
        last = self.series[-1] if self.series else None
        dq = queries - last["_queries"] if last else 0
        dh = hits - last["_hits"] if last else 0
        rate = dh / dq if dq > 0 else (last["prefix_hit_rate"] if last else 0.0)
        self.series.append({"t": round(time.time(), 3), "kv_usage": round(kv_usage, 4),
                            "prefix_hit_rate": round(rate, 4), "running": running, "waiting": waiting,
                            "_queries": queries, "_hits": hits})

    # -- views -------------------------------------------------------------------------------
    def actors_view(self, now: int | None = None) -> dict[str, Any]:
        now = now_ns() if now is None else now
        rows = [self._actor_row(a, now) for a in sorted(self.actors.values(), key=lambda a: (a.node, a.name))]
        return {"now": round(time.time(), 3), "window_s": WINDOW_S, "dropped": self.missed,
                "processes": [{"node": p.node, "pid": p.pid, "alive": p.alive, "restarts": p.restarts,
                               "down_reason": p.down_reason} for p in self.processes.values()],
                "actors": rows, "edges": self._edges(now)}

    def _actor_row(self, a: _Actor, now: int) -> dict[str, Any]:
        s = a.stats
        rate_from = next((h for h in a.history if now - h[0] <= RATE_S * 1e9), None)
        last = a.history[-1] if a.history else None
        msgs_per_s = util = 0.0
        if rate_from is not None and last is not None and last[0] > rate_from[0]:
            dt = (last[0] - rate_from[0]) / 1e9
            msgs_per_s = (last[1] - rate_from[1]) / dt
            util = min((last[2] - rate_from[2]) / 1e9 / dt, 1.0)
        by_type, waits, runs = [], [], []
        cutoff = now - WINDOW_S * 1e9
        for msg_type, samples in sorted(a.by_type.items()):
            recent = [x for x in samples if x[0] >= cutoff]
            if not recent:
                continue
            w = sorted(x[1] / 1e6 for x in recent)
            r = sorted(x[2] / 1e6 for x in recent)
            waits += w
            runs += r
            by_type.append({"msg_type": msg_type, "count": len(recent), **_quantiles(w, r)})
        waits.sort()
        runs.sort()
        q = _quantiles(waits, runs)
        errors_recent = last is not None and a.history[0][3] < last[3]
        restarted = last is not None and a.history[0][4] < last[4]
        depths = [s.depth] if s else []
        health = ("error" if errors_recent else "restarted" if restarted
                  else "growing" if s and s.depth >= GROWING_DEPTH
                  else "slow" if q["handler_p99_ms"] > SLOW_HANDLER_MS else "ok")
        p = self.processes.get(a.node)
        return {"node": a.node, "pid": p.pid if p else 0, "actor": a.name,
                "depth": depths[0] if depths else 0, "max_depth": s.max_depth if s else 0,
                "handled": s.handled if s else 0, "msgs_per_s": round(msgs_per_s, 2),
                "utilisation": round(util, 4), "errors": s.errors if s else 0,
                "restarts": s.restarts if s else 0, "last_error": s.last_error if s else None,
                "health": health, **q, "by_type": by_type}

    def _edges(self, now: int) -> list[dict[str, Any]]:
        out = []
        first_sec = (now - int(WINDOW_S * 1e9)) // 1_000_000_000
        rate_sec = (now - int(RATE_S * 1e9)) // 1_000_000_000
        for (src, dst), runs in sorted(self.edges.items()):
            while runs and runs[0][0] < first_sec:
                runs.popleft()
            if not runs:
                continue
            recent = sum(c for sec, c in runs if sec >= rate_sec)
            out.append({"src": src, "dst": dst, "count": sum(c for _, c in runs),
                        "msgs_per_s": round(recent / RATE_S, 2)})
        return out

    def steps_view(self, seconds: float = WINDOW_S, limit: int = 300) -> dict[str, Any]:
        offset = wall_offset_ns()
        cutoff = now_ns() - int(seconds * 1e9)
        steps = [s for _, s in self.steps if s.end_ns >= cutoff][-limit:]
        return {"steps": [{"step": s.step, "t": round((s.start_ns + offset) / 1e9, 3), "batch": s.batch,
                           "tokens": s.tokens, "duration_ms": round((s.end_ns - s.start_ns) / 1e6, 3),
                           "gap_ms": round(s.gap_ns / 1e6, 3), "phases": s.phases} for s in steps],
                "series": [{k: v for k, v in p.items() if not k.startswith("_")} for p in self.series]}

    def requests_view(self, limit: int = 50) -> dict[str, Any]:
        offset = wall_offset_ns()
        out = []
        for rid in reversed(self.requests):
            hops = self.requests[rid]
            out.append({"id": rid, "request_id": rid, "t": round((hops[0].start_ns + offset) / 1e9, 3),
                        "status": _status(hops), "hops": len(hops)})
            if len(out) >= limit:
                break
        return {"requests": out}

    def resolve(self, request_id: str) -> list[str]:
        """The engine requests an id names: the id itself, an OpenAI response id, or a request
        with several choices (``{id}-{index}``)."""
        bare = request_id
        for prefix in RESPONSE_PREFIXES:
            if bare.startswith(prefix):
                bare = bare[len(prefix):]
        if bare in self.requests:
            return [bare]
        return [rid for rid in self.requests if rid.startswith(bare + "-") and rid[len(bare) + 1:].isdigit()]

    def request_view(self, request_id: str) -> dict[str, Any] | None:
        rids = self.resolve(request_id)
        if not rids:
            return None
        spans = sorted({id(r): r for rid in rids for r in self.requests[rid]}.values(), key=lambda r: r.start_ns)
        t0 = min(min(r.enqueue_ns, r.start_ns) for r in spans)
        hops = [_hop(r, t0) for r in spans]
        queued = _queue_hop(spans, t0)
        if queued is not None:
            hops.append(queued)
            hops.sort(key=lambda h: (h["start_ms"], h["name"] != "queue"))
        return {"id": request_id, "request_id": rids[0] if len(rids) == 1 else rids[0].rsplit("-", 1)[0],
                "requests": rids, "hops": hops}

    def chrome_trace(self, seconds: float = WINDOW_S, request_id: str | None = None) -> dict[str, Any]:
        cutoff = now_ns() - int(seconds * 1e9)
        pids = {p.node: p.pid for p in self.processes.values()}
        if request_id is not None:
            rids = set(self.resolve(request_id))
            spans = [r for r in self.spans if r.end_ns >= cutoff and rids.intersection(r.links)]
            steps = [(n, s) for n, s in self.steps if s.end_ns >= cutoff and any(
                r.msg_type == "Step" and r.start_ns <= s.start_ns <= r.end_ns for r in spans)]
            return to_chrome_trace(spans, pids, steps, rids)
        spans = [r for r in self.spans if r.end_ns >= cutoff]
        steps = [(n, s) for n, s in self.steps if s.end_ns >= cutoff]
        recent = [rid for rid in self.requests if self.requests[rid][-1].end_ns >= cutoff]
        return to_chrome_trace(spans, pids, steps, recent)


def _quantiles(waits: list[float], runs: list[float]) -> dict[str, float]:
    return {"wait_p50_ms": round(percentile(waits, 0.5), 4), "wait_p99_ms": round(percentile(waits, 0.99), 4),
            "handler_p50_ms": round(percentile(runs, 0.5), 4), "handler_p99_ms": round(percentile(runs, 0.99), 4)}


HOP_NAMES = {("tokenizer", "Generate"): "tokenize", ("scheduler", "AddRequest"): "schedule.add",
             ("grammar", "CompileGrammar"): "grammar.compile", ("scheduler", "GrammarReady"): "grammar.ready",
             ("scheduler", "Step"): "step", ("executor", "SchedulerOutput"): "execute",
             ("worker", "SchedulerOutput"): "forward", ("detokenizer", "TrackRequest"): "detokenize.track",
             ("detokenizer", "EngineCoreOutputs"): "detokenize", ("scheduler", "AbortRequests"): "abort",
             ("kv_connector", "KVLoad"): "kv.load", ("kv_connector", "KVLoadFailed"): "kv.load_failed",
             ("kv_connector", "KVSend"): "kv.send"}


def _is_http_request(r: SpanRecord) -> bool:
    """The span of a whole HTTP request (its other spans are its receive and chunks)."""
    return r.actor == "http" and r.msg_type.startswith(("POST ", "GET "))


def _hop(r: SpanRecord, t0: int) -> dict[str, Any]:
    if r.actor == "http":
        name = "http.request" if _is_http_request(r) else f"http.{r.msg_type}"
    else:
        name = HOP_NAMES.get((r.actor, r.msg_type), f"{r.actor}.{r.msg_type}")
    return {"name": name, "node": r.node, "actor": r.actor, "msg_type": r.msg_type,
            "start_ms": round((r.start_ns - t0) / 1e6, 3), "wait_ms": round(max(r.start_ns - r.enqueue_ns, 0) / 1e6, 3),
            "run_ms": round((r.end_ns - r.start_ns) / 1e6, 3), "status": r.status}


def _queue_hop(spans: list[SpanRecord], t0: int) -> dict[str, Any] | None:
    """The wait in the scheduler's queue: from the request's admission to its first step."""
    added = next((r for r in spans if r.actor == "scheduler" and r.msg_type in ("AddRequest", "GrammarReady")), None)
    first = next((r for r in spans if r.actor == "scheduler" and r.msg_type == "Step"), None)
    if added is None or first is None or first.start_ns < added.end_ns:
        return None
    return {"name": "queue", "node": added.node, "actor": "scheduler", "msg_type": "",
            "start_ms": round((added.end_ns - t0) / 1e6, 3), "wait_ms": round((first.start_ns - added.end_ns) / 1e6, 3),
            "run_ms": 0.0, "status": "ok"}


def _status(hops: list[SpanRecord]) -> str:
    if any(r.status == "error" for r in hops):
        return "error"
    if any(r.actor == "scheduler" and r.msg_type == "AbortRequests" for r in hops):
        return "aborted"
    return "finished" if any(_is_http_request(r) for r in hops) else "running"


# -- the actor -------------------------------------------------------------------------------
class Poll(Msg):
    pass


TelemetryProtocol = Poll


class TelemetryActor(Actor):
    """Collects every process's telemetry into its window every ``POLL_S``; ``engine_sample``
    gives the engine's gauges for the time series. Handlers call the window directly
    (``colocated``)."""
    protocol = TelemetryProtocol

    def __init__(self, window: TelemetryWindow,
                 engine_sample: Callable[[], tuple[float, int, int, int, int] | None],
                 source: str | None = None) -> None:
        """``source``: the node whose system actor collects (its own and its children's
        records): this one's (None), or with several API servers the frontend node's."""
        self.source = source
        self.window = window
        self.engine_sample = engine_sample
        self.cursors: dict[str, Cursor] = {}
        self.ticker: Ticker | None = None

    async def started(self) -> None:
        self.ticker = Ticker(self.ctx.self_ref, Poll, POLL_S)
        self.ticker.again()

    async def stopped(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()

    def colocated(self) -> TelemetryWindow:
        return self.window

    async def receive(self, msg: TelemetryProtocol) -> None:
        try:
            chunk = await self.ctx.node.ref(SYSTEM_ACTOR, self.source).ask(GetTelemetry(self.cursors), timeout=10.0)
        except Exception as exc:           # tried again at the next poll
            log.warning("telemetry collection failed: %s", exc)
            return
        finally:
            self.ticker.again()
        for c in chunk.walk():
            self.cursors[c.node] = c.cursor
        self.window.ingest(chunk)
        sample = self.engine_sample()
        if sample is not None:
            self.window.sample_engine(*sample)


class Telemetry:
    """What the HTTP endpoints hold: the window, and a way to bring it up to date first."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self.window: TelemetryWindow = ref.colocated()

    async def fresh(self) -> TelemetryWindow:
        """The window, after a collection made now (what happened just before is in it)."""
        try:
            await self.ref.ask(Poll(), timeout=15.0)
        except Exception as exc:             # the window as it is, then
            log.warning("telemetry collection failed: %s", exc)
        return self.window
