"""Engine and request statistics as the frontend sees them, rendered as Prometheus text."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from transport.messages import SchedulerStats

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(slots=True)
class EngineStats:
    model: str = ""
    last: SchedulerStats = field(default_factory=SchedulerStats)
    steps: int = 0
    max_batch_size: int = 0                     # most requests served by one step so far
    batch_size_counts: list[int] = field(default_factory=lambda: [0] * (len(BATCH_BUCKETS) + 1))
    batch_size_sum: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)   # by finish reason
    started_at: float = field(default_factory=time.time)

    def observe_step(self, s: SchedulerStats) -> None:
        self.last = s
        if s.num_scheduled_reqs == 0:
            return
        self.steps += 1
        self.max_batch_size = max(self.max_batch_size, s.num_scheduled_reqs)
        self.batch_size_sum += s.num_scheduled_reqs
        for i, bound in enumerate(BATCH_BUCKETS):
            if s.num_scheduled_reqs <= bound:
                self.batch_size_counts[i] += 1
                break
        else:
            self.batch_size_counts[-1] += 1

    def observe_finished(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def as_dict(self) -> dict:
        s = self.last
        return {"model": self.model, "steps": self.steps, "max_batch_size": self.max_batch_size,
                "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage, "num_preemptions": s.num_preemptions,
                "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                "requests_finished": dict(self.requests_finished)}

    def prometheus(self) -> str:
        s, m = self.last, f'model_name="{self.model}"'
        lines = [
            "# HELP troupe:num_requests_running Requests in the running batch.",
            "# TYPE troupe:num_requests_running gauge",
            f"troupe:num_requests_running{{{m}}} {s.num_running}",
            "# HELP troupe:num_requests_waiting Requests waiting to be scheduled.",
            "# TYPE troupe:num_requests_waiting gauge",
            f"troupe:num_requests_waiting{{{m}}} {s.num_waiting}",
            "# HELP troupe:kv_cache_usage_perc Fraction of KV cache blocks in use.",
            "# TYPE troupe:kv_cache_usage_perc gauge",
            f"troupe:kv_cache_usage_perc{{{m}}} {s.kv_cache_usage:.6f}",
            "# HELP troupe:num_preemptions_total Requests preempted since start.",
            "# TYPE troupe:num_preemptions_total counter",
            f"troupe:num_preemptions_total{{{m}}} {s.num_preemptions}",
            "# HELP troupe:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
            "# TYPE troupe:prefix_cache_queries_total counter",
            f"troupe:prefix_cache_queries_total{{{m}}} {s.prefix_cache_queries}",
            "# HELP troupe:prefix_cache_hits_total Prompt tokens served from the prefix cache.",
            "# TYPE troupe:prefix_cache_hits_total counter",
            f"troupe:prefix_cache_hits_total{{{m}}} {s.prefix_cache_hits}",
            "# HELP troupe:prompt_tokens_total Prompt tokens received.",
            "# TYPE troupe:prompt_tokens_total counter",
            f"troupe:prompt_tokens_total{{{m}}} {self.prompt_tokens}",
            "# HELP troupe:generation_tokens_total Tokens generated.",
            "# TYPE troupe:generation_tokens_total counter",
            f"troupe:generation_tokens_total{{{m}}} {self.generation_tokens}",
            "# HELP troupe:max_batch_size Most requests served by one engine step.",
            "# TYPE troupe:max_batch_size gauge",
            f"troupe:max_batch_size{{{m}}} {self.max_batch_size}",
            "# HELP troupe:batch_size Requests served per engine step.",
            "# TYPE troupe:batch_size histogram",
        ]
        cumulative = 0
        for bound, count in zip(BATCH_BUCKETS, self.batch_size_counts):
            cumulative += count
            lines.append(f'troupe:batch_size_bucket{{{m},le="{bound}"}} {cumulative}')
        cumulative += self.batch_size_counts[-1]
        lines += [f'troupe:batch_size_bucket{{{m},le="+Inf"}} {cumulative}',
                  f"troupe:batch_size_sum{{{m}}} {self.batch_size_sum}",
                  f"troupe:batch_size_count{{{m}}} {cumulative}",
                  "# HELP troupe:request_success_total Finished requests by finish reason.",
                  "# TYPE troupe:request_success_total counter"]
        for reason, n in sorted(self.requests_finished.items()):
            lines.append(f'troupe:request_success_total{{{m},finished_reason="{reason}"}} {n}')
        return "\n".join(lines) + "\n"
