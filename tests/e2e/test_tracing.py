"""Tracing on the real server (three processes): the actor table names every process's actors
with their real pids; a request's hops, found by its response id, run from its arrival through
tokenizing, the queue, the engine steps, the worker and the detokenizer to the chunks sent; the
Chrome trace is valid trace-event JSON whose flows pair; the debug views need the API key;
killing the worker leaves a flight-recorder file that loads as a trace."""
from __future__ import annotations

import collections
import glob
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from server import ROOT, Server

pytestmark = pytest.mark.slow

KEY = "trace-secret"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def flight_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("flight"))


@pytest.fixture(scope="module")
def collector():
    """An OTLP trace collector (gRPC, OpenTelemetry's own protocol definitions) on a free port: the
    spans it was sent."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    spans: list = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            for rs in request.resource_spans:
                resource = {a.key: a.value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    spans.extend((resource, span) for span in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"http://127.0.0.1:{port}", spans
    grpc_server.stop(grace=None)


@pytest.fixture(scope="module")
def server(flight_dir, collector):
    s = Server("--api-key", KEY, "--flight-recorder-dir", flight_dir, "--otlp-traces-endpoint", collector[0],
               "--collect-detailed-traces", "all", env={"OTEL_BSP_SCHEDULE_DELAY": "100"})        # spans leave within 0.1 s of their end
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def streamed(client):
    """A streamed completion: its response id and the X-Request-Id header it came with."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Trace me, please:", max_tokens=6,
                                                      temperature=0, stream=True)
    chunks = list(raw.parse())
    return chunks[0].id, raw.headers["X-Request-Id"]


def get(server, path: str, key: str | None = KEY) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(server.url + path, headers=headers), timeout=60) as resp:
        return json.loads(resp.read())


def test_the_actor_table_has_every_processs_actors_with_their_pids_and_the_edges_between(server, streamed):
    view = get(server, "/debug/actors")
    pids = {p["node"]: p["pid"] for p in view["processes"]}
    assert set(pids) == {"frontend", "engine", "worker0"} and len(set(pids.values())) == 3
    assert pids["frontend"] == server.proc.pid
    actors = {(a["node"], a["actor"]): a for a in view["actors"]}
    for key in [("frontend", "tokenizer"), ("frontend", "detokenizer"), ("frontend", "http"),
                ("engine", "scheduler"), ("engine", "executor"), ("engine", "kv_manager"), ("worker0", "worker")]:
        assert key in actors, key
        assert actors[key]["pid"] == pids[key[0]]
    assert actors[("engine", "scheduler")]["handled"] > 0
    assert actors[("worker0", "worker")]["by_type"][0]["handler_p99_ms"] > 0
    edges = {(e["src"], e["dst"]) for e in view["edges"]}
    assert {("frontend/http", "frontend/tokenizer"), ("frontend/tokenizer", "engine/scheduler"),
            ("engine/executor", "worker0/worker"), ("engine/scheduler", "frontend/detokenizer")} <= edges


def test_a_requests_hops_by_its_response_id_run_from_arrival_to_the_last_chunk(server, streamed):
    response_id, header_id = streamed
    assert header_id == response_id and response_id.startswith("cmpl-")
    view = get(server, f"/debug/requests/{response_id}")
    names = [h["name"] for h in view["hops"]]
    assert [h["start_ms"] for h in view["hops"]] == sorted(h["start_ms"] for h in view["hops"])
    for earlier, later in [("http.receive", "tokenize"), ("tokenize", "schedule.add"), ("schedule.add", "queue"),
                           ("queue", "step"), ("step", "forward"), ("forward", "detokenize"),
                           ("detokenize", "http.chunk")]:
        assert names.index(earlier) < names.index(later), names
    assert names.count("forward") >= 6 and names.count("http.chunk") >= 6      # each step, each chunk
    assert {h["node"] for h in view["hops"]} == {"frontend", "engine", "worker0"}
    recent = get(server, "/debug/requests")["requests"]
    assert view["request_id"] in [r["id"] for r in recent]


