"""A load generator for any OpenAI-compatible server: streamed completions of a workload's
token-id prompts, Poisson arrivals at a request rate (or a fixed concurrency), and latency
percentiles. Timestamps are taken as chunks arrive; the generator's own CPU time is reported
so its overhead on a small machine is visible."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from tools.bench import workload


@dataclass(slots=True)
class Result:
    ok: bool
    start: float
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def one_request(session: Any, url: str, model: str, r: dict) -> Result:
    body = {"model": model, "prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"],
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res = Result(False, start)
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = str(event["error"])[:200]
                    return res
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
                if any(c.get("text") for c in event.get("choices", [])):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except Exception as exc:   # a failed request is counted, never fatal to the run
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(int(p * len(s)), len(s) - 1)]
    return {"p50": round(q(0.5), 4), "p90": round(q(0.9), 4), "p99": round(q(0.99), 4),
            "mean": round(sum(s) / len(s), 4)}


async def run(args: Any) -> dict[str, Any]:
    import aiohttp
    reqs = workload.from_args(args)
    url = args.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    cpu0 = time.process_time()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model
        if model is None:
            async with session.get(url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        rng = random.Random(args.seed)
        t0 = time.perf_counter()
        if args.concurrency:
            queue = list(reqs)
            results: list[Result] = []

            async def worker() -> None:
                while queue:
                    results.append(await one_request(session, url, model, queue.pop(0)))
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        else:
            tasks = []
            for r in reqs:
                tasks.append(asyncio.ensure_future(one_request(session, url, model, r)))
                if args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            results = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"bench": "serve", "url": url, "model": model,
            "request_rate": args.request_rate if not args.concurrency else None,
            "concurrency": args.concurrency or None, "requests": len(reqs),
            "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:3],
            "seconds": round(wall, 3), "output_tokens": out_tokens,
            "request_per_s": round(len(ok) / wall, 3), "output_tok_per_s": round(out_tokens / wall, 2),
            "ttft_s": percentiles([r.ttft for r in ok]),
            "itl_s": percentiles([x for r in ok for x in r.itl]),
            "tpot_s": percentiles(tpot), "e2e_s": percentiles([r.e2e for r in ok]),
            "client_cpu_s": round(cpu, 3), "client_cpu_fraction": round(cpu / wall, 4)}


def main(args: Any) -> None:
    import uvloop
    print(json.dumps(uvloop.run(run(args))), flush=True)
