"""vLLM's OpenTelemetry tracing (``--otlp-traces-endpoint``): each finished request becomes one
``llm_request`` span, exported over OTLP to a collector (Jaeger, Tempo, an OpenTelemetry
Collector), with vLLM's span name, kind and attributes (``gen_ai.*``: the request's id, sizes
and sampling, its time in the queue, to the first token, in prefill, decode and inference, end
to end). A request that came with W3C trace context (``traceparent``, ``tracestate`` headers)
gets its span in that trace, under the caller's span.

The exporter speaks gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says ``http/protobuf``
(vLLM's rule); the other OpenTelemetry variables (``OTEL_BSP_SCHEDULE_DELAY``,
``OTEL_SERVICE_NAME``, ...) apply as they do anywhere. Spans leave in batches from a thread of
the SDK's, never from the event loop. The packages are optional: ``pip install troupe[otel]``."""
from __future__ import annotations

import contextvars
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("troupe.otel")

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
SHUTDOWN_S = 5.0          # the most a stop waits for the last spans to reach the collector
INSTALL = "pip install 'troupe[otel]'"

# The W3C trace context of the HTTP request being answered (set by the server for each request;
# read when its engine requests are admitted).
request_trace_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "request_trace_headers", default=None)


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The trace context among ``headers`` (None: none)."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


def check_available(endpoint: str) -> None:
    """ValueError naming what to install when the OpenTelemetry packages are not there, or the
    protocol asked for is not one the exporters speak."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"Unsupported OTLP protocol '{protocol}' is configured ({PROTOCOL_ENV}: grpc or "
                         "http/protobuf)")
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if protocol == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    try:
        __import__("opentelemetry.sdk.trace")
        __import__(module)
    except ImportError as exc:
        raise ValueError(f"OpenTelemetry is not available, so --otlp-traces-endpoint {endpoint} cannot be "
                         f"served ({exc}); install it: {INSTALL}") from None


class Attr:
    """vLLM's span attribute names (OpenTelemetry's gen_ai conventions and vLLM's own)."""
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_N = "gen_ai.request.n"
    RESPONSE_MODEL = "gen_ai.response.model"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


class RequestTracer:
    """The process's tracer provider with its OTLP exporter, and the span of each request."""

    def __init__(self, endpoint: str, model: str, forward_time: bool = False, execute_time: bool = False) -> None:
        """``forward_time``, ``execute_time`` (--collect-detailed-traces model, worker): spans
        also hold the request's seconds in the model's forward passes, in the workers' steps."""
        check_available(endpoint)
        self.forward_time, self.execute_time = forward_time, execute_time
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        if os.environ.get(PROTOCOL_ENV, "grpc") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=endpoint)
        self.endpoint = endpoint
        self.model = model
        self.provider = TracerProvider(resource=Resource.create({
            "vllm.instrumenting_module_name": "troupe", "vllm.process_id": str(os.getpid())}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("troupe")
        self.kind = SpanKind.SERVER
        self.propagator = TraceContextTextMapPropagator()

    def request_finished(self, *, request_id: str, arrival_time: float, scheduled_time: float,
                         first_token_time: float, last_token_time: float, now: float, num_prompt_tokens: int,
                         num_generation_tokens: int, params: Any, n: int,
                         headers: dict[str, str] | None,
                         model_times: tuple[float, float] | None = None) -> None:
        """One finished request's span, from its arrival to now (times: time.time(); 0.0: the
        request never reached that phase). ``model_times``: its seconds in the model's forward
        passes and in the workers' steps (--collect-detailed-traces)."""
        scheduled = scheduled_time or arrival_time
        first = first_token_time or now
        last = last_token_time or first
        attributes: dict[str, Any] = {
            Attr.REQUEST_ID: request_id, Attr.RESPONSE_MODEL: self.model,
            Attr.USAGE_PROMPT_TOKENS: num_prompt_tokens, Attr.USAGE_COMPLETION_TOKENS: num_generation_tokens,
            Attr.LATENCY_E2E: now - arrival_time, Attr.LATENCY_TIME_IN_QUEUE: max(scheduled - arrival_time, 0.0),
            Attr.LATENCY_TIME_IN_MODEL_PREFILL: max(first - scheduled, 0.0),
            Attr.LATENCY_TIME_IN_MODEL_DECODE: max(last - first, 0.0),
            Attr.LATENCY_TIME_IN_MODEL_INFERENCE: max(last - scheduled, 0.0),
        }
        if first_token_time:
            attributes[Attr.LATENCY_TIME_TO_FIRST_TOKEN] = first_token_time - arrival_time
        if self.forward_time:
            attributes[Attr.LATENCY_TIME_IN_MODEL_FORWARD] = model_times[0] if model_times else 0.0
        if self.execute_time:
            attributes[Attr.LATENCY_TIME_IN_MODEL_EXECUTE] = model_times[1] if model_times else 0.0
        if params is not None:
            if params.top_p:
                attributes[Attr.REQUEST_TOP_P] = params.top_p
            if params.max_tokens:
                attributes[Attr.REQUEST_MAX_TOKENS] = params.max_tokens
            if params.temperature:
                attributes[Attr.REQUEST_TEMPERATURE] = params.temperature
        if n:
            attributes[Attr.REQUEST_N] = n
        context = self.propagator.extract(headers) if headers else None
        span = self.tracer.start_span(SPAN_NAME, context=context, kind=self.kind, attributes=attributes,
                                      start_time=int(arrival_time * 1e9))
        span.end(end_time=int(now * 1e9))

    def shutdown(self, timeout: float = SHUTDOWN_S) -> None:
        """Export what is still batched, then stop the exporter; at most ``timeout`` seconds (a
        collector that is gone makes the exporter retry for longer: its spans are dropped)."""
        def stop() -> None:
            try:
                self.provider.shutdown()
            except Exception:           # a collector that went away must not fail the stop
                log.warning("the OTLP exporter did not shut down cleanly", exc_info=True)
        thread = threading.Thread(target=stop, name="otel-shutdown", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the OTLP collector at %s did not take the last spans within %g s; they are dropped",
                        self.endpoint, timeout)
