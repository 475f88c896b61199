"""vLLM's OpenTelemetry tracing, the exporter side: with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
http/protobuf a request's span reaches an OTLP/HTTP collector with vLLM's name and attributes and
its caller's trace context; a protocol the exporters do not speak is refused, naming it; a stop
does not wait long for a collector that is gone."""
from __future__ import annotations

import http.server
import threading
import time

import pytest

from actors.engine.sampling_params import SamplingParams
from actors.runtime import otel


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self):
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_span_reaches_an_otlp_http_collector_with_vllms_attributes(monkeypatch):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    monkeypatch.setenv(otel.PROTOCOL_ENV, "http/protobuf")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tracer = otel.RequestTracer(f"http://127.0.0.1:{server.server_port}/v1/traces", "my-model")
        now = time.time()
        tracer.request_finished(
            request_id="req-1", arrival_time=now - 2.0, scheduled_time=now - 1.5, first_token_time=now - 1.0,
            last_token_time=now - 0.1, now=now, num_prompt_tokens=7, num_generation_tokens=9,
            params=SamplingParams(max_tokens=9, temperature=0.7, top_p=1.0), n=1,
            headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
        tracer.shutdown()
    finally:
        server.shutdown()
    spans = []
    for body in _Collector.bodies:
        req = ExportTraceServiceRequest.FromString(body)
        spans += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    (span,) = spans
    attrs = {a.key: a.value for a in span.attributes}
    assert span.name == "llm_request" and span.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.parent_span_id.hex() == "00f067aa0ba902b7"
    assert attrs["gen_ai.request.id"].string_value == "req-1"
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == 7 and attrs["gen_ai.usage.completion_tokens"].int_value == 9
    assert attrs["gen_ai.latency.time_in_queue"].double_value == pytest.approx(0.5, abs=1e-6)
    assert attrs["gen_ai.latency.time_to_first_token"].double_value == pytest.approx(1.0, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_model_prefill"].double_value == pytest.approx(0.5, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_model_decode"].double_value == pytest.approx(0.9, abs=1e-6)
    assert attrs["gen_ai.latency.e2e"].double_value == pytest.approx(2.0, abs=1e-6)
    assert attrs["gen_ai.request.temperature"].double_value == pytest.approx(0.7)
    assert (span.end_time_unix_nano - span.start_time_unix_nano) == pytest.approx(2e9, abs=1e3)


def test_an_unknown_protocol_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(otel.PROTOCOL_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match="Unsupported OTLP protocol 'carrier-pigeon'"):
        otel.check_available("http://127.0.0.1:4317")


def test_a_stop_waits_briefly_for_a_collector_that_is_gone():
    tracer = otel.RequestTracer("http://127.0.0.1:9", "m")      # nothing listens there
    now = time.time()
    tracer.request_finished(request_id="r", arrival_time=now - 1, scheduled_time=0.0, first_token_time=0.0,
                            last_token_time=0.0, now=now, num_prompt_tokens=1, num_generation_tokens=0,
                            params=None, n=1, headers=None)
    t0 = time.monotonic()
    tracer.shutdown(timeout=1.0)
    assert time.monotonic() - t0 < 3.0
