"""Long-context capacity of the hybrid KV cache manager: how many requests of ``--prompt-len``
tokens a KV cache of ``--kv-cache-gib`` holds at once, with the hybrid manager and without it
(--disable-hybrid-kv-cache-manager). Computed from the resolved config (blocks in the cache,
blocks a decoding request holds per KV cache group), then confirmed by running the engine's
scheduler and KV manager over that many requests and more, with a stub worker that samples a
fixed token (the blocks a request holds do not depend on what the model computes): the most
requests decoding at once with every prompt token in the cache."""
from __future__ import annotations

import json
from typing import Any

from actors.engine.args import EngineArgs
from actors.engine.config import EngineConfig
from actors.engine.messages import EngineCoreRequest, ModelRunnerOutput
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.kv_cache_spec import blocks_per_request, describe_groups
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler


def resolved(model: str, kv_bytes: int, disable_hybrid: bool, max_num_seqs: int) -> EngineConfig:
    from models.registry import open_checkpoint
    cfg = EngineArgs(model=model, kv_cache_bytes=kv_bytes, device="cpu", max_num_seqs=max_num_seqs,
                     disable_hybrid_kv_cache_manager=disable_hybrid).create_engine_config()
    return cfg.resolve(cuda_available=False, cpu_count=1, arch=open_checkpoint(cfg.model.source).config)


def computed(cfg: EngineConfig, prompt_len: int) -> dict[str, Any]:
    """Blocks in the cache, blocks one decoding request holds, and how many such requests fit."""
    groups = cfg.kv_cache_groups()
    per_request = blocks_per_request(groups, prompt_len + 1, 1)      # decoding: one new token a step
    return {"groups": describe_groups(groups), "num_blocks": cfg.cache.num_blocks,
            "blocks_per_request": per_request, "requests": (cfg.cache.num_blocks - 1) // per_request}


def run_engine(cfg: EngineConfig, prompt_len: int, num_requests: int, max_tokens: int) -> dict[str, Any]:
    """The scheduler and KV manager over ``num_requests`` prompts (all queued at once), a stub
    worker sampling token 7: the most requests decoding at once, and the preemptions."""
    c = cfg.cache
    kv = KVCacheManager(c.num_blocks, c.block_size, c.enable_prefix_caching, cfg.kv_cache_groups())
    s = Scheduler(cfg, kv)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):       # distinct prompts: no prefix-cache hits
        s.add_request(EngineCoreRequest(f"r{i}", [(i * 100_003 + j) % 50_000 + 10 for j in range(prompt_len)],
                                        params, float(i)))
    most = 0
    while s.has_work():
        so = s.schedule()
        most = max(most, sum(1 for r in s.running if r.num_computed_tokens > prompt_len))
        sampled = [[7] if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens else []
                   for rid in so.num_scheduled_tokens]
        s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled))
    kv.check_integrity()
    return {"most_decoding_at_once": most, "preemptions": s.counters.num_preemptions}


def main(args: Any) -> None:
    kv_bytes = int(args.kv_cache_gib * (1 << 30))
    out: dict[str, Any] = {"bench": "hybrid_kv", "model": args.model, "kv_cache_gib": args.kv_cache_gib,
                           "prompt_len": args.prompt_len}
    for name, disable in (("hybrid", False), ("conservative", True)):
        cfg = resolved(args.model, kv_bytes, disable, args.num_requests)
        fig = computed(cfg, args.prompt_len)
        fig |= run_engine(cfg, args.prompt_len, args.num_requests, args.max_tokens)
        print(f"{name:>12}: {fig['groups']}; {fig['num_blocks']} blocks, {fig['blocks_per_request']} a request: "
              f"{fig['requests']} requests fit; the engine decoded {fig['most_decoding_at_once']} at once "
              f"({fig['preemptions']} preemptions)", flush=True)
        out[name] = fig
    print(json.dumps(out))
