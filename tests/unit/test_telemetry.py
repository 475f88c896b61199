"""The dashboard's data from records of known shape: rings that say what a slow reader missed,
the actor table's rates and percentiles, edges, a request's hops (by its OpenAI id too), and a
Chrome trace whose flows pair and whose processes carry their pids."""
from __future__ import annotations

import collections

from actors.frontend.telemetry import TelemetryWindow
from actors.runtime.system import Cursor, TelemetryChunk
from actors.runtime.tracing import ActorStats, Ring, SpanRecord, StepRecord, to_chrome_trace

MS = 1_000_000
T0 = 5_000_000 * MS


def span(span_id: int, parent: int, node: str, actor: str, msg_type: str, start_ms: float, run_ms: float,
         wait_ms: float = 0.0, links: tuple[str, ...] = (), sender: str = "") -> SpanRecord:
    start = T0 + int(start_ms * MS)
    return SpanRecord(1, span_id, parent, span_id, node, actor, msg_type, start - int(wait_ms * MS), start,
                      start + int(run_ms * MS), 0, "ok", 0, links, sender)


def request_spans(rid: str) -> list[SpanRecord]:
    return [span(1, 0, "frontend", "http", "POST /v1/completions", 0, 50, links=(rid,), sender="client"),
            span(2, 1, "frontend", "http", "receive", 0, 3, links=(rid,)),
            span(3, 1, "frontend", "tokenizer", "Generate", 1, 1, 0.1, (rid,), "frontend/http"),
            span(4, 3, "engine", "scheduler", "AddRequest", 2.5, 0.1, 0.2, (rid,), "frontend/tokenizer"),
            span(5, 0, "engine", "scheduler", "Step", 4, 20, 0.1, (rid, "other"), "engine/scheduler"),
            span(6, 5, "worker0", "worker", "SchedulerOutput", 5, 18, 0.1, (rid, "other"), "engine/executor"),
            span(7, 5, "frontend", "detokenizer", "EngineCoreOutputs", 25, 0.2, 0.1, (rid, "other"), "engine/scheduler")]


ACTORS = {"frontend": {"http", "tokenizer", "detokenizer"}, "engine": {"scheduler"}, "worker0": {"worker"}}


def chunk(spans: list[SpanRecord], handled: int = 10, busy_ns: int = 0, steps=()) -> TelemetryChunk:
    by_node = collections.defaultdict(list)
    for r in spans:
        by_node[r.node].append(r)
    pids = {"frontend": 100, "engine": 200, "worker0": 300}
    kids = [TelemetryChunk(n, pids[n], by_node[n], list(steps) if n == "engine" else [],
                           [ActorStats(a, 0, 2, handled, busy_ns, 0, 0) for a in ACTORS[n]],
                           Cursor(len(by_node[n]), 0)) for n in ("engine", "worker0")]
    return TelemetryChunk("frontend", pids["frontend"], by_node["frontend"], [],
                          [ActorStats(a, 0, 1, handled, busy_ns, 0, 0) for a in ACTORS["frontend"]],
                          Cursor(), 0, kids)


def test_a_ring_gives_what_came_since_a_cursor_and_counts_what_was_overwritten():
    ring = Ring(4)
    for i in range(10):
        ring.append(i)
    assert ring.since(8) == ([8, 9], 0)
    assert ring.since(3) == ([6, 7, 8, 9], 3)          # 3, 4, 5 were overwritten
    assert ring.since(6, limit=2) == ([8, 9], 2)       # the newest two of four
    assert ring.since(99) == ([6, 7, 8, 9], 6)         # a cursor of an earlier process: from the start


def test_the_actor_table_has_every_process_and_its_rates_come_from_the_counters():
    w = TelemetryWindow()
    spans = request_spans("req-1")
    w.ingest(chunk(spans, handled=10, busy_ns=0), now=T0)
    w.ingest(chunk([], handled=30, busy_ns=500 * MS), now=T0 + 2000 * MS)
    view = w.actors_view(now=T0 + 2000 * MS)
    assert {(p["node"], p["pid"]) for p in view["processes"]} == {("frontend", 100), ("engine", 200), ("worker0", 300)}
    rows = {(a["node"], a["actor"]): a for a in view["actors"]}
    sched = rows[("engine", "scheduler")]
    assert sched["msgs_per_s"] == 10.0 and sched["utilisation"] == 0.25      # 20 msgs, 0.5 s busy in 2 s
    assert sched["handler_p99_ms"] == 20.0 and sched["health"] == "ok"
    assert {t["msg_type"] for t in sched["by_type"]} == {"AddRequest", "Step"}
    edges = {(e["src"], e["dst"]) for e in view["edges"]}
    assert ("frontend/tokenizer", "engine/scheduler") in edges and ("engine/executor", "worker0/worker") in edges


def test_a_restarted_process_is_counted_and_its_actors_start_again():
    w = TelemetryWindow()
    w.ingest(chunk(request_spans("req-1")), now=T0)
    again = chunk([])
    again.children[1].pid = 301
    w.ingest(again, now=T0 + MS)
    worker = next(p for p in w.actors_view(now=T0 + MS)["processes"] if p["node"] == "worker0")
    assert worker["pid"] == 301 and worker["restarts"] == 1


def test_a_requests_hops_come_in_time_order_with_its_queue_wait_by_any_of_its_ids():
    w = TelemetryWindow()
    w.ingest(chunk(request_spans("req-7") + request_spans("req-8-0")), now=T0)
    for rid in ("req-7", "cmpl-req-7", "chatcmpl-req-7"):
        hops = w.request_view(rid)["hops"]
        names = [h["name"] for h in hops]
        assert names[:4] == ["http.request", "http.receive", "tokenize", "schedule.add"], names
        assert names.index("queue") < names.index("step") < names.index("forward") < names.index("detokenize")
        assert [h["start_ms"] for h in hops] == sorted(h["start_ms"] for h in hops)
    assert w.request_view("cmpl-req-8")["requests"] == ["req-8-0"]             # n choices: {id}-{index}
    assert w.request_view("req-9") is None
    assert w.requests_view()["requests"][0]["id"] == "req-8-0"
    status = {r["id"]: r["status"] for r in w.requests_view()["requests"]}
    assert status["req-7"] == status["req-8-0"] == "finished" and status["other"] == "running"


def test_the_chrome_trace_pairs_every_flow_and_names_each_process_by_its_pid():
    spans = request_spans("req-1")
    steps = [("engine", StepRecord(1, T0 + 4 * MS, T0 + 24 * MS, 0, 1, 1, {"forward": 18.0}))]
    trace = to_chrome_trace(spans, {"frontend": 100, "engine": 200, "worker0": 300}, steps, ["req-1"])
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "pid"} <= set(e) and isinstance(e["pid"], int)
        if e["ph"] != "M":
            assert isinstance(e["ts"], float) and "name" in e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and "tid" in e
    flows = collections.defaultdict(list)
    for e in events:
        if e["ph"] in "sf":
            flows[e["id"]].append(e["ph"])
    assert flows and all(sorted(v) == ["f", "s"] for v in flows.values())
    names = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"frontend": 100, "engine": 200, "worker0": 300}
    assert [e["ph"] for e in events if e.get("cat") == "request"] == ["b", "e"]
    assert any(e["ph"] == "X" and e.get("cat") == "step" for e in events)
