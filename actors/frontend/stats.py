"""Engine and request statistics as the frontend sees them, rendered as Prometheus text.

Names, types and labels are vLLM's (vLLM v1's ``vllm/v1/metrics/loggers.py``): gauges of the last
engine step, counters since start, and histograms of requests observed by the Detokenizer as
their outputs arrive. ``METRICS`` is the one list of what /metrics shows: each metric vLLM has is
written under the ``vllm:`` prefix (so dashboards made for vLLM work unchanged) and under
``troupe:``; Troupe's own metrics under ``troupe:`` only. --metrics-prefix picks the prefixes."""
from __future__ import annotations

import contextlib
import copy
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import msgspec

from actors.engine.messages import SchedulerStats

PREFIXES = ("vllm", "troupe")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
KV_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120,
                        300, 600, 1200, 1800)     # vLLM's: millisecond reuse gaps to half-hour lifetimes
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")     # counted from 0, as vLLM does
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


@dataclass(frozen=True, slots=True)
class Metric:
    name: str            # as scraped, after the prefix (counters end in _total, as vLLM's do)
    kind: str            # "counter" | "gauge" | "histogram"
    help: str
    vllm: bool = True    # vLLM has it (written under vllm: too); False: Troupe's own
    labels: str = ""     # labels beside model_name and engine


