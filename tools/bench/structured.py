"""Structured outputs: what a grammar costs. Output tokens/s of N concurrent ``json_schema``
requests against N free ones of the same lengths (greedy, EOS ignored for the free ones), grammar
compile time p50/p99 over the 50 schemas cold and cached, and the time to fill one step's
bitmask for a batch of 64 constrained requests. In-process engine; one JSON line last."""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

from tools.bench.schemas import schemas

PROMPT = "Describe a thing as JSON."


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def compile_times(llm: Any) -> dict[str, float]:
    """Seconds to compile each of the 50 schemas, the first time and again (cached). The very
    first compile also loads xgrammar and the vocabulary: reported apart."""
    from actors.engine.sampling_params import StructuredOutputsParams
    specs = [StructuredOutputsParams(json=json.dumps(s)) for s in schemas()]
    first = await llm.client.check_grammar(StructuredOutputsParams(regex="[a-z]+"))
    cold = [await llm.client.check_grammar(spec) for spec in specs]
    cached = []
    for spec in specs:
        t0 = time.perf_counter()
        await llm.client.check_grammar(spec)
        cached.append(time.perf_counter() - t0)
    ms = lambda v: round(v * 1000, 3)     # noqa: E731
    return {"first_grammar_ms": ms(first), "compile_cold_p50_ms": ms(_pct(cold, 0.5)), "compile_cold_p99_ms": ms(_pct(cold, 0.99)),
            "compile_cached_p50_ms": ms(_pct(cached, 0.5)), "compile_cached_p99_ms": ms(_pct(cached, 0.99))}


async def throughput(llm: Any, n: int) -> dict[str, float]:
    """N json_schema requests at once, then N free ones of the same output lengths."""
    import msgspec

    from actors.api import RequestOutputKind, SamplingParams
    from actors.engine.sampling_params import StructuredOutputsParams
    picked = (schemas() * (n // 50 + 1))[:n]

    async def run(params: SamplingParams, prompt: str) -> int:
        out = None
        async for out in llm.generate(prompt, msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)):
            pass
        return len(out.token_ids)

    constrained = [SamplingParams(max_tokens=200, temperature=0,
                                  structured_outputs=StructuredOutputsParams(json=json.dumps(s))) for s in picked]
    prompts = [f"{PROMPT} ({i})" for i in range(n)]
    t0 = time.perf_counter()
    lengths = await asyncio.gather(*(run(p, q) for p, q in zip(constrained, prompts)))
    constrained_s = time.perf_counter() - t0
    free = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in lengths]
    t0 = time.perf_counter()
    free_lengths = await asyncio.gather(*(run(p, q) for p, q in zip(free, prompts)))
    free_s = time.perf_counter() - t0
    c_rate, f_rate = sum(lengths) / constrained_s, sum(free_lengths) / free_s
    return {"requests": n, "output_tokens": sum(lengths), "constrained_tok_per_s": round(c_rate, 1),
            "free_tok_per_s": round(f_rate, 1), "constrained_over_free": round(c_rate / f_rate, 3)}


def bitmask_fill(llm: Any, batch: int, repeats: int = 50) -> dict[str, float]:
    """Milliseconds to fill the bitmask of ``batch`` constrained requests (one step's work)."""
    from actors import topology
    from actors.engine.sampling_params import StructuredOutputsParams
    structured = llm._fe.node.cells[topology.SCHEDULER].actor.core.structured
    specs = [StructuredOutputsParams(json=json.dumps(s)) for s in (schemas() * 2)[:batch]]
    ids = [f"bench-{i}" for i in range(batch)]
    for rid, spec in zip(ids, specs):
        if not structured.start(rid, spec):
            raise RuntimeError("the schemas were compiled above; a grammar is missing")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        structured.fill_bitmask(ids)
        times.append(time.perf_counter() - t0)
    for rid in ids:
        structured.free(rid)
    return {"bitmask_batch": batch, "bitmask_fill_ms": round(statistics.median(times) * 1000, 3)}


async def run(args: Any) -> dict[str, Any]:
    from actors.api import AsyncLLM
    from actors.engine.args import EngineArgs
    llm = await AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args, multiprocess=False))
    try:
        result: dict[str, Any] = {"bench": "structured", "engine": "troupe"}
        result.update(await compile_times(llm))
        result.update(await throughput(llm, args.n))
        result.update(bitmask_fill(llm, args.bitmask_batch))
        return result
    finally:
        await llm.shutdown()


def main(args: Any) -> None:
    import uvloop
    print(json.dumps(uvloop.run(run(args))), flush=True)
