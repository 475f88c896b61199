"""Single-stream latency: prefill time of a 128-token prompt, decode tokens/s of one stream,
and cold start (from launching ``python -m tools.serve`` to the first streamed token)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from tools.bench import workload


async def warm(args: Any) -> dict[str, float]:
    from actors.api import AsyncLLM, RequestOutputKind, SamplingParams
    from actors.engine.args import EngineArgs
    # in this process, unless the layout needs a worker process per rank (tensor or pipeline parallelism)
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    llm = await AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args, multiprocess=ranks > 1))
    try:
        # a fresh prompt for every run: a repeated one would be served from the prefix cache
        prompts = [r["prompt_token_ids"] for r in workload.generate(
            args.repeats + 2, (args.prompt_len, args.prompt_len), (1, 1), args.seed)]

        async def timed(max_tokens: int) -> tuple[float, float, int]:
            prompt = prompts.pop()
            t0 = time.perf_counter()
            first, n = 0.0, 0
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            async for out in llm.generate(prompt, params):
                if n == 0:
                    first = time.perf_counter() - t0
                n += len(out.token_ids)
            return first, time.perf_counter() - t0, n
        await timed(2)                                                        # warm-up
        prefills = [(await timed(1))[0] for _ in range(args.repeats)]
        first, total, n = await timed(args.decode_tokens)
    finally:
        await llm.shutdown()
    return {"prefill_s": round(min(prefills), 4),
            "decode_tok_per_s": round((n - 1) / (total - first), 2)}


def cold_start(args: Any) -> float:
    """Seconds from launching the server process to the first streamed token."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "tools.serve", "--port", "0"] + (["--model", args.model] if args.model else [])
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    cmd += ["--kv-cache-dtype", args.kv_cache_dtype, "--device", args.device]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size),
            "--pipeline-parallel-size", str(args.pipeline_parallel_size)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"Troupe ready on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError("the server exited before it was ready")
        import urllib.request
        body = json.dumps({"prompt": "Hello", "max_tokens": 2, "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    return time.perf_counter() - t0
        raise RuntimeError("no token streamed")
    finally:
        proc.terminate()
        proc.wait(30)


def main(args: Any) -> None:
    import uvloop
    result: dict[str, Any] = {"bench": "latency", "engine": "troupe", "device": args.device,
                              "enforce_eager": args.enforce_eager, "quantization": args.quantization,
                              "kv_cache_dtype": args.kv_cache_dtype,
                              "tensor_parallel_size": args.tensor_parallel_size,
                              "pipeline_parallel_size": args.pipeline_parallel_size,
                              "prompt_tokens": args.prompt_len}
    result.update(uvloop.run(warm(args)))
    result["cold_start_to_first_token_s"] = round(cold_start(args), 2)
    print(json.dumps(result), flush=True)
