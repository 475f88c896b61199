"""Embedding throughput (a pooling model, ``--runner pooling``): every prompt of a workload
embedded at once by an in-process engine, after a warm-up on its first two; the workload's
max_tokens are not used. ``tools/bench/vllm_peer.py embed`` measures vLLM the same way."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from tools.bench import workload


async def run(args: Any) -> dict[str, Any]:
    from actors.api import AsyncLLM
    from actors.engine.args import EngineArgs

    reqs = workload.from_args(args)
    llm = await AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args, multiprocess=args.multiprocess))
    config = llm.client.config
    try:
        def embed_all(batch: list[dict]) -> Any:
            return asyncio.gather(*(llm.embed({"prompt_token_ids": r["prompt_token_ids"]}) for r in batch))

        await embed_all(reqs[:2])
        before, steps0 = llm.client.stats.last, llm.client.stats.steps
        t0 = time.perf_counter()
        outs = await embed_all(reqs)
        seconds = time.perf_counter() - t0
        stats = llm.client.stats
        busy = stats.last.busy_seconds - before.busy_seconds
        compute = stats.last.compute_seconds - before.compute_seconds
        steps = stats.steps - steps0
    finally:
        await llm.shutdown()
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    return {"bench": "embed", "engine": "troupe", "device": config.device.device, "dtype": config.model.dtype,
            "pooling": config.model.pooling.pooler.seq_pooling_type, "requests": len(reqs),
            "dims": len(outs[0].outputs.embedding), "prompt_tokens": n_in, "seconds": round(seconds, 3),
            "prompts_per_s": round(len(reqs) / seconds, 2), "prompt_tok_per_s": round(n_in / seconds, 1),
            "steps": steps, "engine_overhead_fraction": round(1 - compute / busy, 4) if busy else None}


def main(args: Any) -> None:
    import uvloop
    print(json.dumps(uvloop.run(run(args))), flush=True)
