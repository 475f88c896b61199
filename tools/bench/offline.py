"""Offline throughput: every request of a workload submitted at once to an in-process engine."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from tools.bench import flops, workload


async def run(args: Any) -> dict[str, Any]:
    from actors.api import AsyncLLM, RequestOutputKind, SamplingParams
    from actors.engine.args import EngineArgs

    reqs = workload.from_args(args)
    llm = await AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args, multiprocess=args.multiprocess))
    config = llm.client.config                 # resolved
    try:
        async def one(r: dict, params: SamplingParams) -> int:
            n = 0
            async for out in llm.generate(r["prompt_token_ids"], params):
                n += len(out.token_ids)
            return n

        def params(r: dict) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, output_kind=RequestOutputKind.DELTA)

        # warm-up on the first two requests, as tools/bench/vllm_peer.py does for vLLM
        await asyncio.gather(*(one(r, params(r)) for r in reqs[:2]))
        before = llm.client.stats.last
        tracer = llm._fe.node.tracer               # in one process: every actor's spans
        spans0, steps0 = tracer.spans.next, llm.client.stats.steps
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(r, params(r)) for r in reqs))
        seconds = time.perf_counter() - t0
        stats = llm.client.stats
        busy = stats.last.busy_seconds - before.busy_seconds
        compute = stats.last.compute_seconds - before.compute_seconds
        spans_per_step = (tracer.spans.next - spans0) / max(stats.steps - steps0, 1)
    finally:
        await llm.shutdown()
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    n_out = sum(outs)
    gflops = flops.workload_flops(config.model.arch, reqs) / seconds / 1e9
    device = config.device.device
    peak = flops.matmul_peak_gflops() if device == "cpu" else None    # this CPU's own float32 peak
    return {"bench": "offline", "engine": "troupe", "device": device, "enforce_eager": args.enforce_eager,
            "dtype": args.dtype, "trace": config.observability.trace, "multiprocess": args.multiprocess,
            "async_scheduling": config.scheduler.async_scheduling,
            "quantization": args.quantization, "kv_cache_dtype": config.cache.cache_dtype,
            "kv_cache_blocks": config.cache.num_blocks,
            "kv_cache_tokens": config.cache.num_blocks * config.cache.block_size,
            "requests": len(reqs),
            "prompt_tokens": n_in, "output_tokens": n_out, "seconds": round(seconds, 3),
            "output_tok_per_s": round(n_out / seconds, 2),
            "total_tok_per_s": round((n_in + n_out) / seconds, 2),
            "gflops_per_s": round(gflops, 1), "matmul_peak_gflops_per_s": round(peak, 1) if peak else None,
            "fraction_of_peak": round(gflops / peak, 3) if peak else None, "steps": stats.steps,
            "engine_overhead_fraction": round(1 - compute / busy, 4) if busy else None,
            "max_batch_size": stats.max_batch_size,
            "trace_spans_per_step": round(spans_per_step, 1) if args.trace and not args.multiprocess else None}


def main(args: Any) -> None:
    import uvloop
    print(json.dumps(uvloop.run(run(args))), flush=True)
