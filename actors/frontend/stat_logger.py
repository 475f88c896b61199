"""The engine's periodic log lines, vLLM's (``vllm/v1/metrics/loggers.py`` LoggingStatLogger and
``vllm/v1/spec_decode/metrics.py`` SpecDecodingLogging), every ``VLLM_LOG_STATS_INTERVAL``
seconds (10) unless ``--disable-log-stats``: per engine core, its prompt and generation
throughput over the interval, requests running and waiting, preemptions in the interval, KV
cache usage and prefix cache hit rate; with speculative decoding, a second line with the
interval's mean acceptance length, accepted and drafted tokens and their rates, the acceptance
rate per draft position and overall. Lines of an idle engine (no tokens in this interval nor the
one before) are logged at debug level, as vLLM does, so an idle server stays quiet.

It reads the stats the engine cores send with their outputs (``EngineStats.engines``: each core's
counters since start) and logs the differences; nothing is asked of the engine."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, ClassVar

from actors.engine.messages import SchedulerStats
from actors.frontend.stats import EngineStats
from actors.runtime import Actor, Msg
from actors.runtime.ticker import Ticker

log = logging.getLogger("troupe.stats")

INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0


def log_interval() -> float:
    """vLLM's VLLM_LOG_STATS_INTERVAL (seconds, > 0)."""
    raw = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{INTERVAL_ENV} must be positive, got {raw!r}")
    return value


class _Engine:
    """One engine core's counters at the last line, and whether it moved then."""
    __slots__ = ("last", "was_busy")

    def __init__(self) -> None:
        self.last = SchedulerStats()
        self.was_busy = False


class StatLines:
    """Turns the engine cores' cumulative stats into vLLM's periodic lines."""

    def __init__(self, stats: EngineStats, kv_cache_device: str, now: Callable[[], float] = time.monotonic) -> None:
        self.stats = stats
        self.kv_cache_device = "GPU" if kv_cache_device == "cuda" else kv_cache_device.upper()
        self.now = now
        self.since = now()
        self.engines: dict[int, _Engine] = {}

    def lines(self) -> list[tuple[int, str, tuple[Any, ...]]]:
        """The lines for the interval since the last call: (level, format, arguments) each."""
        now = self.now()
        seconds, self.since = max(now - self.since, 1e-9), now
        out = []
        for index, s in sorted(self.stats.engines.items()):
            e = self.engines.setdefault(index, _Engine())
            prev, e.last = e.last, s
            if s.step < prev.step:          # the engine core was restarted: its counters began again
                prev = SchedulerStats()
            prompt = (s.prompt_tokens_computed - prev.prompt_tokens_computed) / seconds
            generation = (s.generation_tokens - prev.generation_tokens) / seconds
            busy = bool(prompt or generation)
            level = logging.INFO if busy or e.was_busy else logging.DEBUG
            e.was_busy = busy
            prefix = f"Engine {index:03d}: "
            parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                     "Running: %d reqs", "Waiting: %d reqs"]
            args: list[Any] = [prompt, generation, s.num_running, s.num_waiting]
            if s.num_preemptions > prev.num_preemptions:
                parts.append("Preemptions: %d")
                args.append(s.num_preemptions - prev.num_preemptions)
            parts.append("%s KV cache usage: %.1f%%")
            args += [self.kv_cache_device, s.kv_cache_usage * 100]
            if s.prefix_cache_queries:
                parts.append("Prefix cache hit rate: %.1f%%")
                args.append(s.prefix_cache_hits / s.prefix_cache_queries * 100)
            if s.external_prefix_cache_queries:
                parts.append("External prefix cache hit rate: %.1f%%")
                args.append(s.external_prefix_cache_hits / s.external_prefix_cache_queries * 100)
            out.append((level, prefix + ", ".join(parts), tuple(args)))
            spec = _spec_line(prev, s, seconds)
            if spec is not None:
                out.append((level, prefix + spec[0], spec[1]))
            flops = s.estimated_flops - prev.estimated_flops          # --enable-mfu-metrics
            moved = (s.estimated_read_bytes + s.estimated_write_bytes
                     - prev.estimated_read_bytes - prev.estimated_write_bytes)
            if flops > 0 or moved > 0:
                out.append((level, prefix + "MFU: %.3f TF/s/device %.1f GB/s/device",
                            (flops / seconds / 1e12, moved / seconds / 1e9)))
        return out


def _spec_line(prev: SchedulerStats, s: SchedulerStats, seconds: float) -> tuple[str, tuple[Any, ...]] | None:
    drafts = s.spec_num_drafts - prev.spec_num_drafts
    if drafts <= 0:
        return None
    drafted = s.spec_num_draft_tokens - prev.spec_num_draft_tokens
    accepted = s.spec_num_accepted_tokens - prev.spec_num_accepted_tokens
    before = prev.spec_num_accepted_tokens_per_pos
    per_pos = [(n - (before[i] if i < len(before) else 0)) / drafts
               for i, n in enumerate(s.spec_num_accepted_tokens_per_pos)]
    return ("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            (1 + accepted / drafts, accepted / seconds, drafted / seconds, accepted, drafted,
             ", ".join(f"{p:.3f}" for p in per_pos), accepted / drafted * 100 if drafted else float("nan")))


class LogStats(Msg):
    """Log the interval's lines (the actor's own timer sends it)."""
    reply_type: ClassVar[Any] = None


class StatLoggerActor(Actor):
    protocol = LogStats

    def __init__(self, lines: StatLines, interval_s: float) -> None:
        self.stat_lines = lines
        self.interval_s = interval_s
        self.ticker: Ticker | None = None

    async def started(self) -> None:
        self.ticker = Ticker(self.ctx.self_ref, LogStats, self.interval_s)
        self.ticker.again()

    async def stopped(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()

    async def receive(self, msg: LogStats) -> None:
        try:
            for level, fmt, args in self.stat_lines.lines():
                log.log(level, fmt, *args)
        finally:
            self.ticker.again()