METRICS: tuple[Metric, ...] = (
    Metric("num_requests_running", "gauge", "Requests in the running batch."),
    Metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    Metric("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (1 = full)."),
    Metric("engine_sleep_state", "gauge", "Engine sleep state: awake, weights_offloaded (level 1) or "
           "discard_all (level 2) is 1 (all 0: paused, level 0).", labels="sleep_state"),
    Metric("cache_config_info", "gauge", "The KV cache's configuration, as labels (value 1).",
           labels="block_size, cache_dtype, enable_prefix_caching, gpu_memory_utilization, "
                  "num_gpu_blocks (no model_name)"),
    Metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache."),
    Metric("prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache."),
    Metric("external_prefix_cache_queries_total", "counter",
           "Prompt tokens looked up in another instance's cache (a KV connector)."),
    Metric("external_prefix_cache_hits_total", "counter",
           "Prompt tokens whose KV was loaded from another instance (a KV connector)."),
    Metric("num_preemptions_total", "counter", "Requests preempted since start."),
    Metric("mm_cache_queries_total", "counter", "Multi-modal cache queries, in terms of number of queried items "
           "(images looked up in the processor cache)."),
    Metric("mm_cache_hits_total", "counter", "Multi-modal cache hits, in terms of number of cached items."),
    Metric("spec_decode_num_drafts_total", "counter", "Requests verified with draft tokens, once per step."),
    Metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified."),
    Metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted."),
    Metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Draft tokens accepted at each draft position (0: the first).", labels="position"),
    Metric("estimated_flops_per_gpu_total", "counter", "Estimated floating-point operations per device (for Model "
           "FLOPs Utilization); only with --enable-mfu-metrics."),
    Metric("estimated_read_bytes_per_gpu_total", "counter", "Estimated bytes read from memory per device; only "
           "with --enable-mfu-metrics."),
    Metric("estimated_write_bytes_per_gpu_total", "counter", "Estimated bytes written to memory per device; "
           "only with --enable-mfu-metrics."),
    Metric("prompt_tokens_total", "counter", "Prompt tokens received."),
    Metric("generation_tokens_total", "counter", "Tokens generated."),
    Metric("watermark_requests_total", "counter", "Finished requests by watermark status: watermarked, "
           "skipped (asked for it and could not have it: greedy, beam search) or not_watermarked (opted out); "
           "only with --watermark-config.", labels="status"),
    Metric("request_success_total", "counter", "Finished requests by finish reason (stop, length, abort, "
           "error).", labels="finished_reason"),
    Metric("request_prompt_tokens", "histogram", "Prompt tokens of each finished request."),
    Metric("request_generation_tokens", "histogram", "Tokens generated by each finished request."),
    Metric("request_max_num_generation_tokens", "histogram",
           "Most tokens generated by one choice of each finished request (its n choices)."),
    Metric("request_params_n", "histogram", "The n parameter of each finished request."),
    Metric("request_params_max_tokens", "histogram",
           "The max_tokens of each finished request (unset: what the context left)."),
    Metric("iteration_tokens_total", "histogram", "Tokens scheduled per engine step."),
    Metric("time_to_first_token_seconds", "histogram", "Time from arrival to the first generated token."),
    Metric("inter_token_latency_seconds", "histogram", "Time between successive outputs of a request."),
    Metric("time_per_output_token_seconds", "histogram",
           "The same as inter_token_latency_seconds (vLLM's older name for it)."),
    Metric("request_time_per_output_token_seconds", "histogram",
           "Each finished request's decode time over its generated tokens but the first."),
    Metric("e2e_request_latency_seconds", "histogram", "Time from arrival to the last output."),
    Metric("request_queue_time_seconds", "histogram",
           "Time from arrival to the first scheduling in the engine."),
    Metric("request_prefill_time_seconds", "histogram",
           "Time from a request's first scheduling to its first token."),
    Metric("request_decode_time_seconds", "histogram", "Time from a request's first token to its last."),
    Metric("request_inference_time_seconds", "histogram",
           "Time from a request's first scheduling to its last token."),
    Metric("kv_block_lifetime_seconds", "histogram", "KV cache blocks' lifetime from allocation to eviction "
           "(a sample of the blocks: --kv-cache-metrics, --kv-cache-metrics-sample)."),
    Metric("kv_block_idle_before_evict_seconds", "histogram",
           "How long sampled KV cache blocks sat unused before their eviction (--kv-cache-metrics)."),
    Metric("kv_block_reuse_gap_seconds", "histogram",
           "Time between a sampled KV cache block's last prefix-cache reuses (--kv-cache-metrics)."),
    Metric("rl_weight_update_operation_duration_seconds", "histogram", "Duration of one weight-transfer operation.",
           labels="operation"),
    Metric("rl_weight_update_operations_in_flight", "gauge", "Weight-transfer operations currently awaited.",
           labels="operation"),
    Metric("sleep_mode_operation_duration_seconds", "histogram", "Duration of one sleep-mode operation.",
           labels="operation"),
    Metric("sleep_mode_operations_in_flight", "gauge", "Sleep-mode operations currently awaited.",
           labels="operation"),
    Metric("max_batch_size", "gauge", "Most requests served by one engine step.", vllm=False),
    Metric("api_server_requests_total", "counter", "Finished requests by the API server that took them (only with "
           "--api-server-count above 1).", vllm=False, labels="api_server"),
    Metric("api_server_requests_open", "gauge", "Requests each API server has open now (only with "
           "--api-server-count above 1).", vllm=False, labels="api_server"),
    Metric("batch_size", "histogram", "Requests served per engine step.", vllm=False),
    Metric("engine_busy_seconds_total", "counter", "Wall time of back-to-back engine step cycles.", vllm=False),
    Metric("encoder_cache_queries_total", "counter", "Images looked up in the workers' encoder cache (once per "
           "request and image, as its positions are first computed).", vllm=False),
    Metric("encoder_cache_hits_total", "counter", "Of those, images whose embeddings were there (not encoded "
           "again).", vllm=False),
    Metric("engine_compute_seconds_total", "counter",
           "Of that, model forward and sampling (the rest is engine overhead).", vllm=False),
    *(Metric(f"kv_transfer_{name}_total", "counter", help, vllm=False) for name, help in (
        ("recv_bytes", "KV bytes loaded from other instances."),
        ("recv_blocks", "KV blocks loaded from other instances."),
        ("recv_seconds", "Seconds spent loading KV from other instances (handshake, read, copy)."),
        ("recv_requests", "Requests whose prompt KV was loaded from another instance."),
        ("recv_failures", "KV loads that failed (the prompt is computed here instead)."),
        ("sent_bytes", "KV bytes read by other instances."),
        ("sent_blocks", "KV blocks read by other instances."),
        ("sent_requests", "Requests whose KV another instance read."),
        ("leases_expired", "Held KV blocks freed because no reader renewed their lease."),
        ("shm_reads", "KV loads that went through shared memory (same machine)."),
        ("cma_reads", "KV loads copied straight from the producer's cache (same machine, process_vm_readv)."),
        ("nixl_reads", "KV loads read from the producer's cache through NIXL (NixlConnector)."))),
)
VLLM_METRIC_NAMES = tuple(f"vllm:{m.name}" for m in METRICS if m.vllm)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets of token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


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


