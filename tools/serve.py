"""``python -m tools.serve``: the OpenAI-compatible server on the default (or given) model.

Three processes: this one (HTTP frontend, tokenizer, detokenizer), the engine core
(scheduler, KV manager, executor) and the worker (model runner). Ctrl-C stops all three."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from actors.engine_core import EngineConfig

log = logging.getLogger("troupe.serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model name, .gguf path or checkpoint dir "
                   "(default: HuggingFaceTB/SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--lenient", action="store_true",
                   help="accept (and log) unknown request fields instead of answering 400")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="'priority': requests' priority field orders the queue (lower first)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: float32 on the CPU, bfloat16 on a GPU")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: a CUDA GPU when one is present, else the CPU")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (GPU only; for debugging)")
    p.add_argument("--quantization", default=None, choices=["gguf", "gguf-i8"],
                   help="'gguf': the checkpoint's GGUF Q4_1/Q8_0 blocks run natively with float32 "
                        "activations (same weights, faster decoding); 'gguf-i8': Q4_1 layers also "
                        "take int8 activations in two parts (AVX512-VNNI; faster prefill, rare "
                        "token changes)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="memory for the KV cache")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: the model's dtype; float16 / bfloat16 store K and V rounded to 16 bits "
                        "(twice the tokens per GiB, half the bytes long-context decoding reads)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's own")
    p.add_argument("--threads", type=int, default=0, help="worker compute threads (0: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.kv_cache_gib <= 0:
        p.error("--kv-cache-gib must be positive")
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        enforce_eager=args.enforce_eager, quantization=args.quantization,
                        block_size=args.block_size,
                        kv_cache_bytes=int(args.kv_cache_gib * 2**30), kv_cache_dtype=args.kv_cache_dtype,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, num_threads=args.threads, seed=args.seed,
                        scheduling_policy=args.scheduling_policy)


async def serve(args: argparse.Namespace) -> int:
    """Listen first (probes answer 503 while the model loads), then load and serve."""
    from actors.frontend.actor import GetAddress, HttpFrontend
    from actors.frontend.app import OpenAIServer, ServerOptions
    from actors.frontend.launch import create_frontend
    fe = create_frontend(multiprocess=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: fe.node.closed.done() or fe.node.closed.set_result(0))
    try:
        server = OpenAIServer(options=ServerOptions(args.api_key, args.lenient, args.scheduling_policy),
                              trace=fe.trace)
        http = await fe.node.start("http", lambda: HttpFrontend(server, args.host, args.port))
        addr = await http.ask(GetAddress())
        print(f"Troupe listening on http://{addr.host}:{addr.port} (loading the model)", flush=True)
        loading = asyncio.ensure_future(fe.start(engine_config(args)))
        await asyncio.wait([loading, fe.node.closed], return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():          # a signal during loading
            loading.cancel()
            return fe.node.closed.result()
        server.attach(loading.result())
        log.info("serving %s on http://%s:%d (engine pid %d)", fe.client.model_name, addr.host,
                 addr.port, fe.engine_process.pid)
        print(f"Troupe ready on http://{addr.host}:{addr.port}", flush=True)
        code = await fe.node.closed
        if code:
            await asyncio.sleep(1.0)   # let error responses reach their clients
            log.error("shutting down with exit code %d", code)
        return code
    finally:
        await fe.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [frontend] %(name)s: %(message)s")
    import uvloop
    try:
        code = uvloop.run(serve(args))
    except Exception as exc:  # start-up failures: one clear line, non-zero exit
        log.debug("start-up failed", exc_info=True)
        print(f"troupe: error: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
