"""The server's own work, without the engine: ``POST /tokenize`` of long texts at a fixed
concurrency (the HTTP, JSON and tokenizer work that ``--api-server-count`` spreads over several
processes), in requests per second. Each text differs, so no cache answers it."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

TEXT = " ".join(f"word{i} and some more text, numbers {i * 7} here." for i in range(300))


async def run(url: str, n: int, concurrency: int, warmup: int = 50) -> dict[str, Any]:
    import aiohttp
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(i: int) -> int:
            async with gate:
                async with session.post(url + "/tokenize", json={"prompt": f"{TEXT} {i}"}) as r:
                    if r.status != 200:
                        raise RuntimeError(f"/tokenize: HTTP {r.status}: {(await r.text())[:200]}")
                    return (await r.json())["count"]
        await asyncio.gather(*(one(-i - 1) for i in range(warmup)))
        t0, c0 = time.perf_counter(), time.process_time()
        counts = await asyncio.gather(*(one(i) for i in range(n)))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"bench": "frontend", "url": url, "requests": n, "concurrency": concurrency,
            "seconds": round(seconds, 3), "requests_per_s": round(n / seconds, 1),
            "prompt_tokens": counts[0], "client_cpu_fraction": round(cpu / seconds, 4)}


def main(args: Any) -> None:
    print(json.dumps(asyncio.run(run(args.url.rstrip("/"), args.n, args.concurrency))))