# vLLM's bucket families (--custom-histogram-buckets) and the histograms each sets
BUCKET_FAMILIES: dict[str, tuple[str, ...]] = {
    "request_latency": ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                        "request_decode_time", "request_inference_time"),
    "time_to_first_token": ("time_to_first_token",),
    "inter_token_latency": ("inter_token_latency", "request_time_per_output_token"),
    "iteration_tokens": ("step_tokens",),
    "request_params_n": ("request_params_n",),
    "request_num_preemptions": (),       # vLLM's family; Troupe counts preemptions engine-wide only
    "request_tokens": ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
                       "request_params_max_tokens"),
    "kv_cache_residency": ("kv_block_lifetime", "kv_block_idle_before_evict", "kv_block_reuse_gap"),
}


def check_histogram_buckets(value: dict[str, list[float]]) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """vLLM's --custom-histogram-buckets checked (its error words): a known family each, a
    non-empty, strictly increasing list of finite bounds above 0."""
    if not isinstance(value, dict):
        raise ValueError("custom_histogram_buckets must be a JSON object of bucket family -> bounds")
    out = []
    for family, buckets in value.items():
        if family not in BUCKET_FAMILIES:
            raise ValueError(f"custom_histogram_buckets: unknown bucket family {family!r}; known families: "
                             f"{sorted(BUCKET_FAMILIES)}")
        if not isinstance(buckets, list) or not buckets:
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bucket list must not be empty")
        for bound in buckets:
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound) or bound <= 0:
                raise ValueError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be finite and "
                                 "greater than 0")
        if any(a >= b for a, b in zip(buckets, buckets[1:])):
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bounds {buckets} must be strictly increasing")
        out.append((family, tuple(buckets)))
    return tuple(out)


OPERATION_BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)     # vLLM's
OPERATION_FAMILIES = ("rl_weight_update", "sleep_mode")


def _hist(buckets: tuple[float, ...]) -> Callable[[], Histogram]:
    return lambda: Histogram(buckets)


