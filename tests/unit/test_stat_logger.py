"""The periodic statistics lines (vLLM's LoggingStatLogger and SpecDecodingLogging): rates over
the interval from the engine cores' counters, idle engines at debug level, speculative decoding's
acceptance per position and overall, one line set per engine core."""
from __future__ import annotations

import logging

import pytest

from actors.engine.messages import SchedulerStats
from actors.frontend.stat_logger import StatLines, log_interval
from actors.frontend.stats import EngineStats


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _logger(device: str = "cpu") -> tuple[EngineStats, Clock, StatLines]:
    stats, clock = EngineStats(), Clock()
    return stats, clock, StatLines(stats, device, clock)


def test_a_busy_interval_gives_vllms_line_with_its_rates():
    stats, clock, lines = _logger()
    stats.observe_step(SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prompt_tokens_computed=500,
                                      generation_tokens=200, prefix_cache_queries=400, prefix_cache_hits=100,
                                      num_preemptions=1))
    clock.t += 10.0
    [(level, fmt, args)] = lines.lines()
    assert level == logging.INFO
    assert fmt % args == ("Engine 000: Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 "
                          "tokens/s, Running: 3 reqs, Waiting: 2 reqs, Preemptions: 1, CPU KV cache usage: 25.0%, "
                          "Prefix cache hit rate: 25.0%")


def test_rates_are_of_the_interval_and_an_idle_engine_goes_quiet_after_one_more_line():
    stats, clock, lines = _logger("cuda")
    stats.observe_step(SchedulerStats(prompt_tokens_computed=100, generation_tokens=40, num_preemptions=2))
    clock.t += 10.0
    lines.lines()
    stats.observe_step(SchedulerStats(prompt_tokens_computed=100, generation_tokens=60, num_preemptions=2))
    clock.t += 5.0
    [(level, fmt, args)] = lines.lines()
    text = fmt % args
    assert level == logging.INFO and "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 4.0" in text
    assert "Preemptions" not in text and "GPU KV cache usage: 0.0%" in text and "Prefix cache" not in text
    clock.t += 10.0
    assert lines.lines()[0][0] == logging.INFO      # the interval after the last tokens: still shown
    clock.t += 10.0
    assert lines.lines()[0][0] == logging.DEBUG     # idle twice: debug, as vLLM does


def test_speculative_decoding_adds_its_acceptance_line():
    stats, clock, lines = _logger()
    stats.observe_step(SchedulerStats(generation_tokens=10, spec_num_drafts=2, spec_num_draft_tokens=8,
                                      spec_num_accepted_tokens=4, spec_num_accepted_tokens_per_pos=[2, 1, 1, 0]))
    clock.t += 10.0
    lines.lines()
    stats.observe_step(SchedulerStats(generation_tokens=50, spec_num_drafts=12, spec_num_draft_tokens=48,
                                      spec_num_accepted_tokens=34, spec_num_accepted_tokens_per_pos=[12, 9, 8, 5]))
    clock.t += 10.0
    main, (level, fmt, args) = lines.lines()
    assert level == logging.INFO
    assert fmt % args == ("Engine 000: SpecDecoding metrics: Mean acceptance length: 4.00, Accepted throughput: "
                          "3.00 tokens/s, Drafted throughput: 4.00 tokens/s, Accepted: 30 tokens, Drafted: 40 "
                          "tokens, Per-position acceptance rate: 1.000, 0.800, 0.700, 0.500, Avg Draft "
                          "acceptance rate: 75.0%")
    clock.t += 10.0
    assert len(lines.lines()) == 1                  # no drafts in the interval: no second line


def test_each_engine_core_has_its_own_lines():
    stats, clock, lines = _logger()
    stats.observe_step(SchedulerStats(generation_tokens=30, num_running=1), 0)
    stats.observe_step(SchedulerStats(generation_tokens=10, num_running=4), 1)
    clock.t += 10.0
    texts = [fmt % args for _, fmt, args in lines.lines()]
    assert [t[:11] for t in texts] == ["Engine 000:", "Engine 001:"]
    assert "generation throughput: 3.0" in texts[0] and "Running: 4 reqs" in texts[1]


def test_the_interval_comes_from_vllms_variable(monkeypatch):
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    assert log_interval() == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert log_interval() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
            log_interval()


def test_a_restarted_engine_cores_counters_start_the_interval_from_zero():
    stats, clock, lines = _logger()
    stats.observe_step(SchedulerStats(step=900, generation_tokens=5000, num_preemptions=3))
    clock.t += 10.0
    lines.lines()
    stats.observe_step(SchedulerStats(step=40, generation_tokens=300))       # its counters began again
    clock.t += 10.0
    [(_, fmt, args)] = lines.lines()
    assert "Avg generation throughput: 30.0 tokens/s" in fmt % args and "Preemptions" not in fmt % args
