"""Engine and request statistics as the frontend sees them, rendered as Prometheus text.

Names follow vLLM's (``vllm:`` becomes ``troupe:``): gauges of the last engine step, counters
since start, and latency histograms observed by the Detokenizer as outputs arrive."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.engine.messages import SchedulerStats

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram: per-bucket counts (the last is +Inf), their sum and count."""
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip((*self.buckets, "+Inf"), self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        return out + [f"{name}_sum{{{labels}}} {self.sum:.6f}", f"{name}_count{{{labels}}} {cumulative}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(slots=True)
class EngineStats:
    model: str = ""
    last: SchedulerStats = field(default_factory=SchedulerStats)
    steps: int = 0
    max_batch_size: int = 0                     # most requests served by one step so far
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))
    step_tokens: Histogram = field(default_factory=lambda: Histogram(STEP_TOKEN_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)   # by finish reason
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    request_queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    started_at: float = field(default_factory=time.time)
    kv_cache: dict = field(default_factory=dict)  # dtype, blocks, block size, tokens, scales (the resolved config)

    def observe_step(self, s: SchedulerStats) -> None:
        self.last = s
        if s.num_scheduled_reqs == 0:
            return
        self.steps += 1
        self.max_batch_size = max(self.max_batch_size, s.num_scheduled_reqs)
        self.batch_size.observe(s.num_scheduled_reqs)
        self.step_tokens.observe(s.num_scheduled_tokens)

    def observe_finished(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def as_dict(self) -> dict:
        s = self.last
        return {"model": self.model, "steps": self.steps, "max_batch_size": self.max_batch_size,
                "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage, "num_preemptions": s.num_preemptions,
                "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                "busy_seconds": round(s.busy_seconds, 3), "compute_seconds": round(s.compute_seconds, 3),
                "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                "requests_finished": dict(self.requests_finished), "kv_cache": dict(self.kv_cache)}

    def prometheus(self) -> str:
        s, m = self.last, f'model_name="{_escape(self.model)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP troupe:{name} {help_}", f"# TYPE troupe:{name} {kind}", *samples])

        def scalar(name: str, kind: str, help_: str, value: float | int) -> None:
            metric(name, kind, help_, [f"troupe:{name}{{{m}}} {value}"])

        def histogram(name: str, help_: str, h: Histogram) -> None:
            metric(name, "histogram", help_, h.lines(f"troupe:{name}", m))

        scalar("num_requests_running", "gauge", "Requests in the running batch.", s.num_running)
        scalar("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", s.num_waiting)
        scalar("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (1 = full).",
               f"{s.kv_cache_usage:.6f}")
        scalar("num_preemptions_total", "counter", "Requests preempted since start.", s.num_preemptions)
        scalar("prefix_cache_queries_total", "counter",
               "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        scalar("prefix_cache_hits_total", "counter",
               "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        scalar("prompt_tokens_total", "counter", "Prompt tokens received.", self.prompt_tokens)
        scalar("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
        metric("request_success_total", "counter",
               "Finished requests by finish reason (stop, length, abort, error).",
               [f'troupe:request_success_total{{{m},finished_reason="{_escape(r)}"}} {n}'
                for r, n in sorted(self.requests_finished.items())])
        histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.",
                  self.time_to_first_token)
        histogram("inter_token_latency_seconds", "Time between successive outputs of a request.",
                  self.inter_token_latency)
        histogram("e2e_request_latency_seconds", "Time from arrival to the last output.",
                  self.e2e_request_latency)
        histogram("request_queue_time_seconds",
                  "Time from arrival to the first scheduling in the engine.", self.request_queue_time)
        scalar("max_batch_size", "gauge", "Most requests served by one engine step.", self.max_batch_size)
        histogram("batch_size", "Requests served per engine step.", self.batch_size)
        histogram("iteration_tokens_total", "Tokens scheduled per engine step.", self.step_tokens)
        scalar("engine_busy_seconds_total", "counter",
               "Wall time of back-to-back engine step cycles.", f"{s.busy_seconds:.6f}")
        scalar("engine_compute_seconds_total", "counter",
               "Of that, model forward and sampling (the rest is engine overhead).",
               f"{s.compute_seconds:.6f}")
        return "\n".join(lines) + "\n"