@dataclass(slots=True)
class EngineStats:
    model: str = ""
    max_model_len: int = 8192                   # the top of the token-count buckets
    cache_info: dict[str, str] = field(default_factory=dict)   # cache_config_info's labels
    last: SchedulerStats = field(default_factory=SchedulerStats)
    steps: int = 0
    last_progress: float = field(default_factory=time.monotonic)   # the last step that ran tokens
    max_batch_size: int = 0                     # most requests served by one step so far
    batch_size: Histogram = field(default_factory=_hist(BATCH_BUCKETS))
    step_tokens: Histogram = field(default_factory=_hist(STEP_TOKEN_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    mm_cache_queries: int = 0                   # images looked up in this API server's processor cache
    mm_cache_hits: int = 0                      # of those, found there
    requests_finished: dict[str, int] = field(default_factory=dict)   # by finish reason
    time_to_first_token: Histogram = field(default_factory=_hist(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=_hist(ITL_BUCKETS))
    request_time_per_output_token: Histogram = field(default_factory=_hist(ITL_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=_hist(REQUEST_BUCKETS))
    request_queue_time: Histogram = field(default_factory=_hist(REQUEST_BUCKETS))
    request_prefill_time: Histogram = field(default_factory=_hist(REQUEST_BUCKETS))
    request_decode_time: Histogram = field(default_factory=_hist(REQUEST_BUCKETS))
    request_inference_time: Histogram = field(default_factory=_hist(REQUEST_BUCKETS))
    request_params_n: Histogram = field(default_factory=_hist(N_BUCKETS))
    sleep_level: int | None = None               # sleep mode's level (None: awake)
    kv_block_lifetime: Histogram = field(default_factory=_hist(KV_RESIDENCY_BUCKETS))
    kv_block_idle_before_evict: Histogram = field(default_factory=_hist(KV_RESIDENCY_BUCKETS))
    kv_block_reuse_gap: Histogram = field(default_factory=_hist(KV_RESIDENCY_BUCKETS))
    # vLLM's timed control operations, once one ran: (family, operation) -> durations, and calls
    # under way (families rl_weight_update: init, shutdown, start, start_draft, update, finish;
    # sleep_mode: sleep, wake, release_kv_cache_memory)
    operations: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    operations_in_flight: dict[tuple[str, str], int] = field(default_factory=dict)
    # token counts, bucketed up to the context length (set in __post_init__)
    request_prompt_tokens: Histogram = field(init=False)
    request_generation_tokens: Histogram = field(init=False)
    request_max_num_generation_tokens: Histogram = field(init=False)
    request_params_max_tokens: Histogram = field(init=False)
    started_at: float = field(default_factory=time.time)
    engines: dict[int, SchedulerStats] = field(default_factory=dict)   # each engine core's latest
    kv_cache: dict = field(default_factory=dict)  # dtype, blocks, block size, tokens, scales (the resolved config)
    # --custom-histogram-buckets: (family, bounds) pairs replacing those families' buckets
    custom_buckets: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # --watermark-config: finished requests by watermark status (None: no watermark, no metric)
    watermark_requests: dict[str, int] | None = None
    mfu: bool = False                    # --enable-mfu-metrics: the estimated_* counters are shown
    engine: int = 0                      # the rank labelled when one engine core is served (external load balancing: its own)
    api_server: int = 0                  # this API server's index (--api-server-count)
    # with several API servers, in the copy /metrics shows: finished requests by API server
    api_server_requests: dict[int, int] = field(default_factory=dict)
    api_server_open: dict[int, int] = field(default_factory=dict)     # and their requests open now

    def __post_init__(self) -> None:
        buckets = build_1_2_5_buckets(max(self.max_model_len, 1))
        self.request_prompt_tokens = Histogram(buckets)
        self.request_generation_tokens = Histogram(buckets)
        self.request_max_num_generation_tokens = Histogram(buckets)
        self.request_params_max_tokens = Histogram(buckets)
        for family, bounds in self.custom_buckets:
            for name in BUCKET_FAMILIES[family]:
                setattr(self, name, Histogram(tuple(bounds)))

    def observe_step(self, s: SchedulerStats, engine: int = 0) -> None:
        """A step's stats from engine core ``engine``: ``last`` is its, or with several engine
        cores (data parallelism) the sum of every engine's latest (the KV cache usage: their mean)."""
        self.engines[engine] = s
        self.last = s if len(self.engines) == 1 else combine_stats(list(self.engines.values()))
        for lifetime, idle, gaps in s.kv_cache_eviction_events:
            self.kv_block_lifetime.observe(lifetime)
            self.kv_block_idle_before_evict.observe(idle)
            for gap in gaps:
                self.kv_block_reuse_gap.observe(gap)
        if s.num_scheduled_reqs == 0:
            return
        self.steps += 1
        self.last_progress = time.monotonic()
        self.max_batch_size = max(self.max_batch_size, s.num_scheduled_reqs)
        self.batch_size.observe(s.num_scheduled_reqs)
        self.step_tokens.observe(s.num_scheduled_tokens)

    def engine_down(self, engine: int = 0) -> None:
        """Engine core ``engine`` died: it runs and waits for nothing now (its counters stay)."""
        s = self.engines.get(engine)
        if s is None:
            return
        self.engines[engine] = msgspec.structs.replace(s, num_running=0, num_waiting=0, num_scheduled_reqs=0,
                                                       num_scheduled_tokens=0, kv_cache_usage=0.0)
        self.last = (self.engines[engine] if len(self.engines) == 1
                     else combine_stats(list(self.engines.values())))

    def observe_finished(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def observe_request(self, *, num_prompt_tokens: int, num_generation_tokens: int, max_tokens: int | None,
                        arrival_time: float, scheduled_time: float, first_token_time: float,
                        last_token_time: float, now: float) -> None:
        """A request the engine finished: its sizes, its max_tokens (None: the context's rest)
        and the times of its phases (0.0: it never reached that phase)."""
        self.e2e_request_latency.observe(now - arrival_time)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        self.request_params_max_tokens.observe(
            max_tokens if max_tokens is not None else max(self.max_model_len - num_prompt_tokens, 0))
        if first_token_time <= 0.0:
            return
        scheduled = scheduled_time if scheduled_time > 0.0 else arrival_time
        decode = max(last_token_time - first_token_time, 0.0)
        self.request_prefill_time.observe(max(first_token_time - scheduled, 0.0))
        self.request_decode_time.observe(decode)
        self.request_inference_time.observe(max(last_token_time - scheduled, 0.0))
        # vLLM's: the first token is the prefill's, not the decode's
        self.request_time_per_output_token.observe(
            decode / (num_generation_tokens - 1) if num_generation_tokens > 1 else 0.0)

    def observe_choices(self, n: int, max_generation_tokens: int) -> None:
        """A request's n choices all finished; the most tokens one of them generated."""
        self.request_params_n.observe(n)
        self.request_max_num_generation_tokens.observe(max_generation_tokens)

    def as_dict(self) -> dict:
        s = self.last
        return {"model": self.model, "steps": self.steps, "max_batch_size": self.max_batch_size,
                "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage, "num_preemptions": s.num_preemptions,
                "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                "spec_decode": {"num_drafts": s.spec_num_drafts, "num_draft_tokens": s.spec_num_draft_tokens,
                                "num_accepted_tokens": s.spec_num_accepted_tokens,
                                "num_accepted_tokens_per_pos": list(s.spec_num_accepted_tokens_per_pos)},
                "busy_seconds": round(s.busy_seconds, 3), "compute_seconds": round(s.compute_seconds, 3),
                "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                "requests_finished": dict(self.requests_finished), "kv_cache": dict(self.kv_cache)}

    # -- Prometheus text ---------------------------------------------------------------------
    def _samples(self, m: Metric, name: str, labels: str) -> list[str]:
        """The sample lines of metric ``m`` written as ``name``."""
        s = self.last
        scalars = {
            "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
            "kv_cache_usage_perc": f"{s.kv_cache_usage:.6f}", "num_preemptions_total": s.num_preemptions,
            "prefix_cache_queries_total": s.prefix_cache_queries,
            "prefix_cache_hits_total": s.prefix_cache_hits, "prompt_tokens_total": self.prompt_tokens,
            "generation_tokens_total": self.generation_tokens, "max_batch_size": self.max_batch_size,
            "mm_cache_queries_total": self.mm_cache_queries, "mm_cache_hits_total": self.mm_cache_hits,
            "engine_busy_seconds_total": f"{s.busy_seconds:.6f}",
            "encoder_cache_queries_total": s.encoder_cache_queries, "encoder_cache_hits_total": s.encoder_cache_hits,
            "engine_compute_seconds_total": f"{s.compute_seconds:.6f}",
            "spec_decode_num_drafts_total": s.spec_num_drafts,
            "spec_decode_num_draft_tokens_total": s.spec_num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": s.spec_num_accepted_tokens,
            "external_prefix_cache_queries_total": s.external_prefix_cache_queries,
            "external_prefix_cache_hits_total": s.external_prefix_cache_hits,
            "estimated_flops_per_gpu_total": s.estimated_flops,
            "estimated_read_bytes_per_gpu_total": s.estimated_read_bytes,
            "estimated_write_bytes_per_gpu_total": s.estimated_write_bytes,
        }
        if m.name.startswith("kv_transfer_"):
            value = s.kv_transfer.get(m.name.removeprefix("kv_transfer_").removesuffix("_total"), 0)
            return [f"{name}{{{labels}}} {int(value) if float(value).is_integer() else round(value, 6)}"]
        if m.name in PER_ENGINE and len(self.engines) > 1:    # data parallelism: one sample per engine core
            return [f"{name}{{{_engine_label(labels, e)}}} {PER_ENGINE[m.name](es)}"
                    for e, es in sorted(self.engines.items())]
        if m.name in scalars:
            return [f"{name}{{{labels}}} {scalars[m.name]}"]
        if m.name.startswith("api_server_requests_"):
            counts = self.api_server_requests if m.name.endswith("_total") else self.api_server_open
            return [f'{name}{{{labels},api_server="{i}"}} {n}' for i, n in sorted(counts.items())]
        if m.name == "watermark_requests_total":
            return [f'{name}{{{labels},status="{s}"}} {n}' for s, n in (self.watermark_requests or {}).items()]
        if m.name.startswith(OPERATION_FAMILIES):
            family = m.name.removesuffix("_operation_duration_seconds").removesuffix("_operations_in_flight")
            if m.kind == "histogram":
                return [line for (f, op), h in sorted(self.operations.items()) if f == family
                        for line in h.lines(name, f'{labels},operation="{op}"')]
            return [f'{name}{{{labels},operation="{op}"}} {n}'
                    for (f, op), n in sorted(self.operations_in_flight.items()) if f == family]
        if m.name == "request_success_total":
            counts = dict.fromkeys(FINISH_REASONS, 0) | self.requests_finished
            return [f'{name}{{{labels},finished_reason="{_escape(r)}"}} {n}' for r, n in counts.items()]
        if m.name == "spec_decode_num_accepted_tokens_per_pos_total":
            return [f'{name}{{{labels},position="{pos}"}} {n}'
                    for pos, n in enumerate(s.spec_num_accepted_tokens_per_pos)]
        if m.name == "engine_sleep_state":
            now = "awake" if self.sleep_level is None else SLEEP_STATES[self.sleep_level] if self.sleep_level else ""
            return [f'{name}{{{labels},sleep_state="{state}"}} {int(state == now)}' for state in SLEEP_STATES]
        if m.name == "cache_config_info":
            info = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(self.cache_info.items()))
            return [f'{name}{{{info + "," if info else ""}engine="{self.engine}"}} 1']
        return self._histogram(m.name).lines(name, labels)

    def _histogram(self, name: str) -> Histogram:
        return {
            "request_prompt_tokens": self.request_prompt_tokens,
            "request_generation_tokens": self.request_generation_tokens,
            "request_max_num_generation_tokens": self.request_max_num_generation_tokens,
            "request_params_n": self.request_params_n,
            "request_params_max_tokens": self.request_params_max_tokens,
            "iteration_tokens_total": self.step_tokens,
            "time_to_first_token_seconds": self.time_to_first_token,
            "inter_token_latency_seconds": self.inter_token_latency,
            "time_per_output_token_seconds": self.inter_token_latency,
            "request_time_per_output_token_seconds": self.request_time_per_output_token,
            "e2e_request_latency_seconds": self.e2e_request_latency,
            "request_queue_time_seconds": self.request_queue_time,
            "request_prefill_time_seconds": self.request_prefill_time,
            "request_decode_time_seconds": self.request_decode_time,
            "request_inference_time_seconds": self.request_inference_time,
            "batch_size": self.batch_size,
            "kv_block_lifetime_seconds": self.kv_block_lifetime,
            "kv_block_idle_before_evict_seconds": self.kv_block_idle_before_evict,
            "kv_block_reuse_gap_seconds": self.kv_block_reuse_gap,
        }[name]

    # -- several API servers (--api-server-count) ------------------------------------------------
    def request_stats(self, open_requests: int = 0) -> RequestStats:
        """What this API server counted of its own requests (the engine cores' stats reach every
        API server alike; these are each one's own); ``open_requests``: how many it has open."""
        return RequestStats(self.api_server, open_requests, {name: getattr(self, name) for name in REQUEST_COUNTERS},
                            dict(self.requests_finished),
                            dict(self.watermark_requests) if self.watermark_requests is not None else None,
                            {name: (list(getattr(self, name).counts), getattr(self, name).sum)
                             for name in REQUEST_HISTOGRAMS})

    def with_requests_of(self, others: list[RequestStats], open_requests: int = 0) -> EngineStats:
        """A copy whose request counters and histograms add ``others``' (the other API servers');
        ``open_requests``: this one's open now."""
        out = copy.copy(self)
        out.api_server_requests = {self.api_server: sum(self.requests_finished.values()),
                                   **{o.index: sum(o.finished.values()) for o in others}}
        out.api_server_open = {self.api_server: open_requests, **{o.index: o.open for o in others}}
        out.requests_finished = dict(self.requests_finished)
        out.watermark_requests = dict(self.watermark_requests) if self.watermark_requests is not None else None
        for name in REQUEST_HISTOGRAMS:
            mine = getattr(self, name)
            setattr(out, name, Histogram(mine.buckets))
            getattr(out, name).counts, getattr(out, name).sum = list(mine.counts), mine.sum
        for other in others:
            for name, value in other.counters.items():
                setattr(out, name, getattr(out, name) + value)
            for reason, n in other.finished.items():
                out.requests_finished[reason] = out.requests_finished.get(reason, 0) + n
            if out.watermark_requests is not None and other.watermark is not None:
                for status, n in other.watermark.items():
                    out.watermark_requests[status] = out.watermark_requests.get(status, 0) + n
            for name, (counts, total) in other.histograms.items():
                h = getattr(out, name)
                if len(counts) == len(h.counts):
                    h.counts = [a + b for a, b in zip(h.counts, counts)]
                    h.sum += total
        return out

    @contextlib.contextmanager
    def operation(self, family: str, operation: str) -> Iterator[None]:
        """Time one control operation of ``family`` (vLLM's rl_weight_update_* and sleep_mode_*
        metrics), refused ones too."""
        key = (family, operation)
        if key not in self.operations:
            self.operations[key] = Histogram(OPERATION_BUCKETS)
            self.operations_in_flight[key] = 0
        self.operations_in_flight[key] += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.operations_in_flight[key] -= 1
            self.operations[key].observe(time.perf_counter() - t0)

    def prometheus(self, prefixes: tuple[str, ...] = PREFIXES) -> str:
        """Every metric of ``METRICS`` under each prefix (``vllm``: those vLLM has)."""
        return "\n".join(self._lines(prefixes)) + "\n"

    def _lines(self, prefixes: tuple[str, ...]) -> Iterator[str]:
        labels = f'model_name="{_escape(self.model)}",engine="{self.engine}"'
        for prefix in prefixes:
            for m in METRICS:
                if ((prefix == "vllm" and not m.vllm) or (m.name == "watermark_requests_total"
                                                          and self.watermark_requests is None)
                        or (m.name.startswith("api_server_requests_") and not self.api_server_requests)
                        or (m.name.startswith("estimated_") and not self.mfu)
                        or (m.name.startswith(OPERATION_FAMILIES)
                            and not any(m.name.startswith(f) for f, _ in self.operations))):
                    continue
                name = f"{prefix}:{m.name}"
                yield f"# HELP {name} {m.help}"
                yield f"# TYPE {name} {m.kind}"
                yield from self._samples(m, name, labels)


# what each API server counts of its own requests (--api-server-count: /metrics adds them up)
REQUEST_COUNTERS = ("prompt_tokens", "generation_tokens", "mm_cache_queries", "mm_cache_hits")
REQUEST_HISTOGRAMS = ("time_to_first_token", "inter_token_latency", "request_time_per_output_token",
                      "e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                      "request_inference_time", "request_params_n", "request_prompt_tokens",
                      "request_generation_tokens", "request_max_num_generation_tokens", "request_params_max_tokens")


class RequestStats(msgspec.Struct, array_like=True):
    """One API server's (``index``) request counters, finish reasons, watermark statuses and
    histograms (bucket counts, sum)."""
    index: int
    open: int                          # requests open now
    counters: dict[str, int]
    finished: dict[str, int]
    watermark: dict[str, int] | None
    histograms: dict[str, tuple[list[int], float]]


# the gauges and counters sampled per engine core when there are several (label engine="i")
PER_ENGINE = {
    "num_requests_running": lambda s: s.num_running, "num_requests_waiting": lambda s: s.num_waiting,
    "kv_cache_usage_perc": lambda s: f"{s.kv_cache_usage:.6f}", "num_preemptions_total": lambda s: s.num_preemptions,
    "prefix_cache_queries_total": lambda s: s.prefix_cache_queries,
    "prefix_cache_hits_total": lambda s: s.prefix_cache_hits,
    "estimated_flops_per_gpu_total": lambda s: s.estimated_flops,
    "estimated_read_bytes_per_gpu_total": lambda s: s.estimated_read_bytes,
    "estimated_write_bytes_per_gpu_total": lambda s: s.estimated_write_bytes,
}


def _engine_label(labels: str, engine: int) -> str:
    return re.sub(r'engine="\d+"', f'engine="{engine}"', labels)


def combine_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several engine cores' latest stats as one: counts summed, KV cache usage averaged."""
    width = max(len(s.spec_num_accepted_tokens_per_pos) for s in stats)
    per_pos = [sum(s.spec_num_accepted_tokens_per_pos[i] for s in stats if i < len(s.spec_num_accepted_tokens_per_pos))
               for i in range(width)]
    total = lambda name: sum(getattr(s, name) for s in stats)   # noqa: E731
    transfer: dict[str, float] = {}
    for st in stats:
        for key, value in st.kv_transfer.items():
            transfer[key] = transfer.get(key, 0.0) + value
    return SchedulerStats(
        step=total("step"), num_running=total("num_running"), num_waiting=total("num_waiting"),
        num_scheduled_reqs=total("num_scheduled_reqs"), num_scheduled_tokens=total("num_scheduled_tokens"),
        kv_cache_usage=total("kv_cache_usage") / len(stats), num_preemptions=total("num_preemptions"),
        prefix_cache_queries=total("prefix_cache_queries"), prefix_cache_hits=total("prefix_cache_hits"),
        prompt_tokens_computed=total("prompt_tokens_computed"), generation_tokens=total("generation_tokens"),
        busy_seconds=total("busy_seconds"), compute_seconds=total("compute_seconds"),
        spec_num_drafts=total("spec_num_drafts"), spec_num_draft_tokens=total("spec_num_draft_tokens"),
        spec_num_accepted_tokens=total("spec_num_accepted_tokens"), spec_num_accepted_tokens_per_pos=per_pos,
        external_prefix_cache_queries=total("external_prefix_cache_queries"),
        external_prefix_cache_hits=total("external_prefix_cache_hits"), kv_transfer=transfer,
        estimated_flops=total("estimated_flops"), estimated_read_bytes=total("estimated_read_bytes"),
        estimated_write_bytes=total("estimated_write_bytes"),
        encoder_cache_queries=total("encoder_cache_queries"), encoder_cache_hits=total("encoder_cache_hits"))


def parse_prefixes(text: str) -> tuple[str, ...]:
    """--metrics-prefix: a comma list of ``PREFIXES``, each at most once."""
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PREFIXES]
    if not chosen or unknown or len(set(chosen)) != len(chosen):
        raise ValueError(f"--metrics-prefix takes a comma list of {' and '.join(PREFIXES)}, got {text!r}")
    return chosen


def cache_config_info(block_size: int, cache_dtype: str, enable_prefix_caching: bool,
                      gpu_memory_utilization: float, num_blocks: int) -> dict[str, str]:
    """The labels of cache_config_info (vLLM's names for the KV cache's settings)."""
    return {"block_size": str(block_size), "cache_dtype": cache_dtype,
            "enable_prefix_caching": str(enable_prefix_caching),
            "gpu_memory_utilization": str(gpu_memory_utilization), "num_gpu_blocks": str(num_blocks)}