def test_the_trace_is_valid_trace_event_json_whose_flows_pair_and_processes_carry_their_pids(server, streamed, tmp_path):
    pids = {p["node"]: p["pid"] for p in get(server, "/debug/actors")["processes"]}
    for path in ("/debug/trace?seconds=60", f"/debug/trace?request_id={streamed[0]}"):
        events = get(server, path)["traceEvents"]
        flows = collections.defaultdict(list)
        for e in events:
            assert e["ph"] in "XCsfbeM" and isinstance(e["pid"], int) and isinstance(e["name"], str)
            if e["ph"] != "M":
                assert isinstance(e["ts"], (int, float))
            if e["ph"] == "X":
                assert e["dur"] >= 0 and isinstance(e["tid"], int)
            if e["ph"] == "C":
                assert all(isinstance(v, (int, float)) for v in e["args"].values())
            if e["ph"] in "sf":
                flows[e["id"]].append(e["ph"])
        assert flows and all(sorted(phases) == ["f", "s"] for phases in flows.values())
        named = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
        assert named == pids
    out = tmp_path / "trace.json"
    cli = subprocess.run([sys.executable, "-m", "tools.trace", server.url, "-o", str(out), "--request-id",
                          streamed[0], "--api-key", KEY], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert any(e.get("cat") == "request" for e in json.loads(out.read_text())["traceEvents"])


def test_the_debug_views_need_the_api_key_and_bad_queries_are_400s(server):
    for path in ("/debug/actors", "/debug/trace", "/debug/requests"):
        with pytest.raises(urllib.error.HTTPError) as e:
            get(server, path, key=None)
        assert e.value.code == 401
    for path, code in (("/debug/trace?seconds=abc", 400), ("/debug/trace?seconds=100000", 400),
                       ("/debug/requests/cmpl-nope", 404)):
        with pytest.raises(urllib.error.HTTPError) as e:
            get(server, path)
        assert e.value.code == code


def test_the_live_stream_sends_updates_about_once_a_second(server):
    req = urllib.request.Request(server.url + "/debug/live", headers={"Authorization": f"Bearer {KEY}"})
    events, t0 = [], time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as resp:
        for line in resp:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break
    assert time.monotonic() - t0 > 1.5      # paced by the server, not a tight loop (no upper bound:
                                            # a loaded machine is slow, the read has its timeout)
    assert all({"actors", "steps", "requests"} <= set(e) for e in events)
    assert events[-1]["actors"]["processes"]


def test_each_request_is_an_opentelemetry_span_in_its_callers_trace(server, collector):
    """vLLM's --otlp-traces-endpoint: a finished request is an llm_request span (a server span with
    vLLM's gen_ai attributes, with --collect-detailed-traces its time in the model) sent to the collector; with a traceparent header it is the caller's
    span's child in the caller's trace, without one the root of a trace of its own."""
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    answers = []
    for headers in ({"traceparent": f"00-{trace_id}-{parent_id}-01"}, {}):
        req = urllib.request.Request(server.url + "/v1/completions", method="POST", data=json.dumps(
            {"model": MODEL, "prompt": "Span me:", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
             "top_p": 0.5}).encode(), headers={"Content-Type": "application/json",
                                               "Authorization": f"Bearer {KEY}", **headers})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answers.append(json.loads(resp.read()))
    _, spans = collector
    deadline = time.monotonic() + 20
    while len([s for _, s in spans if s.attributes]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    found = {}
    for resource, span in spans:
        attrs = {a.key: a.value for a in span.attributes}
        found[attrs["gen_ai.request.id"].string_value] = (resource, span, attrs)
    assert len(found) >= 2, spans
    children = [v for v in found.values() if v[1].trace_id.hex() == trace_id]
    (resource, span, attrs), = children
    assert span.name == "llm_request" and span.kind == 2          # SPAN_KIND_SERVER
    assert span.parent_span_id.hex() == parent_id
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == answers[0]["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 5
    assert attrs["gen_ai.request.max_tokens"].int_value == 5
    assert attrs["gen_ai.request.top_p"].double_value == 0.5
    assert "gen_ai.request.temperature" not in attrs             # vLLM's: only when not 0
    assert attrs["gen_ai.response.model"].string_value == MODEL
    e2e, ttft = attrs["gen_ai.latency.e2e"].double_value, attrs["gen_ai.latency.time_to_first_token"].double_value
    assert 0 < ttft <= e2e and abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 - e2e) < 1e-3
    assert resource["vllm.instrumenting_module_name"].string_value == "troupe"
    # --collect-detailed-traces all: its seconds in the model's forward passes, within the workers' steps
    forward = attrs["gen_ai.latency.time_in_model_forward"].double_value
    execute = attrs["gen_ai.latency.time_in_model_execute"].double_value
    assert 0 < forward <= execute <= e2e
    roots = [v for v in found.values() if v[1].trace_id.hex() != trace_id]
    assert roots and all(not v[1].parent_span_id for v in roots)


def test_killing_the_worker_leaves_a_flight_record_that_loads_as_a_trace(server, client, flight_dir):
    client.completions.create(model=MODEL, prompt="Warm", max_tokens=4)
    worker = next(p["pid"] for p in get(server, "/debug/actors")["processes"] if p["node"] == "worker0")
    deadline = time.monotonic() + 30      # until a collection brought the worker's spans up (through the engine)
    while not any(e["ph"] == "X" and e["pid"] == worker for e in get(server, "/debug/trace?seconds=60")["traceEvents"]):
        assert time.monotonic() < deadline, "the worker's spans never reached the frontend"
        time.sleep(0.2)
    os.kill(worker, 9)
    deadline = time.monotonic() + 30
    while not glob.glob(os.path.join(flight_dir, f"worker0-{worker}-*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    files = glob.glob(os.path.join(flight_dir, f"worker0-{worker}-*.json"))
    assert files, "no flight-recorder file"
    trace = json.load(open(files[0]))
    assert trace["metadata"]["pid"] == worker and "SIGKILL" in trace["metadata"]["reason"]
    assert any(e["ph"] == "X" and e["pid"] == worker for e in trace["traceEvents"])
    assert any(files[0] in line for line in server.lines), "the log says where the file is"
    # the replacement worker serves again
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if client.completions.create(model=MODEL, prompt="Again", max_tokens=2).choices[0].text is not None:
                break
        except openai.APIError:
            time.sleep(1)
